"""Forced tool calls: OpenAI's `tool_choice` "required" or a named function, Anthropic's "any" or "tool".

As vLLM serves them, the output is constrained by a JSON schema instead of Qwen's XML call format (tool_calls.py):
a named function's arguments object, or for "required" a list of one or more {"name", "parameters"} objects of the
given tools (at most one without parallel calls). The grammar constrains every generated token, so the whole
output is that JSON and is read back as the calls. An arguments object takes only its declared properties unless its
schema says otherwise (vLLM's default grammar backend reads schemas that way too): without it a model could write
keys the tool does not take until max_tokens.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

from .errors import ApiError
from .tool_calls import ToolCall

_NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclasses.dataclass(frozen=True)
class ForcedTools:
    """The calls a request forces. name: the one function it names (None: any of the tools, "required");
    parallel: whether a "required" output may hold several calls."""

    functions: tuple[tuple[str, Mapping[str, Any]], ...]  # (name, parameters schema) of each tool in play
    name: str | None = None
    parallel: bool = True

    def response_format(self) -> dict[str, Any]:
        """SamplingParams.response_format of the output: the calls' JSON schema."""
        if self.name is not None:
            schema = dict(self.functions)[self.name]
        else:
            schema = {"type": "array", "minItems": 1, "items": {"anyOf": [
                {"type": "object", "properties": {"name": {"const": name}, "parameters": parameters},
                 "required": ["name", "parameters"], "additionalProperties": False}
                for name, parameters in self.functions]}}
            if not self.parallel:
                schema["maxItems"] = 1
        return {"type": "json_schema", "json_schema": {"name": "tool_calls", "schema": schema}}

    def calls(self, text: str) -> list[ToolCall] | None:
        """The calls an output holds; None when it is not the schema's JSON (cut short by max_tokens or a stop)."""
        try:
            value = json.loads(text)
        except ValueError:
            return None
        if self.name is not None:
            return [ToolCall(self.name, value)] if isinstance(value, dict) else None
        known = dict(self.functions)
        if not isinstance(value, list) or not value or not all(
                isinstance(call, dict) and call.get("name") in known and isinstance(call.get("parameters"), dict)
                for call in value):
            return None
        return [ToolCall(call["name"], call["parameters"]) for call in value]


def forced_tools(tools: Sequence[Mapping[str, Any]] | None, name: str | None, *, param: str,
                 parallel: bool = True) -> ForcedTools:
    """The ForcedTools of `tools` (the chat template's nested function tools) for the function `name`, or any of
    them (None). A request that forces a call without tools, or names a function it does not define, is a 400 (as
    OpenAI, Anthropic and vLLM answer it); `param` names the request's field."""
    if not tools:
        raise ApiError("invalid_request", f"{param} forces a tool call, but the request defines no tools", param=param)
    functions = tuple((tool["function"]["name"], _closed(tool["function"].get("parameters") or _NO_PARAMETERS))
                      for tool in tools)
    if name is not None and name not in dict(functions):
        raise ApiError("invalid_request", f"{param} names the function {name!r}, which is not among the request's "
                       f"tools ({', '.join(repr(n) for n, _ in functions)})", param=param)
    return ForcedTools(functions, name, parallel)


def _closed(schema: Mapping[str, Any]) -> Mapping[str, Any]:
    """An object schema without additionalProperties takes no properties but its own."""
    is_object = schema.get("type") == "object" or "properties" in schema
    return {**schema, "additionalProperties": False} if is_object and "additionalProperties" not in schema else schema


def output_format(forced: ForcedTools | None, own: dict[str, Any] | None, field: str) -> dict[str, Any] | None:
    """SamplingParams.response_format of a request: its forced calls' schema, else its own constraint (`own`, from
    the request's `field`); a request with both is a 400."""
    if forced is None:
        return own
    if own is not None:
        raise ApiError("invalid_request", f"give one output constraint: tool_choice forces tool calls, and {field} "
                       "constrains the output too", param="tool_choice")
    return forced.response_format()


def openai_forced_tools(choice: str | Mapping[str, Any] | None, tools: Sequence[Mapping[str, Any]] | None, *,
                        parallel: bool | None) -> ForcedTools | None:
    """OpenAI's tool_choice: "required", or a function named as chat completions write it ({"type": "function",
    "function": {"name": ...}}) or as the Responses API does ({"type": "function", "name": ...}); None for "auto",
    "none" and unset."""
    if choice in (None, "auto", "none"):
        return None
    name = None
    if choice != "required":
        refused = ApiError("invalid_request", 'tool_choice must be "none", "auto", "required" or {"type": "function", '
                           '"function": {"name": ...}}', param="tool_choice")
        if not isinstance(choice, Mapping) or choice.get("type") != "function":
            raise refused
        function = choice.get("function")
        name = function.get("name") if isinstance(function, Mapping) else choice.get("name")
        if not isinstance(name, str):
            raise refused
    return forced_tools(tools, name, param="tool_choice", parallel=parallel is not False)


def anthropic_forced_tools(choice: Mapping[str, Any] | None, tools: Sequence[Mapping[str, Any]] | None, *,
                           parallel: bool) -> ForcedTools | None:
    """Anthropic's tool_choice: {"type": "any"} or {"type": "tool", "name": ...}; None for "auto", "none" and unset.
    parallel: not its disable_parallel_tool_use."""
    kind = (choice or {}).get("type", "auto")
    if kind in ("auto", "none"):
        return None
    name = choice.get("name")
    if kind not in ("any", "tool") or kind == "tool" and not isinstance(name, str):
        raise ApiError("invalid_request", 'tool_choice.type must be "auto", "any", "tool" (with a name) or "none"',
                       param="tool_choice")
    return forced_tools(tools, name if kind == "tool" else None, param="tool_choice", parallel=parallel)
