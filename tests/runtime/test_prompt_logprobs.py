"""Prompt logprobs (`SamplingParams.prompt_logprobs`, vLLM's): each prompt token's log-probability and its top
alternatives, against transformers' full forward; such a request computes its whole prompt (no cache read) and its
generated tokens are those of a plain request."""

import numpy as np
import pytest
import torch

from oracle import ORACLE_VOCAB, hf_model
from ninfer_jax import Engine, SamplingParams

TOP = 5


@pytest.fixture(scope="module")
def checkpoint(checkpoint_factory):
    return checkpoint_factory("tiny-dense", "text", seed=41)


@pytest.fixture(scope="module")
def engine(checkpoint):
    # Passes of 64 tokens (a 150-token prompt takes three) and mixed steps, which a request that scores its prompt
    # must not ride: a running request decodes meanwhile.
    engine = Engine.from_pretrained(checkpoint, max_concurrency=4, prefill_chunk=64, idle_prefill_chunk=128,
                                    max_model_len=512, kv_capacity=32 * 64, mixed_prefill_tokens=64)
    yield engine
    engine.stop()


@pytest.fixture(autouse=True)
def _no_leaks(engine):
    yield
    engine.check_ledger()
    stats = engine.stats()
    assert stats["pages"]["active"] == 0 and stats["requests"]["running"] == 0
    assert stats["compiles_since_warmup"] == 0


def _log_softmax(checkpoint, ids):
    with torch.no_grad():
        logits = hf_model(checkpoint)(torch.tensor(ids)[None]).logits[0].double()
    return torch.log_softmax(logits, -1).numpy()


def test_prompt_logprobs_equal_transformers_at_every_prompt_position(engine, checkpoint):
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, ORACLE_VOCAB, 150).tolist()
    other = rng.integers(0, ORACLE_VOCAB, 20).tolist()
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    plain = engine.generate(prompt, greedy)
    # A request decodes while the scored one prefills: with mixed steps on, its passes still run alone.
    running = engine.submit(other, SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))
    scored = engine.generate(prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                                                    prompt_logprobs=TOP))
    engine.cancel(running)
    assert scored.token_ids == plain.token_ids and plain.prompt_logprobs is None
    assert scored.usage.cached_tokens == 0  # the cache held the prompt: a scored request reads none of it
    logp = _log_softmax(checkpoint, prompt)
    entries = scored.prompt_logprobs
    assert len(entries) == len(prompt) and entries[0] is None
    for i in range(1, len(prompt)):
        row, entry = logp[i - 1], entries[i]
        assert entry["token_id"] == prompt[i]
        assert entry["logprob"] == pytest.approx(row[prompt[i]], abs=1e-4), f"position {i}"
        want = np.argsort(-row, kind="stable")[:TOP]
        assert [t for t, _ in entry["top"]] == want.tolist(), f"position {i}"
        np.testing.assert_allclose([v for _, v in entry["top"]], row[want], atol=1e-4)


def test_prompt_logprobs_past_the_maximum_are_refused():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)


def test_short_prompts_have_an_entry_per_token(engine, checkpoint):
    """Nothing predicts a first token: a one-token prompt has one None; prompt_logprobs=0 keeps each prompt token's
    own logprob and no alternatives."""
    out = engine.generate([5], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=0))
    assert out.prompt_logprobs == (None,)
    out = engine.generate([5, 9, 11], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=0))
    logp = _log_softmax(checkpoint, [5, 9, 11])
    assert [e["top"] for e in out.prompt_logprobs[1:]] == [[], []]
    assert [e["logprob"] for e in out.prompt_logprobs[1:]] == pytest.approx([logp[0, 9], logp[1, 11]], abs=1e-4)


def test_an_engine_without_prompt_logprobs_compiles_none_and_refuses_them(checkpoint):
    with Engine.from_pretrained(checkpoint, max_concurrency=2, prefill_chunk=64, max_model_len=256,
                                kv_capacity=8 * 64, prompt_logprobs=False) as engine:
        assert engine.runner.compile_counts()["scores"] == 0
        with pytest.raises(ValueError, match="prompt_logprobs"):
            engine.generate([1, 2, 3], SamplingParams(max_tokens=1, prompt_logprobs=0))
        assert engine.generate([1, 2, 3], SamplingParams(max_tokens=1)).token_ids
