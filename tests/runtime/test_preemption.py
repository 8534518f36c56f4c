"""Preemption when the KV pool cannot extend a running lane: the most junior running request goes back to the queue
and resumes from what the cache kept, and every request ends as it would have alone: its full output, the same
tokens, each streamed once."""

import dataclasses
import logging
import queue

import numpy as np
import pytest

from oracle import ORACLE_VOCAB
from ninfer_jax import Engine, SamplingParams

LONG = 180  # output tokens: 60 + 180 need 4 of the 8 pages, three such lanes 12
GREEDY = SamplingParams(max_tokens=LONG, temperature=0.0, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=LONG, temperature=0.9, seed=7, repetition_penalty=1.3, frequency_penalty=0.2,
                         presence_penalty=0.1, ignore_eos=True)
# Greedy decoding of a tiny random model repeats itself, so penalties decide its tokens: a resumed lane must count
# its output so far
PENALIZED = SamplingParams(max_tokens=LONG, temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5,
                           ignore_eos=True)
CROWDED = dict(max_concurrency=3, prefill_chunk=64, max_model_len=512, kv_capacity=8 * 64, output_window=64)


def _prompts(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, ORACLE_VOCAB, 60).tolist() for _ in range(3)]


@pytest.fixture(scope="module")
def checkpoint(checkpoint_factory):
    return checkpoint_factory("tiny-dense", "text", seed=31)


@pytest.fixture(scope="module")
def alone(checkpoint):
    """Each request's output run by itself in a pool that holds it."""
    with Engine.from_pretrained(checkpoint, max_concurrency=1, prefill_chunk=64, max_model_len=512,
                                kv_capacity=16 * 64, no_prefix_reuse=True) as engine:
        yield lambda prompt, sp: engine.generate(prompt, sp).token_ids


def _stream(engine, prompts, params):
    """Submits in order (so arrival order is submission order) and returns each request's id and events."""
    boxes = [queue.SimpleQueue() for _ in prompts]
    ids = [engine.submit(p, sp, sink=box.put) for p, sp, box in zip(prompts, params, boxes)]
    streams = []
    for box in boxes:
        events = [box.get(timeout=300)]
        while events[-1].finish_reason is None:
            events.append(box.get(timeout=300))
        streams.append(events)
    return ids, streams


@pytest.mark.parametrize("options", [dict(), dict(speculative="ngram", num_speculative_tokens=3, host_cache_mib=0)],
                         ids=["host-tier", "ngram-without-host-tier"])
def test_lanes_the_pool_cannot_extend_preempt_the_youngest_and_every_request_ends_as_alone(checkpoint, alone,
                                                                                          options, caplog):
    prompts = _prompts()
    # speculation verifies drafts only while no lane processes its logits: all greedy there
    params = [GREEDY, GREEDY, GREEDY if options else SAMPLED]
    with caplog.at_level(logging.INFO, logger="ninfer_jax.scheduler"), \
            Engine.from_pretrained(checkpoint, **CROWDED, **options) as engine:
        ids, streams = _stream(engine, prompts, params)
        preempted = [r.getMessage().split()[1] for r in caplog.records if r.getMessage().startswith("preempted")]
        assert preempted and set(preempted) == {ids[2]}  # the most junior, never a senior one
        for prompt, sp, events in zip(prompts, params, streams):
            streamed = sum((e.token_ids for e in events), ())
            assert events[-1].finish_reason == "length" and events[-1].usage.completion_tokens == LONG
            assert streamed == alone(prompt, sp)  # every token once, each the one it would be alone
            assert [e.usage is not None for e in events].count(True) == 2  # admitted once, then the last event
            assert events[-1].usage.prompt_tokens == len(prompt)
        if "host_cache_mib" not in options:  # its state and blocks kept: it resumed from its own endpoint
            assert engine.cache_record(ids[2])["source"] == "endpoint"
        stats = engine.stats()
        assert stats["requests"]["requests_preempted"] == len(preempted)
        assert stats["requests"]["requests_submitted"] == stats["requests"]["requests_admitted"] == 3
        assert stats["pages"]["active"] == 0 and stats["compiles_since_warmup"] == 0
        if options:
            assert stats["speculative"]["verify_rounds"] > 0
        engine.check_ledger()


def test_the_lowest_priority_lane_is_preempted_first_though_it_came_first(checkpoint, alone, caplog):
    prompts = _prompts(seed=1)
    params = [dataclasses.replace(sp, priority=p) for sp, p in ((PENALIZED, 5), (GREEDY, 0), (GREEDY, 0))]
    with caplog.at_level(logging.INFO, logger="ninfer_jax.scheduler"), \
            Engine.from_pretrained(checkpoint, **CROWDED, scheduling_policy="priority") as engine:
        ids, streams = _stream(engine, prompts, params)
        preempted = {r.getMessage().split()[1] for r in caplog.records if r.getMessage().startswith("preempted")}
        assert preempted == {ids[0]}
        outs = [sum((e.token_ids for e in events), ()) for events in streams]
        for prompt, sp, out in zip(prompts, params, outs):
            assert out == alone(prompt, dataclasses.replace(sp, priority=0))
        # its penalties counted its whole output: the tokens before its preemption too (its lane's row, last written)
        counts = np.asarray(engine.runner.sampler_state.counts)
        assert any((row == np.bincount(outs[0], minlength=row.shape[0])).all() for row in counts)
        engine.check_ledger()


