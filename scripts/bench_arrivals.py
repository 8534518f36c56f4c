"""Running requests' token latency while long prompts keep arriving (issue 31): mixed steps against passes and
rounds apart, on one engine, random weights at the real shapes.

`--lanes` requests decode greedily from `--context`-token prompts for the whole run. Then, for each phase of
`--phase-s` seconds:
  * "no arrivals": the lanes decode alone (the TPOT baseline);
  * "mixed M": `--arrival-tokens`-token prompts arrive back to back (the next when the last has its first token),
    and each of their passes of M tokens rides in the lanes' decode round (`--mixed-tokens`, each M in turn on the
    same engine; default: the engine's mixed_prefill_tokens);
  * "apart": the same arrivals with the scheduler's mixing off: a pass of the prefill chunk, then a round.
TPOT samples are the gaps between a running lane's consecutive tokens inside the phase; TTFT is each arrival's.
Target: TPOT p99 with arrivals <= 2x TPOT p50 without. An untimed warm phase first compiles every program the timed
phases use (the engine skips its warmup: the 35B-A3B's full warmup takes minutes).

    python scripts/bench_arrivals.py --model 35b-a3b --out docs/benchmarks     # one H200; arrivals.{json,md}
    python scripts/bench_arrivals.py --model 35b-a3b --mixed-tokens 256,512 --no-apart ...   # other pass lengths
    python scripts/bench_arrivals.py --smoke                                   # tiny MoE on CPU, a temp folder
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import threading
import time

import numpy as np

from ninfer_jax import SamplingParams
from ninfer_jax.benchmarks import report
from ninfer_jax.benchmarks.models import model_config, random_engine, tiny_engine
from ninfer_jax.frontend.prepared_prompt import prepare_tokens


class Lanes:
    """The running requests: each token event's time, per lane."""

    def __init__(self, engine, prompts, max_tokens: int):
        self.times = [[] for _ in prompts]
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.ids = [engine.submit(p, sampling, sink=self._sink(i)) for i, p in enumerate(prompts)]

    def _sink(self, i):
        def sink(event):
            self.times[i].extend([time.perf_counter()] * max(1, len(event.token_ids)))
        return sink

    def decoding(self, tokens: int = 1) -> int:
        """Lanes with at least `tokens` tokens."""
        return sum(len(t) >= tokens for t in self.times)

    def gaps(self, start: float, end: float) -> np.ndarray:
        """Seconds between consecutive tokens of a lane, both inside [start, end], over every lane."""
        out = []
        for times in self.times:
            t = np.asarray(times)
            t = t[(t >= start) & (t <= end)]
            out.append(np.diff(t))
        return np.concatenate(out) if out else np.zeros(0)


