"""Decode output tok/s at many lanes (1 to 256) for the real Qwen3.5 shapes with random bf16 weights (or block-FP8:
--weights fp8, fp8-dynamic), each against the round's roofline (issue 31: >= 80% of it at 64 lanes and up).

Per model (one process each), on one engine whose max_concurrency is the most lanes asked that fit:
  * the two ceilings in the same run (`models.measure_ceilings`: a bf16 matmul, a device copy);
  * for each lane count L, ascending: an untimed wave of L requests, which compiles the round sizes it is the
    first to reach (its seconds and compiles are reported apart as the first run; with --warmup the engine
    compiles every program it can reach in parallel before the first wave), then the timed wave. Each lane's
    prompt is --decode-context random token ids; greedy, ignore_eos; each lane asks `wide_decode.wave_tokens`
    (L - 1 + --decode-tokens + 4 for a one-pass prompt). The scheduler prefills one prompt per step beside a
    decode round, so the lanes admitted first decode while the last still prefill: only the rounds after the last
    lane's first token run all L lanes, and those are timed (`wide_decode.full_width_window`: about
    --decode-tokens rounds); the other lanes are cancelled at the first finish;
  * the round's roofline at L lanes and the window's mean context (`wide_decode.round_roofline`).
Memory: the cache stays on, on the Device only (host_cache_mib 0), with --device-snapshot-slots (2) and no taps:
no_prefix_reuse keeps C + 2 snapshot slots, and 514 slots of the 27B (147 MiB each) beside its 51 GiB of weights
and the KV pool do not fit 141 GB. The KV pool holds every lane's prompt and tokens. A lane count whose slots and
pages exceed what `startup.device_budget` leaves after the weights is recorded as not fitting, with the numbers.
Writes docs/benchmarks/wide_decode.{json,md} (or --out DIR); a run keeps the other models' sections.

    python scripts/bench_wide_decode.py --models 35b-a3b --deadline 480
    python scripts/bench_wide_decode.py --models 27b --deadline 480
    python scripts/bench_wide_decode.py --models 35b-a3b --weights fp8-dynamic --lanes 8,64,256 --deadline 480
    python scripts/bench_wide_decode.py --smoke      # the tiny MoE shape on CPU, lanes 1 and 4, a temporary folder
"""

from __future__ import annotations

import os

# jax takes 75% of the GPU by default: 256 lanes of the 27B need more (its weights, 258 state slots and KV pool).
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

import argparse
import collections
import json
import logging
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ninfer_jax.benchmarks import report
from ninfer_jax.benchmarks.models import MODELS, WEIGHTS, measure_ceilings, model_config

STARTED = time.monotonic()
NAME = "wide_decode"
SMOKE = {"models": "tiny-moe", "kernels": "reference", "lanes": "1,4", "decode_context": 128, "decode_tokens": 4,
         "prefill_chunk": 256}
TARGET_PCT, TARGET_FROM_LANES = 80, 64
GiB = 2**30


def memory_plan(cfg, lanes: int, args, weight_bytes: int) -> dict:
    """The engine options for `lanes` and the device bytes their pools take beside `weight_bytes`, against what
    `startup.device_budget` leaves (None on a backend that reports no memory: a CPU)."""
    import jax.numpy as jnp

    from ninfer_jax.benchmarks.wide_decode import default_pass_tokens, wave_tokens
    from ninfer_jax.model.state import (
        PAGE,
        page_bytes,
        prefill_activation_bytes,
        slot_bytes,
    )
    from ninfer_jax.runtime.options import EngineOptions
    from ninfer_jax.runtime.scheduler import pages_for
    from ninfer_jax.runtime.startup import device_budget

    context = args.decode_context + wave_tokens(cfg, lanes, args.decode_context, args.decode_tokens,
                                                default_pass_tokens(cfg, args.prefill_chunk))
    max_model_len = pages_for(context + 2) * PAGE
    pages = lanes * pages_for(context) + 8  # 8 spare: a snapshot's tail page
    slots = lanes + args.device_snapshot_slots
    need = slots * slot_bytes(cfg, jnp.bfloat16) + pages * page_bytes(cfg, jnp.bfloat16)
    longest_pass = prefill_activation_bytes(cfg, max_model_len, jnp.bfloat16)  # no pass outgrows the context
    budget = device_budget(EngineOptions(), weight_bytes, longest_pass)
    options = {"max_concurrency": lanes, "max_model_len": max_model_len, "kv_capacity": pages * PAGE,
               "host_cache_mib": 0, "device_snapshot_slots": args.device_snapshot_slots, "max_new_taps": 0}
    if args.prefill_chunk:
        options["prefill_chunk"] = args.prefill_chunk
    return {"lanes": lanes, "options": options, "state_slots": slots, "kv_pages": pages,
            "weights_gib": weight_bytes / GiB, "pools_gib": need / GiB,
            "budget_gib": None if budget is None else budget / GiB, "fits": budget is None or need <= budget}


