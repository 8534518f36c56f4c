"""The hybrid prefix cache in the engine, Device tier: the spec's §13.3 scenarios on the tiny model (fp32).

Every scenario compares against an engine with no_prefix_reuse on the same checkpoint (the "root" run),
and ends with the index's invariant checker and a leak check.
"""

import dataclasses
import queue

import numpy as np
import pytest

from cache_support import assert_blocks_stored_once, assert_same_output, cancel_mid_prefill, tokens, with_hints
from oracle import ORACLE_VOCAB
from ninfer_jax import Engine, SamplingParams
from ninfer_jax.frontend.prepared_prompt import TapHintKind
from ninfer_jax.prefix_cache import TapPlanOptions, plan_taps

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=5)
COMMON = dict(max_concurrency=8, prefill_chunk=256, max_model_len=2048, output_window=64)


@pytest.fixture(scope="module")
def checkpoint(checkpoint_factory):
    return checkpoint_factory("tiny-dense", "text", seed=41)


@pytest.fixture(scope="module")
def root(checkpoint):
    engine = Engine.from_pretrained(checkpoint, no_prefix_reuse=True, kv_capacity=128 * 64, warmup=False, **COMMON)
    yield engine
    engine.stop()


# 24 snapshot slots: the scenarios share one engine, and without a Host tier a new snapshot only takes a
# slot from a less valuable one (§9.2), which would make each scenario depend on the ones before it.
HPC = {**COMMON, "kv_capacity": 128 * 64, "max_new_taps": 8, "tap_ladder_tokens": 512, "tap_min_gap_tokens": 128,
       "device_snapshot_slots": 24}


def settle(engine, warmed=True):
    """The invariant checker passes and nothing leaked: no private page, slot or pin outlives a request; an engine
    that compiled its steps at startup compiled nothing while serving."""
    engine.check_ledger()
    stats = engine.stats()
    assert stats["pages"]["active"] == 0 and stats["requests"]["running"] == 0
    if warmed:
        assert stats["compiles_since_warmup"] == 0


@pytest.fixture(scope="module")
def shared_hpc(checkpoint):
    engine = Engine.from_pretrained(checkpoint, **HPC)
    yield engine
    engine.stop()


@pytest.fixture()
def hpc(shared_hpc):
    """The cache-on engine; tests use prompts of their own random tokens, so they do not share prefixes."""
    yield shared_hpc
    settle(shared_hpc)


@pytest.fixture()
def special(checkpoint):
    """make(**overrides) -> a cache-on engine with other options, stopped after the test. Its steps compile on
    first use (the shared engine pins that serving compiles nothing)."""
    made = []

    def make(**overrides):
        made.append(Engine.from_pretrained(checkpoint, **{**HPC, "warmup": False, **overrides}))
        return made[-1]

    yield make
    for engine in made:
        settle(engine, warmed=False)
        engine.stop()


def test_resume_from_a_tap_equals_root(hpc, root):
    prompt = tokens(700, 1)
    published = hpc.stats()["prefix_cache"]["taps_published"]
    first = hpc.generate(prompt, GREEDY)
    assert first.usage.cached_tokens == 0
    # Same first 600 tokens, then different: resumes from the deepest tap at or below 600.
    edited = prompt[:600] + tokens(90, 2)
    resumed = hpc.generate(edited, GREEDY)
    assert resumed.usage.cached_tokens > 0 and resumed.usage.cached_tokens % 64 == 0
    assert resumed.usage.cached_tokens <= 600
    assert_same_output(resumed, root.generate(edited, GREEDY))
    assert hpc.stats()["prefix_cache"]["taps_published"] > published


def test_resume_from_an_endpoint_with_a_tail_equals_root(hpc, root):
    prompt = tokens(300, 3)
    # The endpoint needs >= 64 tokens past the prompt-tail tap at 256 (spec §7.7).
    turn1 = hpc.generate(prompt, SamplingParams(max_tokens=70, temperature=0, ignore_eos=True))
    history = prompt + list(turn1.token_ids)
    end = len(history) - 1  # the last generated token never entered the state
    assert end % 64 != 0  # the endpoint carries a tail
    turn2 = history + tokens(40, 4)
    resumed = hpc.generate(turn2, GREEDY)
    assert resumed.usage.cached_tokens == end
    assert_same_output(resumed, root.generate(turn2, GREEDY))


