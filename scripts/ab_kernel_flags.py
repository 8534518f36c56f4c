"""A/B of the kernel switches (`ops.KernelConfig` fields) in one engine's decode rounds, in one process.

One engine on random weights at a real shape; then, --reps times, each variant in turn: the runner's KernelConfig
replaced by the variant's (a static argument of the steps, so they are traced and compiled again), one untimed round
at each lane count, then --rounds rounds back to back (`profiling.time_rounds`). The report is each variant's median
ms a round and its ratio to the first variant. One process spares the engine's start per side (a minute at the real
shapes) and alternating spreads the machine's drift over every variant; `ab_decode.py` compares two checkouts.

    python scripts/ab_kernel_flags.py --model 35b-a3b --variants 'base;fuse_gdn_out=0' --lanes 1,8
    python scripts/ab_kernel_flags.py --model 27b --weights fp8-dynamic --variants 'base;fuse_gdn_out=0' --lanes 1
    python scripts/ab_kernel_flags.py --model 35b-a3b --variants 'base;moe.decode_share_tiles=0' --lanes 4,8
    python scripts/ab_kernel_flags.py --smoke        # the tiny MoE shape on CPU (interpret mode), 1 lane

A `moe.FIELD=value` item replaces that `MoeConfig` field in every config `pallas_kernels.moe` picks from (they are read
while tracing, so jax's caches are cleared and the steps traced again).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")  # the 35B-A3B's bf16 weights on an H100


def parse_variant(text: str, kernel_config, moe_config) -> tuple[dict, dict]:
    """'base' or comma-separated KernelConfig field=value and moe.MoeConfig-field=value items (0 / 1 for switches,
    integers as such) -> (the KernelConfig fields to replace, the MoeConfig fields to replace)."""
    kc, mc = {}, {}
    if text.strip() == "base":
        return kc, mc
    for item in text.split(","):
        name, _, value = item.strip().partition("=")
        into, config = (mc, moe_config) if name.startswith("moe.") else (kc, kernel_config)
        name = name.removeprefix("moe.")
        fields = [f.name for f in dataclasses.fields(config)]
        if name not in fields or not value:
            raise SystemExit(f"--variants: {item!r} is not [moe.]field=value (fields: {', '.join(fields)})")
        into[name] = bool(int(value)) if value in ("0", "1") else int(value) if value.isdigit() else value
    return kc, mc


def moe_configs(fields: dict, base: dict) -> None:
    """Put base's MoeConfigs back in `pallas_kernels.moe`, each with `fields` replaced."""
    from pallas_kernels import moe

    for name, config in base.items():
        setattr(moe, name, dataclasses.replace(config, **fields))


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

    lanes = [int(x) for x in args.lanes.split(",")]
    start = time.perf_counter()
    engine = round_engine(args.model, max(lanes), weights=args.weights)
    print(f"engine {args.model} {args.weights}: {time.perf_counter() - start:.1f} s", flush=True)
    from pallas_kernels import moe

    base = engine.runner.kernels
    moe_base = {name: c for name, c in vars(moe).items() if isinstance(c, moe.MoeConfig)}
    variants = [(v.strip(), *parse_variant(v, base, moe.DEFAULT_CONFIG)) for v in args.variants.split(";")]
    retrace = any(mc for _, _, mc in variants)

    def apply(kc, mc):
        # KernelConfig is a static argument of the steps: a new one traces and compiles them again
        engine.runner.kernels = dataclasses.replace(base, **kc)
        if retrace:
            moe_configs(mc, moe_base)
            jax.clear_caches()

    try:
        ms = alternate_rounds(engine, [(name, lambda kc=kc, mc=mc: apply(kc, mc)) for name, kc, mc in variants],
                              lanes, args.rounds, args.reps)
    finally:
        engine.runner.kernels = base
        moe_configs({}, moe_base)
        engine.stop()
    print(f"{args.model} {args.weights} on {jax.devices()[0].device_kind}, medians of {args.reps}:")
    for n in lanes:
        ref = statistics.median(ms[(variants[0][0], n)])
        print(f"  {n} lanes: " + ", ".join(f"[{name}] {statistics.median(ms[(name, n)]):.3f} ms "
                                          f"({statistics.median(ms[(name, n)]) / ref:.4f}x)" for name, *_ in variants))
    return 0


if __name__ == "__main__":
    sys.exit(main())
