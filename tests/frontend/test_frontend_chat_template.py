"""The Qwen3.5 chat template: literal renderings, the layout read back from them, and template loading."""

from __future__ import annotations

import json

import pytest

from frontend_support import hf_tokenizer, qwen35_dir  # noqa: F401
from ninfer_jax.frontend import QWEN35_CHAT_TEMPLATE, ChatTemplate, ChatTemplateError, load_chat_template

QWEN35 = ChatTemplate.qwen35()

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}

TOOLS_BLOCK = (
    "<|im_start|>system\n"
    "# Tools\n\nYou have access to the following functions:\n\n<tools>\n"
    '{"type": "function", "function": {"name": "get_weather", "description": "Current weather", '
    '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}\n'
    "</tools>\n\n"
    "If you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
    "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"
    "<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n"
    "</parameter>\n</function>\n</tool_call>\n\n"
    "<IMPORTANT>\nReminder:\n"
    "- Function calls MUST follow the specified format: an inner <function=...></function> block must be "
    "nested within <tool_call></tool_call> XML tags\n"
    "- Required parameters MUST be specified\n"
    "- You may provide optional reasoning for your function call in natural language BEFORE the function call, "
    "but NOT after\n"
    "- If there is no function call available, answer the question like normal with your current knowledge and "
    "do not tell the user about function calls\n"
    "</IMPORTANT>"
)

TOOL_TURN = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Oslo?"},
    {
        "role": "assistant",
        "content": "Checking both.",
        "reasoning_content": "Two cities, two calls.",
        "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "b", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}},
        ],
    },
    {"role": "tool", "tool_call_id": "a", "content": '{"temp": 14}'},
    {"role": "tool", "tool_call_id": "b", "content": '{"temp": 3}'},
]

TOOL_TURN_TEXT = (
    TOOLS_BLOCK + "\n\nBe brief.<|im_end|>\n"
    "<|im_start|>user\nWeather in Paris and Oslo?<|im_end|>\n"
    "<|im_start|>assistant\n<think>\nTwo cities, two calls.\n</think>\n\nChecking both.\n\n"
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>\n"
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>"
    "<|im_end|>\n"
    "<|im_start|>user\n<tool_response>\n{\"temp\": 14}\n</tool_response>\n"
    "<tool_response>\n{\"temp\": 3}\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n<think>\n"
)


def test_thinking_on_opens_a_think_block():
    text = QWEN35.render([{"role": "user", "content": "Hi"}]).text
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"


def test_thinking_off_pre_closes_an_empty_think_block():
    messages = [{"role": "system", "content": "  Be kind.\n"}, {"role": "user", "content": "Hi"}]
    text = QWEN35.render(messages, enable_thinking=False).text
    assert text == (
        "<|im_start|>system\nBe kind.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


def test_no_generation_prompt_ends_after_the_last_turn():
    text = QWEN35.render([{"role": "user", "content": "Hi"}], add_generation_prompt=False).text
    assert text == "<|im_start|>user\nHi<|im_end|>\n"


def test_a_continued_final_message_leaves_its_turn_open_after_its_content():
    messages = [{"role": "user", "content": "Give JSON"}, {"role": "assistant", "content": '{"a":'}]
    rendered = QWEN35.render(messages, add_generation_prompt=False, continue_final_message=True)
    assert rendered.text == ('<|im_start|>user\nGive JSON<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n'
                             '{"a":')
    layout = rendered.layout
    assert layout.message_ends[-1] == layout.part_ends[-1][-1] == len(rendered.text)
    assert layout.generation_opener == layout.message_starts[-1]  # the turn the model continues


@pytest.mark.parametrize("messages, add_generation_prompt, error", [
    ([{"role": "user", "content": "x"}], False, "the assistant's"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": ""}], False, "text content"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": "a", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{}"}}]}], False, "no tool calls"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": "a"}], True, "both"),
])
def test_a_final_message_that_cannot_be_continued_is_refused(messages, add_generation_prompt, error):
    with pytest.raises(ChatTemplateError, match=error):
        QWEN35.render(messages, add_generation_prompt=add_generation_prompt, continue_final_message=True)


