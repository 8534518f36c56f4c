"""Reading jax profiler traces (the perfetto trace jax writes), timing the runner's decode round directly, and timing
repeated calls."""

from __future__ import annotations

import contextlib
import functools
import gzip
import json
import math
import re
import time
from pathlib import Path


def call_seconds(fn, repeats: int) -> list[float]:
    """Seconds of each of `repeats` calls of `fn()` (which must return only when its work is done), after one
    untimed call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def perfetto_trace(folder: str | Path) -> Path:
    """The newest perfetto trace jax wrote under `folder`."""
    files = sorted(Path(folder).rglob("*perfetto_trace.json.gz"))
    if not files:
        raise FileNotFoundError(f"no perfetto trace under {folder}")
    return files[-1]


def summarize_device_trace(path: Path, top: int | None = 15) -> dict:
    """Where a perfetto trace's device time went.

    Device processes are those named "/device:..." (on a CPU, which has none, every process but the Python
    tracer's). Events are summed by name, the largest first (`top` of them; None: all), with the total busy
    time (overlapping events on several streams add up). Per device thread (a stream, or XLA's op and module
    lines): its busy time with overlaps merged and its span from first start to last end, so span - busy is
    the time that line sat idle (a host-bound loop shows it on the compute stream).
    """
    events, names = _trace_events(path)
    threads = {(e["pid"], e.get("tid")): e.get("args", {}).get("name", "") for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    devices = ({pid for pid, name in names.items() if name.startswith("/device:")}
               or {pid for pid, name in names.items() if name != "python"})
    totals, counts, spans = {}, {}, {}
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in devices:
            totals[e["name"]] = totals.get(e["name"], 0.0) + e.get("dur", 0.0)
            counts[e["name"]] = counts.get(e["name"], 0) + 1
            spans.setdefault((e["pid"], e.get("tid")), []).append((e.get("ts", 0.0), e.get("dur", 0.0)))
    ranked = sorted(totals, key=totals.get, reverse=True)[:top]
    lines = [{"name": threads.get(key) or f"{names.get(key[0], key[0])}/{key[1]}", "events": len(iv),
              "busy_us": _merged_busy(iv), "span_us": max(t + d for t, d in iv) - min(t for t, _ in iv)}
             for key, iv in spans.items()]
    lines.sort(key=lambda line: line["busy_us"], reverse=True)
    return {"busy_us": sum(totals.values()), "events": sum(counts.values()),
            "top": [{"name": n, "us": totals[n], "count": counts[n]} for n in ranked], "threads": lines[:8]}


def _trace_events(path: Path) -> tuple[list, dict]:
    """A perfetto trace's events and its process names by pid."""
    with gzip.open(path) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return events, {e["pid"]: e.get("args", {}).get("name", "") for e in events
                    if e.get("ph") == "M" and e.get("name") == "process_name"}


def host_event_table(folder: str | Path, rounds: int, top: int) -> list[dict]:
    """The host side of the trace under `folder` per round: the runtime's and XLA's events outside the device
    processes by name, the most time first (`top` rows). The Python tracer's frames ("$"-named) are left out
    (cProfile covers Python: profile_decode's --engine); nested events each count their own span."""
    events, names = _trace_events(perfetto_trace(folder))
    totals, counts = {}, {}
    for e in events:
        if (e.get("ph") == "X" and not names.get(e.get("pid"), "").startswith("/device:")
                and not e["name"].startswith("$")):
            totals[e["name"]] = totals.get(e["name"], 0.0) + e.get("dur", 0.0)
            counts[e["name"]] = counts.get(e["name"], 0) + 1
    return [{"event": name[:120], "us_per_round": totals[name] / rounds, "per_round": counts[name] / rounds}
            for name in sorted(totals, key=totals.get, reverse=True)[:top]]


def kernel_table(folder: str | Path, rounds: int, top: int) -> list[dict]:
    """The device events of the trace under `folder` by name, per round: `top` rows, then one for all events."""
    summary = summarize_device_trace(perfetto_trace(folder), top=top)
    rows = [{"kernel": t["name"][:120], "us_per_round": t["us"] / rounds, "launches_per_round": t["count"] / rounds}
            for t in summary["top"]]
    return rows + [{"kernel": "ALL device events", "us_per_round": summary["busy_us"] / rounds,
                    "launches_per_round": summary["events"] / rounds}]


def trace_difference(on: dict, off: dict) -> list[dict]:
    """Per event name, device time and count of `on` minus `off` (summaries with every name), the largest
    absolute time differences first."""
    a = {t["name"]: t for t in on["top"]}
    b = {t["name"]: t for t in off["top"]}
    zero = {"us": 0.0, "count": 0}
    rows = [{"name": n, "us": a.get(n, zero)["us"] - b.get(n, zero)["us"],
             "count": a.get(n, zero)["count"] - b.get(n, zero)["count"]} for n in a.keys() | b.keys()]
    return sorted(rows, key=lambda r: abs(r["us"]), reverse=True)


def trace_line(summary: dict) -> str:
    """One log line of a device trace summary."""
    return (f"{summary['busy_us'] / 1e3:.1f} ms busy in {summary['events']} events; top: "
            + ", ".join(f"{t['name'][:40]} {t['us'] / 1e3:.2f} ms x{t['count']}" for t in summary["top"][:6])
            + "; lines (busy / span ms): "
            + ", ".join(f"{t['name'][:40]} {t['busy_us'] / 1e3:.1f} / {t['span_us'] / 1e3:.1f}"
                        for t in summary.get("threads", [])[:6]))


def _merged_busy(intervals: list[tuple[float, float]]) -> float:
    """Microseconds covered by (start, duration) intervals, overlaps counted once."""
    busy, end = 0.0, float("-inf")
    for start, dur in sorted(intervals):
        if start + dur > end:
            busy += start + dur - max(start, end)
            end = start + dur
    return busy


def distinct_tokens(shape, vocab: int):
    """int32 token ids of `shape`, no two alike while they fit the vocabulary (none is 0): rows fed one token route
    alike, so an MoE round of many rows would read one row's experts where the engine's rows read most of them."""
    import numpy as np

    n = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)
    return (n * 7919 % (vocab - 1) + 1).astype(np.int32)


