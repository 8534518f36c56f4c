"""A seeded random workload through a small, crowded cache: follow-up turns, edits, repeats and fresh prompts, under
two salts and none, sometimes a cancelled request among them, n samples, a request with prompt logprobs, a quarter
of them confined to allowed tokens, a Device demotion, a reset and a restart from the cache file. Every greedy
output equals the no-reuse engine's, and the index's invariants and the ledger hold after every batch. (The workload
that found salted hash chains built on rounded keys.)"""

import dataclasses
import queue
import random

import pytest

from cache_support import ORACLE_VOCAB, settle_host, tokens
from ninfer_jax import Engine, SamplingParams

COMMON = dict(max_concurrency=4, prefill_chunk=128, max_model_len=1024, output_window=64, warmup=False)
# Few pages, slots and Host slabs: admissions evict, snapshots take each other's slots, the Host tier fills.
CACHE = dict(kv_capacity=40 * 64, device_snapshot_slots=6, host_cache_mib=4, concurrent_prefill=True, max_new_taps=4,
             tap_ladder_tokens=256, tap_min_gap_tokens=64)
BATCHES = 24


@pytest.fixture(scope="module")
def checkpoint(checkpoint_factory):
    return checkpoint_factory("tiny-dense", "text", seed=7)


def _drain(box):
    events = [box.get(timeout=120)]
    while events[-1].finish_reason is None:
        events.append(box.get(timeout=120))
    return sum((e.token_ids for e in events), ())


def test_a_random_workload_equals_no_reuse_through_evictions_resets_and_a_restart(checkpoint, tmp_path):
    rng = random.Random(5)
    constraints = random.Random(11)  # apart from rng, so the prompts stay the workload they were
    root = Engine.from_pretrained(checkpoint, no_prefix_reuse=True, kv_capacity=64 * 64, **COMMON)
    options = {**COMMON, **CACHE, "prefix_cache_file": str(tmp_path / "prefix.cache")}
    engine = Engine.from_pretrained(checkpoint, **options)
    references = {}

    def reference(ids, sp):
        key = (tuple(ids), sp.max_tokens, sp.allowed_token_ids)
        if key not in references:
            references[key] = root.generate(list(ids), sp).token_ids
        return references[key]

    histories = [tokens(rng.randrange(50, 300), 900 + i) for i in range(3)]
    cached = 0
    try:
        for batch_index in range(BATCHES):
            batch = []
            for _ in range(rng.randrange(1, 5)):
                history, kind = rng.choice(histories), rng.random()
                if kind < 0.5:  # a next turn
                    ids = history + tokens(rng.randrange(1, 80), rng.randrange(10**6))
                elif kind < 0.65:  # an edit inside the history
                    ids = history[:rng.randrange(1, len(history))] + tokens(rng.randrange(1, 60), rng.randrange(10**6))
                elif kind < 0.8:  # the same prompt again
                    ids = list(history)
                else:
                    ids = tokens(rng.randrange(10, 400), rng.randrange(10**6))
                salt = rng.choice([None, None, "a", "b"])
                allowed = tuple(constraints.sample(range(ORACLE_VOCAB), 40)) if constraints.random() < 0.25 else None
                sp = SamplingParams(max_tokens=rng.choice([1, 5, 40]), temperature=0.0, ignore_eos=True,
                                    allowed_token_ids=allowed)
                batch.append((ids[:900], salt, sp))
            prompts = [{"prompt_token_ids": ids, "cache_salt": salt} if salt else ids for ids, salt, _ in batch]
            action = batch_index % 6
            if action == 1:  # all at once, one of them cancelled mid-way
                boxes = [queue.SimpleQueue() for _ in batch]
                ids = [engine.submit(p, sp, sink=box.put) for p, (_, _, sp), box in zip(prompts, batch, boxes)]
                engine.cancel(ids[-1])
                for i, ((prompt_ids, _, sp), box) in enumerate(zip(batch, boxes)):
                    out = _drain(box)
                    want = reference(prompt_ids, sp)
                    assert out == want[:len(out)] if i == len(batch) - 1 else out == want
            elif action == 3:  # three samples of the first prompt, then the rest with prompt logprobs
                (prompt_ids, _, sp), boxes = batch[0], [queue.SimpleQueue() for _ in range(3)]
                engine.submit_samples(prompts[0], [sp] * 3, [box.put for box in boxes])
                assert all(_drain(box) == reference(prompt_ids, sp) for box in boxes)
                for prompt, (prompt_ids, _, sp) in zip(prompts[1:], batch[1:]):
                    scored = dataclasses.replace(sp, prompt_logprobs=0)
                    assert engine.generate(prompt, scored).token_ids == reference(prompt_ids, sp)
            else:
                outs = engine.generate_many(prompts, [sp for _, _, sp in batch])
                for out, (prompt_ids, salt, sp) in zip(outs, batch):
                    assert out.token_ids == reference(prompt_ids, sp), (batch_index, salt, out.usage)
                    cached += out.usage.cached_tokens
                    if salt is None:
                        histories = (histories + [prompt_ids + list(out.token_ids)])[-6:]
            if batch_index == 9:  # the cache moves to the Host; a prompt again resumes from there alone
                long, sp = tokens(400, 990), SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
                assert engine.generate(long, sp).token_ids == reference(long, sp)
                assert engine.demote_device_cache()["pages"] > 0
                again = engine.generate(long, sp)
                assert again.token_ids == reference(long, sp)
                restored = engine.cache_record(again.request_id)["restored_host_bytes"]
            if batch_index == 15:
                assert engine.reset_prefix_cache()["blocks"] > 0
            if batch_index == 19:  # a restart from the cache file
                settle_host(engine, warmed=False)
                engine.stop()
                engine = Engine.from_pretrained(checkpoint, **options)
                assert engine.cache_load.outcome == "restored" and engine.cache_load.blocks > 0
            settle_host(engine, warmed=False)
        # the workload reused the cache (from the Host too, after the demotion) and crowded it
        stats = engine.stats()["prefix_cache"]
        assert cached > 1000 and restored > 0 and stats["host_evictions"]["gdsf"] > 0 and stats["nodes_lost"] > 0
    finally:
        engine.stop()
        root.stop()
