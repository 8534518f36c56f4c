"""The block-FP8 projection at the 27B's and 35B-A3B's shapes, side by side in one run on the GPU: the bf16 matmul on
bf16 weights, XLA's matmul on the FP8 weight dequantized inside the jit, our decode kernels
(pallas_kernels/fp8_matmul.py, a few configs) and torch's row-scaled FP8 GEMM (`torch._scaled_mm`, cuBLASLt).
At decode row counts also `--fp8-activations dynamic`'s FP8 x FP8 kernel. Then one 35B-A3B MoE layer (256 experts,
top 8, the shared expert) on bf16 against block-FP8 experts. `--only gemm`: the prefill block-FP8 GEMM
(pallas_kernels/fp8_gemm.py, Mosaic GPU wgmma) at the 27B's projections, its configs first at two tuning points,
then every shape with the fastest, beside bf16, dequantize + bf16 and torch in the same process; `--only gemm-wide`
the same kernel at a wide decode round's 64-256 rows, its auto_config beside other tiles and K ranges; `--only
layout` each dense kernel on the weight [N, K] beside it `blocked` (`startup.BLOCK_FP8_WEIGHTS`). `--only rows`:
the producers writing FP8 rows (pallas_kernels/fp8_rows.py: the GDN gated norm, the MLP's SwiGLU) beside XLA's
composition, and the projections they feed. `--only sweep`
(never run by default): the decode kernels' config variants (SWEEP_VARIANTS) checked against float64 at a small
shape and against the dequantized float32 product at the real ones, and timed beside XLA's bf16 matmul and, with
`--sweep-old`, an earlier copy of fp8_matmul.py; every program is compiled before any is timed (compiling beside a
timing slows it). On a CPU it runs the kernels in the Pallas interpreter, by default at a 1024x256 weight: a check
of the script, not a measurement.

    python scripts/bench_fp8_kernels.py --out docs/benchmarks/fp8                # fp8_kernels.{json,md}
    python scripts/bench_fp8_kernels.py --only moe --out docs/benchmarks/fp8     # fp8_moe.{json,md}
    python scripts/bench_fp8_kernels.py --only gemm --out docs/benchmarks/fp8    # fp8_gemm.{json,md}
    python scripts/bench_fp8_kernels.py --only rows --out docs/benchmarks/fp8    # fp8_rows.{json,md}
    python scripts/bench_fp8_kernels.py --only gemm-wide --out docs/benchmarks/fp8   # fp8_gemm_wide.{json,md}
    python scripts/bench_fp8_kernels.py --only layout --out docs/benchmarks/fp8      # fp8_layout.{json,md}
    python scripts/bench_fp8_kernels.py --only gemm-wide --gemm-wide-rows 64 --gemm-wide-shapes '27b mlp down,6144x5120'
    git show 22da5b9:pallas_kernels/fp8_matmul.py > /tmp/fp8_matmul_old.py
    python scripts/bench_fp8_kernels.py --only sweep --sweep-old /tmp/fp8_matmul_old.py --out docs/benchmarks/fp8
                                                                                  # fp8_sweep.{json,md}
    python scripts/bench_fp8_kernels.py --only sweep --sweep-rows 16,32,64,128 --out OUT   # a wide round's rows:
                          # the swap-AB kernels' 32-128-row tiles against dequantize + bf16 and the wgmma GEMM

Times are per call (median of 5 batches; a call repeated 10 times inside one jit, so dispatch is not timed); GB/s
count the weight's FP8 bytes (bf16: its own bytes), the bound of a decode round.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import functools
import importlib.util
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from bench_kernels import compile_pure, time_pure, time_torch  # noqa: E402

from ninfer_jax.benchmarks import report  # noqa: E402
from ninfer_jax.model import ops  # noqa: E402
from ninfer_jax.model.params import QuantizedWeight  # noqa: E402
from ninfer_jax.model.random_init import fp8_normal  # noqa: E402
from pallas_kernels import fp8_gemm, fp8_matmul, fp8_rows  # noqa: E402
from pallas_kernels import reference as ref  # noqa: E402

# name -> (K, N): the 27B's MLP, GDN in-projection and attention output, the 35B-A3B's shared expert gate_up
SHAPES = {"27b mlp gate_up": (5120, 34816), "27b mlp down": (17408, 5120), "27b gdn in [qkv|z]": (5120, 16384),
          "27b o_proj": (6144, 5120), "35b shared gate_up": (2048, 1024)}
# the 35B-A3B's projections a wide decode round runs on the wgmma GEMM (`--only gemm-wide`)
WIDE_SHAPES = {"35b gdn in [qkv|z]": (2048, 12288), "35b gdn out | o_proj": (4096, 2048),
               "35b attention qkv": (2048, 9216),
               "27b mlp gate_up": SHAPES["27b mlp gate_up"], "27b mlp down": SHAPES["27b mlp down"],
               "27b gdn in [qkv|z]": SHAPES["27b gdn in [qkv|z]"]}
CONFIGS = {"default": fp8_matmul.DEFAULT_CONFIG,
           "cuda-core to 2 rows": dataclasses.replace(fp8_matmul.DEFAULT_CONFIG, cuda_core_max_rows=2),
           "swap-AB bf16": dataclasses.replace(fp8_matmul.DEFAULT_CONFIG, tc_mode="bf16", cuda_core_max_rows=0),
           "swap-AB 8 splits": dataclasses.replace(fp8_matmul.DEFAULT_CONFIG, min_programs=0, cuda_core_max_rows=0)}


def bench_shape(name: str, k: int, n: int, rows: tuple[int, ...]) -> list[dict]:
    w = fp8_normal(jax.random.key(0), (n, k), k**-0.5)
    bf16 = ops.dequantize(w).astype(jnp.bfloat16)
    pallas = ops.KernelConfig("pallas")
    out = []
    for m in rows:
        x = jax.random.normal(jax.random.key(m), (m, k), jnp.float32).astype(jnp.bfloat16)
        row = {"shape": name, "K": k, "N": n, "M": m}
        row["bf16_us"] = time_pure(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.bfloat16), (x, bf16),
                                   unroll=10) * 1e6
        row["xla_dequantized_us"] = time_pure(lambda a, v, s: ops.quantized_dot(
            ops.REFERENCE, a, QuantizedWeight(v, s)), (x, w.values, w.scales), unroll=10) * 1e6
        row["engine_us"] = time_pure(lambda a, v, s: ops.quantized_dot(pallas, a, QuantizedWeight(v, s)),
                                     (x, w.values, w.scales), unroll=10) * 1e6
        if m <= fp8_matmul.DEFAULT_CONFIG.max_rows:
            for label, cfg in CONFIGS.items():
                row[f"{label}_us"] = time_pure(lambda a, v, s, cfg=cfg: fp8_matmul.fp8_matmul(a, v, s, config=cfg),
                                               (x, w.values, w.scales), unroll=10) * 1e6
        if m <= fp8_matmul.DEFAULT_CONFIG.rows_limit(True):
            # --fp8-activations dynamic: the rows quantized per token and 128-group, an FP8 x FP8 product
            row["dynamic_us"] = time_pure(lambda a, v, s: fp8_matmul.fp8_matmul(a, v, s, quantize_activations=True),
                                          (x, w.values, w.scales), unroll=10) * 1e6
            got = np.asarray(fp8_matmul.fp8_matmul(x, w.values, w.scales, quantize_activations=True), np.float64)
            want = np.asarray(jnp.dot(x.astype(jnp.float32), ops.dequantize(w), precision="highest"), np.float64)
            row["dynamic_rel_err"] = float(np.linalg.norm(got - want) / np.linalg.norm(want))
            row["dynamic_vs_engine"] = row["engine_us"] / row["dynamic_us"]
        row["torch_rowwise_us"] = _torch_rowwise(m, k, n)
        got = np.asarray(ops.quantized_dot(pallas, x, w), np.float64)
        want = np.asarray(jnp.dot(x.astype(jnp.float32), ops.dequantize(w), precision="highest"), np.float64)
        row["rel_err"] = float(np.linalg.norm(got - want) / np.linalg.norm(want))
        row["engine_vs_bf16"] = row["bf16_us"] / row["engine_us"]
        row["engine_vs_torch"] = row["torch_rowwise_us"] / row["engine_us"] if row["torch_rowwise_us"] else None
        row["engine_gbps"] = k * n / row["engine_us"] / 1e3
        print(" ".join(f"{key}={report.fmt(v)}" for key, v in row.items()), flush=True)
        out.append(row)
    return out


_MOE_TILE_FIELDS = {"m": ("block_m",), "n": ("block_n",), "k": ("block_k", "down_block_k"), "dn": ("down_block_n",),
                    "w": ("num_warps",), "s": ("num_stages",), "g": ("fp8_grouped_rows_per_expert",)}


def _moe_config(name: str):
    """An FP8 x FP8 expert tile config from its `--moe-configs` name: "default" (`moe.default_config`'s pick at the
    row count) or tokens over the prefill fields of moe.DEFAULT_CONFIG, e.g. "m32 k128 w4 s4" (block_m 32, block_k
    and down_block_k 128, 4 warps, 4 stages; also n: block_n, dn: down_block_n, g: fp8_grouped_rows_per_expert, the
    rows a expert from which a Hopper GPU takes the grouped wgmma GEMM)."""
    from pallas_kernels import moe

    if name == "default":
        return None
    fields = {}
    for token in name.split():
        key = token.rstrip("0123456789")
        if key not in _MOE_TILE_FIELDS or key == token:
            raise SystemExit(f"--moe-configs: {token!r} in {name!r}: not one of {sorted(_MOE_TILE_FIELDS)} + a number")
        fields.update(dict.fromkeys(_MOE_TILE_FIELDS[key], int(token[len(key):])))
    return dataclasses.replace(moe.DEFAULT_CONFIG, **fields)


def bench_moe(tokens: tuple[int, ...], configs: tuple[str, ...] = ()) -> list[dict]:
    """One 35B-A3B MoE layer's experts (pallas_kernels/moe.py) on bf16 and on block-FP8 weights; the FP8 bytes a
    decode call reads are the distinct experts its tokens route to, plus the shared expert."""
    from pallas_kernels import moe
    from pallas_kernels import reference as ref

    e, k, h, i = 256, 8, 2048, 512
    gate_up, down = fp8_normal(jax.random.key(1), (e, 2 * i, h), h**-0.5), fp8_normal(jax.random.key(2), (e, h, i),
                                                                                       i**-0.5)
    s_gate_up, s_down = fp8_normal(jax.random.key(3), (2 * i, h), h**-0.5), fp8_normal(jax.random.key(4), (h, i),
                                                                                        i**-0.5)
    fp8 = [ops.block_fp8(w) for w in (gate_up, down, s_gate_up, s_down)]
    bf16 = [ops.dequantize(w).astype(jnp.bfloat16) for w in (gate_up, down, s_gate_up, s_down)]
    router = jax.random.normal(jax.random.key(5), (e, h), jnp.float32)
    out = []
    for t in tokens:
        x = jax.random.normal(jax.random.key(t), (t, h), jnp.float32).astype(jnp.bfloat16)
        ids, w = ref.moe_route_ref(x.astype(jnp.float32), router, k)
        gate = jnp.full((t,), 0.5, jnp.float32)

        def run(a, i_, w_, g, d, sg, sd, quantize_activations=False, config=None):
            return moe.moe_experts(a, i_, w_, g, d, ref.SharedExpert(sg, sd, gate),
                                   quantize_activations=quantize_activations, config=config)

        row = {"shape": "35b-a3b moe layer", "M": t}
        row["bf16_us"] = time_pure(run, (x, ids, w, *bf16), unroll=10 if t <= 8 else 1) * 1e6
        row["engine_us"] = time_pure(run, (x, ids, w, *fp8), unroll=10 if t <= 8 else 1) * 1e6
        row["engine_vs_bf16"] = row["bf16_us"] / row["engine_us"]
        used = len(set(np.asarray(ids).reshape(-1).tolist()))
        row["engine_gbps"] = (used + 1) * 3 * h * i / row["engine_us"] / 1e3
        got = np.asarray(run(x, ids, w, *fp8), np.float64)
        want = np.asarray(run(x, ids, w, *bf16), np.float64)
        row["rel_err"] = float(np.linalg.norm(got - want) / np.linalg.norm(want))  # bf16 rounding of W, act
        if t * k > moe.DEFAULT_CONFIG.decode_max_rows:  # the prefill layout: FP8 x FP8 tiles
            dynamic = functools.partial(run, quantize_activations=True)
            row["dynamic_us"] = time_pure(dynamic, (x, ids, w, *fp8), unroll=1) * 1e6
            row["dynamic_vs_engine"] = row["engine_us"] / row["dynamic_us"]
            row["dynamic_rel_err"] = _rel(dynamic(x, ids, w, *fp8), want)
            if moe.grouped_available(h, i):
                row["grouped_kernel_rel_err"] = _guard("grouped", lambda: _grouped_kernel_err(x, ids, fp8[0]))
            for name in configs:  # one config failing to compile leaves its cell empty
                tiles = functools.partial(dynamic, config=_moe_config(name))
                row[f"tiles {name}_us"] = _guard(name, lambda: time_pure(tiles, (x, ids, w, *fp8), unroll=1) * 1e6)
                row[f"tiles {name}_rel_err"] = _guard(name, lambda: _rel(tiles(x, ids, w, *fp8), want))
        print(" ".join(f"{key}={report.fmt(v)}" for key, v in row.items()), flush=True)
        out.append(row)
    return out


def _grouped_kernel_err(x, ids, gate_up) -> float:
    """The grouped wgmma GEMM on a layer's gate_up against its jnp reference, over the used row tiles."""
    from pallas_kernels import moe

    _, tiles, x_rows, x_scales = moe.grouped_rows(x, ids.reshape(-1).astype(jnp.int32), ids.shape[1],
                                                  gate_up.values.shape[0])
    args = (x_rows, x_scales, tiles, *gate_up)
    used = np.repeat(np.asarray(tiles) >= 0, fp8_gemm.group_rows())
    got = np.asarray(fp8_gemm.grouped_gemm(*args, out_dtype=jnp.float32), np.float64)[used]
    return _rel(got, fp8_gemm.grouped_reference(*args, out_dtype=jnp.float32)[used])