def bench(name: str, args) -> dict:
    import jax
    import numpy as np

    from ninfer_jax import SamplingParams
    from ninfer_jax.benchmarks.models import random_engine, weight_bytes
    from ninfer_jax.benchmarks.wide_decode import engine_pass_tokens, round_roofline, run_wave, wave_tokens
    from ninfer_jax.model.state import slot_bytes

    cfg = model_config(name)
    fp8 = args.weights != "bf16"
    section = name if not fp8 else f"{name}, {args.weights} weights"
    lanes_asked = sorted({int(n) for n in args.lanes.split(",")})
    result = {**report.run_meta(), "model": name, "weights": args.weights, "decode_context": args.decode_context,
              "decode_tokens": args.decode_tokens, "kernels": args.kernels, "lanes": []}

    def save(event: str) -> None:
        print(f"[{section}] {event}", flush=True)
        write_report(section, result, Path(args.out))

    tflops, tbps = measure_ceilings(*((256, 1) if args.smoke else ()))
    result.update(matmul_tflops=tflops, copy_tbps=tbps)
    save(f"ceilings: matmul {report.fmt(tflops)} TFLOP/s, copy {report.fmt(tbps)} TB/s")
    weights = weight_bytes(cfg, args.weights)
    plans = {n: memory_plan(cfg, n, args, weights) for n in lanes_asked}
    fitting = [n for n in lanes_asked if plans[n]["fits"]]
    result["slot_mib"] = slot_bytes(cfg, jax.numpy.bfloat16) / 2**20
    for n in lanes_asked:
        if not plans[n]["fits"]:
            p = plans[n]
            result["lanes"].append({"lanes": n, "status": "does not fit", "plan": p})
            save(f"{n} lanes do not fit: {p['state_slots']} state slots and {p['kv_pages']} KV pages take "
                 f"{p['pools_gib']:.1f} GiB, {p['budget_gib']:.1f} GiB left after {p['weights_gib']:.1f} GiB of "
                 f"weights")
    if not fitting:
        return result
    plan = plans[fitting[-1]]
    result["plan"] = plan
    # --warmup: every program compiled up front on the engine's compile threads, none in the background
    warm = {"warmup": True, "background_compile": "off"} if args.warmup else {}
    if args.compile_threads:
        warm["compile_threads"] = args.compile_threads
    started = time.perf_counter()
    try:
        engine, init_s = random_engine(name, kernels=args.kernels, weights=args.weights, **warm, **plan["options"])
    except Exception as e:  # noqa: BLE001  (an engine that cannot start is a result, not a crash)
        result["error"] = f"engine start: {type(e).__name__}: {e}"[:2000]
        save(result["error"])
        return result
    if args.warmup:
        result.update(warmup_s=time.perf_counter() - started - init_s, warmup_programs=engine.runner.compile_count())
        save(f"warm-up: {result['warmup_programs']} programs compiled and run in {result['warmup_s']:.1f} s on "
             f"{engine.options.compile_threads} threads")
    memory = jax.devices()[0].memory_stats() or {}
    result.update(init_s=init_s, device=str(jax.devices()[0].device_kind), kv=engine.stats()["kv"],
                  options=engine.options.summary(), bytes_in_use_gib=memory.get("bytes_in_use", 0) / GiB,
                  bytes_limit_gib=memory.get("bytes_limit", 0) / GiB)
    save(f"engine: {fitting[-1]} lanes, {plan['state_slots']} state slots, {plan['kv_pages']} KV pages, weights made "
         f"in {init_s:.1f} s" + (f", {result['bytes_in_use_gib']:.1f} of {result['bytes_limit_gib']:.1f} GiB in use"
                                 if memory else ""))
    rng = np.random.default_rng(0)
    previous = None  # (lanes, its timed wave's seconds, seconds per program its first wave compiled)
    for n in fitting:
        elapsed = time.monotonic() - STARTED
        projected = 0.0
        if previous:  # two waves of the timed one's length per lane, and the round sizes new at this width compiled
            lanes, timed_s, per_program = previous
            new_sizes = sum(1 for size in engine.runner.decode_sizes if lanes < size <= n)
            projected = 2 * timed_s * n / lanes + per_program * new_sizes
        if args.deadline and elapsed + projected > args.deadline:
            result["lanes"].append({"lanes": n, "status": "skipped", "elapsed_s": elapsed, "projected_s": projected})
            save(f"{n} lanes skipped: {elapsed:.0f} s elapsed + {projected:.0f} s projected > --deadline "
                 f"{args.deadline:.0f} s")
            continue
        sampling = SamplingParams(max_tokens=wave_tokens(cfg, n, args.decode_context, args.decode_tokens,
                                                         engine_pass_tokens(engine)), temperature=0, ignore_eos=True)
        try:
            waves = [run_wave(engine, [rng.integers(0, cfg.vocab_size, args.decode_context).tolist()
                                       for _ in range(n)], sampling) for _ in range(2)]
        except Exception as e:  # noqa: BLE001
            result["lanes"].append({"lanes": n, "status": "error", "error": f"{type(e).__name__}: {e}"[:2000]})
            save(f"{n} lanes failed: {result['lanes'][-1]['error']}")
            break
        first, timed = waves
        previous = (n, timed.seconds, max(0.0, first.seconds - timed.seconds) / max(1, first.compiles))
        row = {"lanes": n, "first_wave_s": first.seconds, "first_wave_compiles": first.compiles,
               "timed_wave_s": timed.seconds, "timed_wave_compiles": timed.compiles,
               "worker_ms_per_round": timed.ms_per_round_by_phase}
        window = timed.window()
        if window is None:
            row.update(status="no full-width window")
            result["lanes"].append(row)
            save(f"{n} lanes: no round ran all lanes (raise --decode-tokens)")
            continue
        roof = round_roofline(cfg, n, args.decode_context + (window.start_tokens + window.end_tokens) / 2,
                              tflops, tbps, fp8=fp8)
        row.update(status="measured", tok_s=window.tok_s, rounds=window.rounds, every_lane=window.every_lane,
                   finish_reasons=collections.Counter(timed.finish_reasons), ms_per_round=window.ms_per_round,
                   mean_context=roof.context, roofline_tok_s=roof.tok_s, roofline_ms=roof.seconds * 1e3,
                   roofline_bound=roof.bound, pct_of_roofline=100 * window.tok_s / roof.tok_s,
                   round_gb=roof.bytes / 1e9, weight_gb=roof.weight_bytes / 1e9, kv_gb=roof.kv_bytes / 1e9,
                   state_gb=roof.state_bytes / 1e9, round_tflop=roof.flops / 1e12,
                   experts_per_layer=roof.experts_per_layer)
        result["lanes"].append(row)
        save(f"{n} lanes: first wave {first.seconds:.1f} s ({first.compiles} programs compiled), timed wave "
             f"{timed.seconds:.1f} s ({timed.compiles}); {window.tok_s:.0f} tok/s over {window.rounds} full-width "
             f"rounds ({window.ms_per_round:.2f} ms each); roofline {roof.tok_s:.0f} tok/s ({roof.seconds * 1e3:.2f} "
             f"ms, {roof.bound}-bound: {roof.bytes / 1e9:.2f} GB, {roof.flops / 1e12:.2f} TFLOP at mean context "
             f"{roof.context:.0f}) -> {row['pct_of_roofline']:.1f}%"
             + ("" if window.every_lane else "; a timed round lacked a lane"))
    result["peak_gib"] = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use", 0) / GiB
    try:  # an engine a wave failed may fail these too; the rows are what counts
        result["compiles_since_warmup"] = engine.stats()["compiles_since_warmup"]
        engine.stop()
    except Exception as e:  # noqa: BLE001
        result["stop_error"] = f"{type(e).__name__}: {e}"[:500]
    save(f"done in {time.monotonic() - STARTED:.0f} s")
    return result


