"""POST /v1/responses through the official `openai` client: on the real engine (usage with cached tokens, thinking
as a reasoning item, JSON schema output, streaming equal to the non-streamed answer), and on a scripted engine
whose output the tests choose (function calls out, function calls and their outputs rendered back in)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from server_support import CALL, RENDERED_CALL, LiveServer, ScriptedEngine, oai, real_engine, server  # noqa: F401

NO_THINKING = {"effort": "none"}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather for a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}]
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def engine():
    return real_engine()


@pytest.fixture(scope="module")
def scripted():
    engine = ScriptedEngine()
    with LiveServer(engine) as live:
        yield engine, openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)


def test_text_answer_with_usage_and_cached_tokens(oai, engine):
    question = "Name the colours of the rainbow, in order. " + " ".join(f"Hint {i}." for i in range(40))
    fields = dict(model=engine.model_name, input=question, max_output_tokens=5, temperature=0, reasoning=NO_THINKING)
    first = oai.responses.create(**fields)
    assert first.object == "response" and first.id.startswith("resp_")
    [message] = first.output
    assert message.type == "message" and message.role == "assistant"
    assert first.output_text == message.content[0].text != ""
    usage = first.usage
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens and usage.output_tokens <= 5
    assert usage.output_tokens_details.reasoning_tokens == 0
    assert (first.status == "incomplete") == (usage.output_tokens == 5)
    if first.status == "incomplete":
        assert first.incomplete_details.reason == "max_output_tokens"
    again = oai.responses.create(**fields)
    assert again.output_text == first.output_text
    assert first.usage.input_tokens > 128
    assert again.usage.input_tokens_details.cached_tokens >= 64  # the same prompt, reused from the cache


def test_thinking_is_a_reasoning_item(oai, engine):
    response = oai.responses.create(model=engine.model_name, input="Hi", max_output_tokens=4, temperature=0)
    [reasoning] = response.output  # the tiny model never closes </think>: all of it is reasoning
    assert reasoning.type == "reasoning" and reasoning.content[0].type == "reasoning_text"
    assert reasoning.content[0].text != "" and response.output_text == ""
    assert response.usage.output_tokens_details.reasoning_tokens == response.usage.output_tokens == 4


def test_json_schema_text_format_parses(oai, engine):
    response = oai.responses.create(
        model=engine.model_name, input="A number, please.", max_output_tokens=20, temperature=0,
        text={"format": {"type": "json_schema", "name": "number", "schema": SCHEMA, "strict": True}})
    value = json.loads(response.output_text)  # thinking is off under a JSON format
    assert set(value) == {"n"} and 0 <= value["n"] <= 9


def test_stream_events_add_up_to_the_non_streamed_response(oai, engine):
    fields = dict(model=engine.model_name, input="Count to five.", max_output_tokens=6, temperature=0,
                  reasoning=NO_THINKING)
    expected = oai.responses.create(**fields)
    events = list(oai.responses.create(**fields, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{expected.status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == expected.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == expected.usage.output_tokens


def test_refusals_name_the_field(oai, engine, server):
    with pytest.raises(openai.BadRequestError) as raised:
        oai.responses.create(model=engine.model_name, input="Hi", previous_response_id="resp_123")
    assert raised.value.body["param"] == "previous_response_id"
    reply = httpx.post(f"{server.url}/v1/responses", json={
        "model": engine.model_name, "input": [{"type": "input_image", "image_url": "http://x/y.png"}]})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "input[0].type"
    reply = httpx.post(f"{server.url}/v1/responses", json={
        "model": engine.model_name, "input": "Hi", "tools": [{"type": "web_search"}]})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "tools[0]"
    reply = httpx.post(f"{server.url}/v1/responses", json={"model": engine.model_name, "input": "Hi", "priority": 2})
    assert reply.status_code == 400 and "--scheduling-policy priority" in reply.json()["error"]["message"]


def test_function_call_goes_out_as_an_item_and_comes_back_rendered(scripted):
    engine, client = scripted
    engine.say("The user wants weather.\n</think>\n\nLet me look.\n\n" + CALL)
    first = client.responses.create(model=engine.model_name, input="Weather in Paris?", tools=TOOLS,
                                    instructions="Be brief.")
    assert [item.type for item in first.output] == ["reasoning", "message", "function_call"]
    reasoning, message, call = first.output
    assert reasoning.content[0].text == "The user wants weather." and message.content[0].text == "Let me look."
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris", "days": 2})
    assert "\n\nBe brief.<|im_end|>\n<|im_start|>user\nWeather in Paris?<|im_end|>" in engine.rendered()

    engine.say("</think>\n\nIt is sunny.")
    second = client.responses.create(model=engine.model_name, tools=TOOLS, input=[
        {"role": "user", "content": "Weather in Paris?"},
        *[item.model_dump(exclude_none=True) for item in first.output],
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 C"}])
    assert second.output_text == "It is sunny."
    rendered = engine.rendered()
    assert RENDERED_CALL in rendered and "<tool_response>\nSunny, 24 C\n</tool_response>" in rendered
    assert "Let me look." in rendered


def test_streamed_function_call_events(scripted):
    engine, client = scripted
    engine.say("Thinking.</think>\n\n" + CALL)
    events = list(client.responses.create(model=engine.model_name, input=[
        {"role": "developer", "content": [{"type": "input_text", "text": "Use tools."}]},
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]}], tools=TOOLS, stream=True))
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert reasoning == "Thinking."
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert json.loads(done.arguments) == {"city": "Paris", "days": 2}
    final = events[-1].response
    assert events[-1].type == "response.completed" and [i.type for i in final.output] == ["reasoning", "function_call"]
    assert final.output[1].id == done.item_id
    engine.say("Thinking.</think>\n\nSunny.")
    with client.responses.stream(model=engine.model_name, input="Weather?") as stream:  # the SDK's accumulation
        assert stream.get_final_response().output_text == "Sunny."
    assert "\n\nUse tools.<|im_end|>\n<|im_start|>user\nWeather?<|im_end|>" in engine.rendered(-2)
