"""One lane's GDN out-projection with its gated norm (`pallas_kernels.gdn_out_proj`) against XLA's composition (the
norm, the row doubled for a two-row matmul, the matmul: `qwen3_5.dot`) at the 35B-A3B's shape, o [1, 32, 128] and w
[4096, 2048] bf16: each `GdnOutConfig` side by side on one GPU.

30 layers chained in one jit (the 35B-A3B's GDN layers), each with a weight of its own so that the weights come from
HBM; microseconds a layer, medians of --reps, each variant's largest difference from XLA's output. The first config
is `gdn_out_proj.DEFAULT_CONFIG`, the fastest of these on an H100 (docs/kernels_notes.md).

    python scripts/sweep_gdn_out_proj.py          # one GPU, about a minute
    python scripts/sweep_gdn_out_proj.py --smoke  # two layers in interpret mode (CPU): the script runs
"""

from __future__ import annotations

import argparse
import statistics

import jax
import jax.numpy as jnp
import numpy as np

from ninfer_jax.benchmarks.profiling import alternate_calls, first_calls
from pallas_kernels.gdn_out_proj import GdnOutConfig, gdn_out_proj
from pallas_kernels.reference import gated_rms_norm

HV, DV, N, LAYERS, EPS = 32, 128, 2048, 30, 1e-6
INTERPRET = False
CONFIGS = {
    f"n{block_n} s{splits} w{warps} st{stages}": GdnOutConfig(block_n, splits, warps, stages)
    for block_n, splits, warps, stages in [
        (64, 16, 4, 4), (64, 8, 4, 4), (64, 32, 4, 4), (128, 16, 4, 4), (128, 8, 4, 4), (128, 32, 8, 4),
        (32, 16, 2, 4), (32, 8, 2, 4), (64, 16, 2, 4), (64, 16, 4, 2), (128, 16, 8, 3), (256, 16, 8, 3)]
}


def xla(o, z, norm_w, w):
    """The model's path at one lane: the norm, then the two-row matmul (the doubled row keeps XLA off multiply +
    reduce), its first row."""
    y = gated_rms_norm(o, z.reshape(o.shape), norm_w, EPS).reshape(1, -1)
    two = jax.lax.optimization_barrier(jnp.concatenate([y, y]))
    return jnp.dot(two, w, preferred_element_type=o.dtype)[:1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--smoke", action="store_true", help="two layers, 256 columns, interpret mode")
    args = p.parse_args()
    if args.smoke:
        global N, LAYERS, INTERPRET
        N, LAYERS, INTERPRET = 256, 2, True
        args.reps, args.calls = 1, 1
    print(jax.devices()[0].device_kind, flush=True)
    keys = jax.random.split(jax.random.PRNGKey(0), 3 * LAYERS)
    ws = [(jax.random.normal(keys[i], (HV * DV, N), jnp.float32) * 0.02).astype(jnp.bfloat16) for i in range(LAYERS)]
    os_ = [jax.random.normal(keys[LAYERS + i], (1, HV, DV), jnp.float32).astype(jnp.bfloat16) for i in range(LAYERS)]
    zs = [jax.random.normal(keys[2 * LAYERS + i], (1, HV * DV), jnp.float32).astype(jnp.bfloat16)
          for i in range(LAYERS)]
    norm_w = jnp.ones((DV,), jnp.bfloat16)

    def chain(step):
        def run(ws, os_, zs):
            acc = jnp.zeros((1, N), jnp.float32)
            for w, o, z in zip(ws, os_, zs):  # one stream runs the layers' kernels in turn
                acc = acc + step(o, z, w).astype(jnp.float32)
            return acc
        return jax.jit(run)

    variants = {"xla": chain(lambda o, z, w: xla(o, z, norm_w, w))}
    for name, cfg in CONFIGS.items():
        variants[name] = chain(lambda o, z, w, cfg=cfg: gdn_out_proj(o, z, norm_w, w, z_col=0, eps=EPS, config=cfg,
                                                                          interpret=INTERPRET))
    ran = first_calls(variants, ws, os_, zs)
    want = next(iter(ran.values()))[0] if ran else None  # XLA's output, unless it failed
    for name, (out, seconds) in ran.items():
        print(f"[{name}] compiled and ran in {seconds:.1f} s; max |diff| from xla {np.abs(out - want).max():.3e} "
              f"(|out| {np.abs(want).max():.2e})", flush=True)
    times = alternate_calls({name: variants[name] for name in ran}, ws, os_, zs, reps=args.reps, calls=args.calls)
    times = {name: [t / LAYERS * 1e6 for t in ts] for name, ts in times.items()}
    base = statistics.median(times["xla"]) if "xla" in times else None
    gb = HV * DV * N * 2 / 1e9
    for name, t in times.items():
        us = statistics.median(t)
        ratio = f" ({us / base:.3f}x xla)" if base else ""
        print(f"[{name}] {us:.2f} us a layer{ratio}, {gb / us * 1e6 / 1e3:.2f} TB/s of weight", flush=True)


if __name__ == "__main__":
    main()