def test_reasoning_is_stripped_from_turns_before_the_last_user_query():
    messages = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Add them."},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "<think>\nAdd again.\n</think>\n\n6"},
    ]
    text = QWEN35.render(messages, add_generation_prompt=False).text
    assert text == (
        "<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n"
        "<|im_start|>user\nAnd 3+3?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nAdd again.\n</think>\n\n6<|im_end|>\n"
    )


def test_tools_block_then_system_prompt_then_grouped_tool_responses():
    assert QWEN35.render(TOOL_TURN, [WEATHER_TOOL]).text == TOOL_TURN_TEXT


def test_tools_without_system_message_close_the_system_turn():
    text = QWEN35.render([{"role": "user", "content": "Hi"}], [WEATHER_TOOL]).text
    assert text == TOOLS_BLOCK + "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"


def test_tool_call_arguments_render_as_qwen3_coder_parameters():
    messages = [
        {"role": "user", "content": "Go"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"function": {"name": "f", "arguments": {"s": "two\nlines", "n": 3, "b": True, "o": {"k": [1, "é"]}}}}
            ],
        },
        {"role": "tool", "content": "ok"},
        {"role": "user", "content": "Thanks"},
    ]
    text = QWEN35.render(messages, add_generation_prompt=False).text
    assert text == (
        "<|im_start|>user\nGo<|im_end|>\n"
        "<|im_start|>assistant\n<tool_call>\n<function=f>\n"
        "<parameter=s>\ntwo\nlines\n</parameter>\n<parameter=n>\n3\n</parameter>\n"
        "<parameter=b>\nTrue\n</parameter>\n<parameter=o>\n{\"k\": [1, \"é\"]}\n</parameter>\n"
        "</function>\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nok\n</tool_response><|im_end|>\n"
        "<|im_start|>user\nThanks<|im_end|>\n"
    )


def test_developer_role_renders_as_system_and_content_parts_join():
    messages = [
        {"role": "developer", "content": "Rules."},
        {"role": "user", "content": [{"type": "text", "text": "Part one. "}, {"type": "text", "text": "Part two."}]},
    ]
    text = QWEN35.render(messages, add_generation_prompt=False).text
    assert text == "<|im_start|>system\nRules.<|im_end|>\n<|im_start|>user\nPart one. Part two.<|im_end|>\n"


@pytest.mark.parametrize(
    "messages,error",
    [
        ([{"role": "system", "content": "only system"}], "No user query"),
        ([{"role": "user", "content": "a"}, {"role": "system", "content": "late"}], "must be at the beginning"),
        ([{"role": "narrator", "content": "?"}, {"role": "user", "content": "a"}], "Unexpected message role"),
    ],
)
def test_template_rejections_raise_chat_template_error(messages, error):
    with pytest.raises(ChatTemplateError, match=error):
        QWEN35.render(messages)


def test_layout_locates_turns_tools_system_and_opener():
    rendered = QWEN35.render(TOOL_TURN, [WEATHER_TOOL])
    text, layout = rendered.text, rendered.layout
    starts = [text[s:] for s in layout.message_starts]
    assert starts[0].startswith("<|im_start|>system\n# Tools")
    assert starts[1].startswith("<|im_start|>user\nWeather")
    assert starts[2].startswith("<|im_start|>assistant\n<think>")
    assert starts[3].startswith("<|im_start|>user\n<tool_response>\n{\"temp\": 14}")
    assert starts[4].startswith("\n<tool_response>\n{\"temp\": 3}")
    assert layout.message_ends == (*layout.message_starts[1:], layout.generation_opener)
    assert text[layout.generation_opener :] == "<|im_start|>assistant\n<think>\n"
    assert text[: layout.tools_end].endswith("</IMPORTANT>")
    assert text[: layout.system_end].endswith("Be brief.<|im_end|>\n")
    assert text[: layout.part_ends[2][0]].endswith("Checking both.")
    assert text[: layout.part_ends[3][0]].endswith('{"temp": 14}')


