"""One lane's MoE layer on the matrix-vector kernels (`moe.moe_experts_routed`: routing, the routed experts and the
shared expert in two kernels) at the 35B-A3B's shapes: `MoeConfig` gemv variants side by side on one GPU, then
optionally the engine's one-lane round with the fastest as the default config.

Layers: 8 of them chained in one jit, each with weights of its own (the experts come from HBM, not L2) and its own
router logits; microseconds a layer, medians of --reps, each variant's largest difference from the first's output.
bf16 weights, then block-FP8 (--fp8). --engine: `profiling.round_engine`, then --reps times each of the first
variant and the fastest as `moe.DEFAULT_CONFIG` (the steps traced again), 32 rounds back to back each.

    python scripts/sweep_moe_gemv.py --engine                  # one GPU, about 4 minutes
    python scripts/sweep_moe_gemv.py --variants 'base;s8'  # named variants only
    python scripts/sweep_moe_gemv.py --smoke                   # tiny shapes in interpret mode (CPU): the script runs
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import statistics

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")  # the 35B-A3B's bf16 weights on an H100 (--engine)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from ninfer_jax.benchmarks.profiling import alternate_calls, alternate_rounds, first_calls, round_engine  # noqa: E402
from pallas_kernels import fp8_matmul, moe  # noqa: E402
from pallas_kernels.reference import SharedExpert  # noqa: E402

E, K, H, I, LAYERS = 256, 8, 2048, 512, 8  # noqa: E741 (the module docstrings' names)
INTERPRET = False
_B, _R = moe.DEFAULT_CONFIG, dataclasses.replace
VARIANTS = {
    "base": _B,
    "s8": _R(_B, gemv_splits=8),
    "s32": _R(_B, gemv_splits=32),
    "w4": _R(_B, gemv_num_warps=4),
    "w1": _R(_B, gemv_num_warps=1),
    "st2": _R(_B, gemv_num_stages=2),
    "st3": _R(_B, gemv_num_stages=3),
    "bn64": _R(_B, gemv_block_n=64),
    "bn256": _R(_B, gemv_block_n=256),
    "bk32": _R(_B, gemv_block_k=32),
    "bk128 s8": _R(_B, gemv_block_k=128, gemv_splits=8),
    "d4": _R(_B, gemv_down_splits=4),
    "d16": _R(_B, gemv_down_splits=16),
    "dbn64": _R(_B, gemv_down_block_n=64),
    "dbn256": _R(_B, gemv_down_block_n=256),
}


def layer_weights(fp8: bool, seed: int):
    """(gate_up, down, shared expert, its gate [H, 1]) at the 35B-A3B's shapes, random."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    if not fp8:
        def w(k, shape):
            return (jax.random.normal(k, shape, jnp.float32) * 0.02).astype(jnp.bfloat16)
        return (w(ks[0], (E, H, 2 * I)), w(ks[1], (E, I, H)),
                SharedExpert(w(ks[2], (H, 2 * I)), w(ks[3], (I, H)), None), w(ks[4], (H, 1)))

    def q(k, shape):  # FP8 values are [..., N, K]
        values = (jax.random.normal(k, shape, jnp.float32) * 0.5).astype(jnp.float8_e4m3fn)
        return fp8_matmul.BlockFp8(values, jnp.full((*shape[:-2], shape[-2] // 128, shape[-1] // 128), 0.04))
    gate = (jax.random.normal(ks[4], (H, 1), jnp.float32) * 0.02).astype(jnp.bfloat16)
    return (q(ks[0], (E, 2 * I, H)), q(ks[1], (E, H, I)), SharedExpert(q(ks[2], (2 * I, H)), q(ks[3], (H, I)), None),
            gate)


def sweep(fp8: bool, names: list[str], reps: int, calls: int = 20) -> dict[str, float]:
    """Microseconds a layer of each named variant (the first is the baseline)."""
    layers = [layer_weights(fp8, i) for i in range(LAYERS)]
    logits = [jax.random.normal(jax.random.PRNGKey(100 + i), (1, E), jnp.float32) for i in range(LAYERS)]
    x0 = jax.random.normal(jax.random.PRNGKey(7), (1, H), jnp.float32).astype(jnp.bfloat16)
    kind = "fp8" if fp8 else "bf16"

    def chain(x, layers, logits, cfg):
        for (gate_up, down, shared, gate), lg in zip(layers, logits):
            out = moe.moe_experts_routed(x, lg, gate_up, down, shared, gate, top_k=K, config=cfg,
                                         interpret=INTERPRET)[0]
            x = (out * 0.5 + x.astype(jnp.float32)).astype(jnp.bfloat16)
        return x

    print(f"{kind} weights, {LAYERS} layers chained:", flush=True)
    fns = {name: jax.jit(functools.partial(chain, cfg=VARIANTS[name])) for name in names}
    ran = first_calls(fns, x0, layers, logits)
    for name, (out, seconds) in ran.items():
        diff = np.abs(out - ran[names[0]][0]).max() if names[0] in ran else float("nan")
        print(f"{kind} [{name}] compiled and ran in {seconds:.1f} s; max |diff| from [{names[0]}] {diff:.3e}",
              flush=True)
    times = alternate_calls({name: fns[name] for name in ran}, x0, layers, logits, reps=reps, calls=calls)
    times = {name: [t / LAYERS * 1e6 for t in ts] for name, ts in times.items()}
    medians = {name: statistics.median(t) for name, t in times.items()}
    base = medians.get(names[0])
    for name, us in medians.items():
        ratio = f" ({us / base:.3f}x)" if base else ""
        print(f"{kind} [{name}] {us:.2f} us a layer{ratio}, spread {min(times[name]):.2f}-{max(times[name]):.2f}",
              flush=True)
    return medians


def engine_rounds(names: list[str], reps: int) -> None:
    """The 35B-A3B's one-lane round with each named variant as `moe.DEFAULT_CONFIG`, alternated."""
    def apply(name):
        moe.DEFAULT_CONFIG = VARIANTS[name]
        jax.clear_caches()  # the config is read while tracing

    engine = round_engine("35b-a3b", 1)
    try:
        ms = alternate_rounds(engine, [(name, functools.partial(apply, name)) for name in names], [1], 32, reps)
    finally:
        moe.DEFAULT_CONFIG = _B
        engine.stop()
    base = statistics.median(ms[(names[0], 1)])
    for name in names:
        m = statistics.median(ms[(name, 1)])
        print(f"round [{name}] {m:.3f} ms ({m / base:.4f}x)", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default=";".join(VARIANTS), help="';'-separated names, the first the baseline")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--no-fp8", action="store_true", help="bf16 weights only")
    p.add_argument("--engine", action="store_true", help="then the one-lane round: the first and the fastest")
    p.add_argument("--smoke", action="store_true", help="tiny shapes (FP8's 128-blocks) in interpret mode, no engine")
    args = p.parse_args()
    if args.smoke:
        global E, K, H, I, LAYERS, INTERPRET  # noqa: E741
        E, K, H, I, LAYERS, INTERPRET = 8, 2, 128, 128, 2, True  # noqa: E741
        args.reps, args.engine = 1, False
    names = args.variants.split(";")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; known: {list(VARIANTS)}")
    print(jax.devices()[0].device_kind, flush=True)
    bf16 = sweep(False, names, args.reps)
    best = min((n for n in bf16 if n != names[0]), key=bf16.get, default=names[0])
    print(f"fastest bf16: [{best}]", flush=True)
    if args.engine and best != names[0]:
        engine_rounds([names[0], best], 3)
    if not args.no_fp8:
        sweep(True, list(dict.fromkeys([names[0], *names[1:4], best])), args.reps)


if __name__ == "__main__":
    main()