# the prefill GEMM's configs tried at the tuning points (the fastest then runs every shape)
_G = fp8_gemm.GemmConfig(cluster=None)
GEMM_CONFIGS = {"128x128": _G,
                "128x128 3 stages": dataclasses.replace(_G, max_concurrent_steps=3),
                "128x128 minor m": dataclasses.replace(_G, grid_minor="m"),
                "128x128 cluster m": dataclasses.replace(_G, cluster="m"),
                "128x128 cluster n": dataclasses.replace(_G, cluster="n"),  # the default
                "128x128 overlap": dataclasses.replace(_G, overlap=True),
                "256x64": dataclasses.replace(_G, tile_m=128, tile_n=64)}
GEMM_TUNING = (("27b mlp gate_up", 2048),)
TAIL_SPLITS = (1, 2, 4, 8, 10, 20)  # the wide GEMM's tail launch's K ranges timed beside auto_config's
STEP_BLOCKS_OF = ("auto", "n128 k1", "n64 k2")  # the wide GEMM's configs timed with two-block steps beside them


# name -> (producer, its 128-groups, the projection's output width): the GDN out-projections (value heads of Dv 128)
# and the 27B's MLP down-projection (I = 17408)
PRODUCERS = {"35b-a3b gdn out": ("norm", 32, 2048), "27b gdn out": ("norm", 48, 5120),
             "27b mlp down": ("swiglu", 136, 5120)}