def write_report(name: str, result: dict, out: Path) -> None:
    """wide_decode.json (every number, per model) and wide_decode.md, keeping the sections of the models this run
    did not measure."""
    path = out / f"{NAME}.json"
    models = json.loads(path.read_text()).get("models", {}) if path.exists() else {}
    models[name] = result
    meta = report.run_meta(result["command"], device=result.get("device", ""))
    lines = report.header(
        "Wide decode", meta,
        "random weights at the real shapes, bf16 unless a section names FP8 (block-FP8 as Qwen's packs: the roofline "
        "reads their quantized linears at one byte and still counts FLOPs at the bf16 matmul rate); greedy, "
        "ignore_eos; each lane's prompt is random token ids",
        "decode tok/s: the rounds in which every lane of the wave decodes (after the last prompt's first token, "
        "until the first lane finishes), timed by the token reads of the lane that finishes first "
        "(`ninfer_jax/benchmarks/wide_decode.py`); the untimed first wave at each width compiled its round sizes",
        "roofline: max(bytes / copy rate, FLOPs / matmul rate), both rates measured in the same run; bytes: the "
        "non-expert weights once, per layer the routed experts the round's L tokens touch under uniform routing "
        "(E x (1 - (1 - k/E)^L)) plus the shared expert, the lm_head, L embedding rows, the K and V of L x context "
        "tokens and each lane's GDN state read and written; FLOPs: 2 x active params x L plus 4 x head_dim x heads x "
        "context x L per attention layer; context: the window's mean",
        f"target (issue 31): >= {TARGET_PCT}% of the roofline at {TARGET_FROM_LANES} lanes and up")
    for model, r in sorted(models.items()):
        lines += model_section(model, r)
    report.write_report(out, NAME, {**meta, "models": models}, lines)


