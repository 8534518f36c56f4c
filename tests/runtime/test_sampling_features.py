"""Logit processing as vLLM defines it: presence, frequency and repetition penalties, logit_bias, min_tokens, and
JSON output through a grammar's allowed-token masks; a thinking budget; requests without them keep their programs
and tokens."""

import json

import jax
import numpy as np
import pytest

from ninfer_jax import Engine, InvalidRequestError, SamplingParams
from ninfer_jax.runtime.bad_words import BadWords, token_sequences
from ninfer_jax.runtime.sampling import (
    MAX_LOGIT_BIAS, SamplerState, lane_row, mask_words, pack_token_bits, process_logits, set_lane_row,
)
from ninfer_jax.runtime.thinking_budget import ThinkingBudget, think_close_id

PROMPT = list(range(1000, 1040))
X = 4242  # the token the knobs push around (not in PROMPT)


def _greedy(max_tokens=8, **fields):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **fields)


@pytest.fixture(scope="module")
def engine():
    # The built-in checkpoint: its tokenizer is what a grammar compiles against.
    engine = Engine.from_pretrained(None, max_concurrency=4, prefill_chunk=64, max_model_len=256, kv_capacity=2048)
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def least_bias(engine):
    """The least integer bias on X that makes greedy decoding emit only X."""
    lo, hi = 0, 64
    assert set(engine.generate(PROMPT, _greedy(logit_bias={X: hi})).token_ids) == {X}
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if set(engine.generate(PROMPT, _greedy(logit_bias={X: mid})).token_ids) == {X} else (mid, hi)
    return hi


def _reference(logits, prompt_ids, output_ids, sp, allowed_ids, stop_ids, step):
    """vLLM's processing of one row in float64 numpy: allowed tokens, min_tokens, logit_bias, then the penalties."""
    x = logits.astype(np.float64).copy()
    v = len(x)
    keep = np.zeros(v, bool)
    keep[list(allowed_ids)] = True
    x[~keep] = -np.inf
    if step < sp.min_tokens:
        x[list(stop_ids)] = -np.inf
    for token, bias in (sp.logit_bias or {}).items():
        x[token] += bias
    counts = np.bincount(output_ids, minlength=v).astype(np.float64)
    seen = np.zeros(v, bool)
    seen[prompt_ids] = True
    seen |= counts > 0
    rep = np.where(seen, sp.repetition_penalty, 1.0)
    x = np.where(x > 0, x / rep, x * rep)
    return x - sp.frequency_penalty * counts - sp.presence_penalty * (counts > 0)


@pytest.mark.parametrize("step", [pytest.param(0, id="min-tokens-held"), pytest.param(5, id="min-tokens-met")])
def test_processed_logits_equal_a_float64_reference_of_vllms_formula(step):
    rng = np.random.default_rng(7)
    v, lanes = 300, 3
    sp = SamplingParams(max_tokens=8, presence_penalty=0.7, frequency_penalty=-0.4, repetition_penalty=1.3,
                        logit_bias={5: 3.0, 17: -2.5, 299: 100.0}, min_tokens=3, stop_token_ids=[9])
    prompt, output = rng.integers(0, v, 40), rng.integers(0, v, 25)
    allowed = rng.choice(v, 200, replace=False)
    allowed = np.union1d(allowed, [5, 9, 17, 299])
    logits = rng.standard_normal((lanes, v)).astype(np.float32) * 4
    state = SamplerState.empty(lanes, v)
    state = set_lane_row(state, 1, lane_row(sp, prompt, [7], v), np.bincount(output, minlength=v).astype(np.int32))
    lane_of_row = np.array([3, 1, 3], np.int32)  # rows 0 and 2 are padding (lane C)
    masks = np.stack([np.full(mask_words(v), -1, np.int32), pack_token_bits(allowed, v),
                      np.full(mask_words(v), -1, np.int32)])
    got = np.asarray(jax.jit(process_logits)(logits, state, lane_of_row, np.full(lanes, step, np.int32), masks))
    want = _reference(logits[1], prompt, output, sp, allowed, [9, 7], step)
    assert np.array_equal(np.isinf(got[1]), np.isinf(want))
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[1][finite], want[finite], rtol=1e-6, atol=1e-5)
    np.testing.assert_array_equal(got[0], logits[0])  # a padding row's neutral parameters change nothing


