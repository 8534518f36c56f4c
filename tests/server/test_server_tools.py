"""Tools, reasoning and stop sequences through both protocols, on a scripted engine whose output the tests choose
(the tiny random model never writes a tool call): the model's Qwen3.5 text goes out as each protocol's
structures, and those structures come back rendered as the Qwen3.5 template expects."""

from __future__ import annotations

import json

import httpx
import pytest

from server_support import CALL, RENDERED_CALL, ScriptedEngine, claude, oai, server  # noqa: F401 (fixtures)

MODEL = ScriptedEngine.model_name
OPENAI_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]
ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "Weather for a city", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}]


@pytest.fixture(scope="module")
def engine():
    return ScriptedEngine()



def test_openai_tool_call_goes_out_as_tool_calls_and_comes_back_as_the_template_renders_it(oai, engine):
    engine.say("The user wants weather.\n</think>\n\nLet me look.\n\n" + CALL)
    question = [{"role": "user", "content": "Weather in Paris?"}]
    first = oai.chat.completions.create(model=MODEL, messages=question, tools=OPENAI_TOOLS)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.reasoning_content == "The user wants weather."
    assert choice.message.content == "Let me look."
    [call] = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris", "days": 2})

    engine.say("</think>\n\nIt is sunny.")
    second = oai.chat.completions.create(model=MODEL, tools=OPENAI_TOOLS, messages=[
        *question, choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 C"}])
    assert second.choices[0].message.content == "It is sunny."
    rendered = engine.rendered()
    assert RENDERED_CALL in rendered
    assert "<tool_response>\nSunny, 24 C\n</tool_response>" in rendered


def test_openai_streamed_tool_call_equals_the_non_streamed_one(oai, engine):
    engine.say("Thinking.</think>\n\n" + CALL + "\n" + CALL.replace("Paris", "Lyon"))
    chunks = list(oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Two cities?"}],
                                              tools=OPENAI_TOOLS, stream=True))
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or ())]
    assert [tc.index for tc in calls] == [0, 1]
    assert [json.loads(tc.function.arguments)["city"] for tc in calls] == ["Paris", "Lyon"]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    reasoning = [(c.choices[0].delta.model_extra or {}).get("reasoning_content") for c in chunks if c.choices]
    assert "".join(r for r in reasoning if r) == "Thinking."


def test_openai_tool_choice_none_renders_no_tools_and_parses_no_calls(oai, engine):
    engine.say("</think>\n\n" + CALL)
    response = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                           tools=OPENAI_TOOLS, tool_choice="none")
    assert "# Tools" not in engine.rendered()
    assert response.choices[0].message.tool_calls is None
    assert response.choices[0].message.content == CALL


def test_thinking_off_pre_closes_the_think_block_and_all_output_is_content(oai, engine):
    engine.say("Just the answer.")
    response = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                           extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert engine.rendered().endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert (response.choices[0].message.content, response.choices[0].message.reasoning_content) == (
        "Just the answer.", None)


