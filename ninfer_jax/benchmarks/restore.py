"""The Host tier's restore against recomputing: a long prefix brought back from the Host (spec §3.3).

`scripts/bench_prefix_cache_restore.py` runs `measure` once per model, each in its own process (jax keeps the
GPU memory it takes), on an engine with one lane and a Host tier sized by `probe_options`:
  0. the engine's warmup compiles every program the run uses (prefill buckets, the idle passes a long greedy
     prompt takes, the decode round, the Host transfers); its seconds are reported apart as compile seconds;
  1. warm-up: the same sequence on a short prefix (72 blocks: its restore moves a batch of 64 slabs and one of
     8), which runs the restore path once before it is timed;
  2. recompute: a prompt of random token ids, the prefix (the requested tokens rounded up to whole blocks) and
     one token more, with max_tokens 1; its TTFT is the cold prefill. Its prompt-tail tap lands exactly at the
     prefix's end (floor64(n - 1), spec §7.1); that tap is the snapshot a resume uses (a max_tokens 1 request
     publishes no endpoint within a block of it, §7.7). The blocks go through to the Host at its release. A
     recompute that compiled anything has no ratio: the row says so;
  3. each round: `demote_device_cache()` drops every Device copy that has a Host copy (the stats must show the
     prefix's pages gone), then the prompt + its first output token + new ids, 64 tokens past the prefix,
     resumes from the tap: blocks and state image come back from the Host. cached_tokens must cover the prefix
     (else the probe fails); the deltas of host_restored_bytes and host_restore_seconds give the restore rate.
     The best round counts; a round that compiled something shows it in its compile count;
  4. the pinned ceiling, in the same process: `jax.device_put` of a contiguous view of a page-locked slab buffer
     of the engine's slab size (2 GiB, or the engine's Host budget), best of 3; and the same bytes as back-to-back
     views of the restore's largest batch, which shows what the batch size costs.

The spec's planning figure: a Host-resident prefix is about 300x cheaper to restore than to recompute (INT8 KV
on PCIe 5.0 x16); here KV is bf16, so the ratio is the measured one. Target: restore >= 80% of the ceiling.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

from ninfer_jax.benchmarks import report
from ninfer_jax.benchmarks.models import MODELS
from ninfer_jax.runtime.options import KV_DTYPES

BLOCK = 64
WARM_BLOCKS = 72  # restored as one batch of 64 slabs and one of 8
IMAGES = 24  # state images the Host tier is sized for: taps of the two long prompts, one per resume
CEILING_BYTES = 2 << 30
CEILING_REPS = 3
RESTORE_TARGET = 0.8  # of the pinned ceiling
SPEC_RATIO = 300  # recompute / restore time, spec §3.3


class ProbeError(RuntimeError):
    """The probe did not measure what it claims (no Host restore, a short cache hit): the run fails."""


def probe_options(cfg, kv_dtype, prefix_tokens: int, prefill_chunk: int, kv_profile: str = "auto") -> dict:
    """EngineOptions fields for the probe: one lane; room for the prefix and a resume on the Device twice over
    (a resume's pages are taken before the demoted ones are reused); a Host tier for the prefix's blocks and the
    warm-up's, IMAGES state images and 1 GiB to spare, so nothing the probe needs is evicted.

    Args:
        cfg: the ModelConfig; kv_dtype: the activations' dtype; kv_profile: the KV storage profile (with kv_dtype,
          it sizes the slabs).
        prefix_tokens: the requested prefix; prefill_chunk: the engine's chunk.
    """
    from ninfer_jax.model.state import page_bytes, slot_bytes
    from ninfer_jax.prefix_cache.host_slabs import HostSlabPool

    pool = HostSlabPool(0, page_bytes(cfg, kv_dtype, kv_profile), slot_bytes(cfg, kv_dtype))
    blocks = math.ceil(prefix_tokens / BLOCK)
    slabs = blocks + WARM_BLOCKS + 64 + IMAGES * pool.image_slabs
    max_model_len = math.ceil((max(blocks, WARM_BLOCKS) * BLOCK + 2 * prefill_chunk) / 1024) * 1024
    return {"max_concurrency": 1, "prefill_chunk": prefill_chunk, "max_model_len": max_model_len,
            "kv_capacity": 2 * max_model_len, "host_cache_mib": math.ceil(slabs * pool.slab_bytes / 2**20) + 1024,
            "kv_dtype": kv_profile}


def measure(engine, prefix_tokens: int, reps: int, label: str) -> dict:
    """Warm-up, recompute, `reps` demote + resume rounds, ceiling; the result row (see the module docstring).

    Raises:
        ProbeError: the demote left the prefix on the Device, or a resume was not served from the Host.
    """
    import numpy as np

    rng = np.random.default_rng(0)
    start = time.perf_counter()
    _sequence(engine, WARM_BLOCKS, 1, rng, f"{label} warm-up")
    warm_s = time.perf_counter() - start
    compiles = engine.stats()["compiles_since_warmup"]
    print(f"[{label}] warm-up done: {warm_s:.1f} s, {compiles} programs compiled", flush=True)
    row = _sequence(engine, math.ceil(prefix_tokens / BLOCK), reps, rng, label)
    best = min(row["rounds"], key=lambda r: r["restore_s"])
    cache = engine.stats()["prefix_cache"]
    ceiling = pinned_ceiling(engine, cache["host_slab_bytes"], min(CEILING_BYTES, cache["host_cache_bytes"]), label)
    # A recompute that compiled timed the compile, not the prefill: no ratio is quoted from it.
    warm = row["recompute_compiles"] == 0
    return {**row, **ceiling, "warm_up_s": warm_s, "host_pinned": cache.get("host_pinned"),
            "host_cache_bytes": cache.get("host_cache_bytes"), "host_slab_bytes": cache.get("host_slab_bytes"),
            "host_evictions": cache.get("host_evictions"), "restored_bytes": best["restored_bytes"],
            "restore_s": best["restore_s"], "restore_gbs": best["restore_gbs"],
            "resume_ttft_s": best["ttft_s"], "restore_vs_ceiling": best["restore_gbs"] / ceiling["ceiling_gbs"],
            "recompute_vs_restore": row["recompute_s"] / best["restore_s"] if warm else None,
            "cold_vs_resume_ttft": row["recompute_s"] / best["ttft_s"] if warm else None}


def _sequence(engine, blocks: int, reps: int, rng, label: str) -> dict:
    """Recompute a prefix of `blocks` blocks (+ 1 prompt token) cold, then `reps` rounds of demote + resume."""
    from ninfer_jax import SamplingParams

    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    n = blocks * BLOCK
    prompt = rng.integers(0, engine.config.vocab_size, n + 1).tolist()
    compiled = engine.stats()["compiles_since_warmup"]
    cold = engine.generate(prompt, one)
    ttft, compiled = cold.metrics.ttft_s, engine.stats()["compiles_since_warmup"] - compiled
    print(f"[{label}] recompute: {n + 1} tokens cold, TTFT {ttft:.3f} s ({(n + 1) / ttft:.0f} tok/s) | "
          f"{compiled} compiles", flush=True)
    head = prompt + list(cold.token_ids)
    rounds = [_resume(engine, head, n, rng, one, f"{label} round {r + 1}") for r in range(reps)]
    return {"prefix_tokens": n, "prompt_tokens": n + 1, "recompute_s": ttft, "recompute_compiles": compiled,
            "rounds": rounds}


def _resume(engine, head: list[int], n: int, rng, sampling, label: str) -> dict:
    """Demote the Device copies, then resume `head` + new ids (64 tokens past the `n`-token prefix)."""
    stats = engine.stats()
    demoted = engine.demote_device_cache()
    after = engine.stats()
    dropped = stats["prefix_cache"]["device_pages_cached"] - after["prefix_cache"]["device_pages_cached"]
    if min(demoted["pages"], dropped) < n // BLOCK:
        raise ProbeError(f"[{label}] demote freed {demoted['pages']} pages (stats: {dropped} fewer cached); the "
                         f"{n}-token prefix has {n // BLOCK} blocks on the Device")
    prompt = head + rng.integers(0, engine.config.vocab_size, n + BLOCK - len(head)).tolist()
    out = engine.generate(prompt, sampling)
    end = engine.stats()
    delta = {k: end["prefix_cache"][k] - after["prefix_cache"][k]
             for k in ("host_restored_bytes", "host_restore_seconds", "restored_blocks", "restored_images")}
    cached, moved, seconds = out.usage.cached_tokens, delta["host_restored_bytes"], delta["host_restore_seconds"]
    if cached < n or moved <= 0 or seconds <= 0:
        raise ProbeError(f"[{label}] resume of {len(prompt)} tokens: {cached} cached (>= {n} wanted), "
                         f"{moved} B restored from the Host in {seconds} s")
    record = engine.cache_record(out.request_id) or {}
    result = {"demoted_pages": demoted["pages"], "demoted_slots": demoted["slots"], "cached_tokens": cached,
              "ttft_s": out.metrics.ttft_s, "restored_bytes": moved, "restore_s": seconds,
              "restore_gbs": moved / seconds / 1e9, "source": record.get("source"),
              "record_restored_bytes": record.get("restored_host_bytes"),
              "compiles": end["compiles_since_warmup"] - stats["compiles_since_warmup"],
              "restored_blocks": delta["restored_blocks"], "restored_images": delta["restored_images"]}
    print(f"[{label}] demoted {demoted['pages']} pages, {demoted['slots']} slots | resume: {cached} of {len(prompt)} "
          f"cached ({result['source']}), TTFT {result['ttft_s']:.3f} s | restored {moved / 1e9:.3f} GB "
          f"({delta['restored_blocks']} blocks, {delta['restored_images']} images) in {seconds:.4f} s = "
          f"{result['restore_gbs']:.1f} GB/s | {result['compiles']} compiles", flush=True)
    return result


def pinned_ceiling(engine, slab_bytes: int, nbytes: int, label: str) -> dict:
    """device_put of a contiguous view of a slab buffer like the engine's (page-locked on a GPU), best of 3:
    whole, and as back-to-back views of the largest restore batch."""
    import jax

    from ninfer_jax.prefix_cache.host_slabs import HostSlabPool
    from ninfer_jax.runtime.device.host_buffer import HostSlabBuffer

    buffer = HostSlabBuffer(HostSlabPool(max(nbytes, 2 * slab_bytes), slab_bytes, slab_bytes))
    try:
        chunk = buffer.chunks[0]
        rows = max(1, min(len(chunk), nbytes // slab_bytes))
        view, batch = chunk[:rows], engine.runner.transfer_sizes[-1]
        whole = _best(lambda: [jax.device_put(view)])
        pieces = _best(lambda: [jax.device_put(view[i:i + batch]) for i in range(0, rows, batch)])
        pinned = buffer.pinned
    finally:
        buffer.close()
    result = {"ceiling_bytes": view.nbytes, "ceiling_gbs": view.nbytes / whole / 1e9, "batch_slabs": batch,
              "batch_ceiling_gbs": view.nbytes / pieces / 1e9, "ceiling_pinned": pinned}
    print(f"[{label}] pinned ceiling: {view.nbytes / 1e9:.2f} GB in one device_put {result['ceiling_gbs']:.1f} GB/s, "
          f"in batches of {batch} slabs {result['batch_ceiling_gbs']:.1f} GB/s", flush=True)
    return result


def _best(copy) -> float:
    import jax

    best = math.inf
    for _ in range(CEILING_REPS):
        start = time.perf_counter()
        jax.block_until_ready(copy())
        best = min(best, time.perf_counter() - start)
    return best


# --- the run (parent process: no jax here, it would take the GPU's memory) ---------------------------------

FLOOR_S = 120  # a model starts only with this much of --deadline left


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="27b,35b-a3b", help=f"of {', '.join(MODELS)}, each in its own process")
    p.add_argument("--kernels", default="pallas")
    p.add_argument("--smoke", action="store_true", help="the built-in tiny checkpoint on CPU, a 2048-token prefix")
    p.add_argument("--out", help="report folder (default docs/benchmarks; with --smoke a new temp folder)")
    p.add_argument("--report-name", default="prefix_cache_restore")
    p.add_argument("--prefix-tokens", type=int, help="prefix length (default 100000; 2048 with --smoke)")
    p.add_argument("--prefill-chunk", type=int, help="default 2048; 256 with --smoke")
    p.add_argument("--reps", type=int, default=3, help="demote + resume rounds per model")
    p.add_argument("--kv-dtype", default="auto", choices=KV_DTYPES, help="the KV pools' storage profile (spec §3.1)")
    p.add_argument("--deadline", type=float, default=0, help="seconds for the whole run (0: none)")
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.prefix_tokens is None:
        args.prefix_tokens = 2048 if args.smoke else 100_000
    if args.prefill_chunk is None:
        args.prefill_chunk = 256 if args.smoke else 2048
    args.argv = list(sys.argv[1:] if argv is None else argv)
    return args


def run_model(args) -> dict:
    """One model's restore benchmark in this process; its result row."""
    import jax
    import jax.numpy as jnp

    from ninfer_jax.benchmarks import models

    cfg = models.tiny_checkpoint_config() if args.smoke else models.model_config(args.model)
    kv_dtype = jnp.float32 if args.smoke else jnp.bfloat16
    options = probe_options(cfg, kv_dtype, args.prefix_tokens, args.prefill_chunk, args.kv_dtype)
    label = "tiny" if args.smoke else args.model
    start = time.perf_counter()  # the engine's warmup compiles every program the run uses
    if args.smoke:
        engine, init_s = models.tiny_engine(warmup=True, **options), 0.0
    else:
        engine, init_s = models.random_engine(args.model, kernels=args.kernels, warmup=True, **options)
    compile_s = time.perf_counter() - start - init_s
    print(f"[{label}] engine built and compiled in {compile_s:.1f} s", flush=True)
    try:
        row = measure(engine, args.prefix_tokens, max(1, args.reps), label)
    except ProbeError as e:
        return {"model": label, "error": str(e), "options": options, "compile_s": compile_s}
    finally:
        engine.stop()
    return {"model": label, "options": options, "device": jax.devices()[0].device_kind, "jax": jax.__version__,
            "compile_s": compile_s, **row}