def _producer(kind: str, t: int, groups: int, gemm: ops.KernelConfig):
    """(inputs, bf16 rows, the kernel, the fused projection, input bytes per output element) of one producer."""
    k = groups * 128
    if kind == "swiglu":
        gu = jax.random.normal(jax.random.key(2), (t, 2 * k), jnp.float32).astype(jnp.bfloat16)
        return ((gu,), lambda g: ref.swiglu(g[:, :k], g[:, k:]), fp8_rows.swiglu_fp8,
                lambda g, v, s: ops.swiglu_dot(gemm, g, QuantizedWeight(v, s)), 4)
    core, z = (jax.random.normal(jax.random.key(s), (t, groups, 128), jnp.float32).astype(jnp.bfloat16) for s in (2, 3))
    norm_w = (1 + 0.1 * jax.random.normal(jax.random.key(1), (128,))).astype(jnp.bfloat16)
    return ((core, z, norm_w), lambda c, zz, nw: ref.gated_rms_norm(c, zz, nw, 1e-6).reshape(t, -1),
            lambda c, zz, nw: fp8_rows.gated_rms_norm_fp8(c, zz, nw, eps=1e-6),
            lambda c, zz, nw, v, s: ops.gated_norm_dot(gemm, c, zz, nw, 1e-6, QuantizedWeight(v, s)), 4)


def bench_fp8_rows(tokens: tuple[int, ...]) -> list[dict]:
    """The producers that write FP8 rows (pallas_kernels/fp8_rows.py) beside XLA's composition of the producer and
    `quantize_rows`, and the bf16 pass's producer alone; then the whole projection (producer + FP8 GEMM) both ways
    and in bf16. Errors: the kernel's scales and FP8 values against the composition's, the fused projection against
    the composed one."""
    out = []
    gemm = ops.KernelConfig("pallas", fp8_activations=True)

    def timed(fn, *args):
        return time_pure(fn, args, reps=3, min_time=0.03) * 1e6

    for name, (kind, groups, hidden) in PRODUCERS.items():
        w = fp8_normal(jax.random.key(0), (hidden, groups * 128), (groups * 128) ** -0.5)
        wb = ops.dequantize(w).astype(jnp.bfloat16)
        for t in tokens:
            args, rows_bf16, kernel, fused, read = _producer(kind, t, groups, gemm)
            row = {"shape": name, "M": t}

            def composed(*a, rows_bf16=rows_bf16):
                return fp8_matmul.quantize_rows(rows_bf16(*a))

            row["bf16_rows_us"] = timed(rows_bf16, *args)
            row["xla_us"] = timed(composed, *args)
            row["kernel_us"] = _guard("kernel", lambda: timed(kernel, *args))
            if row["kernel_us"]:
                row["kernel_vs_xla"] = row["xla_us"] / row["kernel_us"]
                row["kernel_gbps"] = t * groups * 128 * (read + 1) / row["kernel_us"] / 1e3
            row["bf16_out_us"] = timed(lambda *a: jnp.dot(rows_bf16(*a[:-1]), a[-1]), *args, wb)
            row["xla_out_us"] = timed(lambda *a: ops.quantized_dot(gemm, rows_bf16(*a[:-2]), QuantizedWeight(*a[-2:])),
                                      *args, w.values, w.scales)
            row["fused_out_us"] = _guard("fused", lambda: timed(fused, *args, w.values, w.scales))
            if row["fused_out_us"]:
                row["fused_vs_xla_out"] = row["xla_out_us"] / row["fused_out_us"]
                row["fused_vs_bf16_out"] = row["bf16_out_us"] / row["fused_out_us"]
            got = _guard("kernel result", lambda: kernel(*args))
            if got is not None:
                # op by op, every rounding to bf16 as written; XLA's fusion of it (jit) skips them (excess
                # precision), so its FP8 rows differ from both by more than the kernel's from the first
                for suffix, fn in (("", composed), ("_xla", jax.jit(composed))):
                    want_q, want_s = fn(*args)
                    row[f"scale_rel_diff{suffix}"] = float(jnp.max(jnp.abs(got[1] / want_s - 1)))
                    row[f"values_differing{suffix}"] = float(jnp.mean(got[0].astype(jnp.float32)
                                                                      != want_q.astype(jnp.float32)))
                row["fused_rel_err"] = _rel(fused(*args, w.values, w.scales),
                                            ops.quantized_dot(gemm, rows_bf16(*args), w))
            print(" ".join(f"{key}={report.fmt(v)}" for key, v in row.items()), flush=True)
            out.append(row)
    return out


def _rel(got, want) -> float:
    got, want = jnp.asarray(got, jnp.float32), jnp.asarray(want, jnp.float32)
    return float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))


def _guard(label, fn):
    try:
        return fn()
    except Exception as e:  # one config failing to compile must not end the run
        print(f"{label}: {type(e).__name__}: {str(e)[:1500]}", flush=True)
        return None


