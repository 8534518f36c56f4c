"""Where a cold long prefill's time goes at the real shapes (random bf16 weights, or block-FP8 with --weights), and
what the variants change.

For each model shape: the engine's TTFT of a cold prompt (default 32k tokens) with the default kernels; a jax
profiler trace of one such prefill, its device kernels summed by name and by kind (GEMM, attention, GDN, MoE,
the rest); then the same prompt with each prefill-attention variant (`--attention`, swapped into the runner's
static `KernelConfig`, so each compiles once, untimed), each other kernel choice (`--variants`, the same way, each
timed beside a second run of the default) and each other prefill chunk (`--chunks`: a new engine on the same
weights, whose idle passes are that chunk too, so every pass is as long as named). Every variant is timed in this
one process, so the ratios are side by side.

    python scripts/profile_prefill.py --models 27b,35b-a3b --out docs/benchmarks
    python scripts/profile_prefill.py --smoke        # the tiny shape on CPU, a temporary folder
"""

from __future__ import annotations

import argparse
import collections
import gc
import tempfile
import time
from pathlib import Path

from ninfer_jax.benchmarks import report
from ninfer_jax.benchmarks.models import MODELS, WEIGHTS, model_config, pack_config, weight_options
from ninfer_jax.benchmarks.profiling import kernel_table

# Kernel kinds by name fragment, first match wins (XLA names its cuBLAS/Triton GEMM fusions gemm_* / *dot*).
KINDS = (("attention", ("paged_prefill", "cudnn", "fmha", "flash")), ("gdn", ("gdn",)), ("moe", ("moe",)),
         ("gemm", ("gemm", "dot", "cublas", "sm90_xmma", "nvjet", "fp8")))


def kind_of(kernel: str) -> str:
    low = kernel.lower()
    for kind, fragments in KINDS:
        if any(f in low for f in fragments):
            return kind
    return "other"


def ttft(engine, prompt, reps: int) -> float:
    from ninfer_jax import SamplingParams

    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    return min(engine.generate(prompt, one).metrics.ttft_s for _ in range(reps))


def attention_variants(names: list[str]):
    from pallas_kernels.paged_attention import PrefillConfig

    table = {"default": None, "pallas": PrefillConfig(), "pallas_q64_w4": PrefillConfig(block_q=64, num_warps=4),
             "pallas_q128_w8": PrefillConfig(block_q=128, num_warps=8), "cudnn": PrefillConfig(impl="cudnn")}
    return [(n, table[n]) for n in names]


# Other KernelConfig variants, each a change to the engine's: name -> fields replaced
KERNEL_VARIANTS = {
    "gdn_conv_unfused": dict(fuse_gdn_conv=False),  # the GDN prefill's conv as XLA's fusions
}