class StepLog:
    """Each step the scheduler dispatches on the runner (its time, kind and, for a pass, its first position) and each
    garbage collection of the Python process, so a phase's slowest steps can be told apart."""

    def __init__(self, engine):
        self.steps: list[tuple[float, str, int]] = []
        self.collections: list[tuple[float, float, int]] = []  # (start, seconds, generation)
        self._gc_start = 0.0
        self.host: list[tuple[float, float, dict]] = []  # each scheduler step: start, seconds, its phases' seconds
        runner = engine.runner
        for kind in ("decode", "mixed", "prefill"):
            setattr(runner, kind, self._logged(getattr(runner, kind), kind))
        gc.callbacks.append(self._on_gc)
        scheduler = engine.scheduler
        step = scheduler.step

        def timed_step():  # the engine's thread calls scheduler.step() each loop: this instance attribute
            before, t = dict(scheduler.counters), time.perf_counter()
            ran = step()
            phases = {k[8:]: v - before.get(k, 0.0) for k, v in scheduler.counters.items() if k.startswith("seconds_")}
            self.host.append((t, time.perf_counter() - t, {k: v for k, v in phases.items() if v > 5e-4}))
            return ran

        scheduler.step = timed_step

    def _logged(self, fn, kind: str):
        def step(*args, **kwargs):
            chunk = args[0] if kind == "mixed" else kwargs
            self.steps.append((time.perf_counter(), kind, int(chunk.get("base", -1))))
            return fn(*args, **kwargs)
        return step

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            self.collections.append((self._gc_start, time.perf_counter() - self._gc_start, info["generation"]))

    def summary(self, start: float, end: float, top: int = 6) -> dict:
        """Per step kind, the seconds from its dispatch to the next step's (the device's pace once it is the
        bound); the `top` longest with the step before them; the collections inside [start, end]."""
        steps = [s for s in self.steps if start <= s[0] <= end]
        gaps = [(b[0] - a[0], a, prev) for prev, a, b in zip([None] + steps, steps, steps[1:])]
        kinds = {}
        for gap, (_, kind, _), _ in gaps:
            kinds.setdefault(kind, []).append(gap * 1e3)
        by_kind = {k: {"steps": len(v), "p50_ms": float(np.percentile(v, 50)), "p99_ms": float(np.percentile(v, 99)),
                       "max_ms": float(max(v))} for k, v in kinds.items()}
        gcs = [c for c in self.collections if start <= c[0] <= end]
        slowest = []
        for gap, (t, kind, base), prev in sorted(gaps, key=lambda g: -g[0])[:top]:
            collected = sum(s for c0, s, _ in gcs if t <= c0 <= t + gap)
            host = [f"{(h0 - t) * 1e3:+.1f}: {d * 1e3:.1f} ms ("
                    + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in ph.items()) + ")"
                    for h0, d, ph in self.host if t - 0.06 <= h0 <= t + gap]
            slowest.append({"ms": gap * 1e3, "kind": kind, "base": base, "before": prev[1] if prev else None,
                            "gc_ms_inside": collected * 1e3, "host_steps": host})
        return {"by_kind": by_kind, "slowest": slowest, "collections": len(gcs),
                "gc_ms": sum(c[1] for c in gcs) * 1e3, "gc_max_ms": max((c[1] for c in gcs), default=0.0) * 1e3}


def prompts(rng, vocab: int, tokens: int) -> list:
    """Arrival prompts drawn and prepared (block hashes) before a phase's clock starts, taken in turn (the engine
    caches nothing, so a repeat computes again): the arrivals' thread then holds the GIL as little as a server's
    request thread with its prompt ready."""
    return [prepare_tokens(rng.integers(0, vocab, tokens)) for _ in range(8)]


def arrivals(engine, ready: list, until: float) -> list[float]:
    """The `ready` prompts in turn, one after another until `until` (at least one): each arrives when the last has
    its first token. Returns their TTFTs."""
    ttfts = []
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    while not ttfts or time.perf_counter() < until:
        out = engine.generate(ready[len(ttfts) % len(ready)], one)
        ttfts.append(out.metrics.ttft_s)
    return ttfts


