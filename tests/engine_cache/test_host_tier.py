"""The Host tier of the hybrid prefix cache in the engine (spec §5.4, §6.5, §7.6, §9.3, §13.3) on the tiny
model (fp32): write-through at release and publication, restores after the Device copies are evicted, the
Host eviction decisions under a small budget, and the Device-only mode (host_cache_mib 0).

Every engine ends each test with the invariant checker, the slab ledger and a leak check (`settle`).
"""

import threading
import time

import jax.numpy as jnp
import numpy as np
import pytest

from ninfer_jax import Engine, SamplingParams
from ninfer_jax.prefix_cache import HostSlabPool
from ninfer_jax.prefix_cache.tree import ABSENT, RESIDENT
from ninfer_jax.model.state import DeviceState
from ninfer_jax.runtime.device.buckets import pow2_buckets, split_transfer
from ninfer_jax.runtime.device.host_buffer import HostSlabBuffer
from ninfer_jax.runtime.device.host_tier import HostTier
from ninfer_jax.runtime.device.transfer import gather_pages, gather_slot, scatter_pages, scatter_slot
from ninfer_jax.runtime.options import EngineOptions
from cache_support import assert_same_output, io_error, settle_host as settle, tokens

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=5)
LONG = SamplingParams(max_tokens=70, temperature=0.0, ignore_eos=True, logprobs=5)
COMMON = dict(max_concurrency=2, prefill_chunk=128, max_model_len=1024, output_window=64)
# 24 pages and 3 snapshot slots: three fresh 600-token prompts push every earlier block and image off the
# Device; 16 MiB of Host (128 slabs of 128 KiB) keep all of them.
HOST = {**COMMON, "kv_capacity": 24 * 64, "device_snapshot_slots": 3, "host_cache_mib": 16}


@pytest.fixture(scope="module")
def checkpoint(checkpoint_factory):
    return checkpoint_factory("tiny-dense", "text", seed=41)


@pytest.fixture(scope="module")
def root(checkpoint):
    engine = Engine.from_pretrained(checkpoint, no_prefix_reuse=True, kv_capacity=64 * 64, warmup=False, **COMMON)
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def shared_host(checkpoint):
    engine = Engine.from_pretrained(checkpoint, **HOST)
    yield engine
    engine.stop()


@pytest.fixture()
def host(shared_host):
    """The Host-tier engine; tests use prompts of their own random tokens, so they share no prefixes."""
    yield shared_host
    settle(shared_host)


def push_to_host(engine, seed):
    """Three fresh 600-token prompts: Device LRU and snapshot-slot pressure moves older entries Host-only."""
    for i in range(3):
        engine.generate(tokens(600, seed + i), GREEDY)


def index_of(engine):
    """The engine's prefix index, read from this thread once the worker has settled the requests whose last
    events arrived (it sends a round's last events before settling their lanes)."""
    engine._call(lambda: None)
    return engine.cache_manager.index


def find_snapshot(engine, prompt, frontier):
    """The snapshot at `frontier` on the path of `prompt`'s first block, or None."""
    first = np.asarray(prompt[:64], "<i4").tobytes()
    for s in index_of(engine).tree.snapshots.values():
        path = s.anchor.path()
        if s.frontier == frontier and path and path[0].tokens == first:
            return s
    return None


def host_only(s) -> bool:
    """Image, tail and every path block of `s` are on the Host only."""
    parts_ok = s.image_device is ABSENT and s.image_host is RESIDENT
    parts_ok &= s.tail_len == 0 or (s.tail_device is ABSENT and s.tail_host is RESIDENT)
    return parts_ok and all(n.device_state is ABSENT and n.host_state is RESIDENT for n in s.anchor.path())


def counters(engine, *names):
    stats = engine.stats()["prefix_cache"]
    return {n: stats[n] for n in names}


def test_defaults_follow_the_host_tier_rules():
    with_host = EngineOptions(max_concurrency=3).resolve(4096)
    assert (with_host.device_snapshot_slots, with_host.max_new_taps) == (4, 8)  # C + 1, 8 (§14.2)
    device_only = EngineOptions(max_concurrency=3, host_cache_mib=0).resolve(4096)
    assert (device_only.device_snapshot_slots, device_only.max_new_taps) == (5, 2)  # C + 2, 2


