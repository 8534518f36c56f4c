"""Engine throughput at the real Qwen3.5 shapes with random weights (bf16, and block-FP8 with --weights bf16,fp8),
against rooflines and the HF peer.

One run on the H200 measures, for each model shape (27B dense, 35B-A3B MoE):
  * cold prefill tokens/s for 8k and 32k prompts (TTFT of a max_tokens=1 request): the first request of each
    length compiles the passes it is the first to use, so its TTFT is reported apart ("first"); the steady
    figure is the best of --prefill-reps requests after it,
  * decode tokens/s at 1 and 8 lanes, each lane at a --decode-context prompt (1024 by default), over about
    --decode-tokens rounds that run every lane (`wide_decode.full_width_window`: after the last prompt's first
    token, until the first lane's last; each lane asks the tokens `wide_decode.wave_tokens` gives),
  * the two ceilings in the same run (a bf16 matmul through jax, a device-to-device copy) and the rooflines
    they give (prefill: 2 x active params FLOPs per token; decode: active weight bytes per token),
  * HF transformers (+ fla when it imports) on the same shapes, in a subprocess after ours exits.
Writes docs/benchmarks/engine.{json,md} (or --out DIR).

    python scripts/bench_engine.py --models 27b,35b-a3b --out docs/benchmarks
    python scripts/bench_engine.py --models 27b --weights bf16,fp8 --part ours-only   # FP8 beside bf16
    python scripts/bench_engine.py --smoke            # the tiny MoE shape on CPU, no peer, a temporary folder
    python scripts/bench_engine.py --models 27b --part ours --kv-dtype int8 --decode-context 65536 --out DIR

--kv-dtype stores the KV pools in that profile (spec §3.1); the result records engine.stats()["kv"].
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ninfer_jax.benchmarks import report
from ninfer_jax.benchmarks.models import MODELS, WEIGHTS, measure_ceilings, model_config, param_counts
from ninfer_jax.runtime.options import KV_DTYPES

SMOKE = dict(models="tiny-moe", kernels="reference", prefill_lengths=(512, 1024), decode_tokens=8, lanes=(1, 4),
             max_model_len=2048, max_concurrency=4)
FULL = dict(prefill_lengths=(8192, 32768), lanes=(1, 8), max_model_len=33 * 1024, max_concurrency=8)


def bench_ours(name: str, args) -> dict:
    import dataclasses

    import jax
    import jax.numpy as jnp

    from ninfer_jax import SamplingParams
    from ninfer_jax.benchmarks.models import random_engine
    from ninfer_jax.benchmarks.wide_decode import default_pass_tokens, engine_pass_tokens, run_wave, wave_tokens
    from ninfer_jax.model.state import prefill_activation_bytes

    cfg = model_config(name)
    tflops, tbps = measure_ceilings(*((256, 1) if args.smoke else ()))
    fp8 = args.weights.startswith("fp8")
    total, active, decode_bytes = param_counts(cfg, fp8=fp8)
    sizes = SMOKE if args.smoke else FULL
    max_model_len = max(sizes["max_model_len"], args.decode_context + 64 + wave_tokens(
        cfg, max(sizes["lanes"]), args.decode_context, args.decode_tokens,
        default_pass_tokens(cfg, args.prefill_chunk)))
    engine, init_s = random_engine(name, kernels=args.kernels, weights=args.weights,
                                   max_concurrency=sizes["max_concurrency"], prefill_chunk=args.prefill_chunk,
                                   max_model_len=max_model_len, no_prefix_reuse=True, kv_dtype=args.kv_dtype)
    chunk = engine.options.prefill_chunk  # --prefill-chunk, or the engine's default for this model
    rng = __import__("numpy").random.default_rng(0)
    greedy = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    # The first request compiles the chunk's steps and the decode round; each prefill length's first request
    # below compiles the longer passes it is the first to use. Those are reported as compile (first-run) times.
    t = time.perf_counter()
    engine.generate(rng.integers(0, cfg.vocab_size, chunk).tolist(),
                    SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    compile_s = time.perf_counter() - t
    result = {"model": name, "weights": args.weights, "device": str(jax.devices()[0].device_kind),
              "prefill_chunk": chunk,
              "idle_prefill_chunk": engine.options.idle_prefill_chunk, "init_s": init_s, "compile_s": compile_s,
              "kv": engine.stats()["kv"], "decode_context": args.decode_context,
              "matmul_tflops": tflops,
              "hbm_tbps": tbps, "params_total": total, "params_active": active,
              "prefill_roofline_tok_s": tflops * 1e12 / (2 * active),
              "decode_roofline_tok_s_1lane": tbps * 1e12 / decode_bytes}

    def time_prefill(suffix: str = "") -> None:
        for n in sizes["prefill_lengths"]:
            key = f"{n // 1024}k" if n >= 1024 else str(n)
            compiles = engine.stats()["compiles_since_warmup"]
            first = engine.generate(rng.integers(0, cfg.vocab_size, n).tolist(), greedy).metrics.ttft_s
            compiled = engine.stats()["compiles_since_warmup"] - compiles
            steady = min(engine.generate(rng.integers(0, cfg.vocab_size, n).tolist(), greedy).metrics.ttft_s
                         for _ in range(args.prefill_reps))
            result[f"prefill_{key}_first_ttft_s{suffix}"] = first
            result[f"prefill_{key}_first_compiles{suffix}"] = compiled
            result[f"prefill_{key}_tok_s{suffix}"] = n / steady
            print(f"[{name}] prefill {n}{suffix}: first request {first:.2f} s ({compiled} programs compiled), "
                  f"then {n / steady:.0f} tok/s (ttft {steady:.2f} s, best of {args.prefill_reps})", flush=True)
            # The device's peak so far against the activation bound "auto" KV capacity reserves for the longest pass
            peak = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use", 0)
            longest = max(chunk, min(n, engine.options.idle_prefill_chunk))
            result[f"peak_gib_after_{n // 1024}k{suffix}"] = peak / 2**30
            result[f"activation_bound_gib_{longest}"] = prefill_activation_bytes(cfg, longest, jnp.bfloat16) / 2**30

    time_prefill()

    def time_decode(lanes: int, sampling: SamplingParams, suffix: str = "") -> None:
        prompts = [rng.integers(0, cfg.vocab_size, args.decode_context).tolist() for _ in range(lanes)]
        tokens = wave_tokens(cfg, lanes, args.decode_context, args.decode_tokens, engine_pass_tokens(engine))
        wave = run_wave(engine, prompts, dataclasses.replace(sampling, max_tokens=tokens))
        # The worker's seconds by phase over these requests, per decode round: round_dispatch and round_read are
        # the decode's host time (the read includes waiting for the device); the prefill phases are the prompts'.
        result[f"decode_{lanes}lane_worker_ms_per_round{suffix}"] = wave.ms_per_round_by_phase
        print(f"[{name}] decode {lanes} lanes{suffix}, worker ms per round: "
              + ", ".join(f"{k} {v:.2f}" for k, v in wave.ms_per_round_by_phase.items()), flush=True)
        window = wave.window()  # the rounds that run every lane: the prompts' prefill excluded
        if window is None:
            raise RuntimeError(f"decode {lanes} lanes: no round ran every lane; raise --decode-tokens")
        result[f"decode_{lanes}lane_tok_s{suffix}"] = window.tok_s
        print(f"[{name}] decode {lanes} lanes{suffix}: {window.tok_s:.1f} tok/s over {window.rounds} rounds",
              flush=True)

    decode = SamplingParams(max_tokens=args.decode_tokens, temperature=0, ignore_eos=True)
    for lanes in sizes["lanes"]:
        time_decode(lanes, decode)
    if args.decode_logprobs:  # the same rounds with the top-20 logprobs asked for (a program of its own per round)
        with_logprobs = dataclasses.replace(decode, logprobs=20)
        for lanes in sizes["lanes"]:  # untimed: compiles the logprobs programs (this engine skipped the warmup)
            engine.generate_many([rng.integers(0, cfg.vocab_size, 64).tolist() for _ in range(lanes)],
                                 dataclasses.replace(with_logprobs, max_tokens=4))
        for lanes in sizes["lanes"]:
            time_decode(lanes, with_logprobs, "_logprobs20")
    result["compiles_since_warmup"] = engine.stats()["compiles_since_warmup"]
    # Other prefill attentions on the same engine (the runner's static KernelConfig swapped; each compiles in an
    # untimed first request), so their ratios to the default are side by side.
    from pallas_kernels.paged_attention import PrefillConfig

    for impl in [v for v in args.prefill_attention_variants.split(",") if v]:
        engine.runner.kernels = dataclasses.replace(engine.runner.kernels, prefill_attention=PrefillConfig(impl=impl))
        time_prefill(f"_{impl}")
    engine.stop()
    return result


def bench_peer(name: str, args) -> dict:
    """HF transformers on the same shapes, random bf16 weights on the GPU (fla kernels when importable)."""
    import torch
    import transformers

    raw = json.loads((report.ROOT / "configs" / f"{MODELS[name]}.json").read_text())["text_config"]
    cls = transformers.Qwen3_5MoeForCausalLM if "moe" in raw["model_type"] else transformers.Qwen3_5ForCausalLM
    cfg_cls = transformers.Qwen3_5MoeTextConfig if "moe" in raw["model_type"] else transformers.Qwen3_5TextConfig
    config = cfg_cls(**{k: v for k, v in raw.items() if k != "model_type"})
    try:
        import fla  # noqa: F401
        backend = "fla"
    except Exception:
        backend = "torch"
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: an fp32 27B (108 GB) and its cast do not fit together
    with torch.device("cuda"):
        model = cls(config).eval()
    result = {"model": name, "peer": f"transformers {transformers.__version__} + {backend}"}
    for n in (8192, 32768):
        ids = torch.randint(0, config.vocab_size, (1, n), device="cuda")
        with torch.no_grad():
            model(ids, logits_to_keep=1)
            torch.cuda.synchronize()
            t = time.perf_counter()
            model(ids, logits_to_keep=1)
            torch.cuda.synchronize()
        result[f"prefill_{n // 1024}k_tok_s"] = n / (time.perf_counter() - t)
        print(f"[{name} peer] prefill {n}: {result[f'prefill_{n // 1024}k_tok_s']:.0f} tok/s", flush=True)
    for lanes in (1, 8):
        ids = torch.randint(0, config.vocab_size, (lanes, 1024), device="cuda")
        with torch.no_grad():
            model.generate(ids, max_new_tokens=2, do_sample=False)
            torch.cuda.synchronize()
            t = time.perf_counter()
            model.generate(ids, max_new_tokens=args.peer_decode_tokens + 1, do_sample=False)
            torch.cuda.synchronize()
            full = time.perf_counter() - t
            t = time.perf_counter()
            model.generate(ids, max_new_tokens=1, do_sample=False)
            torch.cuda.synchronize()
            prefill = time.perf_counter() - t
        result[f"decode_{lanes}lane_tok_s"] = lanes * args.peer_decode_tokens / (full - prefill)
        print(f"[{name} peer] decode {lanes} lanes: {result[f'decode_{lanes}lane_tok_s']:.1f} tok/s", flush=True)
    return result


def write_report(rows: list[dict], out: Path, command: str) -> None:
    """engine.json (every number) and engine.md: a row per engine and per other prefill attention, then the
    compile (first-request) times."""
    device = next((r["ours"].get("device") for r in rows if r.get("ours", {}).get("device")), "")
    meta = report.run_meta(command, device=device)
    lines = report.header("Engine throughput", meta, "random weights (bf16; fp8: block-FP8 projections and experts, "
                          "as Qwen's FP8 packs); steady-state figures (compiles apart); rooflines per weight format")
    lines += ["| model | engine | prefill 8k tok/s | prefill 32k tok/s | % compute roofline @32k | decode 1 lane tok/s "
              "| % bandwidth roofline | decode 8 lanes tok/s |", "|---|---|---|---|---|---|---|---|"]
    compiles, ratios = [], []
    for r in rows:
        ours = r.get("ours", {})
        peer = r.get("peer", {})
        labels = {"ours": "ninfer-jax", "ours_fp8": "ninfer-jax, FP8 weights",
                  "ours_fp8-dynamic": "ninfer-jax, FP8 weights and activations (dynamic)"}
        for label, d in [(text, r.get(key, {})) for key, text in labels.items()] + [(peer.get("peer", "peer"), peer)]:
            if not d or "error" in d:
                continue
            roofs = d if "prefill_roofline_tok_s" in d else ours
            pct_p = d.get("prefill_32k_tok_s", 0) / roofs["prefill_roofline_tok_s"] * 100 if roofs else 0
            pct_d = d.get("decode_1lane_tok_s", 0) / roofs["decode_roofline_tok_s_1lane"] * 100 if roofs else 0
            lines.append(f"| {r['model']} | {label} | {d.get('prefill_8k_tok_s', 0):.0f} | "
                         f"{d.get('prefill_32k_tok_s', 0):.0f} | {pct_p:.0f}% | {d.get('decode_1lane_tok_s', 0):.1f} "
                         f"| {pct_d:.0f}% | {d.get('decode_8lane_tok_s', 0):.1f} |")
        for key in [k for k in ours if k.startswith("prefill_32k_tok_s_")]:
            impl = key.removeprefix("prefill_32k_tok_s_")
            lines.append(f"| {r['model']} | ninfer-jax, prefill attention {impl} | "
                         f"{ours.get(f'prefill_8k_tok_s_{impl}', 0):.0f} | {ours[key]:.0f} | "
                         f"{ours[key] / ours['prefill_roofline_tok_s'] * 100:.0f}% | - | - | - |")
        for key in ("ours_fp8", "ours_fp8-dynamic"):
            fp8 = r.get(key, {})
            if ours.get("prefill_32k_tok_s") and fp8.get("prefill_32k_tok_s"):
                prefill = fp8["prefill_32k_tok_s"] / ours["prefill_32k_tok_s"]
                ratios.append(f"- {r['model']}: {labels[key].removeprefix('ninfer-jax, ')} / bf16 = prefill 32k "
                              f"{prefill:.2f}x, " + ", ".join(
                                  f"decode {n} lane{'s' * (n > 1)} "
                                  f"{fp8[f'decode_{n}lane_tok_s'] / ours[f'decode_{n}lane_tok_s']:.2f}x"
                                  for n in (1, 8) if f"decode_{n}lane_tok_s" in fp8))
        if "compile_s" in ours:
            firsts = ", ".join(f"{k.removeprefix('prefill_').removesuffix('_first_ttft_s')} {v:.1f} s "
                               f"({ours[k.replace('_ttft_s', '_compiles')]} programs)"
                               for k, v in ours.items() if k.endswith("_first_ttft_s"))
            compiles.append(f"- {r['model']}: first request (one chunk, 3 tokens) {ours['compile_s']:.1f} s; first "
                            f"request of each prefill length (TTFT, its compiles included): {firsts}")
        for part in ("ours", "ours_fp8", "ours_fp8-dynamic", "peer"):
            if "error" in r.get(part, {}):
                lines.append(f"| {r['model']} | {part}: not measured | {r[part]['error'][-200:]!r} |")
    if ratios:
        lines += ["", "## FP8 weights against bf16 (same run)", "", *ratios]
    lines += ["", "## Compile (first-run) times", "", "The engine runs without warmup here: the first request of "
              "each kind compiles the programs it is the first to use. The table's figures are the best of "
              "the requests after it.", "", *compiles, ""]
    report.write_report(out, "engine", {**meta, "rows": rows}, lines)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="27b,35b-a3b")
    p.add_argument("--kernels", default="pallas")
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="tokens per prefill pass (default: the engine's, 2048 for a dense model and 8192 for MoE)")
    p.add_argument("--decode-tokens", type=int, default=64, help="decode rounds timed with every lane decoding")
    p.add_argument("--peer-decode-tokens", type=int, default=16)
    p.add_argument("--part", choices=["ours", "peer", "all", "ours-only"], default="all",
                   help="all: ours (each --weights) then the peer; ours-only: ours for each --weights, no peer")
    p.add_argument("--weights", default="bf16", help="comma-separated weight formats of ours: bf16, fp8, "
                   "fp8-dynamic (FP8 weights with fp8_activations 'dynamic')")
    p.add_argument("--prefill-attention-variants", default="pallas",
                   help="prefill attentions timed after the default (cuDNN on a GPU) on the same engine ('' for none)")
    p.add_argument("--decode-logprobs", action=argparse.BooleanOptionalAction, default=True,
                   help="also time decode with the top-20 logprobs asked for")
    p.add_argument("--prefill-reps", type=int, default=3, help="steady-state prefill requests per length (one can "
                   "read 25%% low: the figure is their best)")
    p.add_argument("--smoke", action="store_true", help="the tiny MoE shape on CPU, no peer")
    p.add_argument("--out", help="report folder (default docs/benchmarks; with --smoke a new temp folder)")
    p.add_argument("--kv-dtype", default="auto", choices=KV_DTYPES, help="the KV pools' storage profile")
    p.add_argument("--decode-context", type=int, default=1024, help="prompt tokens of each decode lane")
    args = p.parse_args()
    unknown = set(args.weights.split(",")) - set(WEIGHTS)
    if unknown:
        p.error(f"--weights takes {', '.join(WEIGHTS)}; not {', '.join(sorted(unknown))}")
    if args.smoke:
        args.models, args.kernels, args.decode_tokens = SMOKE["models"], SMOKE["kernels"], SMOKE["decode_tokens"]
        args.prefill_chunk = args.prefill_chunk or 256
        args.prefill_attention_variants = ""
    names = args.models.split(",")
    out = Path(args.out or (tempfile.mkdtemp(prefix="engine_smoke-") if args.smoke else report.DOCS))
    if args.part in ("ours", "peer"):
        fn = bench_ours if args.part == "ours" else bench_peer
        print(json.dumps([fn(n, args) for n in names]), flush=True)
        return 0
    rows = []
    for name in names:
        row = {"model": name}
        parts = [("ours" if w == "bf16" else f"ours_{w}", w) for w in args.weights.split(",")]
        for key, weights in parts + ([("peer", "bf16")] if args.part == "all" else []):
            part = key.split("_")[0]
            # One process per part: jax and torch each take the GPU's memory for themselves.
            cmd = [sys.executable, __file__, "--part", part, "--models", name, "--kernels", args.kernels,
                   "--weights", weights,
                   *(["--prefill-chunk", str(args.prefill_chunk)] if args.prefill_chunk else []),
                   "--decode-tokens", str(args.decode_tokens),
                   "--peer-decode-tokens", str(args.peer_decode_tokens),
                   "--prefill-attention-variants", args.prefill_attention_variants,
                   "--prefill-reps", str(args.prefill_reps), *(["--smoke"] if args.smoke else []),
                   "--kv-dtype", args.kv_dtype, "--decode-context", str(args.decode_context),
                   "--decode-logprobs" if args.decode_logprobs else "--no-decode-logprobs"]
            if part == "peer" and args.smoke:
                continue
            proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
            sys.stdout.write(proc.stdout[-4000:])
            sys.stderr.write(proc.stderr[-4000:])
            try:
                row[key] = json.loads(proc.stdout.strip().splitlines()[-1])[0]
            except Exception:
                row[key] = {"error": proc.stderr[-500:]}
        rows.append(row)
        write_report(rows, out, report.command_line())
    print(json.dumps(rows, indent=1))
    return 1 if any("error" in part for row in rows for part in row.values() if isinstance(part, dict)) else 0


if __name__ == "__main__":
    sys.exit(main())
