"""Request limits checked before any work, each naming its option; bodies that must be JSON; CORS off unless
origins are named; and unhandled errors answered as a 500 in the protocol's shape on a connection that stays
usable."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import re
import socket
import threading
from urllib.parse import urlsplit

import httpx
import pytest

from ninfer_jax import SamplingParams
from ninfer_jax.server.context import ServerContext
from ninfer_jax.server.errors import ApiError
from ninfer_jax.server.generation import EngineRun, close_runs, interleave
from ninfer_jax.server.limits import Limits
from server_support import LiveServer, ScriptedEngine, wait_for

MODEL = ScriptedEngine.model_name
USER = [{"role": "user", "content": "Hi"}]
JSON = {"Content-Type": "application/json"}
LIMITS = Limits(max_request_bytes=8192, max_json_depth=8, max_prompts=2, max_stop_strings=2, max_stop_chars=8,
                max_tools=2)  # max_prompt_chars: 16 per token of the engine's 256
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
CHAT, COMPLETIONS, MESSAGES = "/v1/chat/completions", "/v1/completions", "/v1/messages"


class FailingEngine(ScriptedEngine):
    """Raises an error the server does not expect on every request whose prompt contains "explode"."""

    async def astream(self, prompt, sampling=None, request_id=None):
        if "explode" in self.tokenizer.decode(prompt.token_ids):
            raise RuntimeError("boom")
        async for event in super().astream(prompt, sampling, request_id):
            yield event


@pytest.fixture(scope="module")
def engine():
    return FailingEngine(max_model_len=256)


@pytest.fixture(scope="module")
def server(engine):
    with LiveServer(engine, limits=LIMITS) as live:
        yield live


def _post(server, path: str, body, headers=JSON) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.url + path, content=content, headers=headers, timeout=30)


def _error(response: httpx.Response, status: int) -> dict:
    """The error's message, after checking the status and the protocol's shape."""
    assert response.status_code == status, response.text
    body = response.json()
    if response.request.url.path.startswith("/v1/messages"):
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    else:
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def _body(path: str, **fields) -> dict:
    if path == COMPLETIONS:
        return {"model": MODEL, "prompt": "Hi", **fields}
    return {"model": MODEL, "messages": USER, **({"max_tokens": 8} if path == MESSAGES else {}), **fields}


# --- size, characters, depth ----------------------------------------------------------------------

@pytest.mark.parametrize("path, kind", [(CHAT, "invalid_request_error"), (MESSAGES, "request_too_large")])
def test_a_body_over_the_size_limit_is_413_naming_the_option(server, path, kind):
    error = _error(_post(server, path, _body(path, metadata={"pad": "x" * 9000})), 413)
    assert error["type"] == kind and "at most 8192 (--max-request-bytes)" in error["message"]


def test_a_chunked_body_is_refused_while_it_is_read(server):
    chunks = (b" " * 1024 for _ in range(64))  # no Content-Length: counted as it arrives
    error = _error(httpx.post(server.url + CHAT, content=chunks, headers=JSON), 413)
    assert "--max-request-bytes" in error["message"]


def test_a_declared_length_over_the_limit_is_answered_before_the_body_is_sent(server):
    host, port = urlsplit(server.url).hostname, urlsplit(server.url).port
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 5000000\r\n\r\n")
        head = sock.recv(65536).decode()
    assert head.startswith("HTTP/1.1 413") and "connection: close" in head.lower()


def test_text_over_the_character_bound_is_refused_before_tokenizing(server, engine):
    before = len(engine.prompts)
    error = _error(_post(server, CHAT, _body(CHAT, messages=[{"role": "user", "content": "x" * 5000}])), 400)
    assert error["code"] == "context_length_exceeded"
    assert re.match(r"the request has 50\d\d characters of text; "
                    r"this server takes at most 4096 \(--max-prompt-chars\)$", error["message"])
    assert len(engine.prompts) == before


@pytest.mark.parametrize("depth", [9, 1000, 3000])
def test_json_nested_too_deep_is_400_and_the_connection_stays_usable(server, depth):
    nested = b'{"model": "m", "messages": ' + b"[" * depth + b"]" * depth + b"}"
    responses = _on_one_connection(server, [("POST", CHAT, nested), ("POST", CHAT, json.dumps(_body(CHAT)).encode())])
    (status, body), (after, _) = responses
    assert status == 400 and "nests JSON more than 8 levels deep (--max-json-depth)" in body["error"]["message"]
    assert after == 200


# --- counts and the context -----------------------------------------------------------------------

@pytest.mark.parametrize("path, fields, param, message", [
    pytest.param(COMPLETIONS, {"prompt": ["a", "b", "c"]}, "prompt", "3 prompts; this server takes at most 2 "
                 "(--max-prompts)", id="prompts"),
    pytest.param(CHAT, {"stop": ["a", "b", "c"]}, "stop", "3 stop strings; this server takes at most 2 "
                 "(--max-stop-strings)", id="stop-count"),
    pytest.param(COMPLETIONS, {"stop": "nine chars"}, "stop", "a stop string of 10 characters; this server takes "
                 "at most 8 (--max-stop-chars)", id="stop-length"),
    pytest.param(CHAT, {"tools": [TOOL] * 3}, "tools", "3 tools; this server takes at most 2 (--max-tools)",
                 id="tools"),
    pytest.param(MESSAGES, {"stop_sequences": ["a", "b", "c"]}, None, "(--max-stop-strings)", id="anthropic-stops"),
    pytest.param(MESSAGES, {"tools": [{"name": "f"}] * 3}, None, "(--max-tools)", id="anthropic-tools"),
])
def test_counts_over_their_bound_are_400_naming_the_option(server, engine, path, fields, param, message):
    before = len(engine.prompts)
    error = _error(_post(server, path, _body(path, **fields)), 400)
    assert message in error["message"] and error.get("param", param) == param
    assert len(engine.prompts) == before


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS, MESSAGES])
@pytest.mark.parametrize("max_tokens", [256, 10**9, 10**30])
def test_max_tokens_beyond_the_context_left_is_400_with_the_numbers(server, engine, path, max_tokens):
    before = len(engine.prompts)
    error = _error(_post(server, path, _body(path, max_tokens=max_tokens)), 400)
    prompt = int(error["message"].split("tokens (")[1].split(" in the messages")[0])
    assert 0 < prompt < 30 and error["message"] == (
        f"This model's maximum context length is 256 tokens. However, you requested {prompt + max_tokens} tokens "
        f"({prompt} in the messages, {max_tokens} in the completion). Please reduce the length of the messages or "
        "completion.")
    assert len(engine.prompts) == before


# --- values that are not text or numbers ----------------------------------------------------------

@pytest.mark.parametrize("path", [CHAT, MESSAGES])
def test_a_lone_surrogate_is_named_as_such(server, path):
    raw = json.dumps(_body(path)).replace('"Hi"', '"Hi \\ud800"').encode()
    error = _error(_post(server, path, raw), 400)
    assert error["message"].startswith("messages[0].content contains a lone surrogate (U+D800)")
    assert "template" not in error["message"]


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_a_non_finite_temperature_is_named_as_such(server, value):
    raw = json.dumps(_body(CHAT, temperature=0.5)).replace("0.5", value).encode()
    error = _error(_post(server, CHAT, raw), 400)
    assert error["message"].startswith("temperature must be a finite number") and error["param"] == "temperature"


NEUTRAL = {"typical_p": 1, "spaces_between_special_tokens": True, "use_beam_search": False,
           "prompt_embeds": None, "vllm_xargs": None, "echo": False, "audio": None, "modalities": ["text"],
           "functions": None, "web_search_options": None}


@pytest.mark.parametrize("path, field, value", [
    *((path, field, value) for path in (CHAT, COMPLETIONS) for field, value in (
        ("typical_p", 0.5), ("spaces_between_special_tokens", False), ("use_beam_search", True),
        ("prompt_embeds", "AAAA"), ("vllm_xargs", {"k": 1}))),
    (CHAT, "echo", True), (CHAT, "audio", {"voice": "alloy", "format": "wav"}), (CHAT, "modalities", ["text", "audio"]),
    (CHAT, "functions", [{"name": "f", "parameters": {"type": "object"}}]), (CHAT, "web_search_options", {}),
])
def test_a_field_this_server_does_not_implement_is_refused_unless_neutral(server, path, field, value):
    error = _error(_post(server, path, _body(path, **{field: value})), 400)
    assert f"{field} is not supported by this server" in error["message"]
    assert _post(server, path, _body(path, **{field: NEUTRAL[field]})).status_code == 200


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_vllms_request_fields_reach_the_engine(server, engine, path):
    fields = {"include_stop_str_in_output": True, "skip_special_tokens": False, "min_p": 0.1, "priority": 5}
    constraints = {"allowed_token_ids": [7, 3], "bad_words": ["no", "never again"]}
    assert _post(server, path, _body(path, **fields, **constraints)).status_code == 200
    assert {key: getattr(engine.sampling[-1], key) for key in fields} == fields
    assert engine.sampling[-1].allowed_token_ids == (3, 7) and engine.sampling[-1].bad_words == ("no", "never again")


# --- content type and CORS ------------------------------------------------------------------------

@pytest.mark.parametrize("path", [CHAT, COMPLETIONS, MESSAGES, "/v1/messages/count_tokens"])
@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_a_body_not_sent_as_json_is_415(server, engine, path, content_type):
    before = len(engine.prompts)
    headers = {"Content-Type": content_type} if content_type else {}
    error = _error(_post(server, path, _body(path), headers=headers), 415)
    assert "Content-Type: application/json" in error["message"]
    assert len(engine.prompts) == before


def test_cors_is_off_by_default(server):
    preflight = httpx.options(server.url + CHAT, headers={
        "Origin": "https://evil.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type"})
    assert "access-control-allow-origin" not in preflight.headers
    response = httpx.get(server.url + "/v1/models", headers={"Origin": "https://evil.example"})
    assert response.status_code == 200 and "access-control-allow-origin" not in response.headers


def test_cors_allows_the_origins_named():
    with LiveServer(ScriptedEngine(), allowed_origins=["https://app.example"]) as live:
        preflight = httpx.options(live.url + CHAT, headers={
            "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type"})
        other = httpx.options(live.url + CHAT, headers={
            "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "https://app.example"
    assert "access-control-allow-origin" not in other.headers


# --- unhandled errors -----------------------------------------------------------------------------

@pytest.mark.parametrize("path, shape", [
    (CHAT, {"error": {"message": "internal error: RuntimeError", "type": "server_error", "param": None,
                      "code": None}}),
    (MESSAGES, {"type": "error", "error": {"type": "api_error", "message": "internal error: RuntimeError"}}),
])
def test_an_unhandled_error_is_a_500_in_the_protocols_shape_on_a_usable_connection(server, path, shape):
    broken = _body(path, messages=[{"role": "user", "content": "explode"}])
    (status, body), (after, _) = _on_one_connection(
        server, [("POST", path, json.dumps(broken).encode()), ("POST", path, json.dumps(_body(path)).encode())])
    assert (status, body) == (500, shape)
    assert after == 200


def _on_one_connection(server, requests: list[tuple[str, str, bytes]]) -> list[tuple[int, dict]]:
    """(status, JSON body) of each request, sent one after another on one keep-alive connection (fails if the
    server closes it in between)."""
    url = urlsplit(server.url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    results, first_socket = [], None
    try:
        for method, path, body in requests:
            connection.request(method, path, body=body, headers=JSON)
            response = connection.getresponse()
            results.append((response.status, json.loads(response.read())))
            first_socket = first_socket or connection.sock
            assert connection.sock is first_socket, "the server closed the connection"
    finally:
        connection.close()
    return results


def test_a_full_request_queue_answers_503_with_retry_after_and_disconnects_give_places_back():
    """4 lanes and --max-waiting-requests 2: a seventh request in flight gets 503 with Retry-After, in OpenAI's and
    Anthropic's shapes; streams whose clients leave give their places back, and the next request is served."""
    engine = ScriptedEngine(token_delay=0.05)
    engine.default_text = "word " * 400  # each stream stays open until its client leaves
    with LiveServer(engine, limits=Limits(max_waiting_requests=2)) as live:
        with contextlib.ExitStack() as clients:  # each stream's client leaves mid-stream when it closes
            for _ in range(6):
                stream = clients.enter_context(httpx.stream("POST", live.url + CHAT, timeout=30, json={
                    "model": MODEL, "messages": USER, "stream": True}))
                assert stream.status_code == 200
            assert live.context.queue.in_flight == 6
            busy = httpx.post(live.url + CHAT, json={"model": MODEL, "messages": USER}, timeout=30)
            assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
            assert busy.json()["error"]["type"] == "server_error"
            assert "--max-waiting-requests 2" in busy.json()["error"]["message"]
            busy = httpx.post(live.url + MESSAGES, timeout=30, json={"model": MODEL, "max_tokens": 8,
                                                                      "messages": USER})
            assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
            assert busy.json()["type"] == "error" and busy.json()["error"]["type"] == "overloaded_error"
            n = httpx.post(live.url + COMPLETIONS, json={"model": MODEL, "prompt": "Hi", "n": 7}, timeout=30)
            assert n.status_code == 400 and "queues at most 6" in n.json()["error"]["message"]
        # (a bound, not the expected time: every stream is cancelled, which the count below checks)
        wait_for(lambda: live.context.queue.in_flight == 0 and engine.running == 0, timeout=60)
        assert len(engine._cancelled) == 6
        served = httpx.post(live.url + CHAT, json={"model": MODEL, "messages": USER, "max_tokens": 3}, timeout=30)
        assert served.status_code == 200 and live.context.queue.in_flight == 0


