"""FP8 decode-kernel configs on the GPU (pallas_kernels/fp8_matmul.py): correctness (float64 at a small shape;
relative error against the dequantized float32 product at the real ones) and time per call (10 calls inside one jit,
median of 5 batches) of each config in VARIANTS beside XLA's bf16 matmul and, given OLD (a copy of an earlier
fp8_matmul.py), that one's default. GB/s count FP8 weight bytes (bf16: its own). All programs are compiled before any
is timed (compiling beside a timing slows it).

    git show 22da5b9:pallas_kernels/fp8_matmul.py > /tmp/fp8_matmul_old.py
    OLD=/tmp/fp8_matmul_old.py OUT=/tmp python scripts/sweep_fp8_decode.py   # SHAPES=gate_up,down BASE_ROWS=1,8
"""
import os
import sys
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
import concurrent.futures as cf
import dataclasses
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from ninfer_jax.model.random_init import fp8_normal  # noqa: E402
from pallas_kernels import fp8_matmul as fm  # noqa: E402

old = None
if os.environ.get("OLD"):
    import importlib.util

    _spec = importlib.util.spec_from_file_location("fp8_matmul_old", os.environ["OLD"])
    old = sys.modules["fp8_matmul_old"] = importlib.util.module_from_spec(_spec)  # dataclasses look it up
    _spec.loader.exec_module(old)

R = dataclasses.replace
D = fm.DEFAULT_CONFIG
# name -> config, quantize_activations, rows, shapes (None: all)
VARIANTS = {
    "new": (D, False, (1, 2, 8, 16), None),
    "new dynamic": (D, True, (2, 8, 16), None),
    "alt cc stages1": (R(D, cuda_core_stages=1), False, (1,), None),
    "alt cc to 2 rows": (R(D, cuda_core_max_rows=2), False, (2,), None),
    "alt tc 8 splits": (R(D, min_programs=0), False, (8,), None),
    "alt dyn bn32 8 splits": (R(D, dynamic_block_n=32, dynamic_min_programs=0), True, (8,), None),
}

if os.environ.get("DRY"):  # a dry run of the script on the CPU (the Pallas interpreter)
    import functools
    fm.fp8_matmul = functools.partial(fm.fp8_matmul, interpret=True)
    if old is not None:
        old.fp8_matmul = functools.partial(old.fp8_matmul, interpret=True)
print("fp8_matmul from", fm.__file__, jax.devices(), flush=True)
OUT = os.environ.get("OUT", "/tmp")
SHAPES = {"gate_up": (5120, 34816), "down": (17408, 5120), "gdn_in": (5120, 16384), "o_proj": (6144, 5120),
          "35b_shared": (2048, 1024)}
only = os.environ.get("SHAPES")
if only:
    SHAPES = {k: v for k, v in SHAPES.items() if k in only.split(",")}
T0 = time.time()


def step_fn(fn, unroll=10):
    def step(state, *args):
        a = list(args)
        out = None
        for _ in range(unroll):
            a[0] = a[0] + (state * 0).astype(a[0].dtype)
            out = fn(*a)
            state = jnp.sum(out.reshape(-1)[:1]).astype(jnp.float32) * 0
        return state, out
    return jax.jit(step, donate_argnums=0)


def compile_one(fn, args):
    st = jnp.zeros((), jnp.float32)
    return step_fn(fn).lower(st, *args).compile()


def time_compiled(c, args, unroll=10, reps=5, target=0.02):
    st = jnp.zeros((), jnp.float32)
    for _ in range(2):
        st, out = c(st, *args)
    jax.block_until_ready(st)
    t0 = time.perf_counter()
    st, out = c(st, *args)
    jax.block_until_ready(st)
    n = int(max(1, min(200, target / max(time.perf_counter() - t0, 1e-6))))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(n):
            st, out = c(st, *args)
        jax.block_until_ready(st)
        ts.append((time.perf_counter() - t0) / n / unroll)
    return statistics.median(ts)


def jobs_for(base_rows):
    """(label, rows, fn) for every variant; fn "bf16" is XLA's matmul on bf16 weights."""
    js = []
    for m in base_rows:
        js.append(("bf16", m, "bf16"))
        if old is None:
            continue
        js.append(("old default", m, lambda a, v, s: old.fp8_matmul(a, v, s)))
        if m >= 2:
            js.append(("old dynamic", m, lambda a, v, s: old.fp8_matmul(a, v, s, quantize_activations=True)))
    for name, (cfg, q, ms, shapes) in VARIANTS.items():
        for m in ms:
            js.append((name, m, lambda a, v, s, cfg=cfg, q=q: fm.fp8_matmul(a, v, s, config=cfg,
                                                                             quantize_activations=q)))
            ONLY[(name, m)] = shapes
    return js


ONLY = {}


def wanted(sname, label, m):
    shapes = ONLY.get((label, m))
    return shapes is None or sname in shapes