def test_logit_bias_of_100_makes_greedy_emit_that_token(engine):
    out = engine.generate(PROMPT, _greedy(logit_bias={str(X): 100}))
    assert out.token_ids == (X,) * 8
    assert X not in engine.generate(PROMPT, _greedy(logit_bias={X: -100})).token_ids


def test_allowed_token_ids_confine_tokens_and_keep_greedy_choices_inside_the_set(engine):
    plain = engine.generate(PROMPT, _greedy(12)).token_ids
    # Each greedy token is its step's argmax, so a set holding them all changes nothing; one without them forces
    # other tokens, greedy and sampled, for every lane of a step that mixes the kinds.
    others = [t for t in range(2000, 2064) if t not in plain]
    assert engine.generate(PROMPT, _greedy(12, allowed_token_ids=[*plain, *others])).token_ids == plain
    outs = engine.generate_many([PROMPT, PROMPT, PROMPT], [
        _greedy(12, allowed_token_ids=others),
        SamplingParams(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True, allowed_token_ids=others[:5]),
        _greedy(12)])
    assert set(outs[0].token_ids) <= set(others) and set(outs[1].token_ids) <= set(others[:5])
    assert outs[2].token_ids == plain
    assert engine.generate(PROMPT, _greedy(3, allowed_token_ids=[X])).token_ids == (X,) * 3
    engine.check_ledger()


class _Words:
    """A tokenizer of fixed spellings (vLLM's bad-word rule cares only about the ids each spelling gives)."""

    IDS = {"hello": [10], " hello": [20], "big cat": [1, 2], " big cat": [3, 2], "x": [5], " x": [6, 7],
           "same": [8], " same": [8]}

    def encode(self, text):
        return self.IDS[text]


def test_bad_words_take_the_spaced_spelling_only_as_another_word_of_the_same_length():
    assert token_sequences(["hello", " big cat", "x", "same"], _Words()) == [(10,), (20,), (1, 2), (3, 2), (5,), (8,)]


def test_a_bad_sequence_bars_its_last_token_only_after_the_rest_of_it():
    words = BadWords([(10,), (1, 2), (3, 4, 40)], vocab=64)
    assert words.follows_output

    def barred(output):
        row = np.full(mask_words(64), -1, np.int32)
        words.apply(row, output)
        bits = np.unpackbits(row.view(np.uint8), bitorder="little")[:64]
        return set(np.flatnonzero(bits == 0).tolist())

    assert barred([]) == {10}
    assert barred([7, 1]) == {10, 2}
    assert barred([1, 7]) == {10}
    assert barred([3, 4]) == {10, 40} and barred([4]) == {10}
    assert not BadWords([(10,), (33,)], vocab=64).follows_output


def _word_of(engine, ids):
    """A text whose bad-word sequences include exactly `ids`, or None."""
    word = engine.tokenizer.decode(list(ids))
    if not word.strip():
        return None
    return word if tuple(ids) in token_sequences([word], engine.tokenizer) else None


def test_bad_words_bar_single_tokens_always_and_a_pairs_last_token_after_its_first(engine):
    plain = engine.generate(PROMPT, _greedy(12)).token_ids
    single = next((t for t in plain if _word_of(engine, [t])), None)
    assert single is not None
    word = _word_of(engine, [single])
    barred = {s[0] for s in token_sequences([word], engine.tokenizer) if len(s) == 1}
    out = engine.generate(PROMPT, _greedy(12, bad_words=[word])).token_ids
    rest = [i for i in range(engine.config.vocab_size) if i not in barred]
    assert single not in out and out == engine.generate(PROMPT, _greedy(12, allowed_token_ids=rest)).token_ids
    # A two-token word barred where plain decoding would complete it, past the first token (the prefill's, read
    # before any round): tokens agree up to its first token, then the second is refused there and the pair appears
    # nowhere, which needs the lane to decode only once the host has read each token.
    i = next(i for i in range(1, len(plain) - 1) if _word_of(engine, plain[i:i + 2]))
    word = _word_of(engine, plain[i:i + 2])
    first_tokens = {s[0] for s in token_sequences([word], engine.tokenizer) if len(s) == 1}
    assert not first_tokens & set(plain[:i + 2])  # no one-token spelling bars an earlier token
    out = engine.generate(PROMPT, _greedy(12, bad_words=[word])).token_ids
    assert out[:i + 1] == plain[:i + 1] and out[i + 1] != plain[i + 1]
    assert all(tuple(out[j:j + 2]) != tuple(plain[i:i + 2]) for j in range(len(out) - 1))
    engine.check_ledger()


