"""Generated requests against the app in-process (the scripted engine): OpenAI chat completions, completions and
responses (vLLM's request fields on the first two), Anthropic messages and count_tokens. Bodies are mostly
well-formed with fields of any JSON value, lone surrogates, huge and non-finite numbers, deep nesting and the wrong
content type mixed in. No request may get a 5xx or an error inside its stream, and a normal request is served after
each run."""

from __future__ import annotations

import copy
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from ninfer_jax.server.app import create_app
from server_support import ScriptedEngine

MODEL = ScriptedEngine.model_name
EXAMPLES = 500  # per endpoint; each run draws new ones (no example database)
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

def weighted(*choices):
    """One of (weight, strategy) pairs, drawn in proportion to the weights."""
    pool = [strategy for weight, strategy in choices for _ in range(weight)]
    return st.sampled_from(range(len(pool))).flatmap(lambda i: pool[i])


# Text: mostly printable; sometimes any code point, lone surrogates included (json.dumps escapes them).
TEXT = weighted((12, st.text(max_size=24)), (1, st.text(st.characters(exclude_categories=()), max_size=24)))
NAME = st.text(min_size=1, max_size=12)
NUMBER = st.one_of(st.integers(-3, 70), st.integers(-2**40, 2**70), st.sampled_from([10**9, 10**30]),
                   st.floats(allow_nan=True, allow_infinity=True))
ANY = st.recursive(st.none() | st.booleans() | NUMBER | TEXT,
                   lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
                   max_leaves=10)
UNIT = st.floats(0, 1)
SMALL = st.integers(1, 64)
CACHE_CONTROL = st.fixed_dictionaries({"type": st.just("ephemeral")}, optional={"ttl": st.sampled_from(["5m", "1h"])})
SCHEMA = st.fixed_dictionaries({"type": st.just("object")},
                               optional={"properties": st.dictionaries(TEXT, st.just({"type": "string"}), max_size=2)})

OPENAI_PART = st.fixed_dictionaries({"type": st.sampled_from(["text"] * 6 + ["image_url"]), "text": TEXT},
                                    optional={"cache_control": CACHE_CONTROL})
TOOL_CALL = st.fixed_dictionaries({"id": TEXT, "type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": TEXT, "arguments": st.one_of(TEXT, st.just('{"a": 1}'))})})
OPENAI_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "user", "assistant", "tool"]),
     "content": st.one_of(TEXT, st.lists(OPENAI_PART, max_size=3), st.none())},
    optional={"tool_calls": st.lists(TOOL_CALL, max_size=2), "tool_call_id": TEXT, "reasoning_content": TEXT})
# A conversation: an optional system message, a user message, then any messages.
OPENAI_MESSAGES = st.builds(lambda system, user, rest: [*system, {"role": "user", "content": user}, *rest],
                            st.lists(st.fixed_dictionaries({"role": st.just("system"), "content": TEXT}), max_size=1),
                            st.one_of(TEXT, st.lists(OPENAI_PART, min_size=1, max_size=2)),
                            st.lists(OPENAI_MESSAGE, max_size=2))
OPENAI_TOOL = st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": NAME}, optional={"description": TEXT, "parameters": SCHEMA})})
SAMPLING = {
    "max_tokens": SMALL, "temperature": st.floats(0, 2), "top_p": UNIT, "top_k": st.integers(-1, 50),
    "seed": st.integers(0, 2**31), "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "stop": st.one_of(TEXT, st.lists(TEXT, max_size=4)), "ignore_eos": st.booleans(),
    "stop_token_ids": st.lists(st.integers(0, 1000), max_size=3), "user": TEXT,
}
# vLLM's request fields, on both OpenAI endpoints (n at most 1: the scripted engine runs no sample groups)
VLLM = {
    "n": st.integers(-1, 1), "min_p": UNIT, "repetition_penalty": st.floats(-1, 3), "min_tokens": st.integers(-1, 8),
    "allowed_token_ids": st.lists(st.integers(-5, 300_000), max_size=4),
    "bad_words": st.lists(TEXT, max_size=3), "truncate_prompt_tokens": st.integers(-2, 4096),
    "prompt_logprobs": st.integers(-1, 3), "priority": st.integers(-2**40, 2**40), "cache_salt": TEXT,
    "thinking_token_budget": st.integers(-1, 64), "include_stop_str_in_output": st.booleans(),
    "skip_special_tokens": st.booleans(), "return_token_ids": st.booleans(),
    "return_tokens_as_token_ids": st.booleans(),
    "structured_outputs": st.one_of(st.fixed_dictionaries({"regex": st.sampled_from(["[ab]+", "(", "a{2,1}"])}),
                                    st.fixed_dictionaries({"choice": st.lists(TEXT, max_size=3)}),
                                    st.fixed_dictionaries({"json": st.one_of(SCHEMA, TEXT)}),
                                    st.fixed_dictionaries({"grammar": st.sampled_from(['start: "a"+', "start: ("])})),
    "response_format": st.one_of(st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])}),
                                 st.fixed_dictionaries({"type": st.just("json_schema"), "json_schema":
                                                        st.fixed_dictionaries({"name": NAME, "schema": SCHEMA})})),
}
CHAT = st.fixed_dictionaries(
    {"model": st.just(MODEL), "messages": OPENAI_MESSAGES},
    optional={**SAMPLING, **VLLM, "max_completion_tokens": SMALL, "logprobs": st.booleans(),
              "top_logprobs": st.integers(0, 5), "tools": st.lists(OPENAI_TOOL, max_size=3),
              "tool_choice": st.sampled_from(["none", "auto", "required"]),
              "reasoning_effort": st.sampled_from(["none", "low", "high"]),
              "chat_template_kwargs": st.fixed_dictionaries({"enable_thinking": st.booleans()})})