def test_an_endpoint_takes_the_lanes_state_slot_without_a_copy(hpc, root):
    # §7.7: the active image itself becomes the snapshot. The lane and the free snapshot slot swap state slots,
    # so the lane next runs on a slot holding stale state, which a fresh prompt ignores and a resume overwrites.
    runner, copies = hpc.runner, []
    copy_slot = runner.copy_slot
    runner.copy_slot = lambda src, dst: (copies.append((src, dst)), copy_slot(src, dst))[1]
    try:
        prompt = tokens(300, 40)
        lane_slots = hpc.cache_manager.lane_slots.copy()
        endpoints = hpc.stats()["prefix_cache"]["endpoints_published"]
        turn1 = hpc.generate(prompt, SamplingParams(max_tokens=70, temperature=0, ignore_eos=True))
        assert hpc.stats()["prefix_cache"]["endpoints_published"] == endpoints + 1
        assert copies == []  # nothing loaded (a fresh prompt) and nothing copied at the endpoint
        moved = np.flatnonzero(hpc.cache_manager.lane_slots != lane_slots)
        assert len(moved) == 1 and hpc.cache_manager.lane_slots[moved[0]] >= hpc.options.max_concurrency
        fresh = tokens(200, 41)  # runs on the lane's new slot from position 0
        assert_same_output(hpc.generate(fresh, GREEDY), root.generate(fresh, GREEDY))
        turn2 = prompt + list(turn1.token_ids) + tokens(40, 42)
        resumed = hpc.generate(turn2, GREEDY)
        assert resumed.usage.cached_tokens == len(prompt) + len(turn1.token_ids) - 1
        assert len(copies) == 1 and copies[0][0] == lane_slots[moved[0]]  # the endpoint is the lane's old slot
        assert_same_output(resumed, root.generate(turn2, GREEDY))
    finally:
        runner.copy_slot = copy_slot


def test_a_turn_that_stops_on_a_token_leaves_an_endpoint_covering_that_token(hpc, root):
    # Decode runs one round ahead: the round dispatched before the stop token was read feeds it, so the
    # endpoint covers the whole output (stop token included), and its extra sampled token is dropped.
    prompt = tokens(300, 30)
    free_run = root.generate(prompt, SamplingParams(max_tokens=70, temperature=0, ignore_eos=True)).token_ids
    k = next(i for i in range(40, 68) if free_run[i] not in free_run[:i])
    stop = SamplingParams(max_tokens=70, temperature=0, ignore_eos=True, stop_token_ids=[free_run[k]])
    turn1 = hpc.generate(prompt, stop)
    assert turn1.finish_reason == "stop" and turn1.token_ids == free_run[: k + 1]
    history = prompt + list(turn1.token_ids)
    turn2 = history + tokens(40, 31)
    resumed = hpc.generate(turn2, GREEDY)
    assert resumed.usage.cached_tokens == len(history)
    assert_same_output(resumed, root.generate(turn2, GREEDY))


def test_multi_turn_reuses_each_endpoint_exactly_and_the_tail_stays_intact(hpc, root):
    history = tokens(150, 5)
    long = SamplingParams(max_tokens=70, temperature=0, ignore_eos=True, logprobs=5)
    previous_end = 0  # the first turn finds nothing cached
    for turn in range(3):
        out = hpc.generate(history, long)
        assert out.usage.cached_tokens == previous_end
        assert out.token_ids == root.generate(history, long).token_ids
        previous_end = len(history) + len(out.token_ids) - 1
        history = history + list(out.token_ids) + tokens(30, 10 + turn)
    # Two different continuations of one endpoint: the first lane's writes after the tail must not have
    # touched the snapshot's tail page (the tail is copied into a private page, COW).
    base = history[:previous_end]
    a, b = base + tokens(20, 20), base + tokens(20, 21)
    for continuation in (a, b, a):
        out = hpc.generate(continuation, GREEDY)
        assert out.usage.cached_tokens == previous_end
        assert_same_output(out, root.generate(continuation, GREEDY))


