"""Where a mixed step's time goes (issue 31): a decode round of `--lanes` lanes, a prefill pass of M tokens, and
the two as one mixed step (`runner.mixed`), timed back to back on the runner of one engine (random bf16 weights,
real shapes), then each traced with the jax profiler and the mixed step's kernels set against the round's and the
pass's by name; the copies XLA put in the compiled mixed and round programs are listed by bytes.

    python scripts/profile_mixed.py --model 35b-a3b --out docs/benchmarks     # one H200; mixed_profile.{json,md}
    python scripts/profile_mixed.py --smoke                                   # tiny MoE on CPU, a temp folder
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from ninfer_jax.benchmarks import report
from ninfer_jax.benchmarks.models import random_engine, tiny_engine
from ninfer_jax.benchmarks.profiling import (compiled_copies, decode_inputs, mixed_inputs, perfetto_trace,
                                             summarize_device_trace, trace_difference)


def step_calls(engine, lanes: int, context: int, tokens: int, base: int):
    """(round, pass, mixed) callables on the engine's runner: `lanes` lanes at position `context`, a pass of
    `tokens` tokens at position `base` of lane `lanes` (pages after the round's), and both in one step."""
    from ninfer_jax.model.state import PAGE
    from ninfer_jax.runtime.sampling import SamplerInputs

    runner = engine.runner
    ids, positions, tables, slots, active, sampler = decode_inputs(engine, lanes, context)  # distinct tokens
    first = int(tables[:lanes].max()) + 1 if lanes else 0
    table = np.zeros(runner.max_pages, np.int32)
    need = -(-(base + tokens) // PAGE)
    table[:need] = np.arange(first, first + need)
    chunk = dict(tokens=(np.arange(tokens) % 1000 + 5).astype(np.int32), base=base, page_table=table, slot=lanes,
                 sampler=SamplerInputs.empty(1).arrays())
    round_ = dict(tokens=ids, positions=positions, page_tables=tables, slots=slots, active=active, sampler=sampler)
    return (lambda: runner.decode(**round_), lambda: runner.prefill(**chunk), lambda: runner.mixed(chunk, round_))


def back_to_back_ms(fn, calls: int) -> float:
    """Milliseconds per call of `fn` dispatched `calls` times in a row, then waited for (after one untimed call)."""
    import jax

    jax.block_until_ready(fn())
    start = time.perf_counter()
    for _ in range(calls):
        out = fn()
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / calls * 1e3


def traced(fn, calls: int, folder: Path) -> dict:
    """Every device event of `calls` back-to-back calls of `fn`, summed by name (per call)."""
    import jax

    jax.block_until_ready(fn())
    with jax.profiler.trace(str(folder), create_perfetto_trace=True):
        for _ in range(calls):
            out = fn()
        jax.block_until_ready(out)
    s = summarize_device_trace(perfetto_trace(folder), top=None)
    return {"busy_us": s["busy_us"] / calls, "events": s["events"] / calls,
            "top": [{**t, "us": t["us"] / calls, "count": t["count"] / calls} for t in s["top"]]}


def profile(engine, args, m: int, trace_root: Path) -> dict:
    engine.runner.mixed_tokens = m
    rnd, pas, mix = step_calls(engine, args.lanes, args.context, m, args.base)
    row = {"mixed_tokens": m, "lanes": args.lanes}
    for name, fn in (("round", rnd), ("pass", pas), ("mixed", mix)):
        row[f"{name}_ms"] = back_to_back_ms(fn, args.calls)
    row["mixed_over_round_plus_pass"] = row["mixed_ms"] / (row["round_ms"] + row["pass_ms"])
    row["mixed_minus_round_ms"] = row["mixed_ms"] - row["round_ms"]
    print(f"[{m}] round {row['round_ms']:.2f} ms, pass {row['pass_ms']:.2f} ms, mixed {row['mixed_ms']:.2f} ms "
          f"(round + {row['mixed_minus_round_ms']:.2f}; {row['mixed_over_round_plus_pass']:.2f}x round + pass)",
          flush=True)
    if args.no_trace:
        return row
    t = {name: traced(fn, args.trace_calls, trace_root / f"{m}-{name}")
         for name, fn in (("round", rnd), ("pass", pas), ("mixed", mix))}
    apart = {"top": [], "busy_us": t["round"]["busy_us"] + t["pass"]["busy_us"]}
    merged = {}
    for part in ("round", "pass"):
        for e in t[part]["top"]:
            cur = merged.setdefault(e["name"], {"name": e["name"], "us": 0.0, "count": 0.0})
            cur["us"] += e["us"]
            cur["count"] += e["count"]
    apart["top"] = list(merged.values())
    for name in t:
        row[f"{name}_device_ms"] = t[name]["busy_us"] / 1e3
        row[f"{name}_kernels"] = t[name]["events"]
    row["mixed_vs_round"] = trace_difference(t["mixed"], t["round"])[:args.top]
    row["mixed_vs_apart"] = trace_difference(t["mixed"], apart)[:args.top]
    row["mixed_top"] = sorted(t["mixed"]["top"], key=lambda e: -e["us"])[:args.top]
    print(f"[{m}] device ms per call: round {row['round_device_ms']:.2f} ({row['round_kernels']:.0f} kernels), pass "
          f"{row['pass_device_ms']:.2f} ({row['pass_kernels']:.0f}), mixed {row['mixed_device_ms']:.2f} "
          f"({row['mixed_kernels']:.0f})", flush=True)
    for title, key in (("mixed minus round", "mixed_vs_round"), ("mixed minus round and pass", "mixed_vs_apart")):
        print(f"[{m}] {title}, per call:", flush=True)
        for e in row[key]:
            print(f"   {e['us']:9.1f} us {e['count']:+7.1f}x  {e['name'][:110]}", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="35b-a3b", help="27b or 35b-a3b (random bf16 weights)")
    ap.add_argument("--lanes", type=int, default=64, help="lanes in the decode round")
    ap.add_argument("--context", type=int, default=1024, help="the lanes' position")
    ap.add_argument("--base", type=int, default=4096, help="the pass's first position (a later chunk of a prompt)")
    ap.add_argument("--mixed-tokens", default="256,1024", help="comma-separated pass lengths")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--trace-calls", type=int, default=4)
    ap.add_argument("--top", type=int, default=16)
    ap.add_argument("--no-trace", action="store_true")
    ap.add_argument("--no-hlo", action="store_true", help="skip listing the compiled programs' copies")
    ap.add_argument("--smoke", action="store_true", help="the tiny MoE on CPU, small sizes, a temporary folder")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    sizes = [int(v) for v in args.mixed_tokens.split(",")]
    if args.smoke:
        args.lanes, args.context, args.base, args.calls, args.trace_calls, sizes = 2, 64, 128, 2, 1, [64]
    limits = dict(max_concurrency=args.lanes + 1, max_model_len=max(args.context, args.base + max(sizes)) + 128,
                  kv_capacity=(args.lanes + 1) * (args.context + 128) + args.base + max(sizes) + 4096,
                  no_prefix_reuse=True, mixed_prefill_tokens=sizes[0])
    start = time.perf_counter()
    if args.smoke:
        engine, name = tiny_engine(**limits, prefill_chunk=128), "tiny"
    else:
        engine, _ = random_engine(args.model, **limits)
        name = args.model
    print(f"engine ready in {time.perf_counter() - start:.1f} s: {engine.options.summary()}", flush=True)
    trace_root = Path(tempfile.mkdtemp(prefix="profile_mixed_"))
    try:
        rows = [profile(engine, args, m, trace_root) for m in sizes]
        copies = {}
        if not args.no_hlo:
            engine.runner.mixed_tokens = sizes[0]
            packed, r_packed, prev = mixed_inputs(engine, args.lanes, args.context, sizes[0], args.base)
            copies = {"decode": compiled_copies(engine, "decode", r_packed, prev),
                      "mixed": compiled_copies(engine, "mixed", packed, r_packed, prev)}
            for k, v in copies.items():
                print(f"compiled {k} program: {v['copies']} copies, {v['bytes'] / 2**20:.1f} MiB; largest "
                      f"{', '.join(v['largest'][:4])}", flush=True)
    finally:
        engine.stop()
    meta = report.run_meta(model=name, lanes=args.lanes, context=args.context, base=args.base, mixed_tokens=sizes)
    f = report.fmt
    page = report.header(
        "Where a mixed step's time goes", meta,
        f"model: {name}, random bf16 weights; a decode round of {args.lanes} lanes at position {args.context}, a "
        f"pass of M tokens from position {args.base}, and both as one mixed step, on the runner, back to back "
        f"({args.calls} calls after one); device time from a jax profiler trace of {args.trace_calls} calls")
    page += report.table(
        ["M", "round ms", "pass ms", "mixed ms", "mixed - round ms", "mixed / (round + pass)", "device ms: round",
         "pass", "mixed", "kernels: round", "pass", "mixed"],
        [[r["mixed_tokens"], f(r["round_ms"]), f(r["pass_ms"]), f(r["mixed_ms"]), f(r["mixed_minus_round_ms"]),
          f"{r['mixed_over_round_plus_pass']:.2f}x", f(r.get("round_device_ms")), f(r.get("pass_device_ms")),
          f(r.get("mixed_device_ms")), f(r.get("round_kernels")), f(r.get("pass_kernels")),
          f(r.get("mixed_kernels"))] for r in rows])
    for r in rows:
        if "mixed_vs_apart" in r:
            page += ["", f"M = {r['mixed_tokens']}: device time of the mixed step minus the round's and the pass's, by "
                     "kernel name (the largest differences):", ""]
            page += report.table(["us per call", "kernels per call", "kernel"],
                                 [[f"{e['us']:.1f}", f"{e['count']:+.1f}", f"`{e['name'][:100]}`"]
                                  for e in r["mixed_vs_apart"]])
    if copies:
        page += ["", "Copies in the compiled programs (M = %d):" % sizes[0], ""]
        page += report.table(["program", "copies", "MiB", "largest"],
                             [[k, v["copies"], f"{v['bytes'] / 2**20:.1f}", "; ".join(v["largest"][:4])]
                              for k, v in copies.items()])
    out = args.out or tempfile.mkdtemp(prefix="profile_mixed_")
    print(report.write_report(out, "mixed_profile", {**meta, "rows": rows, "copies": copies}, page), flush=True)


if __name__ == "__main__":
    main()
