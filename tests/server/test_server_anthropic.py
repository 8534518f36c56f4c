"""POST /v1/messages on the real engine (built-in tiny checkpoint), driven by the official `anthropic` SDK and,
for the wire-level event order, by raw SSE."""

from __future__ import annotations

import httpx
import pytest

from server_support import claude, real_engine, server, sse_events  # noqa: F401 (fixtures)

GREEDY = {"temperature": 0}  # this SDK version takes sampling fields through extra_body


@pytest.fixture(scope="module")
def engine():
    return real_engine()



def test_message_usage_adds_up_to_the_prompt(claude, engine):
    message = claude.messages.create(
        model=engine.model_name, max_tokens=3, extra_body=GREEDY,
        system=[{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": "Hello"}])
    usage = message.usage
    prompt = claude.messages.count_tokens(
        model=engine.model_name, system=[{"type": "text", "text": "You are terse."}],
        messages=[{"role": "user", "content": "Hello"}]).input_tokens
    assert usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens == prompt
    assert usage.cache_creation_input_tokens > 0  # the system block's marker, not yet read from the cache
    assert usage.cache_creation.ephemeral_5m_input_tokens == usage.cache_creation_input_tokens
    assert message.stop_reason in ("end_turn", "max_tokens") and usage.output_tokens <= 3
    assert [block.type for block in message.content] == ["text"]


def test_stream_sends_the_protocol_event_sequence(engine, server):
    with httpx.stream("POST", f"{server.url}/v1/messages", json={
            "model": engine.model_name, "max_tokens": 4, "stream": True, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Hello"}]}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response.iter_lines())
    names = [name for name, _ in events]
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert all(data["type"] == name for name, data in events)
    start = events[0][1]["message"]
    assert start["usage"]["output_tokens"] == 0 and start["usage"]["cache_read_input_tokens"] >= 0
    assert events[-2][1]["delta"]["stop_reason"] == "max_tokens"
    assert events[-2][1]["usage"]["output_tokens"] == 4


def test_sdk_stream_accumulates_the_streamed_text(claude, engine):
    with claude.messages.stream(model=engine.model_name, max_tokens=4, extra_body=GREEDY,
                                messages=[{"role": "user", "content": "Hello"}]) as stream:
        deltas = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert final.content[0].text == deltas
    assert final.usage.output_tokens <= 4


def test_tool_definitions_and_tool_results_render(claude, engine):
    tools = [{"name": "get_weather", "description": "Weather for a city",
              "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
    message = claude.messages.create(
        model=engine.model_name, max_tokens=2, extra_body=GREEDY, tools=tools,
        messages=[{"role": "user", "content": "Weather in Paris?"},
                  {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                     "input": {"city": "Paris"}}]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny",
                                                "cache_control": {"type": "ephemeral", "ttl": "1h"}}]}])
    assert message.usage.cache_creation.ephemeral_1h_input_tokens == message.usage.cache_creation_input_tokens > 0