def test_closing_an_interleaved_stream_closes_every_engine_event_source():
    """A stream closed while a sample's next event waits unread still ends that sample's engine generator at once
    (left suspended at a yield, it would end only when garbage-collected), and every place in the queue is given
    back."""
    engine = ScriptedEngine()
    engine.default_text = "word " * 50
    ctx = ServerContext(engine=engine)

    async def scenario() -> None:
        runs = [EngineRun(engine, engine._prepare("Hi"), SamplingParams(), f"r{i}", ctx) for i in range(2)]
        first = await runs[0].next_event()
        events = interleave(runs, first)
        for _ in range(3):
            await events.__anext__()
        for _ in range(4):  # both runs' next events come, and stay unread
            await asyncio.sleep(0)
        assert engine.running == 2
        await events.aclose()
        await close_runs(runs)
        assert engine.running == 0 and engine._cancelled == {"r0", "r1"} and ctx.queue.in_flight == 0

    asyncio.run(scenario())


def test_the_tokenizing_queue_takes_every_request_the_request_queue_admits():
    """A burst as large as the request queue's bound waits for the tokenizing threads instead of being refused there
    (256 clients at once on the H200 once found 66 places), and one request more is refused."""
    ctx = ServerContext(engine=ScriptedEngine())
    burst = ctx.queue.bound(ctx.engine.published_stats()["slots"]["active"])

    async def scenario() -> list:
        release = threading.Event()
        calls = [asyncio.ensure_future(ctx.frontend.run(release.wait, 10)) for _ in range(burst)]
        await asyncio.sleep(0.05)
        with pytest.raises(ApiError):
            await ctx.frontend.run(int)
        release.set()
        return await asyncio.gather(*calls)

    assert burst > 66 and asyncio.run(scenario()) == [True] * burst
    ctx.frontend.shutdown()