def bench_gemm(rows: tuple[int, ...], config_names: list[str]) -> list[dict]:
    """The prefill GEMM: times per call (kernel_us: the kernel on x already quantized; gemm_us: with the per-token
    quantization, as the model would call it); errors against float32 products of the dequantized weight, of x
    itself (exact_rel_err: the activations' quantization error included) and of x as quantized (kernel_rel_err)."""
    # smallest case first: a failure to compile shows at once, with its message
    w9 = fp8_normal(jax.random.key(9), (256, 384), 384**-0.5)
    vals, sc = w9.values, w9.scales
    xs_ = jax.random.normal(jax.random.key(8), (256, 384), jnp.float32).astype(jnp.bfloat16)
    probe = _guard("probe", lambda: _rel(fp8_gemm.fp8_gemm(xs_, vals, sc), fp8_gemm.reference(xs_, vals, sc)))
    print(f"probe 256x384x256 rel err vs reference: {probe}", flush=True)
    timing = {}
    for (name, m) in GEMM_TUNING:
        k, n = SHAPES[name]
        w = fp8_normal(jax.random.key(0), (n, k), k**-0.5)
        x = jax.random.normal(jax.random.key(m), (m, k), jnp.float32).astype(jnp.bfloat16)
        xq, xs = fp8_matmul.quantize_rows(x)
        for label in config_names:
            cfg = GEMM_CONFIGS[label]
            t = _guard(label, lambda cfg=cfg: time_pure(
                lambda a, b, v, s: fp8_gemm._gemm(a, b, v, s, cfg, jnp.bfloat16, fp8_gemm._num_sms()),
                (xq, xs, w.values, w.scales), reps=3, min_time=0.03))
            if t is not None:
                timing.setdefault(label, []).append(t)
                print(f"tune {name} M={m} {label}: {t * 1e6:.1f} us {2 * m * k * n / t / 1e12:.0f} TFLOP/s", flush=True)
    ok = [lb for lb in config_names if len(timing.get(lb, [])) == len(GEMM_TUNING)]
    best = min(ok, key=lambda lb: sum(timing[lb])) if ok else config_names[0]
    cfg = GEMM_CONFIGS[best]
    print(f"best config: {best} {cfg}", flush=True)
    out = []
    for name, (k, n) in SHAPES.items():
        if not name.startswith("27b"):
            continue
        w = fp8_normal(jax.random.key(0), (n, k), k**-0.5)
        wf = ops.dequantize(w)  # [K, N] f32
        bf16 = wf.astype(jnp.bfloat16)
        pallas = ops.KernelConfig("pallas")
        for m in rows:
            x = jax.random.normal(jax.random.key(m), (m, k), jnp.float32).astype(jnp.bfloat16)
            row = {"shape": name, "K": k, "N": n, "M": m, "config": best}
            row["bf16_us"] = time_pure(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.bfloat16), (x, bf16),
                                       reps=3, min_time=0.03) * 1e6
            row["dequant_bf16_us"] = time_pure(lambda a, v, s: ops.quantized_dot(pallas, a, QuantizedWeight(v, s)),
                                               (x, w.values, w.scales), reps=3, min_time=0.03) * 1e6
            row["torch_rowwise_us"] = _torch_rowwise(m, k, n)
            xq, xs = fp8_matmul.quantize_rows(x)
            t = _guard("kernel", lambda: time_pure(
                lambda a, b, v, s: fp8_gemm._gemm(a, b, v, s, cfg, jnp.bfloat16, fp8_gemm._num_sms()),
                (xq, xs, w.values, w.scales), reps=3, min_time=0.03))
            row["kernel_us"] = None if t is None else t * 1e6
            t = _guard("gemm", lambda: time_pure(lambda a, v, s: fp8_gemm.fp8_gemm(a, v, s, config=cfg),
                                                 (x, w.values, w.scales), reps=3, min_time=0.03))
            row["gemm_us"] = None if t is None else t * 1e6
            flops = 2 * m * k * n
            if row["kernel_us"]:
                row["kernel_tflops"] = flops / row["kernel_us"] / 1e6
                row["kernel_vs_bf16"] = row["bf16_us"] / row["kernel_us"]
                row["kernel_vs_torch"] = row["torch_rowwise_us"] / row["kernel_us"] if row["torch_rowwise_us"] else None
            if row["gemm_us"]:
                row["gemm_vs_dequant"] = row["dequant_bf16_us"] / row["gemm_us"]
                row["gemm_vs_torch"] = row["torch_rowwise_us"] / row["gemm_us"] if row["torch_rowwise_us"] else None
            row["torch_tflops"] = flops / row["torch_rowwise_us"] / 1e6 if row["torch_rowwise_us"] else None
            exact = jnp.dot(x.astype(jnp.float32), wf, precision="highest")
            seen = (xq.astype(jnp.float32).reshape(m, k // 128, 128) * xs.T[..., None]).reshape(m, k)
            quantized = jnp.dot(seen, wf, precision="highest")
            got = _guard("gemm result", lambda: fp8_gemm.fp8_gemm(x, w.values, w.scales, config=cfg))
            if got is not None:
                row["kernel_rel_err"] = _rel(got, quantized)
                row["exact_rel_err"] = _rel(got, exact)
            row["dequant_rel_err"] = _rel(ops.quantized_dot(pallas, x, w), exact)
            row["quantization_rel_err"] = _rel(quantized, exact)
            print(" ".join(f"{key}={report.fmt(v)}" for key, v in row.items()), flush=True)
            out.append(row)
            del exact, quantized, seen
    return out


# the decode kernels' config variants `--only sweep` times: name -> (config, quantize_activations, rows, shapes: names
# from SHAPES, None for all)
_D = fp8_matmul.DEFAULT_CONFIG
SWEEP_VARIANTS = {
    "new": (_D, False, (1, 2, 8, 16), None),
    "new dynamic": (_D, True, (2, 8, 16), None),
    "alt cc stages1": (dataclasses.replace(_D, cuda_core_stages=1), False, (1,), None),
    "alt cc to 2 rows": (dataclasses.replace(_D, cuda_core_max_rows=2), False, (2,), None),
    "alt tc 8 splits": (dataclasses.replace(_D, min_programs=0), False, (8,), None),
    "alt dyn bn32 8 splits": (dataclasses.replace(_D, dynamic_block_n=32, dynamic_min_programs=0), True, (8,), None),
    # a wide decode round's 32-128 rows: the default tiles (Fp8Config.wide_tiles), 16 rows' tile, and one tile for all
    "wide tiles": (_D, False, (32, 64, 128), None),
    "wide swap AB": (dataclasses.replace(_D, wide_tiles=()), False, (32, 64, 128), None),
    "wide swap AB bn64": (dataclasses.replace(_D, wide_tiles=((fp8_matmul.MAX_ROWS, 64, 4),)), False, (32, 64, 128),
                          None),
    "wide swap AB bn128 8 warps": (dataclasses.replace(_D, wide_tiles=((fp8_matmul.MAX_ROWS, 128, 8),)), False,
                                   (64, 128), None),
    "wide dynamic": (dataclasses.replace(_D, dynamic_max_rows=fp8_matmul.MAX_ROWS), True, (32, 64, 128), None),
    "wide dynamic bn32": (dataclasses.replace(_D, dynamic_max_rows=fp8_matmul.MAX_ROWS, dynamic_block_n=32), True,
                          (32, 64, 128), None),
}
# what the model ran above 16 rows before the wide tiles (and still runs past the Fp8Config limits), timed beside
# the wide variants from WIDE_FROM rows
WIDE_FROM = 17
WIDE_BASELINES = {
    "dequantize + bf16": (lambda a, v, s: ops.dequantized_dot(a, QuantizedWeight(v, s)), False),
    "gemm dynamic (wgmma)": (lambda a, v, s: fp8_gemm.fp8_gemm(a, v, s), True),  # Mosaic GPU: a GPU only
}
# the wgmma GEMM's K splits, narrow column tiles and warpgroups side by side on columns (wg n; 3 stages leave SMEM
# for the float32 partial sums), for rounds whose few row tiles leave SMs idle
for _splits, _tile_n, _wg, _stages in ((2, 128, "m", 4), (4, 128, "m", 4), (8, 128, "m", 4), (1, 64, "m", 4),
                                       (4, 64, "m", 4), (1, 128, "n", 4), (1, 128, "n", 3), (2, 128, "n", 3),
                                       (4, 128, "n", 3)):
    _cfg = fp8_gemm.GemmConfig(k_splits=_splits, tile_n=_tile_n, wg_split=_wg, max_concurrent_steps=_stages)
    WIDE_BASELINES[f"gemm dynamic {_splits} K splits" + (f" bn{_tile_n}" if _tile_n != 128 else "")
                   + (f" wg n {_stages} stages" if _wg == "n" else "")] = (
        lambda a, v, s, cfg=_cfg: fp8_gemm.fp8_gemm(a, v, s, config=cfg), True)
SWEEP_CPU_SHAPE = (1024, 256)  # the interpreter takes tens of seconds a program at the 27B's shapes


def _bf16_dot(a, b):
    return jnp.dot(a, b, preferred_element_type=jnp.bfloat16)


def _sweep_shapes(spec: str | None, cpu: bool) -> dict[str, tuple[int, int]]:
    """--sweep-shapes: by default every SHAPES entry (on a CPU, one small weight)."""
    if not spec:
        return {"x".join(map(str, SWEEP_CPU_SHAPE)): SWEEP_CPU_SHAPE} if cpu else dict(SHAPES)
    return _shapes(spec, SHAPES, "--sweep-shapes")


def _shapes(spec: str, table: dict, flag: str) -> dict[str, tuple[int, int]]:
    """A shapes option: names from table or KxN, comma-separated -> {name: (K, N)}."""
    out = {}
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        if item in table:
            out[item] = table[item]
        else:
            k, sep, n = item.partition("x")
            if not (sep and k.isdigit() and n.isdigit() and fp8_matmul.supported(int(k), int(n))):
                raise SystemExit(f"{flag}: {item!r} is neither one of {list(table)} nor KxN in 128-blocks")
            out[item] = (int(k), int(n))
    return out


def _load_module(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = sys.modules[name] = importlib.util.module_from_spec(spec)  # its dataclasses look the module up
    spec.loader.exec_module(module)
    return module


def _sweep_jobs(rows: tuple[int, ...], old, interpret: bool, kernels: str | None = None) -> list[tuple]:
    """(label, M, fn, shapes) of each program the sweep times; fn None: XLA's matmul on bf16 weights. kernels: the
    labels to time (comma-separated; bf16 always), default every one."""
    jobs = _all_sweep_jobs(rows, old, interpret)
    keep = None if kernels is None else set(kernels.split(",")) | {"bf16"}
    unknown = keep - {j[0] for j in jobs} if keep else set()
    if unknown:
        raise SystemExit(f"--sweep-kernels: no such kernel at these rows: {sorted(unknown)}")
    return [j for j in jobs if keep is None or j[0] in keep]


def _all_sweep_jobs(rows: tuple[int, ...], old, interpret: bool) -> list[tuple]:
    kw = {"interpret": True} if interpret else {}
    jobs = []
    for m in rows:
        jobs.append(("bf16", m, None, None))
        if old is not None:
            jobs.append(("old default", m, lambda a, v, s: old.fp8_matmul(a, v, s, **kw), None))
            if m >= 2:
                jobs.append(("old dynamic", m, lambda a, v, s: old.fp8_matmul(a, v, s, quantize_activations=True,
                                                                              **kw), None))
    for m in (m for m in rows if m >= WIDE_FROM):
        jobs += [(name, m, fn, None) for name, (fn, gpu_only) in WIDE_BASELINES.items()
                 if not (gpu_only and interpret)]
    for name, (cfg, q, ms, shapes) in SWEEP_VARIANTS.items():
        jobs += [(name, m, lambda a, v, s, cfg=cfg, q=q: fp8_matmul.fp8_matmul(a, v, s, config=cfg,
                                                                               quantize_activations=q, **kw), shapes)
                 for m in ms if m in rows]
    return jobs


def _sweep_float64_check(jobs: list[tuple]) -> list[dict]:
    """Each FP8 kernel at K=1024, N=256 against float64, the weight's block scales over three decades (an error
    the real shapes' float32 reference would hide)."""
    rng = np.random.default_rng(0)
    k, n = 1024, 256
    decades = np.repeat(np.repeat(10.0 ** rng.uniform(-3, 0, (n // 128, k // 128)), 128, 0), 128, 1)
    w = rng.standard_normal((n, k)) * decades
    sc = (np.abs(w.reshape(n // 128, 128, k // 128, 128)).max(axis=(1, 3)) / 448).astype(np.float32)
    vals = jnp.asarray((w / np.repeat(np.repeat(sc, 128, 0), 128, 1)).astype(np.float32)).astype(jnp.float8_e4m3fn)
    exact = np.asarray(vals.astype(jnp.float32), np.float64) * np.repeat(np.repeat(sc.astype(np.float64), 128, 0),
                                                                          128, 1)

    def one(job):
        label, m, fn, _ = job
        x = jnp.asarray(np.random.default_rng(m).standard_normal((m, k)) * 30, jnp.bfloat16)
        want = np.asarray(x.astype(jnp.float32), np.float64) @ exact.T
        limit = 0.05 if "dyn" in label else 4e-3  # dynamic: the activations' FP8 quantization
        try:
            got = np.asarray(jax.jit(fn)(x, vals, jnp.asarray(sc)).astype(jnp.float32), np.float64)
            err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
        except Exception as e:  # one kernel failing must not end the run
            err = f"{type(e).__name__}: {str(e)[:300]}"
        ok = isinstance(err, float) and bool(np.isfinite(err)) and err <= limit
        return {"kernel": label, "M": m, "rel_err": err, "limit": limit, "ok": ok}

    with cf.ThreadPoolExecutor(max_workers=15) as pool:
        checks = list(pool.map(one, [j for j in jobs if j[2] is not None]))
    print(f"float64 check at {k}x{n}: {len(checks)} kernels, failing: "
          f"{[c for c in checks if not c['ok']]}", flush=True)
    return checks


def bench_sweep(shapes: dict[str, tuple[int, int]], rows: tuple[int, ...], old_path: str | None, out: str,
                meta: dict, interpret: bool, kernels: str | None = None) -> tuple[list[dict], list[dict]]:
    """The decode kernels' SWEEP_VARIANTS (and with old_path an earlier fp8_matmul.py's default and dynamic
    kernels) beside XLA's bf16 matmul: per call times (GB/s of FP8 weight bytes; bf16: its own), errors against
    the dequantized weight's float32 product, and the float64 check. fp8_sweep.json is rewritten after each
    shape, so a run cut short keeps the shapes it finished."""
    old = _load_module("fp8_matmul_old", old_path) if old_path else None
    if old is not None:
        print("old fp8_matmul from", old.__file__, flush=True)
    jobs = _sweep_jobs(rows, old, interpret, kernels)
    checks = _sweep_float64_check(jobs)
    sds = jax.ShapeDtypeStruct
    programs = {}
    with cf.ThreadPoolExecutor(max_workers=15) as pool:
        for name, (k, n) in shapes.items():
            for label, m, fn, only in jobs:
                if only is not None and name not in only:
                    continue
                x = sds((m, k), jnp.bfloat16)
                args = (x, sds((k, n), jnp.bfloat16)) if fn is None else (
                    x, sds((n, k), jnp.float8_e4m3fn), sds((n // 128, k // 128), jnp.float32))
                programs[name, label, m] = pool.submit(compile_pure, fn or _bf16_dot, args, unroll=10)
    print(f"compiled {len(programs)} programs", flush=True)
    results = []
    for name, (k, n) in shapes.items():
        results += _sweep_shape(name, k, n, jobs, programs)
        report.write_json(out, "fp8_sweep", {**meta, "float64_check": checks, "rows": results})
    return results, checks


def _sweep_shape(name: str, k: int, n: int, jobs: list[tuple], programs: dict) -> list[dict]:
    """The sweep's rows of one shape (its weights freed on return: the next shape's need the memory)."""
    w = fp8_normal(jax.random.key(0), (n, k), k**-0.5)
    deq = ops.dequantize(w)
    bf16 = deq.astype(jnp.bfloat16)
    bf16_us, out = {}, []
    for label, m, fn, _ in jobs:
        if (name, label, m) not in programs:
            continue
        x = jax.random.normal(jax.random.key(m), (m, k), jnp.float32).astype(jnp.bfloat16)
        f, args = (_bf16_dot, (x, bf16)) if fn is None else (fn, (x, w.values, w.scales))

        def measure(f=f, args=args, x=x, program=programs[name, label, m]):
            t = time_pure(f, args, unroll=10, compiled=program.result())
            return t, _rel(jax.jit(f)(*args), jnp.dot(x.astype(jnp.float32), deq, precision="highest"))

        got = _guard(f"{name} {label} M={m}", measure)
        if got is None:
            continue
        us = got[0] * 1e6
        if fn is None:
            bf16_us[m] = us
        row = {"shape": name, "K": k, "N": n, "M": m, "kernel": label, "us": us,
               "gbps": k * n * (2 if fn is None else 1) / us / 1e3,
               "vs_bf16": bf16_us[m] / us if m in bf16_us else None, "rel_err": got[1]}
        print(" ".join(f"{key}={report.fmt(v)}" for key, v in row.items()), flush=True)
        out.append(row)
    return out


def _torch_rowwise(m: int, k: int, n: int) -> float | None:
    try:
        import torch

        a = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
        b = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn)
        sa, sb = torch.ones(m, 1, device="cuda"), torch.ones(1, n, device="cuda")
        return time_torch(lambda: torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)) * 1e6
    except Exception as e:  # no torch, or no FP8 GEMM on this GPU: the row goes without the anchor
        print(f"torch anchor: {type(e).__name__}: {str(e)[:200]}", flush=True)
        return None


def bench_gemm_wide(rows: tuple[int, ...], shapes: dict[str, tuple[int, int]]) -> list[dict]:
    """The wgmma GEMM at a wide decode round's rows: `fp8_gemm.auto_config`'s choice beside column tiles of 64 and
    128 with one, two and four K ranges (each other warpgroup split as auto_config's) and, where tiles overfill the
    last wave, the tail launch's K ranges of TAIL_SPLITS, and STEP_BLOCKS_OF's configs on two-block steps (their
    tails at most as many ranges as divide K), us per call with the partial sums' addition, and each
    one's error against `fp8_gemm.reference_rows` (every program compiles before its timing: the error's call
    compiles it); shapes: {name: (K, N)}."""
    out, sms = [], fp8_gemm._num_sms()
    for name, (k, n) in shapes.items():
        fp8 = fp8_normal(jax.random.key(0), (n, k), k**-0.5)
        w = (fp8.values, fp8.scales)
        for m in rows:
            xq, xs = fp8_matmul.quantize_rows(jax.random.normal(jax.random.key(m), (m, k), jnp.float32))
            auto = fp8_gemm.auto_config(m, n, k, sms)
            configs = {"auto": auto}
            for tile_n in (64, 128):
                for splits in (1, 2, 4):
                    cfg = fp8_gemm.with_k_splits(dataclasses.replace(auto, tile_n=tile_n, tail_splits=1), splits)
                    if cfg not in configs.values() and (k // fp8_gemm.BLOCK) % splits == 0:
                        configs[f"n{tile_n} k{splits}"] = cfg
            if auto.k_splits == 1 and fp8_gemm.whole_wave_columns(auto, m, n, sms) < n:
                for splits in TAIL_SPLITS:
                    cfg = dataclasses.replace(auto, tail_splits=splits)
                    if cfg not in configs.values() and (k // fp8_gemm.BLOCK) % splits == 0:
                        configs[f"tail k{splits}"] = cfg
            for label, cfg in list(configs.items()):  # two-block steps on the stages with_k_splits gives them
                tails = [d for d in range(cfg.tail_splits, 0, -1) if (k // fp8_gemm.BLOCK) % (2 * d) == 0]
                if label in STEP_BLOCKS_OF and (k // fp8_gemm.BLOCK) % (2 * cfg.k_splits) == 0 and tails:
                    configs[f"{label} 2-block steps"] = fp8_gemm.with_k_splits(
                        dataclasses.replace(cfg, step_blocks=2, tail_splits=tails[0]), cfg.k_splits)
            run = {label: functools.partial(fp8_gemm.fp8_gemm_rows, out_dtype=jnp.bfloat16, config=cfg)
                   for label, cfg in configs.items()}
            want = fp8_gemm.reference_rows(xq, xs, *w)
            errs = {label: _guard(label, lambda f=f: _rel(f(xq, xs, *w), want)) for label, f in run.items()}
            times = {label: _guard(label, lambda f=f: time_pure(f, (xq, xs, *w), chain_arg=1, unroll=10) * 1e6)
                     for label, f in run.items()}
            for label, us in times.items():
                cfg = configs[label]
                row = {"shape": name, "M": m, "config": label, "tile_n": cfg.tile_n, "k_splits": cfg.k_splits,
                       "wg_split": cfg.wg_split, "tail_splits": cfg.tail_splits, "us": us,
                       "gbps": k * n / us / 1e3 if us else None,
                       "vs_auto": times["auto"] / us if us and times["auto"] else None, "rel_err": errs[label]}
                print(" ".join(f"{key}={report.fmt(v)}" for key, v in row.items()), flush=True)
                out.append(row)
    return out


def bench_layout(rows: tuple[int, ...], shapes: dict[str, tuple[int, int]]) -> list[dict]:
    """The dense FP8 kernels a round's rows take (`quantized_dot`'s choice: one row weight-only, 2-32 FP8 x FP8
    swap AB, more the wgmma GEMM at auto_config) on the weight [N, K] beside it `blocked`, us per call and whether
    the two give the same bits; shapes: {name: (K, N)}."""
    out = []
    for name, (k, n) in shapes.items():
        fp8 = fp8_normal(jax.random.key(0), (n, k), k**-0.5)
        layouts = {"rows": fp8.values, "blocked": fp8_matmul.blocked(fp8.values)}
        for m in rows:
            x = jax.random.normal(jax.random.key(m), (m, k), jnp.bfloat16)
            xq, xs = fp8_matmul.quantize_rows(x)
            if m == 1:
                fn, args = fp8_matmul.fp8_matmul, (x,)
            elif m <= fp8_matmul.DEFAULT_CONFIG.rows_limit(True):
                fn, args = functools.partial(fp8_matmul.fp8_matmul_rows, out_dtype=jnp.bfloat16), (xq, xs)
            else:
                fn, args = functools.partial(fp8_gemm.fp8_gemm_rows, out_dtype=jnp.bfloat16), (xq, xs)
            got = {lb: _guard(lb, lambda v=v: fn(*args, v, fp8.scales)) for lb, v in layouts.items()}
            us = {lb: _guard(lb, lambda v=v: time_pure(fn, (*args, v, fp8.scales), chain_arg=len(args) - 1,
                                                       unroll=10) * 1e6) for lb, v in layouts.items()}
            row = {"shape": name, "M": m, "rows_us": us["rows"], "blocked_us": us["blocked"],
                   "blocked_gbps": k * n / us["blocked"] / 1e3 if us["blocked"] else None,
                   "blocked_vs_rows": us["rows"] / us["blocked"] if us["rows"] and us["blocked"] else None,
                   "same_bits": None if None in got.values() else bool(jnp.array_equal(*got.values()))}
            print(" ".join(f"{key}={report.fmt(v)}" for key, v in row.items()), flush=True)
            out.append(row)
    return out


def _write_table(out: str, name: str, title: str, note: str, cols: list[str], rows: list[dict]) -> None:
    """One section's report: its rows as a table under the run's header, and as json."""
    meta = report.run_meta(report.command_line())
    lines = report.header(title, meta, note)
    lines += report.table(cols, [[report.fmt(r.get(c)) for c in cols] for r in rows])
    report.write_report(out, name, {**meta, "rows": rows}, lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="docs/benchmarks")
    p.add_argument("--rows", default="1,2,8,16,2048,8192")
    p.add_argument("--moe-tokens", default="1,8,512,8192")
    p.add_argument("--moe-configs", default="", help="with --only moe: FP8 x FP8 expert tile configs timed beside, "
                   "comma-separated, e.g. 'default,m32 k128 w4 s4' (see _moe_config)")
    p.add_argument("--only", choices=["dense", "moe", "gemm", "gemm-wide", "sweep", "rows", "layout"],
                   help="one section (sweep runs only when named)")
    p.add_argument("--gemm-rows", default="2048,8192")
    p.add_argument("--gemm-wide-rows", default="64,128,256")
    p.add_argument("--layout-rows", default="1,8,64,128,256,2048", help="with --only layout")
    p.add_argument("--gemm-wide-shapes", default=",".join(WIDE_SHAPES),
                   help="with --only gemm-wide: names from WIDE_SHAPES or KxN, comma-separated")
    p.add_argument("--rows-tokens", default="8192,32768")
    p.add_argument("--gemm-configs", default=",".join(GEMM_CONFIGS), help="names from GEMM_CONFIGS to tune over")
    p.add_argument("--sweep-rows", default="1,2,8,16",
                   help="bf16 and --sweep-old's kernels at each; each SWEEP_VARIANTS entry at its rows among these")
    p.add_argument("--sweep-shapes", help="comma-separated names from SHAPES, or KxN (default: every SHAPES entry; "
                   f"on a CPU {SWEEP_CPU_SHAPE[0]}x{SWEEP_CPU_SHAPE[1]})")
    p.add_argument("--sweep-kernels", help="comma-separated kernel labels to time (bf16 always; default: all)")
    p.add_argument("--sweep-old", metavar="PATH", help="a copy of an earlier pallas_kernels/fp8_matmul.py (git show "
                   "REV:pallas_kernels/fp8_matmul.py > PATH): its default and dynamic kernels timed beside")
    args = p.parse_args()
    if args.only == "sweep":
        cpu = jax.default_backend() == "cpu"
        shapes = _sweep_shapes(args.sweep_shapes, cpu)
        meta = report.run_meta(report.command_line())
        rows, checks = bench_sweep(shapes, tuple(int(m) for m in args.sweep_rows.split(",")), args.sweep_old,
                                   args.out, meta, interpret=cpu, kernels=args.sweep_kernels)
        cols = ["shape", "M", "kernel", "us", "gbps", "vs_bf16", "rel_err"]
        lines = report.header("Block-FP8 decode kernel configs", meta, "pallas_kernels/fp8_matmul.py's configs "
                              "(SWEEP_VARIANTS in scripts/bench_fp8_kernels.py; old: --sweep-old's copy) beside "
                              "XLA's bf16 matmul on bf16 weights; us per call (10 calls inside one jit, median of 5 "
                              "batches, every program compiled before any is timed); gbps: FP8 weight bytes a "
                              "second (bf16: its own bytes); vs_bf16: the bf16 matmul's time over the kernel's at the "
                              "same rows; rel_err against the dequantized weight's float32 product"
                              + ("; the Pallas interpreter on a CPU: times are not measurements" if cpu else ""))
        lines += report.table(cols, [[report.fmt(r.get(c)) for c in cols] for r in rows])
        kernels = list(dict.fromkeys((r["kernel"], r["M"]) for r in rows))
        cell = {(r["kernel"], r["M"], r["shape"]): f"{report.fmt(r['gbps'])} x{report.fmt(r['vs_bf16'])}" for r in rows}
        lines += ["", "GB/s (x bf16):", ""]
        lines += report.table(["kernel", "M", *shapes], [[lb, m, *[cell.get((lb, m, s), "") for s in shapes]]
                                                         for lb, m in kernels])
        lines += ["", "float64 check (K=1024, N=256, block scales over three decades):", ""]
        lines += report.table(["kernel", "M", "rel_err", "limit", "ok"],
                              [[c["kernel"], c["M"], report.fmt(c["rel_err"]), c["limit"], c["ok"]] for c in checks])
        report.write_report(args.out, "fp8_sweep", {**meta, "float64_check": checks, "rows": rows}, lines)
        return
    if args.only == "rows":
        rows = bench_fp8_rows(tuple(int(t) for t in args.rows_tokens.split(",")))
        cols = ["shape", "M", "bf16_rows_us", "xla_us", "kernel_us", "kernel_vs_xla", "kernel_gbps", "bf16_out_us",
                "xla_out_us", "fused_out_us", "fused_vs_xla_out", "fused_vs_bf16_out", "scale_rel_diff",
                "values_differing", "scale_rel_diff_xla", "values_differing_xla", "fused_rel_err"]
        _write_table(args.out, "fp8_rows", "Producers writing FP8 rows for the FP8 GEMM", "kernel: "
                     "pallas_kernels/fp8_rows.py (the GDN gated norm, the MLP's SwiGLU, written as FP8 rows and their "
                     "scales); xla: the model's producer then quantize_rows, as XLA fuses them; bf16_rows: the "
                     "producer alone, a bf16 pass's; *_out: the producer and its projection (fused: "
                     "ops.gated_norm_dot / ops.swiglu_dot, the kernel into fp8_gemm_rows; xla: the producer into "
                     "fp8_gemm; bf16: into XLA's bf16 matmul); us per call; kernel_gbps counts the bf16 inputs and "
                     "the FP8 rows; scale_rel_diff, values_differing: the kernel's scales and FP8 values against the "
                     "composition run op by op (every bf16 rounding kept); *_xla: against XLA's fusion of it, which "
                     "skips those roundings (excess precision)", cols, rows)
        return
    if args.only == "layout":
        cols = ["shape", "M", "rows_us", "blocked_us", "blocked_gbps", "blocked_vs_rows", "same_bits"]
        _write_table(args.out, "fp8_layout", "Dense FP8 weights [N, K] against blocked [K / 128, N, 128]", "the "
                     "kernel quantized_dot takes at each row count (1: fp8_matmul weight-only; 2-32: FP8 x FP8 swap "
                     "AB; more: fp8_gemm at auto_config) on the weight as the checkpoint stores it and "
                     "fp8_matmul.blocked (the layout startup.BLOCK_FP8_WEIGHTS gives a dense model's engine); us "
                     "per call (10 calls inside one jit, median of 5 batches); blocked_gbps: FP8 weight bytes a "
                     "second", cols,
                     bench_layout(tuple(int(m) for m in args.layout_rows.split(",")),
                                  _shapes(args.gemm_wide_shapes, WIDE_SHAPES, "--gemm-wide-shapes")))
        return
    if args.only == "gemm-wide":
        cols = ["shape", "M", "config", "tile_n", "k_splits", "wg_split", "tail_splits", "us", "gbps", "vs_auto",
                "rel_err"]
        _write_table(args.out, "fp8_gemm_wide", "Block-FP8 wgmma GEMM at wide decode rounds' rows", "config: auto is "
                     "fp8_gemm.auto_config's choice, nTILE_N kSPLITS the alternatives (K ranges summed by XLA, "
                     "timed with them), tail kSPLITS the last wave's tiles as a second launch in K ranges; us per "
                     "call (10 calls inside one jit, median of 5 batches); gbps: FP8 weight "
                     "bytes a second; vs_auto: auto's time over the config's; rel_err: the config's against "
                     "fp8_gemm.reference_rows", cols,
                     bench_gemm_wide(tuple(int(m) for m in args.gemm_wide_rows.split(",")),
                                     _shapes(args.gemm_wide_shapes, WIDE_SHAPES, "--gemm-wide-shapes")))
        return
    if args.only == "gemm":
        rows = bench_gemm(tuple(int(m) for m in args.gemm_rows.split(",")), args.gemm_configs.split(","))
        cols = ["shape", "M", "config", "bf16_us", "dequant_bf16_us", "torch_rowwise_us", "kernel_us", "gemm_us",
                "kernel_tflops", "torch_tflops", "kernel_vs_bf16", "kernel_vs_torch", "gemm_vs_dequant",
                "gemm_vs_torch", "kernel_rel_err", "exact_rel_err", "quantization_rel_err", "dequant_rel_err"]
        _write_table(args.out, "fp8_gemm", "Block-FP8 prefill GEMM", "kernel: pallas_kernels/fp8_gemm.py on x "
                     "already quantized; gemm: with the per-token 128-group quantization of x (XLA); dequant_bf16: "
                     "today's engine (W dequantized to bf16, XLA's matmul); torch_rowwise: cuBLASLt FP8 with one "
                     "scale per row and column; kernel_rel_err against x as quantized times W (float32), "
                     "exact_rel_err and dequant_rel_err against x times W, quantization_rel_err: x as quantized "
                     "against x, the bound the kernel is held to", cols, rows)
        return
    rows = [r for name, (k, n) in SHAPES.items() if args.only != "moe"
            for r in bench_shape(name, k, n, tuple(int(m) for m in args.rows.split(",")))]
    moe_configs = tuple(filter(None, args.moe_configs.split(",")))
    for name in moe_configs:
        _moe_config(name)  # a bad name fails before anything runs
    if args.only != "dense":
        rows += bench_moe(tuple(int(t) for t in args.moe_tokens.split(",")), moe_configs)
    cols = ["shape", "M", "bf16_us", "xla_dequantized_us", "engine_us", "engine_vs_bf16", "engine_gbps",
            "torch_rowwise_us", "engine_vs_torch", *[f"{c}_us" for c in CONFIGS], "rel_err", "dynamic_us",
            "dynamic_vs_engine", "dynamic_rel_err", "grouped_kernel_rel_err", *[f"tiles {c}_us" for c in moe_configs]]
    _write_table(args.out, "fp8_moe" if args.only == "moe" else "fp8_kernels", "Block-FP8 projections", "engine: "
                 "what the model's FP8 product runs (the decode kernels up to Fp8Config's row limits, then the wgmma "
                 "GEMM or dequantize + XLA's bf16 matmul; for the MoE layer, the expert kernels reading FP8 tiles); "
                 "torch_rowwise: cuBLASLt FP8 with one scale per row and column (coarser than the packs' 128-blocks); "
                 "dynamic: --fp8-activations dynamic, the rows quantized per token and 128-group for an FP8 x FP8 "
                 "product (its error against the bf16 rows in dynamic_rel_err); for the MoE layer's prefill rows, "
                 "moe_experts' quantize_activations (FP8 x FP8 tiles up to MoeConfig.fp8_dynamic_rows_per_expert, on "
                 "a Hopper GPU the grouped wgmma GEMM from fp8_grouped_rows_per_expert; grouped_kernel_rel_err: that "
                 "GEMM against its jnp reference); tiles NAME: --moe-configs' NAME", cols, rows)

if __name__ == "__main__":
    main()