COMPLETION = st.fixed_dictionaries(
    {"model": st.just(MODEL),
     "prompt": st.one_of(TEXT, st.lists(TEXT, min_size=1, max_size=3), st.lists(st.integers(0, 150_000), max_size=5),
                         st.lists(st.lists(st.integers(-5, 300_000), max_size=4), max_size=3))},
    optional={**SAMPLING, **VLLM, "logprobs": st.integers(0, 5), "echo": st.booleans(), "best_of": st.integers(0, 2)})
ANTHROPIC_BLOCK = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "text", "image", "tool_use", "tool_result", "thinking"])},
    optional={"text": TEXT, "id": TEXT, "name": TEXT, "input": ANY, "tool_use_id": TEXT,
              "content": st.one_of(TEXT, st.lists(st.just({"type": "text", "text": "x"}))), "thinking": TEXT,
              "cache_control": CACHE_CONTROL})
ANTHROPIC_MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]),
                                           "content": st.one_of(TEXT, st.lists(ANTHROPIC_BLOCK, max_size=3))})
MESSAGES = st.fixed_dictionaries(
    {"model": st.just(MODEL), "max_tokens": SMALL, "messages": st.lists(ANTHROPIC_MESSAGE, min_size=1, max_size=4)},
    optional={"system": st.one_of(TEXT, st.lists(st.fixed_dictionaries(
                  {"type": st.just("text"), "text": TEXT}, optional={"cache_control": CACHE_CONTROL}), max_size=2)),
              "temperature": UNIT, "top_p": UNIT, "top_k": st.integers(0, 50),
              "stop_sequences": st.lists(TEXT, max_size=4), "stream": st.booleans(),
              "tools": st.lists(st.fixed_dictionaries({"name": NAME}, optional={
                  "description": TEXT, "input_schema": SCHEMA}), max_size=3),
              "tool_choice": st.fixed_dictionaries({"type": st.sampled_from(["auto", "any", "none"])}),
              "thinking": st.fixed_dictionaries({"type": st.sampled_from(["enabled", "disabled"]),
                                                 "budget_tokens": st.integers(0, 2048)}),
              "metadata": ANY, "cache_control": CACHE_CONTROL})
RESPONSE_ITEM = weighted(
    (3, st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "developer", "tool"]),
                               "content": st.one_of(TEXT, st.lists(st.fixed_dictionaries(
                                   {"type": st.sampled_from(["input_text", "output_text", "input_image"]),
                                    "text": TEXT}), max_size=2))},
                              optional={"type": st.just("message")})),
    (1, st.fixed_dictionaries({"type": st.just("function_call"), "call_id": TEXT, "name": TEXT,
                               "arguments": st.one_of(TEXT, st.just('{"a": 1}'))})),
    (1, st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": TEXT, "output": ANY})),
    (1, st.fixed_dictionaries({"type": st.sampled_from(["reasoning", "item_reference"])},
                              optional={"summary": st.lists(st.fixed_dictionaries({"text": ANY}), max_size=2),
                                        "content": ANY})))
