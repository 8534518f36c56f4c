"""Where a decode round's time goes at the real shapes (random bf16 or block-FP8 weights): host loop vs device, per
kernel.

Default mode, on one idle engine per model: the runner's decode round at 1 and all lanes, synchronous (each
round's tokens read back before the next is dispatched) and back to back (device time plus launch); the host
time to dispatch one round, beside the jitted step's alone by how its per-round inputs arrive; then a jax profiler
trace of back-to-back rounds at --trace-lanes (one by default), its device kernels summed by name per round, so the
slowest kernels are named with their share, and the same rounds' host events (XLA's and the runtime's) by name.
`--engine`: the scheduler's steps under cProfile while the engine decodes one lane, on the wall clock and on the
thread's CPU clock.

    python scripts/profile_decode.py --models 27b,35b-a3b --out docs/benchmarks
    python scripts/profile_decode.py --models 35b-a3b --engine --out /tmp/decode
    python scripts/profile_decode.py --models 27b --weights fp8 --out docs/benchmarks/fp8   # an FP8 pack's round
    python scripts/profile_decode.py --models 35b-a3b --weights fp8-dynamic --lanes 64 --trace-lanes 64 --out /tmp/w
    python scripts/profile_decode.py --models 35b-a3b --kv-dtype bfloat16,int8,nvfp4 --position 30720 \
        --max-model-len 32768 --out /tmp/kv   # each KV profile's round at a long context
    python scripts/profile_decode.py --smoke          # the tiny shape on CPU, a temporary folder
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from ninfer_jax.benchmarks import report
from ninfer_jax.benchmarks.models import MODELS, WEIGHTS
from ninfer_jax.benchmarks.profiling import (ROUND_DISPATCH, dispatch_by_input, host_event_table, kernel_table,
                                             round_engine, time_rounds)


def worker_profile(engine, name: str, tokens: int, clock, top: int) -> dict:
    """Decode one lane through the engine with the scheduler's steps under cProfile on `clock`; tok/s and the
    functions with the most time of their own."""
    import io
    import pstats

    from ninfer_jax import SamplingParams
    from ninfer_jax.benchmarks.profiling import profiled_scheduler

    with profiled_scheduler(clock) as prof:
        out = engine.generate(list(range(100, 1124)), SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    rate = (tokens - 1) / (out.metrics.latency_s - out.metrics.ttft_s)
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    print(f"[{name}] engine decode 1 lane, profiled on {clock.__name__}: {rate:.1f} tok/s\n{text.getvalue()}",
          flush=True)
    return {"tok_s": rate, "profile": text.getvalue()}


def engine_profile(engine, name: str, args) -> dict:
    """--engine: one-lane decode tok/s plain, under cProfile (wall and CPU clocks) and with a short GIL switch
    interval."""
    from ninfer_jax import SamplingParams

    tokens = args.tokens + 1
    sampling = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    result = {}
    out = engine.generate(list(range(100, 1124)), sampling)
    result["engine_1lane_tok_s"] = args.tokens / (out.metrics.latency_s - out.metrics.ttft_s)
    print(f"[{name}] engine decode 1 lane: {result['engine_1lane_tok_s']:.1f} tok/s", flush=True)
    result["wall"] = worker_profile(engine, name, tokens, time.perf_counter, args.top)
    result["cpu"] = worker_profile(engine, name, tokens, time.thread_time, args.top)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.0002)
    try:
        out = engine.generate(list(range(100, 1124)), sampling)
    finally:
        sys.setswitchinterval(interval)
    result["engine_1lane_switch_0.2ms_tok_s"] = args.tokens / (out.metrics.latency_s - out.metrics.ttft_s)
    print(f"[{name}] engine decode 1 lane, GIL switch interval 0.2 ms: "
          f"{result['engine_1lane_switch_0.2ms_tok_s']:.1f} tok/s", flush=True)
    return result


def round_profile(engine, name: str, args) -> dict:
    """The runner's decode round timed, and its kernels and host events at --trace-lanes mapped."""
    import jax

    from ninfer_jax.benchmarks.profiling import decode_inputs

    result = {}
    for lanes in (1, engine.runner.max_lanes):
        for sync in (True, False):
            s = time_rounds(engine, lanes, args.rounds, sync, args.position)
            result[f"{lanes}lane_{'sync' if sync else 'async'}_ms"] = s * 1e3
            print(f"[{name}] decode {lanes} lanes, {'synchronous' if sync else 'back to back'}: "
                  f"{s * 1e3:.3f} ms/round", flush=True)
        result[f"{lanes}lane_dispatch_by_input"] = by_input = dispatch_by_input(engine, lanes, position=args.position)
        result[f"{lanes}lane_dispatch_ms"] = by_input[ROUND_DISPATCH]
        for label, ms in by_input.items():
            print(f"[{name}] decode {lanes} lanes, {label}: {ms:.3f} ms to dispatch", flush=True)
    trace_dir = Path(args.trace_dir) / name
    inputs = decode_inputs(engine, args.trace_lanes, args.position)
    jax.block_until_ready(engine.runner.decode(*inputs))
    with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
        for _ in range(args.trace_rounds):
            out = engine.runner.decode(*inputs)
        jax.block_until_ready(out)
    result["trace_lanes"] = args.trace_lanes
    result["kernels"] = kernel_table(trace_dir, args.trace_rounds, args.top)
    for r in result["kernels"]:
        print(f"[{name}] {r['us_per_round']:9.1f} us {r['launches_per_round']:6.1f}x  {r['kernel']}", flush=True)
    result["host"] = host_event_table(trace_dir, args.trace_rounds, args.host_top)
    for r in result["host"]:
        print(f"[{name}] host {r['us_per_round']:9.1f} us {r['per_round']:6.1f}x  {r['event']}", flush=True)
    return result


