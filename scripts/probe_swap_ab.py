"""Probe: the Mosaic GPU swap-AB FP8 kernel against the Triton decode kernels, fp8_gemm and bf16 (27B shapes)."""
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from bench_kernels import time_pure  # noqa: E402

from ninfer_jax.model.random_init import fp8_normal  # noqa: E402
from pallas_kernels import fp8_gemm, fp8_matmul  # noqa: E402
from pallas_kernels import fp8_swap_ab as sw  # noqa: E402

SHAPES = {"gate_up": (34816, 5120), "down": (5120, 17408), "gdn_in": (16384, 5120), "o_proj": (5120, 6144),
          "qkv": (14336, 5120)}
ROWS = [int(r) for r in sys.argv[1].split(",")] if len(sys.argv) > 1 else [1, 8, 32, 64]
CFGS = {"s2w6": sw.SwapConfig(2, 6), "s1w8": sw.SwapConfig(1, 8),
        "s2w4b2": sw.SwapConfig(2, 4, 0, 2), "s2w2b4": sw.SwapConfig(2, 2, 0, 4), "s1w6b2": sw.SwapConfig(1, 6, 0, 2),
        "s1w4b4": sw.SwapConfig(1, 4, 0, 4), "s1w8b2": sw.SwapConfig(1, 8, 0, 2)}
ONLY = os.environ.get("SHAPES")
out = []
t0 = time.time()
for name, (n, k) in SHAPES.items():
    if ONLY and name not in ONLY.split(","):
        continue
    w = fp8_normal(jax.random.key(1), (n, k), k ** -0.5)
    wb = fp8_matmul.dequantize_rows(fp8_matmul.BlockFp8(w.values, w.scales), jnp.bfloat16)
    gb = n * k / 1e9
    for m in ROWS:
        x = jax.random.normal(jax.random.key(m), (m, k), jnp.bfloat16)
        row = {"shape": name, "rows": m}
        ref = fp8_gemm.reference(x, w.values, w.scales)

        def t(label, fn, args, check=None):
            try:
                if check is not None:
                    got = fn(*args)
                    row[label + "_rel"] = float(jnp.linalg.norm(got.astype(jnp.float32) - check)
                                                / jnp.linalg.norm(check))
                us = time_pure(fn, args, unroll=10) * 1e6
                row[label] = round(us, 2)
            except Exception as e:
                row[label] = f"ERR {type(e).__name__}: {str(e)[:300]}"

        t("bf16", lambda a, b: jnp.dot(a, b.T, preferred_element_type=jnp.bfloat16), (x, wb))
        if m <= 32:
            t("triton", lambda a, v, s: fp8_matmul.fp8_matmul(a, v, s, quantize_activations=m > 1),
              (x, w.values, w.scales), ref)
        if m > 32:
            t("gemm", lambda a, v, s: fp8_gemm.fp8_gemm(a, v, s), (x, w.values, w.scales), ref)
        for label, cfg in CFGS.items():
            if sw.supported(m, k, n, cfg):
                t(label, lambda a, v, s, cfg=cfg: sw.fp8_swap_ab(a, v, s, config=cfg), (x, w.values, w.scales), ref)
        us = {kk: v for kk, v in row.items() if isinstance(v, float) and not kk.endswith("_rel")}
        print(json.dumps(row), flush=True)
        print(f"  {name} rows {m}: " + ", ".join(f"{kk} {gb / (v * 1e-6):.0f}GB/s" for kk, v in us.items()),
              f"[{time.time() - t0:.0f}s]", flush=True)
        out.append(row)
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "swap_probe.json"), "w"), indent=1)
