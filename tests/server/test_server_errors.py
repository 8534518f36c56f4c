"""Errors in each protocol's own shape and status: malformed bodies, unknown models, prompts too long, invalid
parameters, cache_control misuse, API keys, and a stopping server (OpenAI 503 / Anthropic 529)."""

from __future__ import annotations

import re

import anthropic
import httpx
import openai
import pytest

from server_support import LiveServer, ScriptedEngine, claude, oai, server, sse_events, wait_for  # noqa: F401

MODEL = ScriptedEngine.model_name
USER = [{"role": "user", "content": "Hi"}]
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def engine():
    return ScriptedEngine(max_model_len=256)



def _openai_shape(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def _anthropic_shape(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    return body["error"]


# --- OpenAI -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("body", [b"{not json", b"[1, 2]"])
def test_openai_malformed_body_is_400_invalid_request_error(server, path, body):
    error = _openai_shape(httpx.post(server.url + path, content=body, headers=JSON), 400)
    assert error["type"] == "invalid_request_error"


def test_openai_unknown_model_is_404_model_not_found(oai):
    with pytest.raises(openai.NotFoundError) as raised:
        oai.chat.completions.create(model="gpt-4o", messages=USER)
    assert raised.value.body["code"] == "model_not_found" and raised.value.body["param"] == "model"


def test_openai_prompt_too_long_is_400_context_length_exceeded_with_the_lengths(oai):
    with pytest.raises(openai.BadRequestError) as raised:
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "word " * 400}])
    body = raised.value.body
    assert body["code"] == "context_length_exceeded" and body["type"] == "invalid_request_error"
    assert "max_model_len is 256" in body["message"] and "prompt has" in body["message"]


@pytest.mark.parametrize("fields, param", [
    ({"temperature": 5}, "temperature"),
    ({"n": 0}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"response_format": {"type": "xml"}}, "response_format"),
])
def test_openai_invalid_parameters_are_400_naming_the_field_not_fastapis_422(server, fields, param):
    error = _openai_shape(httpx.post(f"{server.url}/v1/chat/completions",
                                     json={"model": MODEL, "messages": USER, **fields}), 400)
    assert error["type"] == "invalid_request_error" and error["param"] == param


def test_a_request_without_a_model_is_the_served_models_and_anthropic_requires_one(server):
    # vLLM's OpenAI endpoints take a request without a model; the Messages API requires one
    for path, body in (("/v1/completions", {"prompt": "x", "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": USER, "max_tokens": 2}),
                       ("/v1/responses", {"input": "x", "max_output_tokens": 2})):
        response = httpx.post(server.url + path, json=body)
        assert response.status_code == 200 and response.json()["model"] == MODEL, response.text
    response = httpx.post(server.url + "/v1/messages", json={"max_tokens": 2, "messages": USER})
    assert response.status_code == 400 and response.json()["error"]["message"] == "model: Field required"


@pytest.mark.parametrize("part, message", [
    ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, "not supported (text and image_url"),
    ({"type": "text", "text": "x", "prompt_cache_breakpoint": {"mode": "implicit"}}, "must be 'explicit'"),
    ({"type": "text", "text": "x", "prompt_cache_breakpoint": {"mode": "explicit", "ttl": "1w"}}, "ttl"),
    ({"type": "text", "text": "x", "cache_control": {"type": "forever"}}, "must be 'ephemeral'"),
])
def test_openai_bad_content_parts_are_400(oai, part, message):
    with pytest.raises(openai.BadRequestError) as raised:
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [part]}])
    assert message in raised.value.body["message"]
    assert raised.value.body["param"].startswith("messages[0].content[0]")


def test_openai_unknown_route_and_wrong_method_answer_in_openai_shape(server):
    assert _openai_shape(httpx.get(f"{server.url}/v1/embeddings"), 404)["type"] == "invalid_request_error"
    _openai_shape(httpx.get(f"{server.url}/v1/chat/completions"), 405)


def test_openai_template_rejection_is_400(oai):
    with pytest.raises(openai.BadRequestError, match="No user query found"):
        oai.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": "only a system prompt"}])


# --- Anthropic ----------------------------------------------------------------------------------------

def test_anthropic_malformed_body_is_400_invalid_request_error(server):
    error = _anthropic_shape(httpx.post(f"{server.url}/v1/messages", content=b"{oops", headers=JSON), 400)
    assert error["type"] == "invalid_request_error"


def test_anthropic_missing_max_tokens_is_400_not_422(server):
    error = _anthropic_shape(httpx.post(f"{server.url}/v1/messages", json={"model": MODEL, "messages": USER}), 400)
    assert error["message"] == "max_tokens: Field required"


def test_anthropic_unknown_model_is_404_not_found_error(claude):
    with pytest.raises(anthropic.NotFoundError) as raised:
        claude.messages.create(model="claude-opus-4", max_tokens=10, messages=USER)
    assert raised.value.body == {"type": "error",
                                 "error": {"type": "not_found_error", "message": "model: claude-opus-4"}}


def test_anthropic_prompt_too_long_is_400_with_the_lengths(claude):
    with pytest.raises(anthropic.BadRequestError) as raised:
        claude.messages.create(model=MODEL, max_tokens=10, messages=[{"role": "user", "content": "word " * 400}])
    assert raised.value.body["error"]["type"] == "invalid_request_error"
    message = raised.value.body["error"]["message"]
    prompt = int(re.search(r"\((\d+) in the messages, 10 in the completion\)", message).group(1))
    assert prompt > 400 and message == (
        f"This model's maximum context length is 256 tokens. However, you requested {prompt + 10} tokens ({prompt} "
        "in the messages, 10 in the completion). Please reduce the length of the messages or completion.")