def model_section(model: str, r: dict) -> list[str]:
    """A model's run line, engine and memory, and its table."""
    lines = [f"## {model}", "", f"- command: `{r['command']}`", f"- {report.run_line(r)}"]
    if "matmul_tflops" in r:
        lines.append(f"- ceilings: matmul {report.fmt(r['matmul_tflops'])} TFLOP/s, copy "
                     f"{report.fmt(r['copy_tbps'])} TB/s")
    plan = r.get("plan")
    if plan:
        o = plan["options"]
        lines.append(f"- engine: {o['max_concurrency']} lanes, prompts of {r['decode_context']} tokens, each lane "
                     f"asking about {r['decode_tokens']} tokens more than the ramp of the wave's prefills takes "
                     f"steps (`wide_decode.wave_tokens`); prefix cache on the Device only (host_cache_mib 0), "
                     f"{o['device_snapshot_slots']} snapshot slots, no taps (no_prefix_reuse keeps lanes + 2 "
                     f"snapshot slots); kv_capacity {o['kv_capacity']} tokens ({plan['kv_pages']} pages), "
                     f"max_model_len {o['max_model_len']}")
        budget = f"{plan['budget_gib']:.1f} GiB" if plan["budget_gib"] is not None else "no limit reported"
        used = (f"; in use after the start {r['bytes_in_use_gib']:.1f} of {r['bytes_limit_gib']:.1f} GiB, peak "
                f"{r.get('peak_gib', 0):.1f} GiB" if r.get("bytes_limit_gib") else "")
        lines.append(f"- memory: weights {plan['weights_gib']:.1f} GiB; {plan['state_slots']} state slots of "
                     f"{r.get('slot_mib', 0):.1f} MiB and the KV pages {plan['pools_gib']:.1f} GiB against "
                     f"{budget} left by `startup.device_budget`{used}")
    if "warmup_s" in r:
        lines.append(f"- warm-up (`--warmup`): {r['warmup_programs']} programs compiled and run in "
                     f"{r['warmup_s']:.1f} s before the first wave")
    if "error" in r:
        lines.append(f"- not measured: {r['error'][-300:]}")
    lines += ["", *report.table(
        ["lanes", "decode tok/s", "roofline tok/s", f"% of roofline (>= {TARGET_PCT}% from {TARGET_FROM_LANES})",
         "ms per round", "roofline ms (bound)", "GB per round", "experts per layer", "mean context",
         "first wave s (programs compiled)", "timed wave s"],
        [lane_cells(row) for row in sorted(r["lanes"], key=lambda row: row["lanes"])]), ""]
    return lines


