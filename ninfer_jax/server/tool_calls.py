"""Qwen3.5's tool-call text, parsed into a function name and JSON arguments.

The chat template teaches the model this format (see frontend/qwen35_template.py), one block per call:

    <tool_call>
    <function=NAME>
    <parameter=ARG>
    VALUE
    </parameter>
    </function>
    </tool_call>

A value is text. It is typed by the tool's JSON schema, as the template renders it on the way in
(`tojson` for mappings and non-string sequences, `string` otherwise): a parameter the schema declares
as a string stays text; any other declared type is read as JSON when it parses (else kept as text);
a parameter the schema does not declare stays text.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from .errors import ApiError

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"

_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.DOTALL)


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


def parse_tool_call(block: str, tools: Sequence[Mapping[str, Any]] | None = None) -> ToolCall | None:
    """Parses the text between `<tool_call>` and `</tool_call>`; None when it names no function."""
    match = _FUNCTION.search(block)
    if match is None:
        return None
    name = match.group(1).strip()
    schema = _parameter_types(name, tools or ())
    arguments: dict[str, Any] = {}
    for parameter in _PARAMETER.finditer(match.group(2)):
        key = parameter.group(1).strip()
        arguments[key] = _typed(_strip_one_newline(parameter.group(2)), schema.get(key))
    return ToolCall(name, arguments)


def _strip_one_newline(value: str) -> str:
    # The template writes "<parameter=k>\n" + value + "\n</parameter>": one newline each side is format.
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def _parameter_types(name: str, tools: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """{parameter: declared JSON-schema type} of the tool called `name` (OpenAI tool definitions)."""
    for tool in tools:
        function = tool.get("function", tool)
        if function.get("name") == name:
            properties = (function.get("parameters") or {}).get("properties") or {}
            return {key: (spec or {}).get("type") for key, spec in properties.items() if isinstance(spec, Mapping)}
    return {}


def _typed(value: str, declared: Any) -> Any:
    if declared is None or declared == "string" or (isinstance(declared, list) and "string" in declared):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def sent_arguments(arguments: Any, where: str) -> dict[str, Any]:
    """A client's earlier call's arguments (a JSON object, or its text as the protocols send it) as the mapping the
    template renders (none or an empty text: no arguments); anything else is a 400 naming `where`."""
    value = {} if arguments is None else arguments
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments or "{}")
        except json.JSONDecodeError:
            value = None
    if not isinstance(value, dict):
        raise ApiError("invalid_request", f"{where}: the arguments must be a JSON object", param=where)
    return value
