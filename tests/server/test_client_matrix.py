"""Third-party clients against the live server on the built-in tiny model: openai, anthropic, litellm and
langchain-openai, each through chat, streaming, tools (a request with tools, and a tool result sent back), JSON
schema, n > 1 and the Responses API, where the client has them.

The server runs with --default-thinking off, as the README advises for clients that drop reasoning_content.
Nothing may leave the machine: every connection to an address other than loopback fails the test, and
litellm reads its bundled model cost map (LITELLM_LOCAL_MODEL_COST_MAP) instead of fetching it.
"""

from __future__ import annotations

import json
import os
import socket

import anthropic
import openai
import pytest

from server_support import LiveServer, real_engine

TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
FLAG = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Hi"}]
# A conversation that called the tool and holds its result: each client serializes it its own way.
TOOL_TURNS = [{"role": "user", "content": "Weather in Paris?"},
              {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
                  "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
              {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"}]


@pytest.fixture(scope="module", autouse=True)
def loopback_only():
    """Refuses every connection that does not stay on this machine, for the module's tests."""
    connect = socket.socket.connect

    def guarded(self, address):
        host = address[0] if isinstance(address, tuple) else address
        if isinstance(host, str) and host not in ("127.0.0.1", "::1", "localhost") and self.family != socket.AF_UNIX:
            raise AssertionError(f"a client tried to reach {address}")
        return connect(self, address)

    socket.socket.connect = guarded
    yield
    socket.socket.connect = connect


@pytest.fixture(scope="module")
def served():
    """(model name, server URL): the shared tiny engine served without default thinking."""
    engine = real_engine()
    with LiveServer(engine, default_thinking=False) as live:
        yield engine.model_name, live.url


@pytest.fixture(scope="module")
def litellm():
    os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"  # read before import: no fetch of the cost map
    import litellm  # this version sends no telemetry (it has no switch for it); loopback_only would catch it

    return litellm


@pytest.fixture(scope="module")
def langchain(served):
    model, url = served
    os.environ.pop("LANGSMITH_TRACING", None)
    os.environ.pop("LANGCHAIN_TRACING_V2", None)
    from langchain_openai import ChatOpenAI

    def chat(**options):
        return ChatOpenAI(model=model, base_url=f"{url}/v1", api_key="unused", max_retries=0,
                          temperature=0, max_tokens=options.pop("max_tokens", 4), **options)

    return chat


def _flag(text: str) -> bool:
    value = json.loads(text)
    assert set(value) == {"ok"}
    return value["ok"]


# --- openai -------------------------------------------------------------------------------------------

def test_openai(served):
    model, url = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    fields = dict(model=model, max_tokens=4, temperature=0)
    text = client.chat.completions.create(messages=ASK, **fields).choices[0].message.content
    assert text
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        messages=ASK, stream=True, **fields) if c.choices)
    assert streamed == text
    assert client.chat.completions.create(messages=TOOL_TURNS, tools=[TOOL], **fields).choices[0].message.content
    schema = {"type": "json_schema", "json_schema": {"name": "flag", "schema": FLAG}}
    _flag(client.chat.completions.create(messages=ASK, response_format=schema, **{**fields, "max_tokens": 20})
          .choices[0].message.content)
    assert len(client.chat.completions.create(messages=ASK, n=2, **fields).choices) == 2
    assert client.responses.create(model=model, input="Hi", max_output_tokens=4,
                                   temperature=0).output_text == text


# --- anthropic ----------------------------------------------------------------------------------------

def test_anthropic(served):
    model, url = served
    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
    # This SDK has no temperature argument; the server still reads the protocol's field.
    fields = dict(model=model, max_tokens=4, extra_body={"temperature": 0})
    message = client.messages.create(messages=ASK, **fields)
    assert message.content[0].text and message.usage.output_tokens <= 4
    with client.messages.stream(messages=ASK, **fields) as stream:
        assert "".join(stream.text_stream) == message.content[0].text
    tool = {"name": "get_weather", "description": "Weather for a city", "input_schema": TOOL["function"]["parameters"]}
    turns = [{"role": "user", "content": "Weather in Paris?"},
             {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                "input": {"city": "Paris"}}]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny"}]}]
    assert client.messages.create(messages=turns, tools=[tool], **fields).content


# --- litellm ------------------------------------------------------------------------------------------

def test_litellm(litellm, served):
    model, url = served
    fields = dict(model=f"openai/{model}", api_base=f"{url}/v1", api_key="unused", max_tokens=4,
                  temperature=0)
    text = litellm.completion(messages=ASK, **fields).choices[0].message.content
    assert text
    streamed = "".join(c.choices[0].delta.content or "" for c in litellm.completion(messages=ASK, stream=True,
                                                                                   **fields))
    assert streamed == text
    assert litellm.completion(messages=TOOL_TURNS, tools=[TOOL], **fields).choices[0].message.content
    schema = {"type": "json_schema", "json_schema": {"name": "flag", "schema": FLAG}}
    _flag(litellm.completion(messages=ASK, response_format=schema, **{**fields, "max_tokens": 20})
          .choices[0].message.content)
    assert len(litellm.completion(messages=ASK, n=2, **fields).choices) == 2
    response = litellm.responses(model=fields["model"], api_base=fields["api_base"], api_key="unused", input="Hi",
                                 max_output_tokens=4, temperature=0)
    assert response.output[0].content[0].text.startswith(text)  # litellm raises max_output_tokens to 16


# --- langchain-openai ---------------------------------------------------------------------------------

def test_langchain_openai(langchain):
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

    llm = langchain()
    text = llm.invoke("Hi").content
    assert text
    assert "".join(chunk.content for chunk in llm.stream("Hi")) == text
    turns = [HumanMessage("Weather in Paris?"),
             AIMessage("", tool_calls=[{"id": "call_1", "name": "get_weather", "args": {"city": "Paris"}}]),
             ToolMessage("Sunny", tool_call_id="call_1")]
    assert llm.bind_tools([TOOL]).invoke(turns).content
    structured = langchain(max_tokens=20).with_structured_output({"title": "flag", **FLAG}, method="json_schema")
    assert isinstance(structured.invoke("Hi")["ok"], bool)
    assert len(langchain(n=2).generate([[HumanMessage("Hi")]]).generations[0]) == 2
    assert langchain(use_responses_api=True).invoke("Hi").text == text
