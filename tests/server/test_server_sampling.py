"""The OpenAI endpoints' sampling fields on the real engine: penalties, logit_bias (string keys), min_tokens and
response_format (JSON mode, JSON schema), and a 400 naming the field for each bad value."""

from __future__ import annotations

import json

import httpx
import pytest

from server_support import oai, real_engine, server  # noqa: F401 (fixtures)

X = 4242
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 5}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["name", "n"],
    "additionalProperties": False,
}
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def engine():
    return real_engine()


def test_logit_bias_with_string_keys_forces_the_token(oai, engine):
    out = oai.completions.create(model=engine.model_name, prompt=[1000, 1001, 1002], max_tokens=4, temperature=0,
                                 logit_bias={str(X): 100})
    assert out.choices[0].text == engine.tokenizer.decode([X] * 4)


def test_allowed_token_ids_confine_the_completion(oai, engine):
    out = oai.completions.create(model=engine.model_name, prompt=[1000, 1001, 1002], max_tokens=4, temperature=0,
                                 extra_body={"allowed_token_ids": [X]})
    assert out.choices[0].text == engine.tokenizer.decode([X] * 4)


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(oai, engine):
    ids = list(range(1000, 1100))
    fields = dict(model=engine.model_name, max_tokens=3, temperature=0)
    out = oai.completions.create(prompt=ids, **fields, extra_body={"truncate_prompt_tokens": 30})
    alone = oai.completions.create(prompt=ids[-30:], **fields)
    assert out.usage.prompt_tokens == 30 and out.choices[0].text == alone.choices[0].text


def test_penalties_and_min_tokens_reach_the_engine(oai, engine):
    fields = dict(model=engine.model_name, prompt=[1000, 1001, 1002], max_tokens=8, temperature=0,
                  logit_bias={str(X): 20})
    assert oai.completions.create(**fields).choices[0].text == engine.tokenizer.decode([X] * 8)
    penalised = oai.completions.create(**fields, frequency_penalty=2, presence_penalty=2,
                                       extra_body={"repetition_penalty": 1.2, "min_tokens": 2}).choices[0].text
    # the penalties (4 at the first repeat, 2 more a repeat, and / 1.2) outweigh the bias of 20 within 8 tokens
    assert penalised != engine.tokenizer.decode([X] * 8)


def test_a_json_schema_chat_answer_parses_and_validates(oai, engine):
    response = oai.chat.completions.create(
        model=engine.model_name, messages=[{"role": "user", "content": "A person, please."}], max_tokens=60,
        temperature=0, response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}},
        extra_body=NO_THINKING)
    choice = response.choices[0]
    value = json.loads(choice.message.content)
    assert set(value) == {"name", "n"} and len(value["name"]) <= 5 and 0 <= value["n"] <= 9
    assert choice.finish_reason == "stop"


def test_json_mode_answer_starts_an_object(oai, engine):
    response = oai.chat.completions.create(
        model=engine.model_name, messages=[{"role": "user", "content": "JSON"}], max_tokens=5, temperature=0,
        response_format={"type": "json_object"}, extra_body=NO_THINKING)
    assert response.choices[0].message.content.startswith("{")


@pytest.mark.parametrize("fields", [
    pytest.param({"guided_choice": ["red", "green"]}, id="guided_choice"),
    pytest.param({"structured_outputs": {"choice": ["red", "green"], "disable_any_whitespace": True}},
                 id="structured_outputs"),
])
def test_vllms_structured_outputs_constrain_the_answer(oai, engine, fields):
    response = oai.chat.completions.create(
        model=engine.model_name, messages=[{"role": "user", "content": "A colour?"}], max_tokens=10, temperature=0,
        extra_body=fields)  # thinking is off for a constrained answer, as for JSON
    assert response.choices[0].message.content in ("red", "green")
    text = oai.completions.create(model=engine.model_name, prompt="Code:", max_tokens=10, temperature=0,
                                  extra_body={"guided_regex": "[A-Z]{2}[0-9]"}).choices[0].text
    assert len(text) == 3 and text[:2].isupper() and text[2].isdigit()


@pytest.mark.parametrize("fields, words", [
    ({"guided_choice": ["a"], "guided_regex": "a"}, "one output constraint"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "one output constraint"),
    ({"structured_outputs": {"xml": "<a/>"}}, "structured_outputs.xml"),
    ({"guided_json": "{not json"}, "guided_json"),
])
def test_conflicting_or_unknown_constraints_are_400(server, engine, fields, words):
    response = httpx.post(server.url + "/v1/chat/completions", json={
        "model": engine.model_name, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}], **fields})
    assert response.status_code == 400 and words in response.json()["error"]["message"], response.text


@pytest.mark.parametrize("fields, param", [
    pytest.param({"presence_penalty": 2.5}, "presence_penalty", id="presence"),
    pytest.param({"frequency_penalty": -3}, "frequency_penalty", id="frequency"),
    pytest.param({"repetition_penalty": 0}, "repetition_penalty", id="repetition"),
    pytest.param({"min_tokens": -1}, "min_tokens", id="min-tokens"),
    pytest.param({"logit_bias": {"7": 101}}, "logit_bias", id="bias-value"),
    pytest.param({"logit_bias": {"seven": 1}}, "logit_bias", id="bias-key"),
    pytest.param({"allowed_token_ids": []}, "allowed_token_ids", id="allowed-empty"),
    pytest.param({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens", id="truncate-zero"),
    pytest.param({"response_format": {"type": "xml"}}, "response_format", id="format-type"),
    pytest.param({"response_format": {"type": "json_schema", "json_schema": {"schema": {"$ref": "#/nowhere"}}}},
                 "response_format", id="bad-schema"),
])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_bad_values_are_400_naming_the_field(server, engine, path, fields, param):
    body = {"messages": [{"role": "user", "content": "Hi"}]} if "chat" in path else {"prompt": "Hi"}
    response = httpx.post(server.url + path, json={"model": engine.model_name, "max_tokens": 2, **body, **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


def test_out_of_vocabulary_bias_is_400(server, engine):
    response = httpx.post(server.url + "/v1/completions", json={
        "model": engine.model_name, "prompt": "Hi", "max_tokens": 2, "logit_bias": {str(10**9): 1}})
    assert response.status_code == 400 and "logit_bias" in response.json()["error"]["message"]


def test_forced_tool_choices_make_the_model_write_a_call_of_the_tools_schema(oai, engine):
    city = {"type": "object", "properties": {"city": {"enum": ["Paris", "Lyon"]}}, "required": ["city"],
            "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": city}},
             {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {},
                                                                           "additionalProperties": False}}}]
    question = [{"role": "user", "content": "Weather in France?"}]
    for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
        response = oai.chat.completions.create(model=engine.model_name, messages=question, tools=tools,
                                               tool_choice=choice, max_tokens=120, temperature=0)
        calls = response.choices[0].message.tool_calls
        assert calls and response.choices[0].finish_reason == "tool_calls", response
        for call in calls:
            arguments = json.loads(call.function.arguments)
            assert call.function.name in ("get_weather", "now")
            assert arguments == {} if call.function.name == "now" else arguments["city"] in ("Paris", "Lyon")
        if choice != "required":
            assert [call.function.name for call in calls] == ["get_weather"]