def test_anthropic_tool_use_goes_out_and_tool_result_comes_back(claude, engine):
    engine.say("Let me look.\n\n" + CALL)
    question = [{"role": "user", "content": "Weather in Paris?"}]
    first = claude.messages.create(model=MODEL, max_tokens=100, tools=ANTHROPIC_TOOLS, messages=question)
    assert first.stop_reason == "tool_use"
    assert [b.type for b in first.content] == ["text", "tool_use"]
    use = first.content[1]
    assert (use.name, use.input) == ("get_weather", {"city": "Paris", "days": 2})
    assert engine.rendered().endswith("<think>\n\n</think>\n\n")  # thinking is off unless asked for

    engine.say("It is sunny.")
    second = claude.messages.create(model=MODEL, max_tokens=100, tools=ANTHROPIC_TOOLS, messages=[
        *question, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 24 C"}]}])
    assert second.content[0].text == "It is sunny." and second.stop_reason == "end_turn"
    rendered = engine.rendered()
    assert "Let me look.\n\n" + RENDERED_CALL in rendered
    assert "<tool_response>\nSunny, 24 C\n</tool_response>" in rendered


def test_anthropic_stream_gives_thinking_text_and_tool_use_blocks(claude, engine):
    engine.say("Weather is needed.</think>\n\nChecking.\n\n" + CALL)
    with claude.messages.stream(model=MODEL, max_tokens=2048, tools=ANTHROPIC_TOOLS,
                                thinking={"type": "enabled", "budget_tokens": 1024},
                                messages=[{"role": "user", "content": "Weather in Paris?"}]) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use"]
    assert final.content[0].thinking == "Weather is needed."
    assert final.content[1].text == "Checking."
    assert final.content[2].input == {"city": "Paris", "days": 2}
    assert final.stop_reason == "tool_use"



def test_anthropic_enabled_thinking_sends_its_budget_and_adaptive_or_prefilled_thinking_none(claude, engine):
    hi = [{"role": "user", "content": "Hi"}]
    for thinking, messages, budget in (({"type": "enabled", "budget_tokens": 1024}, hi, 1024),
                                       ({"type": "adaptive"}, hi, None),
                                       ({"type": "enabled", "budget_tokens": 1024},
                                        [*hi, {"role": "assistant", "content": "Sure"}], None)):
        engine.say("Fine.")
        claude.messages.create(model=MODEL, max_tokens=2048, thinking=thinking, messages=messages)
        assert engine.sampling[-1].thinking_budget == budget


def test_vllms_thinking_token_budget_reaches_the_sampling_of_a_thinking_answer_only(oai, engine):
    for kwargs, budget in (({}, 5), ({"chat_template_kwargs": {"enable_thinking": False}}, None)):
        engine.say("Fine.")
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                    extra_body={"thinking_token_budget": 5, **kwargs})
        assert engine.sampling[-1].thinking_budget == budget

def test_anthropic_thinking_blocks_come_back_as_reasoning(claude, engine):
    engine.say("Fine.")
    claude.messages.create(model=MODEL, max_tokens=2048, thinking={"type": "enabled", "budget_tokens": 1024},
                           messages=[{"role": "user", "content": "Hi"},
                                     {"role": "assistant", "content": [
                                         {"type": "thinking", "thinking": "Greet back.", "signature": ""},
                                         {"type": "text", "text": "Hello!"}]},
                                     {"role": "user", "content": "And now?"}])
    assert "<|im_start|>assistant\nHello!<|im_end|>" in engine.rendered()  # reasoning before the last query drops


def test_anthropic_stop_sequence_is_reported(claude, engine):
    engine.say("one two STOP three")
    message = claude.messages.create(model=MODEL, max_tokens=100, stop_sequences=["HALT", "STOP"],
                                     messages=[{"role": "user", "content": "Count"}])
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "STOP")
    assert message.content[0].text == "one two "


def test_openai_chat_logprobs_cover_every_generated_token(oai, engine):
    engine.say("Two words.")
    no_think = {"chat_template_kwargs": {"enable_thinking": False}}
    response = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], logprobs=True,
                                           top_logprobs=2, extra_body=no_think)
    content = response.choices[0].logprobs.content
    assert "".join(entry.token for entry in content) == "Two words."
    assert len(content) == response.usage.completion_tokens
    assert all(entry.logprob == -0.5 and [t.logprob for t in entry.top_logprobs] == [-1.0, -2.0] for entry in content)
    assert engine.sampling[-1].logprobs == 2

    engine.say("Two words.")
    chunks = list(oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                              logprobs=True, stream=True, extra_body=no_think))
    streamed = [entry for c in chunks if c.choices and c.choices[0].logprobs for entry in c.choices[0].logprobs.content]
    assert [entry.token for entry in streamed] == [entry.token for entry in content]


