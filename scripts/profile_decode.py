"""Where a decode round's time goes at the real shapes (random bf16 weights): host loop vs device, per kernel.

For each model shape it times the engine's jitted decode step three ways on one idle engine:
  * synchronous, as the worker runs it (each round's tokens read back before the next is dispatched),
  * dispatched back to back (device time plus launch, no host round trip),
and at 1 and at all lanes; then records a jax profiler trace of back-to-back rounds and sums the device
kernels by name (the perfetto trace jax writes), so the slowest kernels per round are named with their share.

    python scripts/profile_decode.py --models 27b,35b-a3b --out $OUT
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
MODELS = {"27b": "qwen3.5-27b", "35b-a3b": "qwen3.5-35b-a3b", "tiny": "tiny-dense"}


def _decode_inputs(engine, lanes: int, position: int):
    import numpy as np

    from ninfer_jax.model.state import PAGE
    from ninfer_jax.runtime.sampling import SamplerInputs

    runner = engine.runner
    c = runner.max_lanes
    tables = np.zeros((c, runner.max_pages), np.int32)
    per_lane = -(-(position + 1) // PAGE)
    for lane in range(lanes):  # the engine is idle: any pages will do, disjoint per lane
        tables[lane, :per_lane] = np.arange(lane * per_lane, (lane + 1) * per_lane)
    active = np.zeros(c, bool)
    active[:lanes] = True
    return (np.ones(c, np.int32), np.full(c, position, np.int32), tables, np.arange(c, dtype=np.int32), active,
            SamplerInputs.empty(c).arrays())


def time_rounds(engine, lanes: int, rounds: int, sync: bool) -> float:
    """Seconds per decode round."""
    import jax
    import numpy as np

    args = _decode_inputs(engine, lanes, 1024)
    out = engine.runner.decode(*args)
    jax.block_until_ready(out)
    t = time.perf_counter()
    for _ in range(rounds):
        out = engine.runner.decode(*args)
        if sync:
            np.asarray(out[0])
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / rounds


def kernel_table(trace_dir: Path, rounds: int, top: int) -> list[dict]:
    """Device events of the perfetto trace summed by name, per round."""
    files = sorted(trace_dir.rglob("*perfetto_trace.json.gz"))
    if not files:
        raise FileNotFoundError(f"no perfetto trace under {trace_dir}: {[str(p) for p in trace_dir.rglob('*')]}")
    events = json.loads(gzip.open(files[-1]).read())
    events = events["traceEvents"] if isinstance(events, dict) else events
    names = {e["pid"]: e["args"].get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    device_pids = {pid for pid, n in names.items() if "GPU" in n or "gpu" in n or "device" in n.lower()}
    print("trace processes:", sorted(set(names.values())), flush=True)
    total = collections.Counter()
    count = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in device_pids and "dur" in e:
            total[e["name"]] += e["dur"]
            count[e["name"]] += 1
    rows = [{"kernel": k[:120], "us_per_round": v / rounds, "launches_per_round": count[k] / rounds}
            for k, v in total.most_common(top)]
    rows.append({"kernel": "ALL device events", "us_per_round": sum(total.values()) / rounds,
                 "launches_per_round": sum(count.values()) / rounds})
    return rows


def worker_profile(engine, name: str, tokens: int, clock, top: int) -> dict:
    """Decode through the engine (one lane) with the worker's steps under cProfile on `clock`; returns tok/s
    and the functions with the most time of their own."""
    import cProfile
    import io
    import pstats

    from ninfer_jax import SamplingParams
    from ninfer_jax.runtime import scheduler as worker_module

    prof = cProfile.Profile(clock)
    step = worker_module.Worker.step

    def profiled(self):
        prof.enable()
        try:
            return step(self)
        finally:
            prof.disable()

    worker_module.Worker.step = profiled
    try:
        out = engine.generate(list(range(100, 1124)), SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    finally:
        worker_module.Worker.step = step
    rate = (tokens - 1) / (out.metrics.latency_s - out.metrics.ttft_s)
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    print(f"[{name}] engine decode 1 lane, profiled on {clock.__name__}: {rate:.1f} tok/s\n{text.getvalue()}", flush=True)
    return {"tok_s": rate, "profile": text.getvalue()}


def profile(name: str, args) -> dict:
    import jax

    from ninfer_jax import Engine, SamplingParams
    from ninfer_jax.config import ModelConfig
    from ninfer_jax.model.random_init import random_params
    from ninfer_jax.runtime.options import EngineOptions

    cfg = ModelConfig.from_file(ROOT / "configs" / f"{MODELS[name]}.json")
    params = random_params(cfg, seed=0)
    opts = EngineOptions(dtype="bfloat16", max_concurrency=8, prefill_chunk=2048, max_model_len=8192,
                         kv_capacity=65536, kernels=args.kernels, no_prefix_reuse=True)
    engine = Engine(cfg, params, opts, model_name=name, warmup=False)
    engine.generate(list(range(100, 1124)), SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    result = {"model": name}
    if args.engine:
        from ninfer_jax import SamplingParams as SP

        out = engine.generate(list(range(100, 1124)), SP(max_tokens=129, temperature=0, ignore_eos=True))
        result["engine_1lane_tok_s"] = 128 / (out.metrics.latency_s - out.metrics.ttft_s)
        print(f"[{name}] engine decode 1 lane: {result['engine_1lane_tok_s']:.1f} tok/s", flush=True)
        result["wall"] = worker_profile(engine, name, 129, time.perf_counter, args.top)
        result["cpu"] = worker_profile(engine, name, 129, time.thread_time, args.top)
        sys.setswitchinterval(0.0002)
        out = engine.generate(list(range(100, 1124)), SP(max_tokens=129, temperature=0, ignore_eos=True))
        result["engine_1lane_switch_0.2ms_tok_s"] = 128 / (out.metrics.latency_s - out.metrics.ttft_s)
        print(f"[{name}] engine decode 1 lane, GIL switch interval 0.2 ms: "
              f"{result['engine_1lane_switch_0.2ms_tok_s']:.1f} tok/s", flush=True)
        sys.setswitchinterval(0.005)
        engine.stop()
        return result
    for lanes in (1, 8):
        for sync in (True, False):
            s = time_rounds(engine, lanes, args.rounds, sync)
            key = f"{lanes}lane_{'sync' if sync else 'async'}_ms"
            result[key] = s * 1e3
            print(f"[{name}] decode {lanes} lanes, {'synchronous' if sync else 'back to back'}: "
                  f"{s * 1e3:.2f} ms/round", flush=True)
    trace_dir = Path(args.trace_dir) / name
    decode_args = _decode_inputs(engine, 1, 1024)
    jax.block_until_ready(engine.runner.decode(*decode_args))
    with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
        for _ in range(args.trace_rounds):
            out = engine.runner.decode(*decode_args)
        jax.block_until_ready(out)
    try:
        result["kernels_1lane"] = kernel_table(trace_dir, args.trace_rounds, args.top)
        for r in result["kernels_1lane"]:
            print(f"[{name}] {r['us_per_round']:9.1f} us {r['launches_per_round']:6.1f}x  {r['kernel']}", flush=True)
    except Exception as e:  # the timings above stand without the table
        print(f"[{name}] kernel table failed: {e!r}", flush=True)
    engine.stop()
    return result


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="27b,35b-a3b")
    p.add_argument("--kernels", default="pallas")
    p.add_argument("--rounds", type=int, default=32)
    p.add_argument("--trace-rounds", type=int, default=8)
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--trace-dir", default="/tmp/ninfer_decode_trace")
    p.add_argument("--out", default=None)
    p.add_argument("--engine", action="store_true", help="profile the engine's worker while it decodes instead")
    args = p.parse_args()
    rows = [profile(m, args) for m in args.models.split(",")]
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "decode_profile.json").write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