def test_mtp_lanes_chained_on_the_device_are_preempted_between_rounds_and_end_as_alone():
    """MTP verify rounds continue the round in flight without reading it; a preemption reads it first. Two lanes of
    40 and 60 prompt tokens and 100 more (3 pages each), admitted with 2 pages each into 4."""
    from ninfer_jax.model.tiny import trained_checkpoint

    prompts, sp = [list(range(100, 140)), list(range(300, 360))], SamplingParams(max_tokens=100, temperature=0.0,
                                                                                 ignore_eos=True)
    with Engine.from_pretrained(trained_checkpoint(), max_concurrency=1, prefill_chunk=64, max_model_len=256,
                                kv_capacity=4 * 64, no_prefix_reuse=True) as engine:
        alone = [engine.generate(p, sp).token_ids for p in prompts]
    with Engine.from_pretrained(trained_checkpoint(), max_concurrency=2, prefill_chunk=64, max_model_len=256,
                                kv_capacity=4 * 64, output_window=64, speculative="mtp",
                                num_speculative_tokens=3) as engine:
        assert [o.token_ids for o in engine.generate_many(prompts, [sp] * 2)] == alone
        stats = engine.stats()
        assert stats["requests"]["requests_preempted"] >= 1 and stats["scheduler"]["chained_rounds"] > 0
        assert stats["compiles_since_warmup"] == 0
        engine.check_ledger()


def test_a_prefilling_request_preempted_scores_its_prompt_once_and_ends_as_alone(checkpoint):
    """With a one-token output window the senior (191 tokens, 3 pages) needs its fourth page at its second token,
    while the junior (400 tokens with prompt logprobs, 7 pages) still prefills in 64-token passes: the junior is
    preempted mid-prompt, and its prompt logprobs come once, equal to its run alone."""
    rng = np.random.default_rng(4)
    senior, junior = (rng.integers(0, ORACLE_VOCAB, n).tolist() for n in (191, 400))
    params = [SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, prompt_logprobs=2)]
    with Engine.from_pretrained(checkpoint, max_concurrency=1, prefill_chunk=64, max_model_len=512,
                                kv_capacity=16 * 64, no_prefix_reuse=True) as engine:
        alone = [engine.generate(p, sp) for p, sp in zip((senior, junior), params)]
    with Engine.from_pretrained(checkpoint, max_concurrency=2, prefill_chunk=64, max_model_len=512,
                                kv_capacity=10 * 64, output_window=1) as engine:
        outs = engine.generate_many([senior, junior], params)
        assert [o.token_ids for o in outs] == [a.token_ids for a in alone]
        assert outs[1].prompt_logprobs == alone[1].prompt_logprobs and len(outs[1].prompt_logprobs) == 400
        assert engine.stats()["requests"]["requests_preempted"] == 1
        engine.check_ledger()


def test_sixteen_lanes_in_a_crowded_pool_preempt_each_other_and_each_ends_as_alone(checkpoint, alone):
    """16 lanes, greedy and seeded sampling, two cancelled mid-stream, in 16 pages with a 16-token output window
    (about ten preemptions on a 2-core CPU, a request sometimes twice): every request that runs to its end has the
    tokens it has alone, a cancelled one a prefix of them, and nothing is left held."""
    rng = np.random.default_rng(9)
    prompts = [rng.integers(0, ORACLE_VOCAB, int(n)).tolist() for n in rng.integers(20, 100, 16)]
    params = [SamplingParams(max_tokens=int(m), ignore_eos=True, **(dict(temperature=0.8, seed=i) if i % 3 else
                                                                    dict(temperature=0.0)))
              for i, m in enumerate(rng.integers(100, 250, 16))]
    with Engine.from_pretrained(checkpoint, max_concurrency=16, prefill_chunk=64, max_model_len=512,
                                kv_capacity=16 * 64, output_window=16) as engine:
        boxes = [queue.SimpleQueue() for _ in prompts]
        ids = [engine.submit(p, sp, sink=box.put) for p, sp, box in zip(prompts, params, boxes)]
        streams = {}
        for i in (5, 11):  # cancelled once they have streamed 20 tokens
            events = [boxes[i].get(timeout=300)]
            while sum(len(e.token_ids) for e in events) < 20 and events[-1].finish_reason is None:
                events.append(boxes[i].get(timeout=300))
            engine.cancel(ids[i])
            streams[i] = events
        for i, box in enumerate(boxes):
            events = streams.get(i, [])
            while not events or events[-1].finish_reason is None:
                events.append(box.get(timeout=300))
            out, want = sum((e.token_ids for e in events), ()), alone(prompts[i], params[i])
            if i in (5, 11):
                assert events[-1].finish_reason == "cancelled" and out == want[:len(out)]
            else:
                assert events[-1].finish_reason == "length" and out == want, i
        stats = engine.stats()
        assert stats["requests"]["requests_preempted"] >= 4, stats["requests"]
        assert stats["pages"]["active"] == 0 and stats["requests"]["running"] == 0
        assert stats["compiles_since_warmup"] == 0
        engine.check_ledger()