def small_check(js):
    """float64 check at K=1024, N=256 with scales over three decades."""
    rng = np.random.default_rng(0)
    K, N = 1024, 256
    decades = np.repeat(np.repeat(10.0 ** rng.uniform(-3, 0, (N // 128, K // 128)), 128, 0), 128, 1)
    w = rng.standard_normal((N, K)) * decades
    sc = (np.abs(w.reshape(N // 128, 128, K // 128, 128)).max(axis=(1, 3)) / 448).astype(np.float32)
    vals = jnp.asarray((w / np.repeat(np.repeat(sc, 128, 0), 128, 1)).astype(np.float32)).astype(jnp.float8_e4m3fn)
    exact = np.asarray(vals.astype(jnp.float32), np.float64) * np.repeat(np.repeat(sc.astype(np.float64), 128, 0),
                                                                          128, 1)
    def one(job):
        label, m, f = job
        x = jnp.asarray(np.random.default_rng(m).standard_normal((m, K)) * 30, jnp.bfloat16)
        want = np.asarray(x.astype(jnp.float32), np.float64) @ exact.T
        try:
            got = np.asarray(jax.jit(f)(x, vals, jnp.asarray(sc)).astype(jnp.float32), np.float64)
            err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
        except Exception as e:
            err = f"{type(e).__name__}: {str(e)[:300]}"
        lim = 0.05 if "dyn" in label else 4e-3
        return None if isinstance(err, float) and np.isfinite(err) and err <= lim else (label, m, err)

    with cf.ThreadPoolExecutor(max_workers=15) as pool:
        bad = [b for b in pool.map(one, [j for j in js if j[2] != "bf16"]) if b]
    print(f"[{time.time()-T0:.0f}s] small float64 check: {len(js)} jobs, bad: {bad}", flush=True)


def main():
    base_rows = [int(r) for r in os.environ.get("BASE_ROWS", "1,2,8,16").split(",") if r]
    js = jobs_for(base_rows)
    small_check(js)
    pool = cf.ThreadPoolExecutor(max_workers=15)
    sds = jax.ShapeDtypeStruct
    futs = {}
    for sname, (k, n) in SHAPES.items():
        for label, m, f in js:
            if not wanted(sname, label, m):
                continue
            xa = sds((m, k), jnp.bfloat16)
            if f == "bf16":
                args = (xa, sds((k, n), jnp.bfloat16))
                fn = lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.bfloat16)  # noqa: E731
            else:
                args, fn = (xa, sds((n, k), jnp.float8_e4m3fn), sds((n // 128, k // 128), jnp.float32)), f
            futs[(sname, label, m)] = (pool.submit(compile_one, fn, args), fn)
    for fut, _ in futs.values():
        try:
            fut.result()
        except Exception:
            pass
    print(f"[{time.time()-T0:.0f}s] compiled {len(futs)}", flush=True)
    results = []
    for sname, (k, n) in SHAPES.items():
        values, scales = fp8_normal(jax.random.key(0), (n, k), k**-0.5)
        deq = (values.astype(jnp.float32).reshape(n // 128, 128, k // 128, 128)
               * scales[:, None, :, None]).reshape(n, k)
        wbf = deq.T.astype(jnp.bfloat16)
        xs = {m: jax.random.normal(jax.random.key(m), (m, k), jnp.float32).astype(jnp.bfloat16) for m in
              sorted({m for _, m, _ in js})}
        bf = {}
        for label, m, f in js:
            if not wanted(sname, label, m):
                continue
            fut, fn = futs[(sname, label, m)]
            args = (xs[m], wbf) if f == "bf16" else (xs[m], values, scales)
            try:
                c = fut.result()
                t = time_compiled(c, args)
                out = jax.jit(fn)(*args)
                want = jnp.dot(xs[m].astype(jnp.float32), deq.T, precision="highest")
                err = float(jnp.linalg.norm(out.astype(jnp.float32) - want) / jnp.linalg.norm(want))
            except Exception as e:
                print(f"FAIL {sname} {label} M={m}: {type(e).__name__}: {str(e)[:400]}", flush=True)
                continue
            nbytes = k * n * (2 if label == "bf16" else 1)
            if label == "bf16":
                bf[m] = t
            r = {"shape": sname, "label": label, "M": m, "us": t * 1e6, "gbps": nbytes / t / 1e9,
                 "vs_bf16": bf.get(m, float("nan")) / t, "rel_err": err}
            results.append(r)
            print(f"[{time.time()-T0:.0f}s] {sname:10s} M={m:2d} {label:36s} {t*1e6:8.2f} us {r['gbps']:7.0f} GB/s "
                  f"x{r['vs_bf16']:.2f} err {err:.1e}", flush=True)
        del deq, wbf, values, scales
        with open(os.path.join(OUT, "sweep.json"), "w") as fh:
            json.dump(results, fh)
    labels = list(dict.fromkeys((r["label"], r["M"]) for r in results))
    print("\nSUMMARY GB/s (xbf16)")
    print(f"{'label':32s} M " + " ".join(f"{s:>13s}" for s in SHAPES))
    for lb, m in labels:
        cells = []
        for s in SHAPES:
            r = [x for x in results if x["label"] == lb and x["M"] == m and x["shape"] == s]
            cells.append(f"{r[0]['gbps']:5.0f} x{r[0]['vs_bf16']:.2f}" if r else " " * 13)
        print(f"{lb[:32]:32s} {m:2d} " + " ".join(f"{c:>13s}" for c in cells))


main()
