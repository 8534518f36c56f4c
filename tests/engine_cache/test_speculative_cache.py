"""Speculative decoding composed with the hybrid prefix cache: only committed tokens enter the cache, so every
resume source (an endpoint with its tail, a tap, the Host tier alone, the cache file) gives the tokens that no
reuse gives, and a conversation is served from cache exactly as much as with speculation off."""

import numpy as np
import pytest

from cache_support import settle_host, tokens
from ninfer_jax import Engine, SamplingParams

TURN = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
COMMON = dict(max_concurrency=2, prefill_chunk=64, max_model_len=1024, output_window=64, warmup=False)
CACHE = {**COMMON, "kv_capacity": 32 * 64, "device_snapshot_slots": 4, "host_cache_mib": 16}


class Continuations:
    """Drafts what the no-reuse engine emitted after the same tokens, every third proposal one token wrong: verify
    rounds keep long runs of drafts and reject some."""

    def __init__(self):
        self.known: list[np.ndarray] = []
        self.calls = 0

    def add(self, prompt, output) -> None:
        self.known.append(np.asarray(list(prompt) + list(output), np.int32))

    def propose(self, seq, limit):
        for full in self.known:
            if len(seq) < len(full) and np.array_equal(full[:len(seq)], seq):
                drafts = full[len(seq):len(seq) + min(3, limit)].copy()
                self.calls += 1
                if self.calls % 3 == 0 and len(drafts) > 1:
                    drafts[1] += 1
                return drafts
        return seq[:0]


@pytest.fixture(scope="module")
def checkpoint(checkpoint_factory):
    return checkpoint_factory("tiny-dense", "text", seed=41)


def speculating(checkpoint, kind: str, drafts: Continuations, file) -> Engine:
    """An engine with `kind` speculation whose verified drafts are the scripted ones. With MTP the device's own
    drafts (and the MTP pages and carried hidden that make them) are still computed every round: they are what the
    cache must hold exactly; the scripted drafts replace them after each round, so rounds keep drafts."""
    engine = Engine.from_pretrained(checkpoint, speculative=kind, prefix_cache_file=str(file), **CACHE)
    if kind == "ngram":
        engine.scheduler.proposer = drafts
        return engine
    retire = engine.scheduler._retire_verify

    def retire_and_script(done):
        retire(done)
        for req in done.reqs:
            req.drafts = drafts.propose(req.sequence(), 3)

    engine.scheduler._retire_verify = retire_and_script
    engine.scheduler.chain_rounds = False  # the scripted drafts replace the device's after each read
    return engine


@pytest.fixture(scope="module")
def root(checkpoint):
    """The no-reuse engine, shared by both drafters (it keeps nothing between requests)."""
    engine = Engine.from_pretrained(checkpoint, no_prefix_reuse=True, kv_capacity=64 * 64, **COMMON)
    yield engine
    engine.stop()


@pytest.mark.parametrize("kind", ["ngram", "mtp"])
def test_every_resume_source_with_speculation_equals_no_reuse(checkpoint, root, tmp_path, kind):
    drafts = Continuations()
    file = tmp_path / "spec.cache"
    plain = Engine.from_pretrained(checkpoint, **CACHE)
    spec = speculating(checkpoint, kind, drafts, file)

    def turn(prompt, engines=(plain, spec)):
        expected = root.generate(prompt, TURN)
        drafts.add(prompt, expected.token_ids)
        outs = [e.generate(prompt, TURN) for e in engines]
        for out in outs:
            assert out.token_ids == expected.token_ids
        assert outs[-1].metrics.accepted_tokens > 0  # the speculating engine kept drafts
        return outs

    try:
        first = tokens(120, 1)  # its prompt-tail tap at 64: the endpoint at 160 is past it by >= 64 (§7.7)
        turn(first)
        # an endpoint with its tail: the first turn but its last token (ended by max_tokens, it was never fed)
        second = first + list(root.generate(first, TURN).token_ids) + tokens(30, 2)
        a, b = turn(second)
        assert a.usage.cached_tokens == b.usage.cached_tokens == 120 + 39
        # a tap: an edit past the prompt-tail tap of another conversation (at 192) resumes from that tap
        other = tokens(200, 3)
        turn(other)
        a, b = turn(other[:195] + tokens(20, 6))
        assert a.usage.cached_tokens == b.usage.cached_tokens == 192
        # the Host tier alone
        # (40 new tokens: its endpoint is >= 64 past its resume point, so the file has it too)
        third = second + list(root.generate(second, TURN).token_ids) + tokens(40, 4)
        for engine in (plain, spec):
            engine.demote_device_cache()
        a, b = turn(third)
        assert a.usage.cached_tokens == b.usage.cached_tokens == len(second) + 39
        assert spec.cache_record(b.request_id)["restored_host_bytes"] > 0
        for engine in (plain, spec):
            settle_host(engine, warmed=False)
        spec.stop()  # an orderly stop saves the Host tier to the file
        # the cache file, read by a new engine
        spec = speculating(checkpoint, kind, drafts, file)
        (c,) = turn(third + list(root.generate(third, TURN).token_ids) + tokens(10, 5), engines=(spec,))
        assert c.usage.cached_tokens == len(third) + 39
        settle_host(spec, warmed=False)
    finally:
        for engine in (plain, spec):
            engine.stop()


def test_mtp_blocks_commit_one_token_behind_the_target_and_taps_wait_for_them(checkpoint):
    """The MTP row of a position needs the next token, so while a lane runs its blocks commit one token behind the
    target (spec §7.4, §7.6): a prefill chunk that ends at a block end leaves that block, and a tap there, to the
    lane's next step, whose first token completes them. Speculation off, blocks commit with the chunk."""
    prompt = tokens(200, 3)  # chunks end at 64, 128, 192 (its prompt-tail tap) and 200
    for kind, lag in ((None, 0), ("mtp", 1)):
        engine = Engine.from_pretrained(checkpoint, speculative=kind, **CACHE)
        manager = engine.scheduler.cache_manager
        seen, computed = [], manager.computed

        def record(req):
            computed(req)
            lane = manager._lanes[req.lane]
            seen.append((req.computed, len(lane.path), [tap.position for tap, *_ in lane.staged]))

        manager.computed = record
        try:
            engine.generate(prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
            assert [n for n, *_ in seen][:4] == [64, 128, 192, 200]
            assert all(blocks == (n - lag) // 64 for n, blocks, _ in seen)
            assert [staged for *_, staged in seen][2:4] == ([[192], []] if lag else [[], []])
            assert engine.stats()["prefix_cache"]["taps_published"] == 1
            engine.check_ledger()
        finally:
            engine.stop()