def _marked(text, **control):
    return {"type": "text", "text": text, "cache_control": {"type": "ephemeral", **control}}


@pytest.mark.parametrize("request_fields, message", [
    ({"system": [_marked("a"), _marked("b")],
      "messages": [{"role": "user", "content": [_marked("c"), _marked("d"), _marked("e")]}]},
     "A maximum of 4 blocks with cache_control may be provided. Found 5."),
    ({"cache_control": {"type": "ephemeral"},
      "messages": [{"role": "user", "content": [_marked("a"), _marked("b"), _marked("c"), _marked("d")]}]},
     "A maximum of 4 blocks with cache_control may be provided. Found 5."),
    ({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a", "cache_control": {"type": "persistent"}}]}]},
     "messages.0.content.0.cache_control.type: Input should be 'ephemeral'"),
    ({"messages": [{"role": "user", "content": [_marked("a", ttl="10m")]}]},
     "messages.0.content.0.cache_control.ttl: Input should be '5m' or '1h'"),
    ({"system": [_marked("a", ttl="5m")], "messages": [{"role": "user", "content": [_marked("b", ttl="1h")]}]},
     "a ttl='1h' cache_control block must not come after a ttl='5m' cache_control block"),
    ({"messages": [{"role": "user", "content": [_marked("  ")]}]},
     "cache_control cannot be set for empty text blocks"),
    ({"tools": [{"name": "t", "input_schema": {"type": "object"}, "cache_control": {"type": "ephemeral", "ttl": "2h"}}],
      "messages": USER}, "tools.0.cache_control.ttl: Input should be '5m' or '1h'"),
    ({"messages": [*USER, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "x", "signature": "", "cache_control": {"type": "ephemeral"}}]}]},
     "cache_control cannot be set for thinking blocks"),
])
def test_anthropic_cache_control_misuse_is_400_with_the_protocols_message(server, request_fields, message):
    response = httpx.post(f"{server.url}/v1/messages", json={"model": MODEL, "max_tokens": 10, **request_fields})
    error = _anthropic_shape(response, 400)
    assert error["type"] == "invalid_request_error" and message in error["message"]


def test_anthropic_four_markers_with_both_ttls_in_order_are_accepted(claude):
    message = claude.messages.create(
        model=MODEL, max_tokens=10, system=[_marked("a", ttl="1h"), _marked("b", ttl="1h")],
        messages=[{"role": "user", "content": [_marked("c"), _marked("d")]}])
    assert message.stop_reason == "end_turn"


@pytest.mark.parametrize("request_fields, message", [
    ({"thinking": {"type": "enabled", "budget_tokens": 100}, "max_tokens": 2000}, "at least 1024"),
    ({"thinking": {"type": "enabled", "budget_tokens": 2000}, "max_tokens": 2000}, "greater than"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "not supported"),
    ({"temperature": 1.5}, "temperature"),
])
def test_anthropic_invalid_parameters_are_400(server, request_fields, message):
    body = {"model": MODEL, "max_tokens": 10, "messages": USER, **request_fields}
    assert message in _anthropic_shape(httpx.post(f"{server.url}/v1/messages", json=body), 400)["message"]


def test_anthropic_unknown_route_answers_in_anthropic_shape(server):
    assert _anthropic_shape(httpx.post(f"{server.url}/v1/messages/batches", json={}), 404)["type"] == "not_found_error"


# --- API key --------------------------------------------------------------------------------------------

def test_api_key_is_required_in_each_protocols_shape(engine):
    with LiveServer(engine, api_key="sekret") as keyed:
        error = _openai_shape(httpx.post(f"{keyed.url}/v1/chat/completions", json={"model": MODEL, "messages": USER}),
                              401)
        assert error["code"] == "invalid_api_key"
        wrong = httpx.post(f"{keyed.url}/v1/messages", headers={"x-api-key": "nope"},
                           json={"model": MODEL, "max_tokens": 5, "messages": USER})
        assert _anthropic_shape(wrong, 401)["type"] == "authentication_error"
        ok = openai.OpenAI(base_url=f"{keyed.url}/v1", api_key="sekret", max_retries=0)
        assert ok.chat.completions.create(model=MODEL, messages=USER).choices
        assert anthropic.Anthropic(base_url=keyed.url, api_key="sekret", max_retries=0).messages.create(
            model=MODEL, max_tokens=5, messages=USER).content
        assert httpx.get(f"{keyed.url}/health").status_code == 200


# --- a stopping engine ------------------------------------------------------------------------------------

def test_stopping_engine_answers_503_openai_and_529_overloaded_anthropic():
    engine = ScriptedEngine(token_delay=0.05)
    engine.default_text = "word " * 200
    with LiveServer(engine) as live:
        with httpx.stream("POST", f"{live.url}/v1/messages", json={
                "model": MODEL, "max_tokens": 500, "stream": True, "messages": USER}) as response:
            lines = response.iter_lines()
            next(line for line in lines if line.startswith("event: content_block_delta"))
            engine.stop()
            assert sse_events(lines)[-1] == ("error", {"type": "error", "error": {
                "type": "overloaded_error", "message": "the server is shutting down; retry on another instance"}})
        wait_for(lambda: engine.running == 0)
        refused = httpx.post(f"{live.url}/v1/chat/completions", json={"model": MODEL, "messages": USER})
        assert _openai_shape(refused, 503)["type"] == "server_error"
        overloaded = httpx.post(f"{live.url}/v1/messages", json={"model": MODEL, "max_tokens": 5, "messages": USER})
        assert _anthropic_shape(overloaded, 529)["type"] == "overloaded_error"
        with pytest.raises(openai.InternalServerError):
            openai.OpenAI(base_url=f"{live.url}/v1", api_key="-", max_retries=0).chat.completions.create(
                model=MODEL, messages=USER)
