"""Whether a chat request thinks, on the real engine: `reasoning_effort`, `chat_template_kwargs.enable_thinking`,
the server's default (--default-thinking), and a JSON response_format, which runs without thinking so that its
JSON is the answer's content. The tiny model never closes </think>, so thinking shows as all-reasoning output,
unless a thinking budget closes it."""

from __future__ import annotations

import json

import openai
import pytest

from ninfer_jax.server.cli import build_parser, serve_options
from server_support import LiveServer, oai, real_engine, server  # noqa: F401 (fixtures)

FLAG = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def engine():
    return real_engine()


@pytest.fixture(scope="module")
def no_thinking_client(engine):
    with LiveServer(engine, default_thinking=False) as live:
        yield openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)


def _ask(client, engine, **fields):
    fields = {"max_tokens": 4, **fields}
    return client.chat.completions.create(model=engine.model_name, messages=[{"role": "user", "content": "Hi"}],
                                          temperature=0, **fields).choices[0].message


def _thought(message) -> bool:
    """True for an all-reasoning answer, False for an all-content one."""
    reasoning = (message.model_extra or {}).get("reasoning_content")
    assert bool(reasoning) != bool(message.content), message
    return bool(reasoning)


@pytest.mark.parametrize("fields, thinks", [
    pytest.param({}, True, id="default"),
    pytest.param({"reasoning_effort": "none"}, False, id="effort-none"),
    pytest.param({"reasoning_effort": "minimal"}, False, id="effort-minimal"),
    pytest.param({"reasoning_effort": "high"}, True, id="effort-high"),
    pytest.param({"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}, False, id="kwargs-off"),
])
def test_thinking_follows_the_request(oai, engine, fields, thinks):
    assert _thought(_ask(oai, engine, **fields)) is thinks


@pytest.mark.parametrize("fields, thinks", [
    pytest.param({}, False, id="default"),
    pytest.param({"reasoning_effort": "low"}, True, id="effort-low"),
    pytest.param({"extra_body": {"chat_template_kwargs": {"enable_thinking": True}}}, True, id="kwargs-on"),
])
def test_a_server_without_default_thinking(no_thinking_client, engine, fields, thinks):
    assert _thought(_ask(no_thinking_client, engine, **fields)) is thinks


def test_json_schema_output_is_the_content_with_thinking_on_by_default(oai, engine):
    message = _ask(oai, engine, max_tokens=20, reasoning_effort="high", response_format={
        "type": "json_schema", "json_schema": {"name": "flag", "schema": FLAG}})
    assert not _thought(message)
    value = json.loads(message.content)
    assert set(value) == {"ok"} and isinstance(value["ok"], bool)



def test_a_thinking_token_budget_ends_the_reasoning_and_the_answer_goes_on_as_content(oai, engine):
    plain = _ask(oai, engine, max_tokens=3)
    budgeted = _ask(oai, engine, max_tokens=12, extra_body={"thinking_token_budget": 3})
    assert _thought(plain) and budgeted.content
    assert budgeted.model_extra["reasoning_content"] == plain.model_extra["reasoning_content"]

def test_default_thinking_flag():
    parse = build_parser().parse_args
    assert serve_options(parse([])).default_thinking is True
    assert serve_options(parse(["--default-thinking", "off"])).default_thinking is False
    with pytest.raises(SystemExit):
        parse(["--default-thinking", "maybe"])