RESPONSES = st.fixed_dictionaries(
    {"model": st.just(MODEL), "input": st.one_of(TEXT, st.lists(RESPONSE_ITEM, min_size=1, max_size=4))},
    optional={"instructions": TEXT, "max_output_tokens": SMALL, "temperature": st.floats(0, 2), "top_p": UNIT,
              "stream": st.booleans(), "tools": st.lists(OPENAI_TOOL.map(lambda t: {"type": "function",
                                                                                    **t["function"]}), max_size=2),
              "tool_choice": st.sampled_from(["none", "auto", "required"]), "parallel_tool_calls": st.booleans(),
              "max_tool_calls": st.integers(0, 3), "reasoning": st.fixed_dictionaries(
                  {"effort": st.sampled_from(["none", "minimal", "low", "high", "max"])}),
              "text": st.fixed_dictionaries({"format": st.one_of(
                  st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])}),
                  st.fixed_dictionaries({"type": st.just("json_schema"), "name": NAME, "schema": SCHEMA}))}),
              "background": st.booleans(), "store": st.booleans(), "metadata": ANY, "cache_salt": TEXT,
              "priority": st.integers(-3, 3)})
FIELDS = sorted({"model", "messages", "prompt", "input", "max_tokens", "system", "tools", *SAMPLING, *VLLM})


def mutated(bodies):
    """A plausible body with one field, at any depth, replaced by any JSON value (or removed)."""
    def mutate(body, path_seed, value):
        body = copy.deepcopy(body)  # st.just values are shared between draws
        target, key = body, FIELDS[path_seed % len(FIELDS)]
        while isinstance(target.get(key), (list, dict)) and target[key] and path_seed % 3:
            inner = target[key]
            if isinstance(inner, list):
                inner = inner[path_seed % len(inner)]
            if not isinstance(inner, dict) or not inner:
                break
            target, key, path_seed = inner, sorted(inner)[path_seed % len(inner)], path_seed // 3
        if value is REMOVE:
            target.pop(key, None)
        else:
            target[key] = value
        return body

    return st.builds(mutate, bodies, st.integers(0, 10**6), st.one_of(ANY, st.just(REMOVE)))


REMOVE = object()


def requests(bodies):
    """(content type, raw body): JSON of a plausible or mutated body mostly; sometimes another content type,
    any JSON value, JSON nested deep, or bytes that are not JSON."""
    def encode(body):
        return json.dumps(body).encode()

    deep = st.integers(10, 3000).map(lambda n: b'{"messages": ' + b"[" * n + b"]" * n + b"}")
    raw = weighted((5, bodies.map(encode)), (5, mutated(bodies).map(encode)), (1, ANY.map(encode)), (1, deep),
                   (1, st.binary(max_size=64)))
    content_type = weighted((20, st.just("application/json")), (1, st.sampled_from(
        ["text/plain", "application/x-www-form-urlencoded", "application/json; charset=utf-8", ""])))
    return st.tuples(content_type, raw)


@pytest.fixture(scope="module")
def client():
    with TestClient(create_app(ScriptedEngine(max_model_len=4096)), raise_server_exceptions=False) as client:
        yield client


def _served(client: TestClient, path: str, content_type: str, raw: bytes) -> None:
    response = client.post(path, content=raw, headers={"Content-Type": content_type} if content_type else {})
    assert response.status_code < 500, (response.status_code, response.text, raw[:400])
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        assert "internal error" not in response.text and "api_error" not in response.text, response.text


@pytest.mark.parametrize("path, bodies, normal", [
    pytest.param("/v1/chat/completions", CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]},
                 id="openai-chat"),
    pytest.param("/v1/completions", COMPLETION, {"model": MODEL, "prompt": "Hi"}, id="openai-completions"),
    pytest.param("/v1/responses", RESPONSES, {"model": MODEL, "input": "Hi"}, id="openai-responses"),
    pytest.param("/v1/messages", MESSAGES, {"model": MODEL, "max_tokens": 8,
                                            "messages": [{"role": "user", "content": "Hi"}]}, id="anthropic-messages"),
    pytest.param("/v1/messages/count_tokens", MESSAGES, {"model": MODEL, "messages": [
        {"role": "user", "content": "Hi"}]}, id="anthropic-count-tokens"),
])
def test_generated_requests_get_no_5xx_and_a_normal_request_is_served_after(client, path, bodies, normal):
    @FUZZ
    @given(requests(bodies))
    def one(request):
        _served(client, path, *request)

    one()
    response = client.post(path, json=normal)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body.get("choices") or body.get("content") or body.get("output") or body["input_tokens"] > 0
