"""Paged decode over INT8-G64 and FP8-row256 pools (`pallas_kernels.paged_attention`): every `DecodeConfig` variant of
the sweeps that chose `QUANT_DECODE_CONFIG` and `INT8_DECODE_CONFIG`, and NVFP4-G16 and K8V4 pools' rows decoded to
bf16 and to f16 (the inline PTX, the default), beside the bf16 pool and a plain copy in one process, at the 27B's
attention shape by default (8 lanes, 24 query and 4 KV heads, D 256; --lanes, --heads). Each variant's bytes read per
second (values and scales) and its share of the copy rate, and its relative error against the XLA reference over the
dequantized pools.

    python scripts/sweep_kv_decode.py                       # one H200, 32k and 131k contexts, about 5 minutes
    python scripts/sweep_kv_decode.py --lanes 1 --heads 16/2 --contexts 30720   # the 35B-A3B's one-lane round
    python scripts/sweep_kv_decode.py --smoke               # a small shape in interpret mode (a CPU check)
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile

from bench_kernels import compile_pure, time_pure

from ninfer_jax.benchmarks import report
from ninfer_jax.benchmarks.models import measure_copy_tbps

UNROLL = 10

LANES, HQ, HKV, D = 8, 24, 4, 256


def variants():
    from pallas_kernels.paged_attention import INT8_DECODE_CONFIG, QUANT_DECODE_CONFIG
    from pallas_kernels.paged_attention import DecodeConfig as DC

    f16 = dict(f16_keys=True, f16_values=True)

    def quant(**changes):  # 1 page, f16 operands, 3 stages (QUANT_DECODE_CONFIG's five cut to three) with `changes`
        return dataclasses.replace(QUANT_DECODE_CONFIG, **{"num_stages": 3, **changes})

    # the transposed products (keys and values the left operand), and the rows dequantized whole (one product a
    # block) to f16 (the f16 flags) or to bf16
    bf16_rows = dict(dequantize_rows=True, f16_keys=False, f16_values=False)
    other = [("1 page, f16, 3 stages, swap AB", quant(swap_ab=True)),
             ("2 pages, f16, 3 stages, swap AB", quant(swap_ab=True, pages_per_block=2)),
             ("1 page, 3 stages, rows dequantized to f16", quant(dequantize_rows=True)),
             ("1 page, 5 stages, rows dequantized to f16 (INT8_DECODE_CONFIG)", INT8_DECODE_CONFIG),
             ("1 page, 3 stages, rows dequantized to bf16", quant(**bf16_rows)),
             ("2 pages, 3 stages, rows dequantized to bf16", quant(pages_per_block=2, **bf16_rows))]
    # Longer splits: one lane of few KV heads spreads its pages over many short programs (4 pages each at the
    # default floor), whose fixed costs and partials the combine reads then dominate (kernels_notes.md)
    longer = [(f"1 page, f16, 3 stages, >= {n} pages a split", quant(min_pages_per_split=n)) for n in (16, 64)]
    return {
        "bfloat16": [("2 pages, 4 warps (default)", DC()), ("1 page, 4 warps", DC(pages_per_block=1)),
                     ("2 pages, swap AB", DC(swap_ab=True)), ("1 page, swap AB", DC(pages_per_block=1, swap_ab=True)),
                     *[(f"2 pages, >= {n} pages a split", DC(min_pages_per_split=n)) for n in (16, 64)]],
        "int8": [("2 pages, 4 warps, 2 stages", DC()), ("1 page", DC(pages_per_block=1)),
                 ("1 page, prefetch", DC(pages_per_block=1, prefetch=True)),
                 ("1 page, f16 keys", DC(pages_per_block=1, f16_keys=True)),
                 ("1 page, f16", DC(pages_per_block=1, **f16)),
                 ("1 page, f16, 1024 programs", DC(pages_per_block=1, target_programs=1024, **f16)),
                 ("1 page, f16, 3 stages", DC(pages_per_block=1, num_stages=3, **f16)),
                 ("1 page, f16, 5 stages", QUANT_DECODE_CONFIG),
                 ("1 page, f16, 1 stage", DC(pages_per_block=1, num_stages=1, **f16)),
                 ("1 page, f16, 8 warps", DC(pages_per_block=1, num_warps=8, **f16)),
                 ("2 pages, f16, 8 warps", DC(num_warps=8, **f16))] + other + longer,
        "fp8": [("2 pages, 4 warps, 2 stages", DC()), ("1 page", DC(pages_per_block=1)),
                ("1 page, prefetch", DC(pages_per_block=1, prefetch=True)),
                ("1 page, f16 values", DC(pages_per_block=1, f16_values=True)),
                ("1 page, f16, 3 stages", DC(pages_per_block=1, num_stages=3, **f16)),
                ("1 page, f16, 5 stages (default)", QUANT_DECODE_CONFIG),
                ("1 page, f16, 1 stage", DC(pages_per_block=1, num_stages=1, **f16)),
                ("1 page, f16, 8 warps", DC(pages_per_block=1, num_warps=8, **f16))] + other + longer,
        # NVFP4 rows two codes a register to f16 by inline PTX (the default), or by integer ops per code to bf16
        **{pool: [("1 page, bf16 rows", DC(pages_per_block=1)),
                  ("1 page, f16 rows", DC(pages_per_block=1, **f16)),
                  ("1 page, f16 rows, 3 stages", quant()),
                  ("1 page, f16 rows, 5 stages (default)", QUANT_DECODE_CONFIG)] + longer
           for pool in ("nvfp4", "k8v4")},
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", default="32768,131072")
    p.add_argument("--lanes", type=int, default=LANES)
    p.add_argument("--heads", default=f"{HQ}/{HKV}", help="query / KV heads (the 27B's 24/4, the 35B-A3B's 16/2)")
    p.add_argument("--out", default=None, help="report folder (default: a temporary one)")
    p.add_argument("--smoke", action="store_true", help="256 keys, a pool's first and last variants, interpret mode")
    args = p.parse_args()

    import jax
    import jax.numpy as jnp

    from pallas_kernels import kv_quant, paged_attention, reference

    interpret = jax.default_backend() == "cpu"
    contexts = [256] if args.smoke else [int(x) for x in args.contexts.split(",")]
    hq, hkv = (int(x) for x in args.heads.split("/"))
    lanes, hq, hkv = (2, 4, 2) if args.smoke else (args.lanes, hq, hkv)
    pages = max(contexts) // 64
    n_pool = lanes * pages + 8
    k1, k2, k3 = jax.random.split(jax.random.key(20), 3)
    k_bf, v_bf = (jax.random.normal(k, (n_pool, 64, hkv, D), jnp.bfloat16) for k in (k1, k2))
    quantize = jax.jit(kv_quant.quantize, static_argnums=0)
    pools = {"bfloat16": (k_bf, v_bf)}
    for name in ("int8", "fp8", "nvfp4", "k8v4"):
        pools[name] = tuple(kv_quant.QuantPages(*quantize(f, x), f.name)
                            for f, x in zip(kv_quant.PROFILES[name], (k_bf, v_bf)))
    order = jax.random.permutation(k3, n_pool)[:lanes * pages].reshape(lanes, pages).astype(jnp.int32)
    copy_tbps = measure_copy_tbps(1 / 256 if args.smoke else 2)
    meta = report.run_meta()
    rows, data = [], {**meta, "copy_tbps": copy_tbps, "rows": []}
    for ctx in contexts:
        tables = order[:, :ctx // 64]
        lengths = jnp.full((lanes,), ctx, jnp.int32) - 3 * jnp.arange(lanes, dtype=jnp.int32)
        q = jax.random.normal(jax.random.key(ctx), (lanes, hq, D), jnp.bfloat16)
        for pool, configs in variants().items():
            k, v = pools[pool]
            want = reference.paged_decode_attention_ref(q, k, v, tables, lengths)
            for label, config in configs[:1] + configs[-1:] if args.smoke else configs:
                def fn(q, k, v, t, n, c=config):
                    return paged_attention.paged_decode_attention(q, k, v, t, n, config=c, interpret=interpret)
                # UNROLL calls inside one jit: one call a dispatch would time the host's dispatch at one lane. The
                # program's output is its last call's (the chained input adds zeros), so it gives the error too.
                unroll, call_args = 1 if args.smoke else UNROLL, (q, k, v, tables, lengths)
                try:
                    program = compile_pure(fn, call_args, unroll=unroll)
                    _, out = program(jnp.zeros((), jnp.float32), *call_args)
                except jax.errors.JaxRuntimeError as failure:  # e.g. more shared memory than the GPU has
                    reason = str(failure).splitlines()[0][:160]
                    data["rows"].append({"pool": pool, "variant": label, "context": ctx, "error": reason})
                    rows.append([pool, label, ctx, "-", "-", "-", reason])
                    print(f"{pool} {label} {ctx}: {reason}", flush=True)
                    continue
                error = float(jnp.linalg.norm((out - want).astype(jnp.float32)) / jnp.linalg.norm(
                    want.astype(jnp.float32)))
                seconds = time_pure(fn, call_args, unroll=unroll, reps=1 if args.smoke else 5, compiled=program)
                tbps = float(jnp.sum(lengths)) * hkv * kv_quant.bytes_per_token_head(pool, D) / seconds / 1e12
                entry = {"pool": pool, "variant": label, "context": ctx, "us": seconds * 1e6, "tbps": tbps,
                         "share_of_copy": tbps / copy_tbps, "relative_error": error}
                data["rows"].append(entry)
                rows.append([pool, label, ctx, report.fmt(entry["us"]), f"{tbps:.2f}", f"{100 * tbps / copy_tbps:.0f}%",
                             f"{error:.1e}"])
                print(f"{pool} {label} {ctx}: {seconds * 1e6:.1f} us {tbps:.2f} TB/s "
                      f"{100 * tbps / copy_tbps:.0f}% of copy, error {error:.1e}", flush=True)
    lines = report.header("Paged decode over quantized pools: the config sweep", meta,
                          f"{lanes} lanes, {hq}/{hkv} heads, D {D}; copy {copy_tbps:.2f} TB/s; bytes read = values and "
                          "scales")
    lines += report.table(["pool", "variant", "context", "us", "TB/s", "of copy", "relative error"], rows)
    page = report.write_report(args.out or tempfile.mkdtemp(prefix="sweep_kv_decode_"), "kv_decode_sweep", data,
                               lines)
    print(f"report: {page}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
