"""The checkpoint's generation_config.json defaults (engine.sampling_defaults) fill what a request leaves unset on
every route, and whatever a request sets wins."""

from __future__ import annotations

import pytest

from server_support import ScriptedEngine, claude, oai, server  # noqa: F401 (fixtures)

MODEL = ScriptedEngine.model_name
DEFAULTS = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05, "max_tokens": 100}
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def engine():
    engine = ScriptedEngine()
    engine.sampling_defaults = dict(DEFAULTS)
    return engine


def _last(engine):
    sampling = engine.sampling[-1]
    return {key: getattr(sampling, key) for key in DEFAULTS}


def test_unset_fields_take_the_checkpoints_defaults_and_set_ones_win(oai, claude, engine):
    oai.chat.completions.create(model=MODEL, messages=HI)
    assert _last(engine) == DEFAULTS  # max_tokens: max_new_tokens, under the context's room
    oai.chat.completions.create(model=MODEL, messages=HI, temperature=0.0, max_tokens=7, extra_body={"min_p": 0.3})
    assert _last(engine) == {**DEFAULTS, "temperature": 0.0, "max_tokens": 7, "min_p": 0.3}
    oai.completions.create(model=MODEL, prompt="Hi")
    assert _last(engine) == {**DEFAULTS, "max_tokens": 16}  # the completions API's own default length
    oai.responses.create(model=MODEL, input="Hi", top_p=0.5)
    assert _last(engine) == {**DEFAULTS, "top_p": 0.5}
    claude.messages.create(model=MODEL, messages=HI, max_tokens=9, extra_body={"top_k": 5})
    assert _last(engine) == {**DEFAULTS, "top_k": 5, "max_tokens": 9}


def test_the_default_length_stays_within_the_context(oai, engine):
    engine.sampling_defaults["max_tokens"] = 10**6
    try:
        oai.chat.completions.create(model=MODEL, messages=HI)
        assert engine.sampling[-1].max_tokens == engine.max_model_len - engine.prompts[-1].num_tokens
    finally:
        engine.sampling_defaults["max_tokens"] = DEFAULTS["max_tokens"]