def test_openai_completion_logprobs_give_tokens_and_text_offsets(oai, engine):
    engine.say("Two words.", "Two words.")
    whole = oai.completions.create(model=MODEL, prompt="Say two words", logprobs=1).choices[0]
    assert "".join(whole.logprobs.tokens) == whole.text == "Two words."
    assert whole.logprobs.text_offset == [0, 3, 9][: len(whole.logprobs.tokens)]
    streamed = [c.choices[0].logprobs for c in oai.completions.create(model=MODEL, prompt="Say two words",
                                                                      logprobs=1, stream=True)
                if c.choices[0].logprobs]
    assert [t for lp in streamed for t in lp.tokens] == whole.logprobs.tokens
    assert [o for lp in streamed for o in lp.text_offset] == whole.logprobs.text_offset


def test_a_final_assistant_message_is_continued_in_both_protocols(oai, claude, engine):
    """Anthropic's prefill and vLLM's continue_final_message: the prompt ends inside the assistant's turn, after its
    text, and the reply is the rest of the answer, read as content (the turn is past its think block)."""
    question = {"role": "user", "content": "Give JSON"}
    engine.say(' 1}')
    message = claude.messages.create(model=MODEL, max_tokens=16, messages=[
        question, {"role": "assistant", "content": '{"a":'}])
    assert engine.rendered().endswith('<|im_start|>assistant\n<think>\n\n</think>\n\n{"a":')
    assert [(b.type, b.text) for b in message.content] == [("text", " 1}")]
    engine.say(" 1}")
    reply = oai.chat.completions.create(model=MODEL, messages=[question, {"role": "assistant", "content": '{"a":'}],
                                        extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert engine.rendered().endswith('</think>\n\n{"a":') and reply.choices[0].message.content == " 1}"
    counted = claude.messages.count_tokens(model=MODEL, messages=[question, {"role": "assistant", "content": '{"a":'}])
    assert counted.input_tokens == len(engine.prompts[-1].token_ids)


def test_continuing_a_message_that_is_not_the_assistants_is_refused(oai):
    import openai

    with pytest.raises(openai.BadRequestError, match="assistant"):
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                    extra_body={"continue_final_message": True})
    with pytest.raises(openai.BadRequestError, match="both"):
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}, {
            "role": "assistant", "content": "y"}], extra_body={"continue_final_message": True,
                                                             "add_generation_prompt": True})


def test_without_parallel_calls_only_the_first_call_is_returned(oai, claude, engine):
    two_calls = "</think>\n\n" + CALL + "\n" + CALL.replace("Paris", "Lyon")
    for stream in (False, True):
        engine.say(two_calls)
        response = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Two cities?"}],
                                               tools=OPENAI_TOOLS, parallel_tool_calls=False, stream=stream)
        if stream:
            calls = [tc for c in response if c.choices for tc in (c.choices[0].delta.tool_calls or ())]
        else:
            calls = response.choices[0].message.tool_calls
        assert [json.loads(tc.function.arguments)["city"] for tc in calls] == ["Paris"]
    engine.say(two_calls.removeprefix("</think>\n\n"))
    message = claude.messages.create(model=MODEL, max_tokens=100, tools=ANTHROPIC_TOOLS,
                                     tool_choice={"type": "auto", "disable_parallel_tool_use": True},
                                     messages=[{"role": "user", "content": "Two cities?"}])
    assert [b.input["city"] for b in message.content if b.type == "tool_use"] == ["Paris"]


def test_include_reasoning_false_leaves_the_reasoning_out(oai, engine):
    for stream in (False, True):
        engine.say("Private thoughts.</think>\n\nThe answer.")
        response = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                               stream=stream, extra_body={"include_reasoning": False})
        if stream:
            deltas = [c.choices[0].delta for c in response if c.choices]
            content = "".join(d.content or "" for d in deltas)
            reasoning = [d for d in deltas if (d.model_extra or {}).get("reasoning_content")]
        else:
            content, reasoning = response.choices[0].message.content, response.choices[0].message.reasoning_content
        assert content == "The answer." and not reasoning
    assert engine.rendered().endswith("<|im_start|>assistant\n<think>\n")  # the model still thinks