def phase(engine, lanes: Lanes, name: str, seconds: float, rng, vocab: int, tokens: int, mix: bool | None,
          log: StepLog) -> dict:
    """One timed phase; mix None: no arrivals."""
    if mix is not None:
        engine.scheduler.mix = mix
    before = dict(engine.stats()["scheduler"])
    ready = prompts(rng, vocab, tokens)
    start = time.perf_counter()
    if mix is None:
        time.sleep(seconds)
        ttfts = []
    else:
        ttfts = arrivals(engine, ready, start + seconds)
    end = time.perf_counter()
    after = engine.stats()["scheduler"]
    gaps = lanes.gaps(start, end) * 1e3
    row = {"phase": name, "seconds": end - start, "tpot_samples": int(gaps.size),
           "tpot_p50_ms": float(np.percentile(gaps, 50)) if gaps.size else None,
           "tpot_p99_ms": float(np.percentile(gaps, 99)) if gaps.size else None,
           "tpot_max_ms": float(gaps.max()) if gaps.size else None,
           "decode_tok_s": gaps.size / (end - start), "arrivals": len(ttfts),
           "ttft_p50_s": float(np.percentile(ttfts, 50)) if ttfts else None,
           "ttft_p99_s": float(np.percentile(ttfts, 99)) if ttfts else None,
           "arrival_prefill_tok_s": len(ttfts) * tokens / (end - start),
           "mixed_steps": after.get("mixed_steps", 0) - before.get("mixed_steps", 0),
           "prefill_chunks": after.get("prefill_chunks", 0) - before.get("prefill_chunks", 0),
           "steps": log.summary(start, end)}
    print(f"{name}: TPOT p50 {report.fmt(row['tpot_p50_ms'])} ms, p99 {report.fmt(row['tpot_p99_ms'])} ms, max "
          f"{report.fmt(row['tpot_max_ms'])} ms over {gaps.size} tokens ({row['decode_tok_s']:.0f} tok/s); "
          f"{len(ttfts)} arrivals" + (f", TTFT p50 {row['ttft_p50_s']:.3f} s p99 {row['ttft_p99_s']:.3f} s"
                                      if ttfts else "") + f"; {row['mixed_steps']} mixed steps", flush=True)
    steps = row["steps"]
    print(f"{name}: steps " + ", ".join(f"{k} x{v['steps']} p50 {v['p50_ms']:.1f} p99 {v['p99_ms']:.1f} max "
                                       f"{v['max_ms']:.1f} ms" for k, v in steps["by_kind"].items())
          + f"; {steps['collections']} collections, {steps['gc_ms']:.1f} ms (max {steps['gc_max_ms']:.1f}); slowest: "
          + ", ".join(f"{s['ms']:.1f} ms {s['kind']}@{s['base']} after {s['before']} (gc {s['gc_ms_inside']:.1f})"
                      for s in steps["slowest"]), flush=True)
    for s in steps["slowest"][:2]:
        print(f"{name}: the host's steps around the {s['ms']:.1f} ms {s['kind']}@{s['base']} (start from its dispatch, "
              "seconds by phase): " + "; ".join(s["host_steps"]), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="35b-a3b", help="27b or 35b-a3b (random bf16 weights)")
    ap.add_argument("--lanes", type=int, default=64)
    ap.add_argument("--context", type=int, default=1024, help="each running lane's prompt tokens")
    ap.add_argument("--arrival-tokens", type=int, default=8192)
    ap.add_argument("--phase-s", type=float, default=20.0)
    ap.add_argument("--mixed-tokens", default=None,
                    help="comma-separated pass lengths of the mixed phases (default: the engine's auto)")
    ap.add_argument("--no-apart", action="store_true", help="skip the phase with passes and rounds apart")
    ap.add_argument("--prefill-attention", default=None, help="the engine's prefill_attention (default: auto)")
    ap.add_argument("--smoke", action="store_true", help="the tiny MoE on CPU, small sizes, a temporary folder")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.smoke:
        args.lanes, args.context, args.arrival_tokens, args.phase_s = 2, 64, 256, 3.0
    variants = [int(v) for v in args.mixed_tokens.split(",")] if args.mixed_tokens else []
    mixed = {"mixed_prefill_tokens": variants[0]} if variants else {}
    if args.prefill_attention:
        mixed["prefill_attention"] = args.prefill_attention
    tokens_per_lane = 8192  # the lanes' budget: they decode through every phase
    limits = dict(max_concurrency=args.lanes + 2, max_model_len=args.context + tokens_per_lane + 64,
                  kv_capacity=args.lanes * (args.context + tokens_per_lane) + 4 * args.arrival_tokens + 4096,
                  no_prefix_reuse=True)
    t = time.perf_counter()
    if args.smoke:
        engine = tiny_engine(**limits, prefill_chunk=128, mixed_prefill_tokens=64)
        vocab, name = 1000, "tiny"
    else:
        engine, _ = random_engine(args.model, **limits, **mixed)
        vocab, name = model_config(args.model).vocab_size, args.model
    print(f"engine ready in {time.perf_counter() - t:.1f} s: {engine.options.summary()}", flush=True)
    rng = np.random.default_rng(0)
    t = time.perf_counter()
    engine.scheduler.mix = False  # the lanes' prompts fill without mixed programs at every round size on the way
    lanes = Lanes(engine, [rng.integers(0, vocab, args.context).tolist() for _ in range(args.lanes)], tokens_per_lane)
    while lanes.decoding(3) < args.lanes:  # rounds at full width ran (their program compiled)
        time.sleep(0.05)
    print(f"{args.lanes} lanes decoding after {time.perf_counter() - t:.1f} s", flush=True)
    variants = variants or [engine.options.mixed_prefill_tokens]
    runs = [(m, True) for m in variants] + ([] if args.no_apart else [(variants[0], False)])
    log = StepLog(engine)
    rows, compiled = [phase(engine, lanes, "no arrivals", args.phase_s, rng, vocab, args.arrival_tokens, None, log)], 0
    for m, mix in runs:
        # The runner's pass length swapped on the running engine (as bench_engine swaps its kernels): its mixed
        # program for this width compiles in the untimed arrival first
        engine.runner.mixed_tokens = m
        engine.scheduler.mix = mix
        t, compiles = time.perf_counter(), engine.stats()["compiles_since_warmup"]
        arrivals(engine, prompts(rng, vocab, args.arrival_tokens)[:1], time.perf_counter())
        print(f"warm arrival ({'mixed ' + str(m) if mix else 'apart'}) {time.perf_counter() - t:.1f} s, "
              f"{engine.stats()['compiles_since_warmup'] - compiles} programs compiled", flush=True)
        compiles = engine.stats()["compiles_since_warmup"]
        rows.append(phase(engine, lanes, f"mixed {m}" if mix else "apart", args.phase_s, rng, vocab,
                          args.arrival_tokens, mix, log))
        compiled += engine.stats()["compiles_since_warmup"] - compiles
    for lane_id in lanes.ids:
        engine.cancel(lane_id)
    threading.Event().wait(1.0)
    engine.stop()
    base = rows[0]["tpot_p50_ms"]
    for row in rows:
        row["tpot_p99_over_base_p50"] = row["tpot_p99_ms"] / base if base else None
    o = engine.options
    meta = report.run_meta(model=name, lanes=args.lanes, context=args.context, arrival_tokens=args.arrival_tokens,
                           mixed_tokens=variants, prefill_chunk=o.prefill_chunk,
                           idle_prefill_chunk=o.idle_prefill_chunk, compiled_in_timed_phases=compiled)
    f = report.fmt
    page = report.header(
        "Token latency of running requests while long prompts arrive", meta,
        f"model: {name}, random bf16 weights; {args.lanes} lanes decoding greedily from {args.context}-token prompts; "
        f"{args.arrival_tokens}-token prompts arriving back to back (max_tokens 1) in the arrival phases, "
        f"{args.phase_s:g} s per phase",
        "mixed M: passes of M tokens in the round's step; apart: passes of the prefill chunk "
        f"({o.prefill_chunk}) and rounds as separate steps; programs compiled during the timed phases: {compiled}",
        "target (issue 31): TPOT p99 with arrivals <= 2x TPOT p50 without")
    page += report.table(
        ["phase", "TPOT p50 ms", "TPOT p99 ms", "TPOT max ms", "p99 / p50 no arrivals", "decode tok/s", "arrivals",
         "TTFT p50 s", "TTFT p99 s", "arrival prefill tok/s", "mixed steps"],
        [[r["phase"], f(r["tpot_p50_ms"]), f(r["tpot_p99_ms"]), f(r["tpot_max_ms"]),
          f"{r['tpot_p99_over_base_p50']:.2f}x" if r["tpot_p99_over_base_p50"] else "-", f(r["decode_tok_s"]),
          r["arrivals"], f(r["ttft_p50_s"]), f(r["ttft_p99_s"]), f(r["arrival_prefill_tok_s"]), r["mixed_steps"]]
         for r in rows])
    page += ["", "Steps by kind (milliseconds from a step's dispatch to the next one's) and the garbage collections in "
             "each phase; the slowest steps with the kind of the step before them and the collection time inside them:",
             ""]
    page += report.table(
        ["phase", "kind", "steps", "p50 ms", "p99 ms", "max ms"],
        [[r["phase"], k, v["steps"], f(v["p50_ms"]), f(v["p99_ms"]), f(v["max_ms"])]
         for r in rows for k, v in r["steps"]["by_kind"].items()])
    page += [""] + report.table(
        ["phase", "collections", "gc ms", "slowest steps: ms kind@position (after kind, gc ms inside)"],
        [[r["phase"], r["steps"]["collections"], f(r["steps"]["gc_ms"]),
          "; ".join(f"{x['ms']:.1f} {x['kind']}@{x['base']} (after {x['before']}, gc {x['gc_ms_inside']:.1f})"
                    for x in r["steps"]["slowest"])] for r in rows])
    out = args.out or tempfile.mkdtemp(prefix="bench_arrivals_")
    print(report.write_report(out, "arrivals", {**meta, "rows": rows}, page), flush=True)


if __name__ == "__main__":
    main()