class _NumpyPoolRunner:
    """The runner surface HostTier uses, over numpy pools: page p's bundle is `pages[p]`, slot s's image
    `slots[s]` (rows of one slab each)."""

    def __init__(self, num_pages: int, image_slots: int, row_bytes: int, image_rows: int):
        self.num_pages, self.image_slots = num_pages, image_slots
        self.enable_host_transfers(row_bytes, image_rows)

    def enable_host_transfers(self, row_bytes: int, image_rows: int) -> None:
        self.transfer_sizes = (1, 2, 4, 8)
        self.pages = np.zeros((self.num_pages, row_bytes), np.uint8)
        self.slots = np.zeros((self.image_slots, image_rows, row_bytes), np.uint8)

    def gather_pages(self, ids):  # rows travel as uint32 words, like the runner's
        return jnp.asarray(self.pages[np.asarray(ids)].view(np.uint32))

    def gather_slot(self, slot):
        return jnp.asarray(self.slots[int(slot)].view(np.uint32))

    def scatter_pages(self, ids, rows) -> None:
        for i, page in enumerate(np.asarray(ids)):
            if page < self.num_pages:  # an out-of-range id drops its row, like the jitted scatter
                self.pages[page] = np.asarray(rows)[i].view(np.uint8)

    def scatter_slot(self, slot, rows) -> None:
        self.slots[int(slot)] = np.asarray(rows).view(np.uint8)


def _gated_host_tier():
    """A HostTier over numpy pools whose restores land only once the returned event is set."""
    pool = HostSlabPool(16 * 8192, 8000, 16000)
    runner = _NumpyPoolRunner(num_pages=8, image_slots=2, row_bytes=pool.slab_bytes, image_rows=pool.image_slabs)
    host = HostTier(runner, HostSlabBuffer(pool, pin=False))
    gate, landed = threading.Event(), host._await_copies
    host._await_copies = lambda staged: (gate.wait(30), landed(staged))
    return host, gate


def test_a_host_write_queued_behind_a_restore_waits_for_its_copies():
    # The worker only dispatches a restore; a slab it reads may be freed and handed to a new write at once. The
    # writer must not rewrite that slab before the restore's copies have read it.
    host, gate = _gated_host_tier()
    rng = np.random.default_rng(0)
    old, new = (rng.integers(0, 256, (1, host.pool.slab_bytes)).astype(np.uint8) for _ in range(2))
    try:
        host.buffer.write([0], old)
        host.runner.pages[5] = new[0]
        host.restore([0], [3])  # dispatched; "in flight" until the gate opens
        host.write("write", [5], [0])  # page 5 into the same slab 0
        time.sleep(0.3)
        assert host.landed() == []  # the write waits for the restore
        np.testing.assert_array_equal(host.buffer.chunks[0][0], old[0])
        gate.set()
        assert host.landed(wait=True) == [("write", None)]
        np.testing.assert_array_equal(host.buffer.chunks[0][0], new[0])
        np.testing.assert_array_equal(host.runner.pages[3], old[0])  # the restore read the slab's old bytes
        assert host.take_restore_failure() is None and host.stats()["host_restore_seconds"] >= 0.3
    finally:
        gate.set()
        host.close()


def test_a_restore_copy_failing_after_its_dispatch_is_reported_once():
    host, gate = _gated_host_tier()
    host._await_copies = io_error
    try:
        host.restore([0, 1], [2, 3])
        assert host.landed(wait=True) == []  # waits for the restore too, failed or not
        failure = host.take_restore_failure()
        assert isinstance(failure, OSError) and host.take_restore_failure() is None
    finally:
        gate.set()
        host.close()


def test_transfer_batches_sum_exactly_to_the_pages_moved():
    assert pow2_buckets(64) == (1, 2, 4, 8, 16, 32, 64) and pow2_buckets(40)[-2:] == (32, 40)
    assert split_transfer(16, pow2_buckets(64)) == [16]
    assert split_transfer(150, pow2_buckets(64)) == [64, 64, 16, 4, 2]
    assert split_transfer(63, pow2_buckets(40)) == [40, 16, 4, 2, 1]
    for count in range(200):
        assert sum(split_transfer(count, pow2_buckets(64))) == count


