"""What a Host write-through costs the decode rounds running beside it, by how its device-to-host copy is made
(issue #8: the cache cost 3.7% of 8-lane decode, where seven lanes end and write inside the timed window).

Builds the KV pools and state slots of a benchmark model (no weights) and a stand-in decode round (a chain of
small matmuls over 3 GB of weights, about a thousand kernels like the real round), then runs 64 rounds, the
host reading each round's output as the worker reads its tokens, with one lane's write-through (its pages
and its state image, as `HostTier.write` gathers them) dispatched at every 8th round. Variants of the copy:
  none            the rounds alone (the baseline);
  pinned_wait     the gather's output placed in pinned host memory by the gather itself; the writer only
                  waits for it (the device side of the write alone);
  pinned_read     the same, the writer reading the rows into numpy (np.asarray) and no further;
  pinned_out      the same, the rows then copied into the page-locked slabs by `HostSlabBuffer.write` (a
                  numpy assignment: the engine as built);
  pinned_memmove  the same, the rows copied by ctypes memmoves (which release the GIL; full-width slabs);
  fused           the round and the lane's gathers in one program, the gathers' outputs in pinned host memory
                  (XLA may overlap their device-to-host copies with the round); the numpy copy into the slabs;
  device_async    the gather into device memory, then `copy_to_host_async()`; a writer thread waits for it
                  and copies the rows into the page-locked slabs;
  device_put      the gather into device memory, then `jax.device_put` to the pinned_host memory kind.
Each variant also reports its copy rate alone (the writes of 8 lanes back to back). Best of --reps, the
variants interleaved rep by rep.

    python scripts/write_through_probe.py --model 35b-a3b --pages 16 [--out DIR]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import queue
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_engine import MODELS  # noqa: E402

ROUNDS, EVERY = 64, 8
KINDS = ("none", "pinned_wait", "pinned_read", "pinned_out", "pinned_memmove", "fused", "device_async", "device_put")


def probe(model: str, pages_per_lane: int, kinds: tuple[str, ...] = KINDS, matmuls: int = 400,
          reps: int = 3) -> dict:
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np

    from ninfer_jax.config import ModelConfig
    from ninfer_jax.model.state import init_device_state, page_bytes, slot_bytes
    from ninfer_jax.prefix_cache.host_slabs import HostSlabPool
    from ninfer_jax.runtime.device.host_tier import HostSlabBuffer
    from ninfer_jax.runtime.device.runner import _gather_pages, _gather_slot

    cfg = ModelConfig.from_file(ROOT / "configs" / f"{MODELS.get(model, model)}.json")
    bundle, image = page_bytes(cfg, jnp.bfloat16), slot_bytes(cfg, jnp.bfloat16)
    lanes = ROUNDS // EVERY
    pool = HostSlabPool(lanes * (pages_per_lane * (bundle + 4096) + 2 * image), bundle, image)
    buffer = HostSlabBuffer(pool)
    state = init_device_state(cfg, 4 * pages_per_lane * lanes, lanes + 1, jnp.bfloat16, jnp.bfloat16)
    device = jax.devices()[0]
    pinned = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
    slot_fn = functools.partial(_gather_slot, rows=pool.image_slabs, row_words=pool.slab_bytes // 4)
    gathers = {"device": (jax.jit(_gather_pages), jax.jit(slot_fn)),
               "pinned": (jax.jit(_gather_pages, out_shardings=pinned), jax.jit(slot_fn, out_shardings=pinned))}

    # The stand-in round: `matmuls` matmuls of [8, 2048] x [2048, 2048] bf16 (8 MB of weights each).
    weights = jax.random.normal(jax.random.key(0), (matmuls, 2048, 2048), jnp.bfloat16) * 0.02

    @jax.jit
    def round_step(x, w):
        for i in range(w.shape[0]):
            x = x + jnp.tanh(x @ w[i])
        return x

    # The fused form: the round and one lane's gathers in one program, the gathers' outputs in pinned host memory,
    # so XLA may overlap their device-to-host copies with the round's matmuls.
    def round_with_write(x, w, k_pages, v_pages, ssm, conv, pages, slot):
        return round_step(x, w), _gather_pages(k_pages, v_pages, pages), slot_fn(ssm, conv, slot)

    fused = jax.jit(round_with_write, out_shardings=(jax.sharding.SingleDeviceSharding(device), pinned, pinned))

    x0 = jnp.ones((8, 2048), jnp.bfloat16)
    page_ids = [np.arange(i * pages_per_lane, (i + 1) * pages_per_lane, dtype=np.int32) for i in range(lanes)]
    slabs = [list(range(i * pages_per_lane, (i + 1) * pages_per_lane)) for i in range(lanes)]

    def dispatch(kind: str, lane: int) -> list:
        gp, gs = gathers["pinned" if kind.startswith("pinned") else "device"]
        parts = [gp(state.k_pages, state.v_pages, page_ids[lane]), gs(state.ssm, state.conv, np.int32(lane))]
        if kind == "device_async":
            for p in parts:
                p.copy_to_host_async()
        elif kind == "device_put":
            parts = [jax.device_put(p, pinned) for p in parts]
        return parts

    def land(parts, lane: int, kind: str) -> None:
        if kind == "pinned_wait":
            jax.block_until_ready(parts)
            return
        rows = np.asarray(parts[0]).view(np.uint8)
        if kind == "pinned_read":
            np.asarray(parts[1])
            return
        if kind == "pinned_memmove":  # the slab copy as ctypes memmoves (they release the GIL)
            for run in pool.runs(slabs[lane]):
                target = buffer.chunks[run.chunk][buffer.first_row(run)].ctypes.data
                ctypes.memmove(target, rows.ctypes.data + run.start * rows.shape[1], run.count * rows.shape[1])
            np.asarray(parts[1])
            return
        buffer.write(slabs[lane], rows)
        np.asarray(parts[1])  # the image's rows: read (their slabs are not the point here)

    def writer(jobs: queue.SimpleQueue) -> None:
        while (job := jobs.get()) is not None:
            land(*job)

    def rounds(kind: str) -> float:
        jobs: queue.SimpleQueue = queue.SimpleQueue()
        thread = threading.Thread(target=writer, args=(jobs,))
        thread.start()
        start = time.perf_counter()
        x, prev = x0, None
        for r in range(ROUNDS):
            writes = kind != "none" and r % EVERY == EVERY - 1
            if writes and kind == "fused":
                lane = r // EVERY
                x, *parts = fused(x, weights, state.k_pages, state.v_pages, state.ssm, state.conv, page_ids[lane],
                                  np.int32(lane))
                jobs.put((parts, lane, kind))
                writes = False
            else:
                x = round_step(x, weights)
            if writes:
                jobs.put((dispatch(kind, r // EVERY), r // EVERY, kind))
            if prev is not None:
                np.asarray(prev[0, :1])  # the worker reads the previous round's tokens
            prev = x
        np.asarray(prev[0, :1])
        elapsed = time.perf_counter() - start
        jobs.put(None)
        thread.join()
        return elapsed

    def alone(kind: str) -> float:
        if kind == "fused":
            kind = "pinned_out"  # the same copies; a fused write exists only beside a round
        start = time.perf_counter()
        for lane in range(lanes):
            land(dispatch(kind, lane), lane, kind)
        return time.perf_counter() - start

    for kind in kinds:  # compile and touch everything once
        rounds(kind)
        if kind != "none":
            alone(kind)
    lane_bytes = pages_per_lane * bundle + pool.image_slabs * pool.slab_bytes
    result = {"model": model, "pages_per_lane": pages_per_lane, "lane_bytes": lane_bytes, "rounds": ROUNDS,
              "writes": lanes, "pinned_slabs": buffer.pinned, "reps": reps}
    # Reps interleave the variants, so a drift of the machine over the run touches every variant alike.
    samples = {kind: [] for kind in kinds}
    for _ in range(reps):
        for kind in kinds:
            samples[kind].append(rounds(kind))
    for kind in kinds:
        best = min(samples[kind])
        row = {"rounds_s": best, "round_ms": best / ROUNDS * 1e3, "samples_s": samples[kind]}
        if kind != "none":
            row["copy_alone_s"] = min(alone(kind) for _ in range(3))
            row["copy_gbs"] = lanes * lane_bytes / row["copy_alone_s"] / 1e9
            row["cost_vs_none"] = best / result["none"]["rounds_s"] - 1
        result[kind] = row
        print(f"[{model}] {kind:14s} rounds {best * 1e3:7.1f} ms ({row['round_ms']:.2f} ms each)"
              + (f" | cost {row['cost_vs_none']:+.1%} | copy alone {row['copy_gbs']:.1f} GB/s"
                 if kind != "none" else ""), flush=True)
    buffer.close()
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="35b-a3b")
    p.add_argument("--pages", type=int, default=16, help="pages each ending lane writes (16: a 1024-token prompt)")
    p.add_argument("--matmuls", type=int, default=400, help="matmuls in the stand-in decode round")
    p.add_argument("--variants", default=",".join(KINDS), help="the variants to run (none always runs)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out")
    args = p.parse_args()
    kinds = ("none",) + tuple(k for k in args.variants.split(",") if k and k != "none")
    unknown = set(kinds) - set(KINDS)
    if unknown:
        raise SystemExit(f"unknown variant(s) {sorted(unknown)}; known: {KINDS}")
    result = probe(args.model, args.pages, kinds, args.matmuls, args.reps)
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "write_through_probe.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