def test_edit_deep_in_history_resumes_at_the_deepest_ladder_tap_below_it(hpc):
    prompt = tokens(1500, 6)
    hpc.generate(prompt, GREEDY)
    opts = TapPlanOptions(max_new_taps=8, tap_ladder_tokens=512, tap_min_gap_tokens=128)
    taps = [t.position for t in plan_taps(1500, 0, [], [], options=opts)]
    edit = 700
    expected = max(p for p in taps if p <= edit)
    assert expected > 0
    edited = prompt[:edit] + [(prompt[edit] + 1) % ORACLE_VOCAB] + prompt[edit + 1:]
    assert hpc.generate(edited, GREEDY).usage.cached_tokens == expected


def test_shared_preamble_across_eight_sessions_is_stored_once(hpc, root):
    preamble = tokens(256, 7)
    sessions = [with_hints(preamble + tokens(40 + 7 * i, 30 + i), (256, TapHintKind.END_OF_SYSTEM))
                for i in range(8)]
    hpc.generate(sessions[0], GREEDY)  # publishes a Boundary snapshot at the end of the preamble
    outs = hpc.generate_many(sessions, GREEDY)
    assert all(o.usage.cached_tokens >= 256 for o in outs)
    refs = root.generate_many([s.token_ids.tolist() for s in sessions], GREEDY)
    assert [o.token_ids for o in outs] == [r.token_ids for r in refs]
    hpc.check_ledger()  # also a sync point: the worker settles a round's lanes after their last events
    assert_blocks_stored_once(hpc, preamble)
    assert hpc.stats()["prefix_cache"]["snapshots_by_kind"].get("boundary", 0) >= 1


def test_eight_identical_prompts_arriving_together_are_correct(hpc, root):
    prompt = tokens(333, 8)
    outs = hpc.generate_many([prompt] * 8, GREEDY)
    ref = root.generate(prompt, GREEDY)
    assert all(o.token_ids == ref.token_ids for o in outs)
    again = hpc.generate(prompt, GREEDY)
    assert again.usage.cached_tokens > 0 and again.token_ids == ref.token_ids


def test_cancel_mid_prefill_publishes_its_blocks_and_they_are_reused(hpc, root):
    prompt = tokens(1000, 9)
    cancel_mid_prefill(hpc, prompt, GREEDY)  # cancelled after the first 256-token chunk
    out = hpc.generate(prompt, GREEDY)
    assert 256 <= out.usage.cached_tokens < 1000
    assert out.token_ids == root.generate(prompt, GREEDY).token_ids


def test_active_growth_evicts_cache_and_device_only_eviction_deletes_subtrees(special, root):
    hpc = special(kv_capacity=20 * 64, max_concurrency=2, host_cache_mib=0)  # Device only: eviction deletes
    for seed in range(4):  # fill the 20-page pool with cached blocks and snapshots
        hpc.generate(tokens(300, 50 + seed), GREEDY)
    before = hpc.stats()["prefix_cache"]
    long_run = SamplingParams(max_tokens=600, temperature=0, ignore_eos=True)
    out = hpc.generate(tokens(500, 60), long_run)
    assert out.usage.completion_tokens == 600  # grew to 18 pages by evicting cache, not truncated
    after = hpc.stats()["prefix_cache"]
    assert after["device_evicted_unbacked"] > before["device_evicted_unbacked"]
    assert after["nodes_lost"] > 0  # no Host tier: evicted blocks lose their last copy with their subtree
    hpc.check_ledger()
    again = tokens(300, 50)
    assert hpc.generate(again, GREEDY).token_ids == root.generate(again, GREEDY).token_ids


def test_disabled_requests_leave_nothing_behind(root):
    root.generate_many([tokens(200, 70), tokens(129, 71)], GREEDY)
    stats = root.stats()["prefix_cache"]
    assert stats["enabled"] is False
    assert stats["nodes"] == 0 and stats["snapshots"] == 0 and stats["device_pages_cached"] == 0
    root.check_ledger()


