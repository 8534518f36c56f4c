"""A/B of the kernel switches (`ops.KernelConfig` fields) in one engine's decode rounds, in one process.

One engine on random weights at a real shape; then, --reps times, each variant in turn: the runner's KernelConfig
replaced by the variant's (a static argument of the steps, so they are traced and compiled again), one untimed round
at each lane count, then --rounds rounds back to back (`profiling.time_rounds`). The report is each variant's median
ms a round and its ratio to the first variant. One process spares the engine's start per side (a minute at the real
shapes) and alternating spreads the machine's drift over every variant; `ab_decode.py` compares two checkouts.

    python scripts/ab_kernel_flags.py --model 35b-a3b --variants 'base;fuse_gdn_out=0' --lanes 1,8
    python scripts/ab_kernel_flags.py --model 27b --weights fp8-dynamic --variants 'base;fuse_gdn_out=0' --lanes 1
    python scripts/ab_kernel_flags.py --model 35b-a3b --variants 'base;moe.decode_share_tiles=0' --lanes 4,8
    python scripts/ab_kernel_flags.py --model 27b --weights fp8-dynamic --variants 'base;fp8.cuda_core_splits=1'
    python scripts/ab_kernel_flags.py --smoke        # the tiny MoE shape on CPU (interpret mode), 1 lane

A `moe.FIELD=value` item replaces that `MoeConfig` field in every config `pallas_kernels.moe` picks from, an
`fp8.FIELD=value` item that `Fp8Config` field of `pallas_kernels.fp8_matmul`, a `gdn.FIELD=value` item that
`GdnDecodeLayerConfig` field of `pallas_kernels.gdn_decode_layer` (they are read while tracing, so jax's caches are
cleared and the steps traced again). A `pallas_kernels.MODULE=PATH` item runs another version of that module (a
copy of the file at PATH, e.g. `git show REV:pallas_kernels/fp8_gemm.py > /tmp/fp8_gemm_old.py`): the module's
functions are replaced by the copy's, whose calls stay within the copy, for a change that no switch selects. A
`layout=blocked` (or `rows`) item runs the dense FP8 weights blocked (`ops.kernel_layout`) or [N, K], converted in
place (the engine's own layout: `startup.BLOCK_FP8_WEIGHTS`):

    python scripts/ab_kernel_flags.py --model 35b-a3b --weights fp8-dynamic --lanes 64,256 \
        --variants 'pallas_kernels.fp8_gemm=/tmp/fp8_gemm_old.py;base'
    python scripts/ab_kernel_flags.py --model 27b --weights fp8-dynamic --lanes 1,64 --variants 'base;layout=blocked'
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")  # the 35B-A3B's bf16 weights on an H100


def parse_variant(text: str, kernel_config, module_configs: dict) -> tuple[dict, dict]:
    """'base' or comma-separated items, KernelConfig field=value, PREFIX.field=value of a kernel module's config
    (module_configs: prefix -> that config; 0 / 1 for switches, integers as such), pallas_kernels.MODULE=PATH or
    layout=rows|blocked -> (the KernelConfig fields to replace, {prefix: that config's fields to replace, "copies":
    {module: path}, "layout": the FP8 weights' layout or None})."""
    kc, mods = {}, {prefix: {} for prefix in module_configs} | {"copies": {}, "layout": None}
    if text.strip() == "base":
        return kc, mods
    for item in text.split(","):
        name, _, value = item.strip().partition("=")
        if name.startswith("pallas_kernels."):
            if not os.path.isfile(value):
                raise SystemExit(f"--variants: {item!r}: no file {value!r} to run as {name}")
            mods["copies"][name] = value
            continue
        if name == "layout" and value in ("rows", "blocked"):
            mods["layout"] = value
            continue
        prefix, dot, field = name.partition(".")
        if dot and prefix in module_configs:
            into, config, name = mods[prefix], module_configs[prefix], field
        else:
            into, config = kc, kernel_config
        fields = [f.name for f in dataclasses.fields(config)]
        if name not in fields or not value:
            raise SystemExit(f"--variants: {item!r} is not [{'|'.join(f'{p}.' for p in module_configs)}]field=value "
                             f"(fields: {', '.join(fields)})")
        into[name] = bool(int(value)) if value in ("0", "1") else int(value) if value.isdigit() else value
    return kc, mods


def module_configs() -> dict:
    """prefix -> (the kernel module, its config class): the configs a `PREFIX.field=value` item replaces, every
    instance of the class in the module (they are read while tracing)."""
    from pallas_kernels import fp8_matmul, gdn_decode_layer, moe

    return {"moe": (moe, moe.MoeConfig), "fp8": (fp8_matmul, fp8_matmul.Fp8Config),
            "gdn": (gdn_decode_layer, gdn_decode_layer.GdnDecodeLayerConfig)}


def put_configs(fields: dict, base: dict) -> None:
    """Put base's configs ({prefix: {name: config}}) back in their modules, each with fields[prefix] replaced."""
    for prefix, (module, _) in module_configs().items():
        for name, config in base[prefix].items():
            setattr(module, name, dataclasses.replace(config, **fields.get(prefix, {})))


def module_copy(name: str, path: str):
    """The file at path run as a module of its own, beside the real one `name` (loaded once)."""
    alias = f"{name}__copy_{abs(hash(os.path.abspath(path)))}"
    if alias not in sys.modules:
        spec = importlib.util.spec_from_file_location(alias, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[alias] = module  # before running it: dataclasses look their module up
        spec.loader.exec_module(module)
    return sys.modules[alias]


def own_functions(module) -> dict:
    """{name: function} of the functions defined in module itself (jitted ones too), not imported into it."""
    return {attr: fn for attr, fn in vars(module).items()
            if callable(fn) and not isinstance(fn, type) and getattr(fn, "__module__", None) == module.__name__}


def put_functions(copies: dict, base: dict) -> None:
    """Give each module in base ({module name: {function name: function}}) its own functions back, then those of
    its copy (copies: {module name: path}) in their place; the copy's functions call each other, not the module's."""
    for name, functions in base.items():
        module = importlib.import_module(name)
        for attr, fn in functions.items():
            setattr(module, attr, fn)
        if name in copies:
            for attr, fn in own_functions(module_copy(name, copies[name])).items():
                setattr(module, attr, fn)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="35b-a3b")
    p.add_argument("--weights", default="bf16")
    p.add_argument("--variants", default="base;fuse_gdn_out=0", help="';'-separated, the first the baseline")
    p.add_argument("--lanes", default="1,8")
    p.add_argument("--rounds", type=int, default=32)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args()
    if args.smoke:
        args.model, args.lanes, args.rounds, args.reps = "tiny-moe", "1", 2, 1

    import jax

    from ninfer_jax.benchmarks.profiling import alternate_rounds, round_engine
    from ninfer_jax.model import ops
    from ninfer_jax.runtime import startup

    lanes = [int(x) for x in args.lanes.split(",")]
    start = time.perf_counter()
    engine = round_engine(args.model, max(lanes), weights=args.weights)
    print(f"engine {args.model} {args.weights}: {time.perf_counter() - start:.1f} s", flush=True)
    base = engine.runner.kernels
    config_base = {prefix: {name: c for name, c in vars(module).items() if isinstance(c, cls)}
                   for prefix, (module, cls) in module_configs().items()}
    defaults = {prefix: module.DEFAULT_CONFIG for prefix, (module, _) in module_configs().items()}
    variants = [(v.strip(), *parse_variant(v, base, defaults)) for v in args.variants.split(";")]
    retrace = any(any(mc.values()) for _, _, mc in variants)
    function_base = {name: own_functions(importlib.import_module(name))
                     for name in {name for _, _, mc in variants for name in mc["copies"]}}

    layouts = any(mc["layout"] for _, _, mc in variants)

    def apply(kc, mc):
        # KernelConfig is a static argument of the steps: a new one traces and compiles them again
        engine.runner.kernels = dataclasses.replace(base, **kc)
        if layouts:  # the weights converted in place (donated): one copy on the device; a new layout compiles again
            layout = mc["layout"] or ("blocked" if startup.BLOCK_FP8_WEIGHTS else "rows")  # the engine's own
            engine.runner.params = ops.kernel_layout(engine.runner.params, layout == "blocked")
        if retrace:
            put_configs(mc, config_base)
            put_functions(mc["copies"], function_base)
            jax.clear_caches()

    try:
        ms = alternate_rounds(engine, [(name, lambda kc=kc, mc=mc: apply(kc, mc)) for name, kc, mc in variants],
                              lanes, args.rounds, args.reps)
    finally:
        engine.runner.kernels = base
        put_configs({}, config_base)
        put_functions({}, function_base)
        engine.stop()
    print(f"{args.model} {args.weights} on {jax.devices()[0].device_kind}, medians of {args.reps}:")
    for n in lanes:
        ref = statistics.median(ms[(variants[0][0], n)])
        print(f"  {n} lanes: " + ", ".join(f"[{name}] {statistics.median(ms[(name, n)]):.3f} ms "
                                          f"({statistics.median(ms[(name, n)]) / ref:.4f}x)" for name, *_ in variants))
        # each alternation's own, so a difference can be read against the spread between compiles of one variant
        print("    each: " + "; ".join(f"[{name}] " + " ".join(f"{v:.3f}" for v in ms[(name, n)])
                                     for name, *_ in variants))
    return 0


if __name__ == "__main__":
    sys.exit(main())