def profile(name: str, kv_dtype: str, args) -> dict:
    engine = round_engine(name, args.lanes, position=args.position, max_model_len=args.max_model_len,
                          kernels=args.kernels, weights=args.weights, prefill_chunk=2048, kv_dtype=kv_dtype)
    try:
        mode = engine_profile if args.engine else round_profile
        return {"model": name, "weights": args.weights, "kv_dtype": kv_dtype, "position": args.position,
                "max_model_len": args.max_model_len, **mode(engine, f"{name}-{kv_dtype}", args)}
    finally:
        engine.stop()


def write_report(rows: list[dict], args, out: Path) -> None:
    meta = report.run_meta()
    lines = report.header("Decode profile", meta, f"random {args.weights} weights, kernels {args.kernels}, "
                          f"{args.lanes} lanes, max_model_len {args.max_model_len}, rounds at position {args.position}")
    for r in rows:
        if "kernels" in r:
            lanes = args.lanes
            lines += [f"## {r['model']}, KV {r['kv_dtype']}", "", *report.table(
                ["lanes", "synchronous ms/round", "back to back ms/round", "dispatch ms"],
                [[n, *(f"{r[f'{n}lane_{k}_ms']:.3f}" for k in ("sync", "async", "dispatch"))] for n in (1, lanes)]),
                "", "Ms to dispatch, the rows taking turns: the runner's whole round, then the jitted step alone by "
                "how its per-round inputs arrive:", "",
                *report.table(["inputs", *(f"{n} lanes" for n in (1, lanes))],
                              [[label, *(f"{r[f'{n}lane_dispatch_by_input'][label]:.3f}" for n in (1, lanes))]
                               for label in r["1lane_dispatch_by_input"]]),
                "", f"{r['trace_lanes']}-lane round, device kernels per round (top {args.top}):", "",
                *report.table(["us per round", "launches per round", "kernel"],
                              [[f"{k['us_per_round']:.1f}", f"{k['launches_per_round']:.1f}", f"`{k['kernel']}`"]
                               for k in r["kernels"]]), "",
                f"The same rounds' host events per round (top {args.host_top}; XLA's and the runtime's, nested ones "
                "each counting their own span):", "",
                *report.table(["us per round", "per round", "event"],
                              [[f"{k['us_per_round']:.1f}", f"{k['per_round']:.1f}", f"`{k['event']}`"]
                               for k in r["host"]]), ""]
        else:
            lines += [f"## {r['model']}, the engine's scheduler under cProfile", "",
                      f"- one lane: {r['engine_1lane_tok_s']:.1f} tok/s; profiled on the wall clock "
                      f"{r['wall']['tok_s']:.1f}, on the CPU clock {r['cpu']['tok_s']:.1f}; GIL switch interval 0.2 ms "
                      f"{r['engine_1lane_switch_0.2ms_tok_s']:.1f}", "", "```", r["wall"]["profile"].strip(), "```", ""]
    report.write_report(out, "decode_profile", {**meta, "rows": rows}, lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="27b,35b-a3b", help=f"of {', '.join(MODELS)}")
    p.add_argument("--kernels", default="pallas")
    p.add_argument("--weights", default="bf16", choices=WEIGHTS,
                   help="fp8: block-FP8 as Qwen's FP8 packs; fp8-dynamic: with fp8_activations 'dynamic'")
    p.add_argument("--lanes", type=int, default=8, help="the engine's max_concurrency: the all-lanes round")
    p.add_argument("--max-model-len", type=int, default=8192,
                   help="the engine's; it sets the page tables' width, so paged decode attention's splits")
    p.add_argument("--kv-dtype", default="auto", help="KV profiles, comma-separated: one engine each")
    p.add_argument("--position", type=int, default=1024, help="every lane's context in the timed rounds")
    p.add_argument("--rounds", type=int, default=32)
    p.add_argument("--trace-rounds", type=int, default=8)
    p.add_argument("--trace-lanes", type=int, default=1, help="the traced round's lanes (at most --lanes)")
    p.add_argument("--tokens", type=int, default=128, help="--engine: decode tokens per request")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--host-top", type=int, default=20, help="rows of the one-lane round's host events")
    p.add_argument("--trace-dir", default=str(Path(tempfile.gettempdir()) / "ninfer_decode_trace"))
    p.add_argument("--engine", action="store_true", help="profile the engine's scheduler while it decodes instead")
    p.add_argument("--smoke", action="store_true", help="the tiny shape on CPU, few rounds")
    p.add_argument("--out", help="report folder (default docs/benchmarks; with --smoke a new temp folder)")
    args = p.parse_args()
    if args.smoke:
        args.models, args.kernels, args.lanes, args.max_model_len = "tiny-dense", "reference", 2, 2048
        args.rounds, args.trace_rounds, args.tokens, args.top = 2, 2, 8, 10
    if not 1 <= args.trace_lanes <= args.lanes:
        p.error(f"--trace-lanes {args.trace_lanes} is not within 1..--lanes ({args.lanes})")
    out = Path(args.out or (tempfile.mkdtemp(prefix="decode_smoke-") if args.smoke else report.DOCS))
    rows = [profile(m, kv, args) for m in args.models.split(",") for kv in args.kv_dtype.split(",")]
    write_report(rows, args, out)
    print(f"report: {out / 'decode_profile.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