def test_a_disabled_request_in_a_cache_engine_neither_reads_nor_adds(hpc, root):
    """§13.3 "Disabled request": SamplingParams(prefix_cache=False) beside cached traffic leaves the tree and
    the snapshots as they were, reuses nothing, and answers as without a cache."""
    cached = tokens(300, 90)
    hpc.generate(cached, GREEDY)
    keys = ("nodes", "snapshots", "admissions", "reuse_tokens", "blocks_inserted", "snapshots_published")
    before = {k: hpc.stats()["prefix_cache"][k] for k in keys}
    off = dataclasses.replace(GREEDY, prefix_cache=False)
    prompts = [cached + tokens(20, 92), tokens(250, 91)]
    outs = hpc.generate_many(prompts, off)
    assert [o.usage.cached_tokens for o in outs] == [0, 0]
    assert {k: hpc.stats()["prefix_cache"][k] for k in keys} == before
    assert hpc.cache_record(outs[0].request_id)["source"] == "disabled"
    for out, prompt in zip(outs, prompts):
        assert_same_output(out, root.generate(prompt, GREEDY))
    assert hpc.generate(prompts[1], GREEDY).usage.cached_tokens == 0  # its blocks were never inserted


def test_usage_cached_tokens_equal_the_index_reuse_tokens(hpc):
    prompt = tokens(400, 12)
    before = hpc.stats()["prefix_cache"]["reuse_tokens"]
    outs = [hpc.generate(prompt + tokens(10, 80 + i), GREEDY) for i in range(3)]
    reported = sum(o.usage.cached_tokens for o in outs)
    assert reported == hpc.stats()["prefix_cache"]["reuse_tokens"] - before > 0


def test_align_policy_keeps_only_the_last_chunk_boundary(special, root):
    hpc = special(cache_policy="align")
    prompt = tokens(700, 13)
    hpc.generate(prompt, GREEDY)
    stats = hpc.stats()["prefix_cache"]
    assert stats["snapshots_by_kind"] == {"tap": 1} and stats["endpoints_published"] == 0
    out = hpc.generate(prompt + tokens(5, 14), GREEDY)
    assert out.usage.cached_tokens == 512  # the last 256-token chunk boundary below n - 1
    assert out.token_ids == root.generate(prompt + tokens(5, 14), GREEDY).token_ids


def test_taps_inside_a_chunk_match_a_separate_run_to_the_tap(special, root):
    # prefill_chunk 256: taps at 64-aligned positions inside a chunk are written by the kernel's state tap.
    # An empty cache with free slots: superseded taps keep their slots until a slot is needed (§9.2).
    hpc = special()
    prompt = tokens(500, 15)
    hints = [(200, TapHintKind.GENERATION_OPENER), (333, TapHintKind.END_OF_TOOLS)]
    published = hpc.stats()["prefix_cache"]["taps_published"]
    hpc.generate(with_hints(prompt, *hints), GREEDY)
    assert hpc.stats()["prefix_cache"]["taps_published"] - published == 3  # 200 -> 192, 333 -> 320, tail 448
    for cut in (192, 320):
        probe = prompt[:cut] + tokens(30, 90 + cut)
        out = hpc.generate(probe, GREEDY)
        assert out.usage.cached_tokens == cut
        assert_same_output(out, root.generate(probe, GREEDY))


def test_coalesced_sibling_waits_for_the_boundary_at_the_divergence(special, root):
    # §12.2: B shares 1000 tokens with A, which is still prefilling; B waits for A's snapshot at 960
    # (the block boundary below the divergence) instead of prefilling the shared prefix again.
    hpc = special(concurrent_prefill=True, max_concurrency=2)
    a = tokens(1200, 16)
    b = a[:1000] + tokens(100, 17)
    out_a, out_b = hpc.generate_many([a, b], GREEDY)
    assert out_a.usage.cached_tokens == 0
    assert out_b.usage.cached_tokens == 960
    stats = hpc.stats()["prefix_cache"]
    assert stats["coalesce_waits"] == 1 and stats["coalesce_taps"] == 1
    assert_same_output(out_b, root.generate(b, GREEDY))
    assert out_a.token_ids == root.generate(a, GREEDY).token_ids


