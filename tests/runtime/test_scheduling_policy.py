"""The scheduling policy: with "priority" (vLLM's), waiting requests get a lane lower priority values first, arrival
breaking ties; with "fcfs" (the default) a request's priority must be 0. Between running lanes, prefill passes go
oldest first and every decoding lane gains a token each round."""

import threading

import numpy as np
import pytest

from oracle import ORACLE_VOCAB
from ninfer_jax import Engine, InvalidRequestError, SamplingParams

COMMON = dict(max_concurrency=1, prefill_chunk=64, max_model_len=512, kv_capacity=64 * 64, no_prefix_reuse=True,
              warmup=False)


@pytest.fixture(scope="module")
def checkpoint(checkpoint_factory):
    return checkpoint_factory("tiny-dense", "text", seed=7)


def _prompt(seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, ORACLE_VOCAB, 24).tolist()


def test_waiting_requests_get_the_lane_by_priority_then_arrival(checkpoint):
    engine = Engine.from_pretrained(checkpoint, scheduling_policy="priority", **COMMON)
    try:
        finished, started, done = [], threading.Event(), threading.Event()

        def sink(name):
            def put(event):
                started.set()
                if event.finish_reason is not None:
                    finished.append(name)
                    if len(finished) == 5:
                        done.set()
            return put

        # The one lane decodes "first" for a while; the rest queue behind it in the order they are sent.
        engine.submit(_prompt(0), SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True), sink=sink("first"))
        assert started.wait(300)
        for name, priority in (("low", 5), ("mid-a", 1), ("mid-b", 1), ("urgent", -2)):
            engine.submit(_prompt(len(name)), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True,
                                                             priority=priority), sink=sink(name))
        assert done.wait(300)
        assert finished == ["first", "urgent", "mid-a", "mid-b", "low"]
        engine.check_ledger()
    finally:
        engine.stop()


def test_a_priority_is_refused_under_first_come_first_served_and_must_be_an_integer(checkpoint):
    engine = Engine.from_pretrained(checkpoint, **COMMON)
    try:
        with pytest.raises(InvalidRequestError, match="scheduling_policy 'priority'"):
            engine.submit(_prompt(1), SamplingParams(max_tokens=2, priority=3))
        assert engine.generate(_prompt(1), SamplingParams(max_tokens=2, priority=0)).finish_reason == "length"
    finally:
        engine.stop()
    with pytest.raises(ValueError, match="priority must be an integer"):
        SamplingParams(priority=1.5)


def test_prompts_prefill_in_arrival_order_and_every_decoding_lane_gains_a_token_each_round(checkpoint):
    """Fairness between lanes: the oldest prefilling lane's pass goes first (a long prompt ahead holds later ones
    back, FIFO as admission), and every lane that decodes gains one token in every round, however many run."""
    lengths = [200, 30, 130, 30, 90, 60, 30, 150]  # several passes of 64 for some, one for others
    prompts = [np.random.default_rng(10 + i).integers(0, ORACLE_VOCAB, n).tolist() for i, n in enumerate(lengths)]
    sent, done = [], threading.Event()  # every request's tokens so far, at each event in the order they are sent
    counts = [0] * len(prompts)

    def sink(i):
        def put(event):
            counts[i] += len(event.token_ids)
            sent.append(tuple(counts))
            if event.finish_reason is not None and all(c == 20 for c in counts):
                done.set()
        return put

    with Engine.from_pretrained(checkpoint, **{**COMMON, "max_concurrency": len(prompts)}) as engine:
        for i, prompt in enumerate(prompts):
            engine.submit(prompt, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True), sink=sink(i))
        assert done.wait(300)
        engine.check_ledger()

    def nth(i, n):  # where request i's n-th token was sent
        return next(k for k, c in enumerate(sent) if c[i] >= n)

    firsts = [nth(i, 1) for i in range(len(prompts))]
    assert firsts == sorted(firsts)  # first tokens in arrival order
    for a in range(len(prompts)):
        for b in range(a + 1, len(prompts)):
            # once b's rounds begin (its first token, from its prompt's last pass, is read after the next round is
            # dispatched) until a ends, a stays the same number of tokens ahead, give or take the one a step's round
            # sends a before b
            window = [c[a] - c[b] for c in sent[nth(b, 2):] if c[a] < 20]
            assert window and max(window) - min(window) <= 1, (a, b, window)