def test_writes_and_restores_move_no_padding_rows():
    # A 13-page write and restore move 13 rows each (8 + 4 + 1), not a 64-row bucket of which 51 are padding.
    host, gate = _gated_host_tier()
    gate.set()
    runner, moved = host.runner, []
    gather, scatter = runner.gather_pages, runner.scatter_pages
    runner.gather_pages = lambda ids: (moved.append(("gather", len(ids))), gather(ids))[1]
    runner.scatter_pages = lambda ids, rows: (moved.append(("scatter", len(ids), len(rows))), scatter(ids, rows))[1]
    runner.num_pages = 16
    runner.enable_host_transfers(host.pool.slab_bytes, host.pool.image_slabs)
    runner.pages[:] = np.random.default_rng(2).integers(0, 256, runner.pages.shape).astype(np.uint8)
    written = runner.pages[:13].copy()
    try:
        host.write("w", list(range(13)), list(range(13)))
        assert host.landed(wait=True) == [("w", None)]
        host.restore(list(range(13)), list(range(3, 16)))
        host.landed(wait=True)
        assert moved == [("gather", 8), ("gather", 4), ("gather", 1),
                         ("scatter", 8, 8), ("scatter", 4, 4), ("scatter", 1, 1)]
        np.testing.assert_array_equal(runner.pages[3:16], written)
    finally:
        host.close()


