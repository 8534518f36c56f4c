"""Chat traffic on the built-in checkpoint (real Qwen3.5 tokenizer and template): a re-rendered history
with the reasoning stripped resumes from the previous turn's generation-opener tap (spec §7.1, §13.3)."""

import pytest

from ninfer_jax import Engine, SamplingParams
from ninfer_jax.frontend import prepare_chat

SYSTEM = "You are a careful assistant for a storage team. " * 30


@pytest.fixture(scope="module")
def engine():
    e = Engine.from_pretrained(None, max_concurrency=2, prefill_chunk=256, max_model_len=2048,
                               kv_capacity=64 * 64, warmup=False)  # compiles only what the chats run
    yield e
    e.stop()


def test_re_rendered_history_with_reasoning_stripped_reuses_the_opener_tap(engine):
    tok = engine.tokenizer
    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "How do I size a slab pool?"}]
    p1 = prepare_chat(tok, turn1, enable_thinking=True)
    out1 = engine.generate(p1, SamplingParams(max_tokens=16, temperature=0))
    assert out1.usage.cached_tokens == 0
    # The client sends the turn back with its reasoning; the template strips it from earlier turns.
    turn2 = turn1 + [
        {"role": "assistant", "content": "Divide the budget by the slab size.", "reasoning_content": "Think."},
        {"role": "user", "content": "And the chunks?"},
    ]
    p2 = prepare_chat(tok, turn2, enable_thinking=True)
    n1 = p1.num_tokens
    shared = next(i for i, (a, b) in enumerate(zip(p1.token_ids, p2.token_ids)) if a != b)
    assert shared >= n1 - 8  # the render diverges only inside the final opener ("<think>\n")
    out2 = engine.generate(p2, SamplingParams(max_tokens=4, temperature=0))
    opener = max(h.position for h in p1.tap_hints if h.kind.name == "GENERATION_OPENER")
    assert out2.usage.cached_tokens == opener // 64 * 64  # the exact opener tap, floored to its block
    # The spec's rules would serve the opener itself here (an exact tap at 318 with a tail; the prompt tail at
    # 320 lies within 64 tokens after it and is dropped). Taps here are 64-aligned without tails (taps.py), so
    # reuse is floor64(opener): at most 63 tokens re-prefilled per re-rendered turn. Recorded in docs/STATUS.md.
    assert opener - out2.usage.cached_tokens < 64
    engine.check_ledger()