def check_attention(cfg, variants) -> list[dict]:
    """Each prefill-attention variant against the jnp reference (float32 softmax) at the model's heads, bf16 pools,
    a chunk of 512 queries over prefixes of 0 and 9000 keys (one full cuDNN segment and a partial second)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from ninfer_jax.model import ops
    from ninfer_jax.runtime.startup import is_hopper
    from ninfer_jax.runtime.options import EngineOptions
    from pallas_kernels.paged_attention import PrefillConfig

    # "default" is the engine's: cuDNN on a Hopper GPU
    resolved = EngineOptions().resolve(65536, jax.default_backend(), hopper=is_hopper(jax.devices()[0]))
    engine_default = PrefillConfig(impl=resolved.prefill_attention)
    rows = []
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    for t, base in ((512, 0), (512, 9000)):
        pages = -(-(base + t) // 64) + 8
        keys = jax.random.split(jax.random.key(base + 1), 3)
        k = jax.random.normal(keys[0], (pages, 64, hkv, d), jnp.bfloat16)
        v = jax.random.normal(keys[1], (pages, 64, hkv, d), jnp.bfloat16)
        q = jax.random.normal(keys[2], (t, hq, d), jnp.bfloat16)
        table = jnp.asarray(np.random.default_rng(base).permutation(pages), jnp.int32)
        want = np.asarray(ops.attention_prefill(ops.REFERENCE, q, k, v, table, jnp.int32(base)), np.float64)
        for label, config in variants:
            kc = ops.KernelConfig("pallas", prefill_attention=config or engine_default)
            got = np.asarray(ops.attention_prefill(kc, q, k, v, table, jnp.int32(base)), np.float64)
            err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
            rows.append({"variant": label, "T": t, "base": base, "rel_err": err, "ok": err < 1e-2})
            print(f"check {label} T={t} base={base}: rel err {err:.2e} ({'ok' if err < 1e-2 else 'FAILED'})",
                  flush=True)
    return rows


def profile(name: str, args) -> dict:
    import dataclasses

    import jax
    import numpy as np

    from ninfer_jax import Engine, SamplingParams
    from ninfer_jax.model.random_init import random_params
    from ninfer_jax.runtime.options import EngineOptions

    cfg = pack_config(model_config(name), args.weights)
    params = random_params(cfg, seed=0, fp8=args.weights != "bf16")
    jax.block_until_ready(params)
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, args.tokens).tolist()
    result = {"model": name, "weights": args.weights, "tokens": args.tokens, "variants": []}
    if args.check and jax.default_backend() == "gpu":
        result["checks"] = check_attention(cfg, attention_variants(args.attention.split(",")))

    def engine_for(chunk: int):
        opts = EngineOptions(dtype="bfloat16", max_concurrency=8, prefill_chunk=chunk, idle_prefill_chunk=chunk,
                             max_model_len=args.tokens + 1024, kv_capacity=args.tokens + 4096,
                             kernels=args.kernels, no_prefix_reuse=True,
                             interpret=args.kernels == "pallas" and jax.default_backend() == "cpu",
                             **weight_options(args.weights))
        engine = Engine(cfg, params, opts, model_name=name, warmup=False)
        t = time.perf_counter()
        engine.generate(prompt[:chunk], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
        print(f"[{name}] chunk {chunk}: compiled in {time.perf_counter() - t:.1f} s", flush=True)
        return engine

    def record(label: str, engine, chunk: int):
        s = ttft(engine, prompt, args.reps)
        row = {"variant": label, "prefill_chunk": chunk, "ttft_s": s, "tok_s": args.tokens / s}
        result["variants"].append(row)
        print(f"[{name}] {label} chunk {chunk}: {args.tokens / s:.0f} tok/s (ttft {s:.3f} s)", flush=True)

    chunks = [int(c) for c in args.chunks.split(",")]
    engine = engine_for(chunks[0])
    base_kc = engine.runner.kernels
    record("default", engine, chunks[0])
    if args.trace:
        trace_dir = Path(args.trace_dir) / name
        with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
            ttft(engine, prompt, 1)
        rows = kernel_table(trace_dir, 1, 10_000)
        by_kind = collections.Counter()
        for r in rows[:-1]:
            by_kind[kind_of(r["kernel"])] += r["us_per_round"]
        result["device_ms"] = rows[-1]["us_per_round"] / 1e3
        result["kernels"] = rows[: args.top] + rows[-1:]
        result["by_kind_ms"] = {k: v / 1e3 for k, v in by_kind.most_common()}
        print(f"[{name}] device kernels {result['device_ms']:.1f} ms in {rows[-1]['launches_per_round']:.0f} "
              f"launches; by kind (ms): " + ", ".join(f"{k} {v:.1f}" for k, v in result["by_kind_ms"].items()),
              flush=True)
        for r in rows[: args.top]:
            print(f"[{name}] {r['us_per_round'] / 1e3:9.2f} ms {r['launches_per_round']:6.0f}x  {r['kernel']}",
                  flush=True)
    for label, config in attention_variants(args.attention.split(",")):
        if label == "default":
            continue  # timed above
        engine.runner.kernels = dataclasses.replace(base_kc, prefill_attention=config)
        ttft(engine, prompt[: chunks[0] + 64], 1)  # compiles this variant's prefill step, untimed
        record(label, engine, chunks[0])
    for label in [v for v in args.variants.split(",") if v]:
        engine.runner.kernels = dataclasses.replace(base_kc, **KERNEL_VARIANTS[label])
        ttft(engine, prompt[: chunks[0] + 64], 1)  # compiles this variant's prefill step, untimed
        record(label, engine, chunks[0])
        engine.runner.kernels = base_kc
        record("default", engine, chunks[0])  # again, after it: the pair side by side
    engine.runner.kernels = base_kc
    for chunk in chunks[1:]:
        engine.stop()
        del engine
        gc.collect()
        engine = engine_for(chunk)
        record("default", engine, chunk)
    engine.stop()
    return result


def write_report(rows: list[dict], out: Path) -> None:
    meta = report.run_meta()
    weights = {r.get("weights", "bf16") for r in rows}
    lines = report.header("Prefill profile", meta, f"random {', '.join(sorted(weights))} weights; TTFT of a cold "
                          "prompt, best of --reps")
    for r in rows:
        fp8 = f", {r['weights']} weights" if r.get("weights", "bf16") != "bf16" else ""
        lines += [f"## {r['model']}{fp8}, {r['tokens']} tokens", "", *report.table(
            ["variant", "prefill chunk", "TTFT s", "tok/s"],
            [[v["variant"], v["prefill_chunk"], f"{v['ttft_s']:.3f}", f"{v['tok_s']:.0f}"] for v in r["variants"]]), ""]
        if "by_kind_ms" in r:
            lines += [f"Device kernels of one default prefill: {r['device_ms']:.1f} ms; by kind (ms): "
                      + ", ".join(f"{k} {v:.1f}" for k, v in r["by_kind_ms"].items()), "",
                      *report.table(["ms", "launches", "kernel"],
                                    [[f"{k['us_per_round'] / 1e3:.2f}", f"{k['launches_per_round']:.0f}",
                                      f"`{k['kernel']}`"] for k in r["kernels"]]), ""]
        for c in r.get("checks", []):
            lines.append(f"- check {c['variant']} T={c['T']} base={c['base']}: relative error {c['rel_err']:.2e} "
                         f"({'ok' if c['ok'] else 'FAILED'})")
    report.write_report(out, "prefill_profile", {**meta, "rows": rows}, lines)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="27b,35b-a3b", help=f"of {', '.join(MODELS)}")
    p.add_argument("--kernels", default="pallas")
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--chunks", default="2048", help="prefill chunks; the first one gets the trace and variants")
    p.add_argument("--attention", default="default,cudnn",
                   help="prefill attentions: default, pallas, pallas_q64_w4, pallas_q128_w8, cudnn")
    p.add_argument("--variants", default="",
                   help=f"other kernel choices on the first chunk: {', '.join(KERNEL_VARIANTS)}")
    p.add_argument("--weights", default="bf16", choices=WEIGHTS,
                   help="fp8: block-FP8 as Qwen's packs; fp8-dynamic: with fp8_activations 'dynamic'")
    p.add_argument("--trace", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                   help="(GPU) check each attention variant against the jnp reference first")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--trace-dir", default=str(Path(tempfile.gettempdir()) / "ninfer_prefill_trace"))
    p.add_argument("--smoke", action="store_true", help="the tiny shape on CPU, a 1024-token prompt, no variants")
    p.add_argument("--out", help="report folder (default docs/benchmarks; with --smoke a new temp folder)")
    args = p.parse_args()
    if args.smoke and args.weights != "bf16":
        p.error("--smoke runs bf16 weights only: block-FP8 needs whole 128-blocks, which the tiny shape lacks")
    if args.smoke:
        args.models, args.kernels, args.tokens, args.reps, args.chunks = "tiny-dense", "reference", 1024, 1, "256"
        args.attention, args.check = "default", False
    out = Path(args.out or (tempfile.mkdtemp(prefix="prefill_smoke-") if args.smoke else report.DOCS))
    rows = []
    for m in args.models.split(","):
        rows.append(profile(m, args))
        gc.collect()
        write_report(rows, out)  # after each model, so a deadline keeps what finished
    print(f"report: {out / 'prefill_profile.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