def test_n_samples_tokenize_their_bad_words_once_and_each_avoids_them(engine, monkeypatch):
    import queue

    from ninfer_jax.runtime import engine as engine_module

    plain = engine.generate(PROMPT, _greedy(12)).token_ids
    single = next(t for t in plain if _word_of(engine, [t]))
    word = _word_of(engine, [single])
    calls = []

    def counted(words, tokenizer):
        calls.append(words)
        return token_sequences(words, tokenizer)

    monkeypatch.setattr(engine_module, "token_sequences", counted)
    samplings = [_greedy(12, seed=s, bad_words=[word]) for s in range(3)]  # greedy: plain decoding emits `single`
    boxes = [queue.SimpleQueue() for _ in samplings]
    engine.submit_samples(PROMPT, samplings, [box.put for box in boxes])
    for box in boxes:
        tokens, event = [], None
        while event is None or event.finish_reason is None:
            event = box.get(timeout=60)
            tokens += event.token_ids
        assert len(tokens) == 12 and single not in tokens
    assert calls == [(word,)]
    engine.check_ledger()


def test_a_thinking_budget_forces_the_end_of_thinking_once_spent_and_the_model_goes_on_from_it(engine):
    end = think_close_id(engine.tokenizer)
    plain = engine.generate(PROMPT, _greedy(8)).token_ids
    assert end not in plain
    for budget in (0, 3):  # 3: the lane's rounds run ahead of the host until the budget's last token
        out = engine.generate(PROMPT, _greedy(8, thinking_budget=budget)).token_ids
        assert out[:budget] == plain[:budget] and out[budget] == end
        assert out[budget + 1:] == engine.generate(PROMPT + list(out[:budget + 1]), _greedy(7 - budget)).token_ids
    engine.check_ledger()


def test_a_thinking_budget_forces_nothing_once_the_output_has_ended_its_thinking():
    budget, row = ThinkingBudget(2, end_id=37), np.full(mask_words(64), -1, np.int32)
    budget.apply(row, [5, 37, 6])
    assert (row == -1).all() and not budget.follows_output([5, 37, 6])
    fresh = ThinkingBudget(2, end_id=37)
    assert not fresh.follows_output([]) and fresh.follows_output([5])
    fresh.apply(row, [5, 6])
    assert np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")).tolist() == [37]
    with pytest.raises(ValueError, match="thinking_budget"):
        SamplingParams(thinking_budget=-1)


def test_presence_and_frequency_penalties_break_greedy_repeats(engine, least_bias):
    def repeats(bias, **penalty):
        return engine.generate(PROMPT, _greedy(logit_bias={X: bias}, **penalty)).token_ids.count(X)

    # Below the least bias X wins some steps; a penalty of 2 takes 2 off its bias once it has appeared (presence)
    # or per appearance (frequency), so over the biases just below it wins fewer steps, and more with -2.
    below = range(max(0, least_bias - 4), least_bias)
    plain = sum(repeats(b) for b in below)
    assert sum(repeats(b, presence_penalty=2.0) for b in below) < plain
    assert sum(repeats(b, frequency_penalty=2.0) for b in below) < plain
    assert sum(repeats(b, presence_penalty=-2.0) for b in below) > plain
    # Well above: presence costs X once, which its margin covers; frequency costs it per repeat, which it cannot.
    above = least_bias + 3
    assert repeats(above, presence_penalty=2.0) == 8 > repeats(above, frequency_penalty=2.0)


def test_repetition_penalty_covers_prompt_and_output_tokens(engine):
    biased = _greedy(logit_bias={X: 30}, repetition_penalty=100.0)
    out = engine.generate(PROMPT, biased)
    assert out.token_ids[0] == X and X not in out.token_ids[1:]  # X once in the output: penalised since
    assert engine.generate(PROMPT + [X], biased).token_ids[0] != X  # X in the prompt: penalised from the start
    assert engine.generate(PROMPT + [X], _greedy(logit_bias={X: 30})).token_ids[0] == X