def test_a_named_tool_choice_constrains_the_output_to_its_arguments_and_returns_them_as_the_call(oai, engine):
    engine.say('{"city": "Paris", "days": 2}')
    named = {"type": "function", "function": {"name": "get_weather"}}
    response = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather?"}],
                                           tools=OPENAI_TOOLS, tool_choice=named)
    # the arguments take the declared properties only, unless the schema says otherwise
    closed = {**OPENAI_TOOLS[0]["function"]["parameters"], "additionalProperties": False}
    assert engine.sampling[-1].response_format["json_schema"]["schema"] == closed
    assert engine.rendered().endswith("<think>\n\n</think>\n\n")  # the grammar binds every token: no thinking
    message = response.choices[0].message
    [call] = message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris", "days": 2})
    assert message.content is None and response.choices[0].finish_reason == "tool_calls"
    # Streamed: the call arrives whole once the output ends
    engine.say('{"city": "Lyon"}')
    chunks = list(oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather?"}],
                                              tools=OPENAI_TOOLS, tool_choice=named, stream=True))
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or ())]
    assert [(tc.index, tc.function.name, json.loads(tc.function.arguments)) for tc in calls] == [
        (0, "get_weather", {"city": "Lyon"})]
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)
    # Cut short by max_tokens, the output is not a call: it is given back as text
    engine.say('{"city": "Pa')
    cut = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather?"}],
                                      tools=OPENAI_TOOLS, tool_choice=named)
    assert cut.choices[0].message.tool_calls is None and cut.choices[0].message.content == '{"city": "Pa'


def test_required_tool_choice_takes_one_or_more_calls_of_the_given_tools(oai, claude, engine):
    two = OPENAI_TOOLS + [{"type": "function", "function": {"name": "now"}}]
    engine.say('[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "now", "parameters": {}}]')
    response = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather?"}],
                                           tools=two, tool_choice="required")
    schema = engine.sampling[-1].response_format["json_schema"]["schema"]
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    assert [option["properties"]["name"] for option in schema["items"]["anyOf"]] == [{"const": "get_weather"},
                                                                                     {"const": "now"}]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in response.choices[0].message.tool_calls] == [
        ("get_weather", {"city": "Paris"}), ("now", {})]
    engine.say('[{"name": "now", "parameters": {}}]')
    oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Time?"}], tools=two,
                                tool_choice="required", parallel_tool_calls=False)
    assert engine.sampling[-1].response_format["json_schema"]["schema"]["maxItems"] == 1
    # The Responses API's, as function_call items
    engine.say('[{"name": "now", "parameters": {}}]')
    flat = [{"type": "function", **tool["function"]} for tool in two]
    response = oai.responses.create(model=MODEL, input="Time?", tools=flat, tool_choice="required")
    assert [(item.type, item.name, json.loads(item.arguments)) for item in response.output] == [
        ("function_call", "now", {})]
    # Anthropic's "any" and "tool" are the same constraints
    engine.say('[{"name": "get_weather", "parameters": {"city": "Oslo", "days": 1}}]')
    message = claude.messages.create(model=MODEL, max_tokens=100, tools=ANTHROPIC_TOOLS, tool_choice={"type": "any"},
                                     messages=[{"role": "user", "content": "Weather?"}])
    assert [(b.type, b.name, b.input) for b in message.content] == [("tool_use", "get_weather",
                                                                     {"city": "Oslo", "days": 1})]
    assert message.stop_reason == "tool_use"
    engine.say('{"city": "Rome"}')
    message = claude.messages.create(model=MODEL, max_tokens=100, tools=ANTHROPIC_TOOLS,
                                     tool_choice={"type": "tool", "name": "get_weather"},
                                     messages=[{"role": "user", "content": "Weather?"}])
    assert message.content[0].input == {"city": "Rome"}
    open_schema = {**ANTHROPIC_TOOLS[0]["input_schema"], "additionalProperties": True}
    engine.say('{"city": "Rome", "note": "sunny"}')
    open_tool = {**ANTHROPIC_TOOLS[0], "input_schema": open_schema}
    message = claude.messages.create(model=MODEL, max_tokens=100, tools=[open_tool],
                                     tool_choice={"type": "tool", "name": "get_weather"},
                                     messages=[{"role": "user", "content": "Weather?"}])
    assert message.content[0].input == {"city": "Rome", "note": "sunny"}
    assert engine.sampling[-1].response_format["json_schema"]["schema"] == open_schema