def main(argv=None) -> int:
    """Each model of --models in its own process (one in --smoke); the report."""
    from ninfer_jax.benchmarks.prefix_cache import run_child

    args = parse_args(argv)
    if args.model:
        Path(args.result).write_text(json.dumps(run_model(args), default=str))
        return 0
    out = Path(args.out) if args.out else (Path(tempfile.mkdtemp(prefix="restore_smoke-")) if args.smoke
                                          else report.DOCS)
    command = report.command_line(["scripts/bench_prefix_cache_restore.py", *args.argv])
    models = ["35b-a3b"] if args.smoke else [m for m in args.models.split(",") if m]
    rows, t0 = [], time.perf_counter()
    for model in models:
        left = args.deadline - (time.perf_counter() - t0) if args.deadline else 0
        if args.deadline and left < FLOOR_S:
            rows.append({"model": model, "error": "no time left before --deadline"})
            continue
        print(f"=== restore {model}", flush=True)
        row = run_child(__spec__.name, [*args.argv, "--model", model], model, left or None)
        rows.append(row if "model" in row else {**row, "model": model})
    ran = [r for r in rows if "error" not in r]
    meta = {**report.run_meta(command, device=ran[0]["device"] if ran else ""), "jax": ran[0]["jax"] if ran else "",
            "kernels": "reference" if args.smoke else args.kernels, "reps": max(1, args.reps)}
    report.write_report(out, args.report_name, {**meta, "rows": rows}, restore_markdown(rows, meta))
    for row in rows:
        print(f"{row['model']}: " + (row["error"] if "error" in row else
              f"{row['restored_bytes'] / 1e9:.2f} GB restored in {row['restore_s']:.4f} s = {row['restore_gbs']:.1f} "
              f"GB/s (ceiling {row['ceiling_gbs']:.1f}); recompute {row['recompute_s']:.2f} s "
              f"({row['recompute_compiles']} compiles) = {_ratio(row['recompute_vs_restore'])} the restore; "
              f"TTFT cold {row['recompute_s']:.2f} s, resumed {row['resume_ttft_s']:.3f} s; compile "
              f"{row['compile_s']:.1f} s"))
    for target, measured, met in restore_targets(rows):
        print(f"{'met   ' if met else 'MISSED'} {target}: {measured}")
    print(f"report: {out / (args.report_name + '.md')} ({time.perf_counter() - t0:.0f} s)")
    return 1 if len(ran) < len(rows) else 0