def test_min_p_of_one_leaves_only_the_likeliest_token(engine):
    greedy = engine.generate(PROMPT, _greedy(12)).token_ids
    sampled = [SamplingParams(max_tokens=12, temperature=1.5, seed=s, ignore_eos=True, min_p=m)
               for s in (1, 2) for m in (1.0, 0.0)]
    outs = [o.token_ids for o in engine.generate_many([PROMPT] * 4, sampled)]
    assert outs[0] == outs[2] == greedy  # min_p 1: the argmax alone survives, whatever the seed
    assert outs[1] != greedy or outs[3] != greedy  # without it the draw strays at this temperature


def test_a_stop_string_stays_in_the_text_when_asked(engine):
    text = engine.generate(PROMPT, _greedy(16)).text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert len(stop) == 3 and stop in text
    cut = text[:text.index(stop)]
    assert engine.generate(PROMPT, _greedy(16, stop=stop)).text == cut
    assert engine.generate(PROMPT, _greedy(16, stop=stop, include_stop_str_in_output=True)).text == cut + stop


def test_special_tokens_reach_the_text_unless_skipped(engine):
    start = engine.tokenizer.encode("<|im_start|>")
    assert len(start) == 1 and start[0] in engine.tokenizer.special_token_ids
    forced = dict(logit_bias={start[0]: 100.0})
    assert engine.generate(PROMPT, _greedy(3, **forced)).text == ""
    assert engine.generate(PROMPT, _greedy(3, skip_special_tokens=False, **forced)).text == "<|im_start|>" * 3


def test_min_tokens_holds_back_stop_tokens(engine):
    stop_at_x = dict(max_tokens=8, temperature=0.0, logit_bias={X: 30}, stop_token_ids=[X])
    assert engine.generate(PROMPT, SamplingParams(**stop_at_x)).token_ids == (X,)
    out = engine.generate(PROMPT, SamplingParams(min_tokens=4, **stop_at_x))
    assert len(out.token_ids) == 5 and out.token_ids[4] == X and out.finish_reason == "stop"


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}


def _check_schema(value):
    assert set(value) == {"name", "age", "tags", "ok"}
    assert isinstance(value["name"], str) and len(value["name"]) <= 6
    assert isinstance(value["age"], int) and 0 <= value["age"] <= 120
    assert isinstance(value["tags"], list) and len(value["tags"]) <= 3 and set(value["tags"]) <= {"a", "b"}
    assert isinstance(value["ok"], bool)


@pytest.mark.parametrize("temperature", [pytest.param(0.0, id="greedy"), pytest.param(1.0, id="sampled")])
def test_a_json_schema_response_parses_and_validates_from_random_weights(engine, temperature):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    plain = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    # Beside requests without a grammar, which keep decoding one round ahead and their tokens.
    solo = engine.generate(PROMPT, plain)
    outs = engine.generate_many([PROMPT, PROMPT[:20], PROMPT], [
        plain, SamplingParams(max_tokens=80, temperature=temperature, seed=1, response_format=fmt), plain])
    _check_schema(json.loads(outs[1].text))
    assert outs[1].finish_reason == "stop"
    assert outs[0].token_ids == outs[2].token_ids == solo.token_ids


def test_json_object_output_starts_an_object(engine):
    json_mode = SamplingParams(max_tokens=6, temperature=0.0, response_format={"type": "json_object"})
    out = engine.generate(PROMPT, json_mode)
    assert out.text.startswith("{")


@pytest.mark.parametrize("temperature", [pytest.param(0.0, id="greedy"), pytest.param(1.0, id="sampled")])
def test_regex_choice_and_grammar_outputs_match_their_constraint(engine, temperature):
    """vLLM's guided_regex, guided_choice and guided_grammar (Lark) as response_format types: the whole output
    matches and the request ends when its constraint is complete."""
    import re

    def ask(fmt, max_tokens=40):
        return engine.generate(PROMPT, SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=2,
                                                      response_format=fmt))

    out = ask({"type": "regex", "regex": "[0-9]{3}-[a-z]{2}"})
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", out.text) and out.finish_reason == "stop"
    choices = ["yes", "no", 'maybe "so"']
    out = ask({"type": "choice", "choice": choices})
    assert out.text in choices and out.finish_reason == "stop"
    out = ask({"type": "grammar", "grammar": 'start: "(" NUM ("," NUM)* ")"\nNUM: /[0-9]{1,3}/'}, 80)
    assert re.fullmatch(r"\([0-9]{1,3}(,[0-9]{1,3})*\)", out.text) or (
        out.finish_reason == "length" and re.fullmatch(r"\([0-9,]*", out.text)), out.text


