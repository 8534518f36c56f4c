"""OpenAI chat messages -> the chat template's messages, tools, and cache breakpoints (spec §7.1, §8.3).

Breakpoints:
  * a content part carrying `prompt_cache_breakpoint: {"mode": "explicit"}` (OpenAI's explicit
    breakpoint) or `cache_control: {"type": "ephemeral"}` (the Anthropic-style marker some
    OpenAI-compatible clients send) is a client-named breakpoint: Breakpoint(i, j, explicit=True);
  * OpenAI's automatic caching is protocol-automatic: one Breakpoint(last message, explicit=False).
    `prompt_cache_options.mode = "explicit"` does not remove it: write-policy modes do not suppress
    automatic taps (spec §8.3), which are cheap and can only add reuse.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ninfer_jax.frontend import Breakpoint

from .errors import ApiError
from .openai_schema import ChatCompletionRequest, ChatMessage

_BREAKPOINT_TTLS = ("30m", "12h")


@dataclasses.dataclass(frozen=True)
class ChatInput:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    breakpoints: tuple[Breakpoint, ...]


def chat_input(request: ChatCompletionRequest) -> ChatInput:
    """The template's view of a chat request. Raises ApiError for content it cannot render."""
    messages: list[dict[str, Any]] = []
    breakpoints: list[Breakpoint] = []
    for index, message in enumerate(request.messages):
        rendered, explicit_parts = _message(message, index)
        messages.append(rendered)
        breakpoints += [Breakpoint(index, part) for part in explicit_parts]
    breakpoints.append(Breakpoint(len(messages) - 1, None, explicit=False))
    tools = [tool.model_dump(exclude_none=True) for tool in request.tools] if request.tools_enabled else None
    return ChatInput(messages, tools, tuple(breakpoints))


def _message(message: ChatMessage, index: int) -> tuple[dict[str, Any], list[int]]:
    rendered: dict[str, Any] = {"role": message.role}
    explicit_parts: list[int] = []
    if isinstance(message.content, list):
        parts = []
        for part_index, part in enumerate(message.content):
            where = f"messages[{index}].content[{part_index}]"
            parts.append({"type": "text", "text": _part_text(part, where)})
            if _marked(part, where):
                explicit_parts.append(part_index)
        rendered["content"] = parts
    else:
        rendered["content"] = message.content
    if message.reasoning_content is not None:
        rendered["reasoning_content"] = message.reasoning_content
    if message.tool_calls:
        rendered["tool_calls"] = [
            {"id": call.id, "type": "function",
             "function": {"name": call.function.name, "arguments": call.function.arguments}}
            for call in message.tool_calls
        ]
    if message.role == "tool" and message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    return rendered, explicit_parts


def _part_text(part: dict[str, Any], where: str) -> str:
    kind = part.get("type")
    if kind == "text" and isinstance(part.get("text"), str):
        return part["text"]
    if kind in ("image_url", "input_audio", "file", "image", "video"):
        raise ApiError("invalid_request", f"{where}: content of type {kind!r} is not supported (text only)",
                       param=where)
    raise ApiError("invalid_request", f"{where}: expected a text part {{'type': 'text', 'text': ...}}",
                   param=where)


def _marked(part: dict[str, Any], where: str) -> bool:
    """Whether the part names a breakpoint; malformed markers are a 400."""
    marked = False
    breakpoint_ = part.get("prompt_cache_breakpoint")
    if breakpoint_ is not None:
        if not isinstance(breakpoint_, dict) or breakpoint_.get("mode") != "explicit":
            raise ApiError("invalid_request", f"{where}.prompt_cache_breakpoint.mode: must be 'explicit'",
                           param=f"{where}.prompt_cache_breakpoint")
        if breakpoint_.get("ttl", "30m") not in _BREAKPOINT_TTLS:
            raise ApiError("invalid_request", f"{where}.prompt_cache_breakpoint.ttl: must be one of "
                           f"{', '.join(_BREAKPOINT_TTLS)}", param=f"{where}.prompt_cache_breakpoint")
        marked = True
    control = part.get("cache_control")
    if control is not None:
        if not isinstance(control, dict) or control.get("type") != "ephemeral":
            raise ApiError("invalid_request", f"{where}.cache_control.type: must be 'ephemeral'",
                           param=f"{where}.cache_control")
        marked = True
    return marked
