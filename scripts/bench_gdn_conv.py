"""Time the GDN prefill conv kernel (`pallas_kernels/gdn_conv.py`) under tile configs against the model's XLA
composition, at a model's shapes, each config's outputs checked against that composition first.

For each token count: the composition (`qwen3_5._gdn_conv_qkv`, jitted) and the kernel at each `--configs` entry
(block_t x num_warps), 30 calls back to back after a warm call, on the same random inputs (the last 5 rows
padding). Reports microseconds per call, the ratio to the composition and the rate over the bytes
the step must move (the pre-conv channels in, q and k in float32 and v out).

    python3 scripts/bench_gdn_conv.py --out $OUT/gdn_conv.json            # H200, 35B-A3B shapes
    python3 scripts/bench_gdn_conv.py --smoke                             # CPU, interpret mode, tiny shapes
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from ninfer_jax.config import ModelConfig  # noqa: E402
from ninfer_jax.model import qwen3_5  # noqa: E402
from pallas_kernels import gdn_conv  # noqa: E402

MODELS = {"35b-a3b": "qwen3.5-35b-a3b", "27b": "qwen3.5-27b", "tiny": "tiny-moe"}


def timeit(fn, args, reps: int) -> float:
    jax.block_until_ready(fn(*args))
    t = time.perf_counter()
    for _ in range(reps):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / reps


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="35b-a3b", choices=list(MODELS))
    p.add_argument("--tokens", default="8192,2048")
    p.add_argument("--configs", default="32x2,32x4,32x8,64x4,64x8,128x8",
                   help="block_t x num_warps pairs (256-token tiles took minutes to compile on the H200)")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--smoke", action="store_true", help="CPU interpret mode, tiny shapes, 2 reps")
    p.add_argument("--out")
    args = p.parse_args()
    model = "tiny" if args.smoke else args.model
    cfg = ModelConfig.from_file(ROOT / "configs" / f"{MODELS[model]}.json")
    tokens = [64, 40] if args.smoke else [int(t) for t in args.tokens.split(",")]
    reps = 2 if args.smoke else args.reps
    configs = [tuple(int(v) for v in c.split("x")) for c in args.configs.split(",")]
    hk, dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
    hv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    c, taps = cfg.conv_dim, cfg.linear_conv_kernel_dim
    width = c + cfg.value_dim + 2 * hv  # the in-projection's output: qkv, z, b, a

    def compose(proj, history, conv_w, n_valid):
        window = jnp.concatenate([history, proj[:, :c]], axis=0)
        return qwen3_5._gdn_conv_qkv(window, conv_w, (jnp.arange(proj.shape[0]) < n_valid)[:, None], cfg)

    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": getattr(jax.devices()[0], "device_kind", str(jax.devices()[0])), "jax": jax.__version__,
            "command": " ".join(["python3"] + sys.argv), "model": model}
    print("meta:", json.dumps(meta), flush=True)
    rows = []
    for t in tokens:
        rng = np.random.default_rng(t)
        proj = jnp.asarray(rng.standard_normal((t, width)), jnp.bfloat16)
        history = jnp.asarray(rng.standard_normal((taps - 1, c)), jnp.bfloat16)
        conv_w = jnp.asarray(rng.standard_normal((taps, c)) * 0.5, jnp.bfloat16)
        n_valid = jnp.int32(t - 5)
        inputs = (proj, history, conv_w, n_valid)
        ref = jax.jit(compose)
        want = ref(*inputs)
        base = timeit(ref, inputs, reps)
        moved = t * c * 2 + t * 2 * hk * dk * 4 + t * hv * dv * 2
        row = {"tokens": t, "composition_s": base, "bytes": moved, "configs": {}}
        print(f"T={t} composition: {base * 1e6:.1f} us ({moved / base / 1e12:.2f} TB/s)", flush=True)
        for block_t, warps in configs:
            name = f"{block_t}x{warps}"
            kc = gdn_conv.GdnConvConfig(block_t=block_t, num_warps=warps)
            fn = jax.jit(lambda *a, kc=kc: gdn_conv.gdn_conv_prefill(
                *a, num_key_heads=hk, key_head_dim=dk, num_value_heads=hv, value_head_dim=dv,
                interpret=args.smoke, config=kc))
            try:
                got = fn(*inputs)
                err = max(float(jnp.max(jnp.abs(g.astype(jnp.float32) - w.astype(jnp.float32))))
                          for g, w in zip(got, want))
                s = timeit(fn, inputs, reps)
            except Exception as e:  # noqa: BLE001 (a config that does not compile is reported, not fatal)
                row["configs"][name] = {"error": repr(e)[:300]}
                print(f"T={t} {name}: FAILED {repr(e)[:300]}", flush=True)
                continue
            row["configs"][name] = {"s": s, "max_abs_err": err}
            print(f"T={t} block_t {block_t} warps {warps}: {s * 1e6:.1f} us ({base / s:.2f}x composition, "
                  f"{moved / s / 1e12:.2f} TB/s), max abs err {err:.2e}", flush=True)
        rows.append(row)
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