def test_requests_without_the_features_keep_their_tokens_and_nothing_compiles(engine):
    before = engine.generate(PROMPT, _greedy(12))
    sampled = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True)
    sampled_before = engine.generate(PROMPT, sampled)
    # A processed request with a neutral bias samples what the plain programs sample.
    assert engine.generate(PROMPT, _greedy(12, logit_bias={X: 0.0})).token_ids == before.token_ids
    assert engine.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=5,
                                                  ignore_eos=True, logit_bias={X: 0.0})).token_ids \
        == sampled_before.token_ids
    mixed = engine.generate_many([PROMPT, PROMPT], [_greedy(12), _greedy(12, frequency_penalty=2.0)])
    assert mixed[0].token_ids == before.token_ids
    assert engine.stats()["compiles_since_warmup"] == 0
    engine.check_ledger()


@pytest.mark.parametrize("fields, words", [
    pytest.param({"presence_penalty": 2.5}, "presence_penalty", id="presence"),
    pytest.param({"frequency_penalty": -3}, "frequency_penalty", id="frequency"),
    pytest.param({"repetition_penalty": 0.0}, "repetition_penalty", id="repetition"),
    pytest.param({"logit_bias": {"7": 101}}, "logit_bias", id="bias-value"),
    pytest.param({"logit_bias": {"x": 1}}, "logit_bias", id="bias-key"),
    pytest.param({"logit_bias": {i: 1 for i in range(MAX_LOGIT_BIAS + 1)}}, "logit_bias", id="bias-entries"),
    pytest.param({"min_tokens": 20}, "min_tokens", id="min-tokens"),
    pytest.param({"allowed_token_ids": []}, "allowed_token_ids", id="allowed-empty"),
    pytest.param({"allowed_token_ids": [3, -1]}, "allowed_token_ids", id="allowed-negative"),
    pytest.param({"allowed_token_ids": "12"}, "allowed_token_ids", id="allowed-string"),
    pytest.param({"bad_words": "word"}, "bad_words", id="bad-words-string"),
    pytest.param({"bad_words": ["ok", " "]}, "bad_words", id="bad-words-blank"),
    pytest.param({"response_format": {"type": "xml"}}, "response_format", id="format"),
    pytest.param({"response_format": {"type": "regex", "regex": ""}}, "response_format.regex", id="regex"),
    pytest.param({"response_format": {"type": "choice", "choice": []}}, "response_format.choice", id="choice"),
    pytest.param({"response_format": {"type": "grammar"}}, "response_format.grammar", id="grammar"),
])
def test_bad_values_are_refused_naming_the_field(fields, words):
    with pytest.raises(ValueError, match=words):
        SamplingParams(max_tokens=8, **fields)


def test_the_engine_refuses_out_of_vocabulary_bias_and_bad_schemas_before_any_work(engine):
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        engine.generate(PROMPT, _greedy(logit_bias={engine.config.vocab_size: 1.0}))
    with pytest.raises(InvalidRequestError, match="allowed_token_ids"):
        engine.generate(PROMPT, _greedy(allowed_token_ids=[5, engine.config.vocab_size]))
    with pytest.raises(InvalidRequestError, match="response_format"):
        engine.generate(PROMPT, SamplingParams(response_format={
            "type": "json_schema", "json_schema": {"schema": {"type": "object", "$ref": "#/nowhere"}}}))
    with pytest.raises(InvalidRequestError, match="response_format.regex"):
        engine.generate(PROMPT, SamplingParams(response_format={"type": "regex", "regex": "("}))
    with pytest.raises(InvalidRequestError, match="response_format.grammar"):
        engine.generate(PROMPT, SamplingParams(response_format={"type": "grammar", "grammar": "start: nope"}))
    assert engine.generate(PROMPT, _greedy(2)).finish_reason == "length"