def decode_inputs(engine, lanes: int, position: int) -> tuple:
    """`runner.decode` arguments for `lanes` lanes at `position` on an idle engine (any pages will do, disjoint
    per lane); the other lanes inactive. Each lane feeds a token of its own (`distinct_tokens`)."""
    import numpy as np

    from ninfer_jax.model.state import PAGE
    from ninfer_jax.runtime.sampling import SamplerInputs

    runner = engine.runner
    c = runner.max_lanes
    tables = np.zeros((c, runner.max_pages), np.int32)
    per_lane = -(-(position + 1) // PAGE)
    for lane in range(lanes):
        tables[lane, :per_lane] = np.arange(lane * per_lane, (lane + 1) * per_lane)
    active = np.zeros(c, bool)
    active[:lanes] = True
    return (distinct_tokens(c, runner.cfg.vocab_size), np.full(c, position, np.int32), tables,
            np.arange(c, dtype=np.int32), active, SamplerInputs.empty(c).arrays())


def round_engine(name: str, lanes: int, *, position: int = 1024, max_model_len: int = 8192, **options):
    """An engine on random weights (`models.random_engine`, `options` its) whose KV pool holds `decode_inputs`'
    disjoint pages for `lanes` lanes at `position` beside room for a warm-up request, which it has run (the rounds
    `time_rounds` times then compile nothing else)."""
    from ninfer_jax import SamplingParams
    from ninfer_jax.benchmarks.models import random_engine
    from ninfer_jax.model.state import PAGE

    pages = lanes * -(-(position + 1) // PAGE) + 2 * -(-max_model_len // PAGE)
    engine, _ = random_engine(name, max_concurrency=lanes, max_model_len=max_model_len,
                              kv_capacity=max(65536, pages * PAGE), no_prefix_reuse=True, **options)
    try:
        engine.generate(list(range(100, 1124)), SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    except BaseException:
        engine.stop()
        raise
    return engine


def time_rounds(engine, lanes: int, rounds: int, sync: bool, position: int = 1024) -> float:
    """Seconds per decode round of the runner: `sync` reads each round's tokens back before the next is
    dispatched (as the scheduler once did); else rounds go back to back (device time plus launch)."""
    import jax
    import numpy as np

    args = decode_inputs(engine, lanes, position)
    jax.block_until_ready(engine.runner.decode(*args))
    start = time.perf_counter()
    for _ in range(rounds):
        out = engine.runner.decode(*args)
        if sync:
            np.asarray(out[0])
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / rounds


def alternate_rounds(engine, variants, lanes: list[int], rounds: int, reps: int) -> dict:
    """Milliseconds a round, back to back, of each variant at each lane count: variants are (name, apply) pairs,
    apply() putting that variant in place before its rounds (one untimed round at each lane count compiles what it
    changed), taken in turn `reps` times so the machine's drift spreads over all. Returns {(name, lanes): [ms]}."""
    ms = {(name, n): [] for name, _ in variants for n in lanes}
    for rep in range(reps):
        for name, apply in variants:
            apply()
            for n in lanes:
                start = time.perf_counter()
                time_rounds(engine, n, 1, False)
                first = time.perf_counter() - start
                ms[(name, n)].append(time_rounds(engine, n, rounds, False) * 1e3)
                print(f"rep {rep} [{name}] {n} lanes: {ms[(name, n)][-1]:.3f} ms a round (first round {first:.1f} s)",
                      flush=True)
    return ms


def first_calls(fns: dict, *args) -> dict:
    """Each function's first call on `args` (its compile), as {name: (output as a float32 numpy array, seconds)} for
    those that ran; one that raises (a config its compiler refuses) is reported and left out."""
    import numpy as np

    ran = {}
    for name, fn in fns.items():
        start = time.perf_counter()
        try:
            out = np.asarray(fn(*args), np.float32)
        except Exception as error:  # a sweep goes on past a variant that does not build
            print(f"[{name}] failed: {type(error).__name__}: {str(error)[:300]}", flush=True)
            continue
        ran[name] = (out, time.perf_counter() - start)
    return ran


def alternate_calls(fns: dict, *args, reps: int, calls: int) -> dict[str, list[float]]:
    """Seconds a call of each function on `args`: `calls` of them dispatched back to back and waited for once, after
    an untimed one, the functions taken in turn `reps` times. Returns {name: [seconds a call, one a rep]}."""
    import jax

    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            jax.block_until_ready(fn(*args))
            start = time.perf_counter()
            for _ in range(calls):
                out = fn(*args)
            jax.block_until_ready(out)
            times[name].append((time.perf_counter() - start) / calls)
    return times


ROUND_DISPATCH = "the runner's whole round (packing and output copies included)"
# How `dispatch_by_input` hands the step alone its two per-round inputs: each a numpy array transferred by the call,
# one device buffer reused by every call, or a new device buffer each call (placed before the timed call).
DISPATCH_INPUTS = {
    "the step alone, packed from the host, prev_tokens one buffer": ("host", "same"),
    "the step alone, packed one device buffer, prev_tokens one buffer": ("same", "same"),
    "the step alone, packed a new device buffer, prev_tokens one buffer": ("new", "same"),
    "the step alone, packed from the host, prev_tokens a new buffer": ("host", "new"),
}


def dispatch_by_input(engine, lanes: int, calls: int = 20, position: int = 1024) -> dict[str, float]:
    """Median host milliseconds to dispatch the runner's whole round (`ROUND_DISPATCH`: packing and output copies
    included), then the jitted decode step alone by how its per-round inputs arrive (`DISPATCH_INPUTS`): whether the
    dispatch time is the call's arguments, its host-to-device copy, or the device program's launch once an input's
    address changes (a command buffer recorded against the old one is updated). The rows take turns call by call,
    so drift on the host falls on each alike; each call is waited for before the next."""
    import statistics

    import jax
    import jax.numpy as jnp

    runner = engine.runner
    args = decode_inputs(engine, lanes, position)
    packed, _, prev = runner._round_inputs(*args)
    full = runner._sampler(False)
    step, program = runner._steps["decode"], ("decode", packed.shape[0], full)
    packed_device = jax.block_until_ready(jnp.asarray(packed))

    def place(kind, host, device):
        if kind == "host":
            return host
        return device if kind == "same" else jax.block_until_ready(jnp.array(device, copy=True))

    def step_alone(packed_kind, prev_kind):
        p, q = place(packed_kind, packed, packed_device), place(prev_kind, None, prev)
        start = time.perf_counter()
        result, state = step(runner.params, runner.cfg, runner.kernels, full, runner.state, p, q)
        took = time.perf_counter() - start
        runner._swap(state, program)
        return took, result

    def whole_round():
        start = time.perf_counter()
        out = runner.decode(*args)
        return time.perf_counter() - start, out

    rows = {ROUND_DISPATCH: whole_round,
            **{label: functools.partial(step_alone, *kinds) for label, kinds in DISPATCH_INPUTS.items()}}
    seconds = {label: [] for label in rows}
    for i in range(calls + 2):  # the first two compile nothing new but settle the inputs' placement
        for label, call in rows.items():
            took, out = call()
            jax.block_until_ready(out)
            if i >= 2:
                seconds[label].append(took)
    return {label: statistics.median(s) * 1e3 for label, s in seconds.items()}


@contextlib.contextmanager
def profiled_scheduler(clock=time.perf_counter):
    """Runs the engine scheduler's steps under cProfile on `clock` while the block runs; yields the profile.
    The engine's thread looks `step` up on every call, so patching the class reaches a running engine."""
    import cProfile

    from ninfer_jax.runtime.scheduler import Scheduler

    prof, step = cProfile.Profile(clock), Scheduler.step

    def profiled(self):
        prof.enable()
        try:
            return step(self)
        finally:
            prof.disable()

    Scheduler.step = profiled
    try:
        yield prof
    finally:
        Scheduler.step = step


_COPY = re.compile(r"=\s*(\w+)\[([\d,]*)\][^=]*?\bcopy(?:-start)?\(")
# Bytes per element of HLO's element types (an unlisted one counts 4)
HLO_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
                   "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}


def hlo_array_bytes(dtype: str, dims: str) -> int:
    """Bytes of the HLO array type `dtype[dims]` (e.g. "bf16", "8,2048")."""
    return math.prod(int(d) for d in dims.split(",") if d) * HLO_DTYPE_BYTES.get(dtype, 4)


def hlo_copies(text: str, top: int = 8) -> dict:
    """The copy instructions of an optimized HLO module: how many, their bytes, each one's shape ("f32[76,64,2,64]",
    largest first) and the `top` largest with their MiB."""
    sizes = []
    for dtype, dims in _COPY.findall(text):
        sizes.append((hlo_array_bytes(dtype, dims), f"{dtype}[{dims}]"))
    sizes.sort(reverse=True)
    return {"copies": len(sizes), "bytes": sum(b for b, _ in sizes), "shapes": [s for _, s in sizes],
            "largest": [f"{s} ({b / 2**20:.1f} MiB)" for b, s in sizes[:top]]}


def compiled_copies(engine, which: str, *inputs) -> dict:
    """`hlo_copies` of the runner's compiled `which` step ("decode" or "mixed") for packed inputs."""
    r = engine.runner
    if which == "decode":
        packed, prev = inputs
        lowered = r._steps["decode"].lower(r.params, r.cfg, r.kernels, False, r.state, packed, prev)
    else:
        packed, r_packed, prev = inputs
        lowered = r._steps["mixed"].lower(r.params, r.cfg, r.kernels, False, (r.mixed_tokens, r.max_taps), r.state,
                                          packed, r.media, r_packed, prev)
    return hlo_copies(lowered.compile().as_text())


def mixed_inputs(engine, lanes: int, context: int, tokens: int, base: int):
    """Packed inputs of a mixed step (`compiled_copies`): a pass of `tokens` tokens at `base` into lane `lanes`'s slot,
    beside a round of lanes 0 .. lanes - 1 at position `context` -> (pass, round, previous tokens)."""
    import numpy as np

    from ninfer_jax.model.state import PAGE
    from ninfer_jax.runtime.sampling import SamplerInputs

    r = engine.runner
    ids, positions, tables, slots, active, sampler = decode_inputs(engine, lanes, context)
    r_packed, _, prev = r._round_inputs(ids, positions, tables, slots, active, sampler)
    table = np.zeros(r.max_pages, np.int32)
    table[:-(-(base + tokens) // PAGE)] = 1
    packed, _ = r._pass_inputs(r.mixed_tokens, np.zeros(tokens, np.int32), base, table, lanes,
                               SamplerInputs.empty(1).arrays())
    return packed, r_packed, prev