def test_n_samples_of_one_prompt_compute_it_once(hpc, root):
    # The first sample prefills; the others wait for its Boundary tap at their divergence (the prompt's last full
    # block) and resume there: each computes fewer than 64 prompt tokens, and a greedy sample equals no reuse.
    prompt = tokens(700, 77)
    samplings = [GREEDY, GREEDY] + [SamplingParams(max_tokens=8, temperature=1.0, seed=s, ignore_eos=True)
                                    for s in (1, 2)]
    boxes = [queue.SimpleQueue() for _ in samplings]
    before = hpc.stats()["tokens"]["prompt"]
    hpc.submit_samples(prompt, samplings, [box.put for box in boxes])
    outs = []
    for box in boxes:
        events = [box.get(timeout=60)]
        while events[-1].finish_reason is None:
            events.append(box.get(timeout=60))
        outs.append((sum((ev.token_ids for ev in events), ()), events[-1].usage))
    assert [usage.cached_tokens for _, usage in outs] == [0, 640, 640, 640]
    assert hpc.stats()["tokens"]["prompt"] - before == 700 + 3 * 60
    reference = root.generate(prompt, GREEDY).token_ids
    assert outs[0][0] == outs[1][0] == reference
    assert outs[2][0] != outs[3][0]  # other seeds, other samples


def test_salted_prompts_share_the_cache_only_with_their_own_salt(hpc, root):
    # vLLM's cache_salt: one tenant's requests never resume from another's blocks, taps or endpoints, and a
    # resume under a salt equals no reuse. A prompt shorter than a block puts the salt on the block its
    # generated tokens complete.
    def salted(ids, salt):
        return {"prompt_token_ids": ids, "cache_salt": salt} if salt else ids

    for prompt in (tokens(300, 190), tokens(40, 191)):
        turn1 = hpc.generate(salted(prompt, "tenant-a"), SamplingParams(max_tokens=70, temperature=0, ignore_eos=True))
        assert turn1.usage.cached_tokens == 0
        turn2 = prompt + list(turn1.token_ids) + tokens(10, 192)
        reference = root.generate(turn2, GREEDY)
        for salt in ("tenant-b", None):
            other = hpc.generate(salted(turn2, salt), GREEDY)
            assert other.usage.cached_tokens == 0
            assert_same_output(other, reference)
        resumed = hpc.generate(salted(turn2, "tenant-a"), GREEDY)
        assert resumed.usage.cached_tokens == len(prompt) + 69  # turn 1's endpoint
        assert_same_output(resumed, reference)


def test_identical_prompts_of_two_salts_do_not_coalesce(special, root):
    hpc = special(concurrent_prefill=True, max_concurrency=2)
    prompt = tokens(1200, 193)
    outs = hpc.generate_many([{"prompt_token_ids": prompt, "cache_salt": salt} for salt in ("a", "b")], GREEDY)
    assert [out.usage.cached_tokens for out in outs] == [0, 0]
    assert hpc.stats()["prefix_cache"]["coalesce_waits"] == 0
    reference = root.generate(prompt, GREEDY)
    for out in outs:
        assert_same_output(out, reference)


def test_a_reset_deletes_what_no_running_request_holds_and_the_running_one_ends_exactly(hpc, root):
    idle = tokens(300, 194)
    hpc.generate(idle, GREEDY)
    running, long = tokens(400, 195), SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    box = queue.SimpleQueue()
    hpc.submit(running, long, sink=box.put)
    events = [box.get(timeout=60)]
    while not events[-1].token_ids:  # its first token: the prompt's taps are published, its blocks held
        events.append(box.get(timeout=60))
    freed = hpc.reset_prefix_cache()
    assert freed["blocks"] >= 4 and freed["snapshots"] >= 2 and freed["pages"] >= 4
    while events[-1].finish_reason is None:
        events.append(box.get(timeout=60))
    assert sum((ev.token_ids for ev in events), ()) == root.generate(running, long).token_ids
    cold = hpc.generate(idle, GREEDY)
    assert cold.usage.cached_tokens == 0
    assert_same_output(cold, root.generate(idle, GREEDY))
    # The running request's blocks stayed; its taps went (unheld), and its end, 55 tokens past the last, made no
    # endpoint: without a state snapshot the prompt starts cold.
    assert_blocks_stored_once(hpc, running)
    assert hpc.generate(running, GREEDY).usage.cached_tokens == 0