def test_slab_buffer_chunks_and_packing():
    # 5 slabs of 8 KiB per 40 KiB chunk: 12 slabs in 3 chunks, no slab crosses a chunk.
    pool = HostSlabPool(12 * 8192, 8000, 20000, max_chunk_bytes=5 * 8192)
    buf = HostSlabBuffer(pool, pin=False)
    assert [c.shape for c in buf.chunks] == [(5, 8192), (5, 8192), (2, 8192)] and not buf.pinned
    slabs = [3, 4, 5, 6, 11, 0]  # runs cut at the chunk boundary (4 | 5) and between chunks
    rows = np.random.default_rng(0).integers(0, 256, (len(slabs), 8000)).astype(np.uint8)
    buf.write(slabs, rows)
    back = np.zeros((len(slabs), 8192), np.uint8)
    buf.read(slabs, back)
    np.testing.assert_array_equal(back[:, :8000], rows)
    np.testing.assert_array_equal(buf.chunks[1][0, :8000], rows[2])  # slab 5 is chunk 1's first
    buf.close()


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float32"])
def test_transfer_ops_move_pages_and_slots_bit_exactly(kv_dtype):
    """The runner's gathers and scatters round-trip raw bytes (the Host slab layout, carried as uint32 words)
    for either KV dtype; viewed as bytes, a gathered bundle is each layer's K page then V page in memory order."""
    rng = np.random.default_rng(1)

    def pages():
        return jnp.asarray(rng.standard_normal((6, 64, 2, 8)), kv_dtype)

    state = DeviceState((pages(), pages()), (pages(), pages()),
                        (jnp.asarray(rng.standard_normal((4, 2, 4, 4)), jnp.float32),) * 2,
                        (jnp.asarray(rng.standard_normal((4, 3, 16)), kv_dtype),) * 2)
    row_bytes = 4 * 64 * 2 * 8 * jnp.dtype(kv_dtype).itemsize + 128  # a bundle, then slab padding
    rows = np.zeros((2, row_bytes // 4), np.uint32)
    gathered = np.asarray(gather_pages(state.k_pages, state.v_pages, jnp.asarray([1, 4])))
    assert gathered.dtype == np.uint32
    layout = [np.asarray(pool[p]).view(np.uint8).reshape(-1) for p in (1, 4)
              for k, v in zip(state.k_pages, state.v_pages) for pool in (k, v)]
    np.testing.assert_array_equal(gathered.view(np.uint8).reshape(-1), np.concatenate(layout))
    rows[:, :gathered.shape[1]] = gathered
    moved_k, moved_v = scatter_pages(state.k_pages, state.v_pages, jnp.asarray([3, 6]), jnp.asarray(rows))
    for before, after in zip(state.k_pages + state.v_pages, moved_k + moved_v):  # page 6 is out of range: dropped
        np.testing.assert_array_equal(np.asarray(after[3]).view(np.uint8), np.asarray(before[1]).view(np.uint8))
        np.testing.assert_array_equal(np.asarray(after[:3]), np.asarray(before[:3]))
    image = gather_slot(state.ssm, state.conv, 2, rows=3, row_words=64)
    packed = np.concatenate([np.asarray(pool[2]).view(np.uint8).reshape(-1)
                             for s, c in zip(state.ssm, state.conv) for pool in (s, c)])
    np.testing.assert_array_equal(np.asarray(image).view(np.uint8).reshape(-1)[:packed.size], packed)
    ssm, conv = scatter_slot(state.ssm, state.conv, 0, image)
    for before, after in zip(state.ssm + state.conv, ssm + conv):
        np.testing.assert_array_equal(np.asarray(after[0]).view(np.uint8), np.asarray(before[2]).view(np.uint8))


def test_host_only_restore_equals_device_resume_and_no_reuse(host, root):
    prompt = tokens(500, 1)
    host.generate(prompt, GREEDY)  # publishes the prompt-tail tap at 448; blocks written through at release
    edited = prompt[:470] + tokens(20, 2)
    device = host.generate(edited, GREEDY)
    assert device.usage.cached_tokens == 448
    assert host.cache_record(device.request_id)["restored_host_bytes"] == 0  # a Device resume

    before = counters(host, "restored_blocks", "restored_images", "device_evicted_backed",
                      "device_evicted_unbacked", "nodes_lost", "host_restored_bytes")
    push_to_host(host, 100)
    tap = find_snapshot(host, prompt, 448)
    assert tap is not None and host_only(tap)  # evicted from the Device, kept on the Host (§9.1, §9.2)
    pressed = counters(host, "device_evicted_backed", "device_evicted_unbacked", "nodes_lost")
    assert pressed["device_evicted_backed"] > before["device_evicted_backed"]
    assert pressed["device_evicted_unbacked"] == before["device_evicted_unbacked"]  # every copy was backed
    assert pressed["nodes_lost"] == before["nodes_lost"]

    restored = host.generate(edited, GREEDY)
    assert restored.usage.cached_tokens == 448
    after = counters(host, "restored_blocks", "restored_images", "host_restored_bytes")
    assert after["restored_blocks"] - before["restored_blocks"] == 7
    assert after["restored_images"] - before["restored_images"] == 1
    slab = index_of(host).slabs.slab_bytes
    moved = (7 + index_of(host).slabs.image_slabs) * slab
    record = host.cache_record(restored.request_id)
    assert record["restored_host_bytes"] == moved and record["source"] == "tap"
    assert after["host_restored_bytes"] - before["host_restored_bytes"] == moved
    reference = root.generate(edited, GREEDY)
    assert_same_output(restored, reference)
    assert_same_output(device, reference)


def test_conversation_pushed_to_the_host_resumes_from_its_endpoint(host, root):
    history = tokens(150, 3)
    out = host.generate(history, LONG)
    history += list(out.token_ids) + tokens(30, 4)
    out = host.generate(history, LONG)  # resumes from turn 1's endpoint on the Device
    assert out.usage.cached_tokens == 150 + 70 - 1
    end = len(history) + len(out.token_ids) - 1  # turn 2's endpoint: 319, a 63-token tail
    endpoint = find_snapshot(host, history, end)
    assert endpoint is not None and endpoint.tail_len == end % 64

    push_to_host(host, 200)
    assert host_only(endpoint)
    before = counters(host, "restored_blocks", "restored_images", "restored_tails")
    turn3 = history + list(out.token_ids) + tokens(20, 5)
    resumed = host.generate(turn3, GREEDY)
    assert resumed.usage.cached_tokens == end
    after = counters(host, "restored_blocks", "restored_images", "restored_tails")
    assert after["restored_blocks"] - before["restored_blocks"] == end // 64
    assert after["restored_images"] - before["restored_images"] == 1
    assert after["restored_tails"] - before["restored_tails"] == 1
    assert host.cache_record(resumed.request_id)["source"] == "endpoint"
    assert_same_output(resumed, root.generate(turn3, GREEDY))


def test_demote_device_cache_moves_reuse_to_the_host(host, root):
    prompt = tokens(400, 21)
    out = host.generate(prompt, LONG)  # endpoint at 469 (7 blocks, a 21-token tail), all written through
    endpoint = find_snapshot(host, prompt, 469)
    assert endpoint is not None and not host_only(endpoint)
    freed = host.demote_device_cache()
    assert host_only(endpoint) and freed["pages"] >= 8 and freed["slots"] >= 1
    stats = host.stats()["prefix_cache"]  # nothing keeps a Device copy beside a Host copy any more
    assert stats["nodes_by_tier"]["both"] == 0 and stats["snapshots_by_tier"]["both"] == 0
    assert stats["nodes_by_tier"]["host"] >= 7 and stats["snapshots_by_tier"]["host"] >= 1
    turn2 = prompt + list(out.token_ids) + tokens(30, 22)
    resumed = host.generate(turn2, GREEDY)
    assert resumed.usage.cached_tokens == 469
    slabs = index_of(host).slabs
    moved = (7 + 1 + slabs.image_slabs) * slabs.slab_bytes  # 7 blocks, the tail, the image
    assert host.cache_record(resumed.request_id)["restored_host_bytes"] == moved
    assert_same_output(resumed, root.generate(turn2, GREEDY))


def test_waiting_head_prefetches_its_host_path_and_admission_restores_only_the_rest(host, root):
    """§6.6: while both lanes decode, the FIFO head's Host-only path blocks are copied into spare pages;
    its admission then restores only the tail and the image, and its output equals no reuse."""
    prompt = tokens(400, 23)
    out = host.generate(prompt, LONG)
    turn2 = prompt + list(out.token_ids) + tokens(30, 24)
    host.demote_device_cache()
    before = counters(host, "prefetches", "prefetched_blocks", "restored_blocks", "restored_tails",
                      "restored_images")
    busy = [tokens(100, 25), tokens(100, 26)]
    outs = host.generate_many(busy + [turn2], [LONG, LONG, GREEDY])  # turn2 waits for a lane
    resumed = outs[2]
    assert resumed.usage.cached_tokens == 469
    after = counters(host, "prefetches", "prefetched_blocks", "restored_blocks", "restored_tails",
                     "restored_images")
    delta = {k: after[k] - before[k] for k in after}
    assert delta == {"prefetches": 1, "prefetched_blocks": 7, "restored_blocks": 0, "restored_tails": 1,
                     "restored_images": 1}
    slabs = index_of(host).slabs
    assert host.cache_record(resumed.request_id)["restored_host_bytes"] == (1 + slabs.image_slabs) * slabs.slab_bytes
    assert_same_output(resumed, root.generate(turn2, GREEDY))
    for o, p in zip(outs[:2], busy):
        assert o.token_ids == root.generate(p, LONG).token_ids


def test_write_through_fills_the_host_and_stats_report_it(host):
    before = host.stats()["prefix_cache"]
    host.generate(tokens(300, 6), GREEDY)
    after = host.stats()["prefix_cache"]
    assert after["host_tier"] and after["host_slab_bytes"] == index_of(host).slabs.slab_bytes
    assert after["host_block_writes"] - before["host_block_writes"] == 4  # blocks 0..3, one batch
    assert after["host_image_writes"] > before["host_image_writes"]  # the prompt-tail tap
    assert after["host_written_bytes"] > before["host_written_bytes"]
    assert set(after["host_evictions"]) == {"dead_kv", "superseded", "gdsf", "gdsf_device_kept"}


def test_host_evictions_decide_which_snapshots_survive(checkpoint):
    """1 MiB of Host: 8 slabs of 128 KiB (one block, one image or one tail each). One lane, one Device
    snapshot slot and no taps, so every endpoint is Host-only once the next one takes the slot."""
    engine = Engine.from_pretrained(checkpoint, max_concurrency=1, prefill_chunk=128, max_model_len=1024,
                                    output_window=64, kv_capacity=8 * 64, device_snapshot_slots=1,
                                    host_cache_mib=1, max_new_taps=0, warmup=False)
    try:
        def evictions():
            return dict(engine.stats()["prefix_cache"]["host_evictions"])

        x1, y1 = tokens(70, 7), tokens(70, 8)
        ox = engine.generate(x1, GREEDY)  # endpoint X@77: block + image + tail = 3 slabs
        oy = engine.generate(y1, GREEDY)  # endpoint Y@77: 3 more, 2 slabs free
        ex1, ey1 = find_snapshot(engine, x1, 77), find_snapshot(engine, y1, 77)
        assert ex1 is not None and ey1 is not None
        settle(engine, warmed=False)

        # Supersession: X's next turn resumes from X@77 and publishes X@145, superseding X@77. Its writes need
        # 3 slabs with 2 free: the superseded snapshot goes first, although Y@77 is older and never hit.
        x2 = x1 + list(ox.token_ids) + tokens(60, 9)
        assert engine.generate(x2, GREEDY).usage.cached_tokens == 77
        assert evictions()["superseded"] == 1
        assert find_snapshot(engine, x1, 77) is None and find_snapshot(engine, y1, 77) is ey1
        ex2 = find_snapshot(engine, x2, 145)
        assert ex2 is not None and not ex2.superseded
        settle(engine, warmed=False)

        # Two retries resume from Y@77 (hits, F = 3) and add no snapshot (fewer than 64 new tokens).
        for i in range(2):
            retry = y1 + list(oy.token_ids)[:7] + tokens(5, 10 + i)
            assert engine.generate(retry, GREEDY).usage.cached_tokens == 77
        assert ey1.hits == 2

        # GDSF, twice: a new conversation needs room. X@145, then W@207 (never hit) are worth less per byte than
        # Y@77 (hit twice) and are evicted; each victim's exclusive path becomes dead KV, which goes before any
        # other snapshot: X0 and X1 free W's room; of W's three blocks one is swept for V's image write.
        w, v = tokens(200, 12), tokens(70, 13)
        for new, frontier, (gone, gone_frontier), gdsf, dead in ((w, 207, (x2, 145), 1, 2), (v, 77, (w, 207), 2, 3)):
            engine.generate(new, GREEDY)
            assert evictions()["gdsf"] == gdsf and evictions()["dead_kv"] == dead
            assert find_snapshot(engine, gone, gone_frontier) is None and find_snapshot(engine, y1, 77) is ey1
            assert find_snapshot(engine, new, frontier) is not None
            settle(engine, warmed=False)
        assert len(index_of(engine).lists.dead) == 2  # dead KV is swept only as far as room is needed

        # The survivor still resumes, from the Host (its image was never on the Device since the slot moved on).
        assert ey1.image_device is ABSENT
        again = engine.generate(y1 + list(oy.token_ids)[:7] + tokens(5, 14), GREEDY)
        assert again.usage.cached_tokens == 77
        assert engine.cache_record(again.request_id)["restored_host_bytes"] > 0
        assert engine.generate(x2, GREEDY).usage.cached_tokens == 0  # X's snapshots are gone
        settle(engine, warmed=False)
    finally:
        engine.stop()


def test_host_cache_0_device_only_eviction_deletes_subtrees(checkpoint, root):
    """§13.3 "host cache 0": the Device-only cache works and unbacked eviction deletes subtrees."""
    engine = Engine.from_pretrained(checkpoint, kv_capacity=20 * 64, host_cache_mib=0, warmup=False, **COMMON)
    try:
        stats = engine.stats()["prefix_cache"]
        assert not stats["host_tier"] and stats["host_slabs"]["capacity"] == 0
        assert engine.options.device_snapshot_slots == 4 and engine.options.max_new_taps == 2  # C + 2, 2
        for seed in range(4):  # fill the 20-page pool with cached blocks and snapshots
            engine.generate(tokens(300, 50 + seed), GREEDY)
        before = engine.stats()["prefix_cache"]
        out = engine.generate(tokens(300, 60), SamplingParams(max_tokens=400, temperature=0, ignore_eos=True))
        assert out.usage.completion_tokens == 400  # grew to 11 of 20 pages by evicting cache, not truncated
        after = engine.stats()["prefix_cache"]
        assert after["device_evicted_unbacked"] > before["device_evicted_unbacked"]
        assert after["nodes_lost"] > 0 and after["host_block_writes"] == 0
        again = tokens(300, 50)
        assert engine.generate(again, GREEDY).token_ids == root.generate(again, GREEDY).token_ids
        settle(engine, warmed=False)
    finally:
        engine.stop()
