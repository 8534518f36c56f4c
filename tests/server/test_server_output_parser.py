"""Generated text -> reasoning, answer and tool calls: the same result streamed or whole."""

from __future__ import annotations

import pytest

from ninfer_jax.server.output_parser import OutputParser, Piece
from ninfer_jax.server.tool_calls import ToolCall, parse_tool_call

WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "units": {"type": "object"}, "zip": {"type": "string"},
}}}}]
CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
        "</parameter>\n<parameter=zip>\n75001\n</parameter>\n</function>\n</tool_call>")


def _whole(text, **kw):
    parser = OutputParser(**kw)
    return _merge(parser.push(text) + parser.finish())


def _streamed(text, **kw):
    parser = OutputParser(**kw)
    pieces = [piece for ch in text for piece in parser.push(ch)]
    return _merge(pieces + parser.finish())


def _merge(pieces: list[Piece]) -> list[tuple[str, object]]:
    merged: list[tuple[str, object]] = []
    for piece in pieces:
        if piece.kind != "tool_call" and merged and merged[-1][0] == piece.kind:
            merged[-1] = (piece.kind, merged[-1][1] + piece.text)
        else:
            merged.append((piece.kind, piece.tool_call if piece.kind == "tool_call" else piece.text))
    return merged


def test_reasoning_ends_at_think_close_and_template_whitespace_is_dropped():
    assert _whole("\nLet me add.\n</think>\n\nIt is 4.", thinking=True) == [
        ("reasoning", "Let me add."), ("content", "It is 4.")]


def test_reasoning_without_think_close_is_all_reasoning():
    assert _whole("still thinking", thinking=True) == [("reasoning", "still thinking")]


def test_thinking_off_makes_everything_answer_text():
    assert _whole("A </think> B", thinking=False) == [("content", "A </think> B")]


@pytest.mark.parametrize("text", [
    "Thinking.</think>\n\nSure.\n\n" + CALL,
    "Thinking.</think>\n\n" + CALL + "\n" + CALL,
    "plain answer with < and </ and <tool and trailing space  ",
])
def test_streaming_one_character_at_a_time_gives_the_same_pieces_as_whole_text(text):
    assert _streamed(text, thinking=True, tools=WEATHER) == _whole(text, thinking=True, tools=WEATHER)


def test_tool_call_block_becomes_a_call_with_arguments_typed_by_the_schema():
    pieces = _whole("Checking.\n\n" + CALL, thinking=False, tools=WEATHER)
    assert pieces == [("content", "Checking."),
                      ("tool_call", ToolCall("get_weather", {"city": "Paris", "days": 3, "zip": "75001"}))]


def test_json_valued_parameter_parses_and_unparsable_value_stays_text():
    call = parse_tool_call('<function=get_weather>\n<parameter=units>\n{"temp": "C"}\n</parameter>\n'
                           '<parameter=days>\nthree\n</parameter>\n</function>', WEATHER)
    assert call == ToolCall("get_weather", {"units": {"temp": "C"}, "days": "three"})


def test_parameter_the_schema_does_not_declare_stays_text():
    call = parse_tool_call("<function=get_weather>\n<parameter=extra>\n42\n</parameter>\n</function>", WEATHER)
    assert call.arguments == {"extra": "42"}


def test_multiline_value_keeps_inner_newlines():
    call = parse_tool_call("<function=f>\n<parameter=body>\nline 1\nline 2\n</parameter>\n</function>", [])
    assert call.arguments == {"body": "line 1\nline 2"}


def test_unterminated_tool_call_is_given_back_as_text():
    text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar"
    assert _whole(text, thinking=False, tools=WEATHER) == [("content", text)]


def test_block_without_function_is_given_back_as_text():
    assert _whole("<tool_call>oops</tool_call>", thinking=False, tools=WEATHER) == [
        ("content", "<tool_call>oops</tool_call>")]


def test_without_tools_tool_call_markup_is_answer_text():
    assert _whole(CALL, thinking=False) == [("content", CALL)]