@pytest.mark.parametrize("path, fields, words", [
    ("/v1/chat/completions", {"tools": OPENAI_TOOLS, "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "names the function 'f', which is not among the request's tools ('get_weather')"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "defines no tools"),
    ("/v1/chat/completions", {"tools": OPENAI_TOOLS, "tool_choice": {"type": "function"}}, 'tool_choice must be'),
    ("/v1/chat/completions", {"tools": OPENAI_TOOLS, "tool_choice": "required",
                              "response_format": {"type": "json_object"}}, "one output constraint"),
    ("/v1/responses", {"input": "Hi", "tools": [{"type": "function", "name": "now"}],
                       "tool_choice": {"type": "function", "name": "later"}}, "'later', which is not among"),
    ("/v1/responses", {"input": "Hi", "tools": [{"type": "function", "name": "now"}], "tool_choice": "required",
                       "text": {"format": {"type": "json_object"}}}, "text.format constrains the output too"),
    ("/v1/messages", {"max_tokens": 10, "tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "tool", "name": "x"}},
     "'x', which is not among"),
    ("/v1/messages", {"max_tokens": 2048, "tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "any"},
                      "thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking may not be enabled"),
])
def test_a_forced_tool_choice_the_request_cannot_meet_is_400(server, engine, path, fields, words):
    messages = {} if path == "/v1/responses" else {"messages": [{"role": "user", "content": "Hi"}]}
    response = httpx.post(server.url + path, json={"model": MODEL, **messages, **fields})
    assert response.status_code == 400, response.text
    body = response.json()["error"]
    assert words in body["message"] and body.get("param", "tool_choice") == "tool_choice", body


def test_responses_max_tool_calls_keeps_the_first_calls(oai, engine):
    engine.say("</think>\n\n" + CALL + "\n" + CALL.replace("Paris", "Lyon"))
    flat = [{"type": "function", **OPENAI_TOOLS[0]["function"]}]
    response = oai.responses.create(model=MODEL, input="Two cities?", tools=flat, max_tool_calls=1)
    assert [json.loads(item.arguments)["city"] for item in response.output if item.type == "function_call"] == [
        "Paris"]


@pytest.mark.parametrize("path, fields, words", [
    ("/v1/responses", {"input": "Hi", "background": True}, "background is not supported"),
    ("/v1/responses", {"input": "Hi", "conversation": "conv_1"}, "conversation is not supported"),
    ("/v1/responses", {"input": "Hi", "reasoning": {"effort": "ultra"}}, "reasoning.effort"),
    ("/v1/messages", {"max_tokens": 10, "messages": [{"role": "user", "content": "Hi"}],
                      "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
])
def test_what_the_protocols_offer_and_this_server_does_not_run_is_400(server, engine, path, fields, words):
    response = httpx.post(server.url + path, json={"model": MODEL, **fields})
    assert response.status_code == 400 and words in response.json()["error"]["message"], response.text


def test_earlier_calls_arguments_must_be_a_json_object_and_refusals_render_as_text(oai, server, engine):
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{not json"}}
    history = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "c1", "content": "Sunny"}]
    response = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, "messages": history,
                                                                      "tools": OPENAI_TOOLS})
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "messages[1].tool_calls[0].function.arguments", error
    items = [{"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "[1]"},
             {"type": "function_call_output", "call_id": "c1", "output": "Sunny"}]
    response = httpx.post(server.url + "/v1/responses", json={"model": MODEL, "input": [
        {"role": "user", "content": "Weather?"}, *items]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "input[1].arguments", response.text
    # OpenAI's assistant refusal parts come back as the answer's text
    engine.say("</think>\n\nOK.")
    refused = {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't."}]}
    oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}, refused,
                                                       {"role": "user", "content": "Please?"}])
    assert "<|im_start|>assistant\nI can't.<|im_end|>" in engine.rendered()