def _ratio(x: float | None) -> str:
    """A time ratio for the report: "-" where the recompute compiled (no ratio)."""
    return "- (the recompute compiled)" if x is None else f"{x:.0f}x"


# --- the report (parent process, no jax) -------------------------------------------------------------------


def restore_targets(rows: list[dict]) -> list[tuple[str, str, bool]]:
    """(target, measured, met) per model that ran."""
    return [(f"{r['model']}: Host restore >= {RESTORE_TARGET:.0%} of the pinned device_put ceiling",
             f"{r['restore_gbs']:.1f} / {r['ceiling_gbs']:.1f} GB/s = {r['restore_vs_ceiling']:.0%}",
             r["restore_vs_ceiling"] >= RESTORE_TARGET) for r in rows if "error" not in r]


def restore_markdown(rows: list[dict], meta: dict) -> list[str]:
    """The report: header, targets, one row per model, every round."""
    ran = [r for r in rows if "error" not in r]
    lines = [
        "# Host tier restore of a long prefix against recomputing it", "",
        f"- command: `{meta['command']}`",
        f"- {report.run_line(meta)}",
        f"- engine: random weights, 1 lane, kernels {meta['kernels']}; per model: "
        + "; ".join(f"{r['model']} max_model_len {r['options']['max_model_len']}, kv_capacity "
                    f"{r['options']['kv_capacity']} tokens, host_cache_mib {r['options']['host_cache_mib']}, "
                    f"{'page-locked' if r['host_pinned'] else 'pageable'} Host slabs of "
                    f"{r['host_slab_bytes'] >> 10} KiB"
                    for r in ran),
        "- method: a prompt of random token ids, the prefix + 1 token, is prefilled cold (max_tokens 1: the "
        "recompute); its prompt-tail tap lands at the prefix's end. Every Device copy that has a Host copy is "
        "dropped (`Engine.demote_device_cache`); the prompt + its first output token + new ids (64 tokens past "
        "the prefix) then resumes from the tap, restoring the blocks and the state image from the Host. Restore "
        "time and bytes are the deltas of `host_restore_seconds` / `host_restored_bytes` (slab bytes; a restore "
        f"timed from its dispatch to its copies landing); best of {meta['reps']} rounds. The ceiling: `jax.device_put` "
        "of a contiguous view of a page-locked slab buffer in the same process, best of 3. The engine's warmup "
        "compiles every program first (compile s, apart); a warm-up on a short prefix then runs the restore path "
        "once. A recompute that compiled anything quotes no ratio.", "",
        "## Targets", "", "| target | measured | status |", "|---|---|---|",
        *[f"| {t} | {m} | {'met' if ok else '**missed**'} |" for t, m, ok in restore_targets(rows)],
        "", "## Per model", "",
        "| model | prefix tokens | restored GB | restore s | restore GB/s | pinned ceiling GB/s (in batches) | "
        f"restore / ceiling | recompute (cold prefill) s | recompute / restore (spec: ~{SPEC_RATIO}x) | "
        "resumed TTFT s | cold / resumed TTFT | compiles in the recompute | compile s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in ran:
        lines.append(f"| {r['model']} | {r['prefix_tokens']} | {r['restored_bytes'] / 1e9:.3f} | "
                     f"{r['restore_s']:.4f} | {r['restore_gbs']:.1f} | "
                     f"{r['ceiling_gbs']:.1f} ({r['batch_ceiling_gbs']:.1f}) | "
                     f"{r['restore_vs_ceiling']:.0%} | {r['recompute_s']:.2f} | {_ratio(r['recompute_vs_restore'])} | "
                     f"{r['resume_ttft_s']:.3f} | {_ratio(r['cold_vs_resume_ttft'])} | {r['recompute_compiles']} | "
                     f"{r.get('compile_s', 0):.1f} |")
    lines += [f"| {r['model']} | not measured: {r['error']} |" for r in rows if "error" in r]
    lines += ["", "## Rounds", "", "| model | round | cached tokens | source | restored blocks / images | "
              "GB | s | GB/s | TTFT s | compiles |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in ran:
        lines += [f"| {r['model']} | {i + 1} | {x['cached_tokens']} | {x['source']} | {x['restored_blocks']} / "
                  f"{x['restored_images']} | {x['restored_bytes'] / 1e9:.3f} | "
                  f"{x['restore_s']:.4f} | {x['restore_gbs']:.1f} | {x['ttft_s']:.3f} | {x['compiles']} |"
                  for i, x in enumerate(r["rounds"])]
    batches = sorted({r["batch_slabs"] for r in ran})
    lines += ["", "The ceiling's second figure moves the same bytes as back-to-back views of the restore's largest "
              f"batch ({'/'.join(map(str, batches))} slabs), the form a restore takes. The resumed TTFT includes the "
              "restore, the 64-token "
              "prefill and the admission; the spec's ~300x assumes INT8 KV on PCIe 5.0 x16 (KV here is bf16).", ""]
    return lines


if __name__ == "__main__":
    sys.exit(main())