def lane_cells(row: dict) -> list:
    n = row["lanes"]
    if row["status"] != "measured":
        why = {"does not fit": lambda p: f"does not fit: {p['pools_gib']:.1f} GiB of slots and pages, "
                                         f"{p['budget_gib']:.1f} GiB left",
               "skipped": lambda _: f"skipped by --deadline ({row['elapsed_s']:.0f} s + {row['projected_s']:.0f} s)",
               "error": lambda _: f"error: {row['error'][-120:]}",
               "no full-width window": lambda _: "no round ran every lane"}[row["status"]](row.get("plan"))
        return [n, why, *["-"] * 9]
    pct = row["pct_of_roofline"]
    verdict = "" if n < TARGET_FROM_LANES else " (met)" if pct >= TARGET_PCT else " (missed)"
    lacked = "" if row.get("every_lane", True) else " (a round lacked a lane)"
    return [n, f"{row['tok_s']:,.0f}{lacked}", f"{row['roofline_tok_s']:,.0f}", f"{pct:.1f}%{verdict}",
            f"{row['ms_per_round']:.2f}", f"{row['roofline_ms']:.2f} ({row['roofline_bound']})",
            f"{row['round_gb']:.2f}", f"{row['experts_per_layer']:.1f}" if row["experts_per_layer"] else "-",
            f"{row['mean_context']:.0f}", f"{row['first_wave_s']:.1f} ({row['first_wave_compiles']})",
            f"{row['timed_wave_s']:.1f}"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="27b,35b-a3b", help=f"comma-separated, of {', '.join(MODELS)}; "
                   "each in a process of its own")
    p.add_argument("--lanes", default="1,8,32,64,128,256", help="comma-separated lane counts")
    p.add_argument("--decode-context", type=int, default=1024, help="prompt tokens of each lane")
    p.add_argument("--decode-tokens", type=int, default=64, help="full-width rounds timed per lane count")
    p.add_argument("--device-snapshot-slots", type=int, default=2, help="the engine's snapshot slots (spec D)")
    p.add_argument("--prefill-chunk", type=int, default=None, help="tokens per prefill pass (default: the "
                   "engine's)")
    p.add_argument("--kernels", default="pallas")
    p.add_argument("--weights", default="bf16", choices=WEIGHTS,
                   help="fp8: block-FP8 as Qwen's packs; fp8-dynamic: with fp8_activations 'dynamic'")
    p.add_argument("--deadline", type=float, default=None, help="seconds from the start: a lane count whose "
                   "waves would end later (projected from the last timed wave and its first wave's compiles) is "
                   "skipped and recorded as skipped")
    p.add_argument("--warmup", action="store_true", help="compile every program the engine can reach before the "
                   "first wave, in parallel (its seconds reported apart; the first waves then compile nothing)")
    p.add_argument("--compile-threads", type=int, default=None, help="the engine's compile_threads (default: its "
                   "own, one a core up to 8)")
    p.add_argument("--log-level", default="warning", help="the engine's log level (info: a line per program "
                   "compiled)")
    p.add_argument("--smoke", action="store_true", help="the tiny MoE shape on CPU with reference kernels")
    p.add_argument("--out", help="report folder (default docs/benchmarks; with --smoke a new temp folder)")
    args = p.parse_args()
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s | %(message)s")
    if args.smoke and args.weights != "bf16":
        p.error("--smoke runs bf16 weights only: block-FP8 needs whole 128-blocks, which the tiny shape lacks")
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
    args.out = args.out or (tempfile.mkdtemp(prefix="wide_decode_smoke-") if args.smoke else str(report.DOCS))
    names = args.models.split(",")
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        p.error(f"--models: unknown {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    if len(names) > 1:  # one process per model: jax keeps the GPU memory a model took
        common = ["--lanes", args.lanes, "--decode-context", str(args.decode_context), "--decode-tokens",
                  str(args.decode_tokens), "--device-snapshot-slots", str(args.device_snapshot_slots), "--kernels",
                  args.kernels, "--weights", args.weights, "--out", args.out,
                  "--log-level", args.log_level, *(["--warmup"] if args.warmup else []),
                  *(["--compile-threads", str(args.compile_threads)] if args.compile_threads else []),
                  *(["--prefill-chunk", str(args.prefill_chunk)] if args.prefill_chunk else []),
                  *(["--deadline", str(args.deadline)] if args.deadline else [])]
        return max(subprocess.run([sys.executable, __file__, "--models", n, *common], check=False).returncode
                   for n in names)
    result = bench(names[0], args)
    print(f"report: {Path(args.out) / (NAME + '.md')}", flush=True)
    bad = "error" in result or any(row["status"] in ("error", "no full-width window") for row in result["lanes"])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