def test_layout_opener_is_the_last_assistant_turn_without_generation_prompt():
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    rendered = QWEN35.render(messages, add_generation_prompt=False)
    assert rendered.layout.generation_opener == rendered.layout.message_starts[1]
    assert rendered.layout.tools_end is None and rendered.layout.system_end is None


def test_layout_is_empty_for_a_template_that_is_not_chatml():
    rendered = ChatTemplate("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}").render(
        [{"role": "user", "content": "hi"}]
    )
    assert rendered.text == "[user] hi\n"
    assert not rendered.layout.located


def test_rendering_equals_transformers_apply_chat_template(hf_tokenizer):
    conversations = [
        ([{"role": "user", "content": "Hi"}], None, {}),
        ([{"role": "user", "content": "Hi"}], None, {"enable_thinking": False}),
        (TOOL_TURN, [WEATHER_TOOL], {}),
        (
            [
                {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4", "reasoning_content": "Add."},
                {"role": "user", "content": [{"type": "text", "text": "Again"}, {"type": "image"}]},
            ],
            None,
            {"enable_thinking": False},
        ),
    ]
    for messages, tools, kwargs in conversations:
        ours = QWEN35.render(messages, tools, **kwargs).text
        hf_messages = QWEN35.render(messages, tools, **kwargs).messages  # tool arguments as mappings
        theirs = hf_tokenizer.apply_chat_template(
            [dict(m) for m in hf_messages], tools=tools, tokenize=False, add_generation_prompt=True, **kwargs
        )
        assert ours == theirs


def test_checkpoint_template_prefers_chat_template_jinja(tmp_path, qwen35_dir):
    assert load_chat_template(qwen35_dir).source == QWEN35_CHAT_TEMPLATE
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "config:{{ messages|length }}"}))
    assert load_chat_template(tmp_path).render([{"role": "user", "content": "x"}]).text == "config:1"
    (tmp_path / "chat_template.jinja").write_text("jinja:{{ messages|length }}")
    assert load_chat_template(tmp_path).render([{"role": "user", "content": "x"}]).text == "jinja:1"


def test_tool_call_arguments_that_are_not_json_are_named_in_the_error():
    """A history call's arguments are parsed when they are JSON; text the template cannot iterate is refused with
    the call's place, not the template's bare TypeError."""
    call = {"type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": "ok"}]
    assert "<function=f>\n<parameter=x>\n1\n</parameter>" in QWEN35.render(messages).text
    messages[1]["tool_calls"] = [call, {"type": "function", "function": {"name": "g", "arguments": "not json"}}]
    with pytest.raises(ChatTemplateError, match=r"messages\[1\]\.tool_calls\[1\]: .*not a JSON object"):
        QWEN35.render(messages)


def test_checkpoint_template_picks_default_of_named_templates_and_falls_back_to_qwen35(tmp_path):
    assert load_chat_template(tmp_path).source == QWEN35_CHAT_TEMPLATE
    named = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "default"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    assert load_chat_template(tmp_path).source == "default"


def test_template_sandbox_refuses_unsafe_attribute_access():
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}").render([{"role": "user", "content": "x"}])


def test_layout_skips_structure_quoted_inside_a_message():
    messages = [
        {"role": "user", "content": "Run it"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]},
        {"role": "tool", "content": "output mentions <tool_response> literally"},
        {"role": "tool", "content": "second"},
    ]
    rendered = QWEN35.render(messages)
    assert rendered.text[rendered.layout.message_starts[3] :].startswith("\n<tool_response>\nsecond")
