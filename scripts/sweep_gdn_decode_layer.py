"""The fused GDN decode step (`pallas_kernels.gdn_decode_layer`) at wide rounds: every (warps, Dv block, stages)
config at 8 to 256 lanes with the 35B-A3B's and the 27B's GDN heads, timed back to back on one GPU, with the state
bytes read and written per second and the largest difference from the first config's output (a Dv block under 128
moves the gated norm to XLA: a bf16 rounding apart). Chose `gdn_decode_layer.WIDE_PROGRAMS`.

    python scripts/sweep_gdn_decode_layer.py      # one H200, about 2 minutes
"""
import itertools
import time

import numpy as np
import jax
import jax.numpy as jnp

from pallas_kernels.gdn_decode_layer import gdn_decode_layer, GdnDecodeLayerConfig


def run(name, hk, hv, d, lanes_list):
    K = 4
    C = 2 * hk * d + hv * d
    for lanes in lanes_list:
        S = lanes + 4
        key = jax.random.PRNGKey(0)
        proj = (jax.random.normal(key, (lanes, C + hv * d + 2 * hv), jnp.float32) * 0.5).astype(jnp.bfloat16)
        hist = (jax.random.normal(key, (S, K - 1, C), jnp.float32) * 0.5).astype(jnp.bfloat16)
        conv_w = (jax.random.normal(key, (K, C), jnp.float32) * 0.3).astype(jnp.bfloat16)
        a_log, dt, nw = jnp.zeros(hv, jnp.float32), jnp.zeros(hv, jnp.float32), jnp.ones(d, jnp.bfloat16)
        pool = jax.random.normal(key, (S, hv, d, d), jnp.float32) * 0.01
        slots = jnp.arange(lanes, dtype=jnp.int32)
        active = jnp.ones(lanes, bool)
        bytes_ = lanes * hv * d * d * 4 * 2
        ref = None
        for warps, bv, stages, minp in itertools.product((4, 8), (128, 64, 32), (1, 2), (128,)):
            cfg = GdnDecodeLayerConfig(num_warps=warps, block_v=bv, num_stages=stages, min_programs=minp)
            f = jax.jit(lambda p, pool, cfg=cfg: gdn_decode_layer(
                proj, active, hist, conv_w, a_log, dt, nw, pool, slots, num_key_heads=hk, eps=1e-6, config=cfg),
                donate_argnums=(1,))
            try:
                p2 = pool + 0
                y, p2, tail = f(proj, p2)
                jax.block_until_ready(p2)
                if ref is None:
                    ref = np.asarray(y, np.float32)
                err = float(np.max(np.abs(np.asarray(y, np.float32) - ref)))
                n = 50
                t = time.perf_counter()
                for _ in range(n):
                    y, p2, tail = f(proj, p2)
                jax.block_until_ready(p2)
                us = (time.perf_counter() - t) / n * 1e6
                print(f"{name} lanes={lanes} warps={warps} block_v={bv} stages={stages}: {us:8.1f} us  "
                      f"{bytes_ / us / 1e6:6.2f} TB/s  err={err:.2e}", flush=True)
            except Exception as e:
                print(f"{name} lanes={lanes} warps={warps} block_v={bv} stages={stages}: FAILED {str(e)[:200]}",
                      flush=True)


if __name__ == "__main__":
    run("35b", 16, 32, 128, [8, 64, 256])
    run("27b", 16, 48, 128, [64, 256])
