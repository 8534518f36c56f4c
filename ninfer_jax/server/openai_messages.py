"""OpenAI chat messages -> the chat template's messages, tools, and cache breakpoints (spec §7.1, §8.3).

Breakpoints:
  * a content part carrying `prompt_cache_breakpoint: {"mode": "explicit"}` (OpenAI's explicit
    breakpoint) or `cache_control: {"type": "ephemeral"}` (the Anthropic-style marker some
    OpenAI-compatible clients send) is a client-named breakpoint: Breakpoint(i, j, explicit=True);
  * OpenAI's automatic caching is protocol-automatic: one Breakpoint(last message, explicit=False).
    `prompt_cache_options.mode = "explicit"` does not remove it: write-policy modes do not suppress
    automatic taps (spec §8.3), which are cheap and can only add reuse.

Images: `image_url` parts of user messages become image parts (`images.py` reads their bytes); a marker on
one is a breakpoint at the image's end, as on a text part. Text and images keep their order.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ninfer_jax.frontend import Breakpoint

from .errors import ApiError
from .images import image_part, url_source
from .openai_schema import ChatCompletionRequest, ChatMessage
from .tool_calls import sent_arguments

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
            parts.append(_part(part, message.role, where))
            if _marked(part, where):
                explicit_parts.append(part_index)
        rendered["content"] = parts
    else:
        rendered["content"] = message.content
    if message.reasoning_content is not None:
        rendered["reasoning_content"] = message.reasoning_content
    if message.tool_calls:
        rendered["tool_calls"] = [
            {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": sent_arguments(
                call.function.arguments, f"messages[{index}].tool_calls[{number}].function.arguments")}}
            for number, call in enumerate(message.tool_calls)
        ]
    if message.role == "tool" and message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    return rendered, explicit_parts


_DETAILS = ("auto", "low", "high")  # OpenAI's; the processor's resize rule decides the tokens either way


def _part(part: dict[str, Any], role: str, where: str) -> dict[str, Any]:
    """The template's part for a text part, or an image_url part of a user message."""
    kind = part.get("type")
    if kind == "text" and isinstance(part.get("text"), str):
        return {"type": "text", "text": part["text"]}
    if kind == "refusal" and role == "assistant" and isinstance(part.get("refusal"), str):
        return {"type": "text", "text": part["refusal"]}  # an earlier answer's refusal, as OpenAI returns it
    if kind == "image_url":
        if role != "user":
            raise ApiError("invalid_request", f"{where}: images are accepted in user messages only, not in a "
                           f"{role} message", param=where)
        image = part.get("image_url")
        if isinstance(image, str):  # the bare-string form some clients send
            return image_part(url_source(image, f"{where}.image_url"))
        if not isinstance(image, dict):
            raise ApiError("invalid_request", f"{where}.image_url: expected an object {{'url': ...}}",
                           param=f"{where}.image_url")
        if image.get("detail", "auto") not in _DETAILS:
            raise ApiError("invalid_request", f"{where}.image_url.detail: must be one of {', '.join(_DETAILS)}",
                           param=f"{where}.image_url.detail")
        return image_part(url_source(image.get("url"), f"{where}.image_url.url"))
    if kind in ("input_audio", "file", "image", "video"):
        raise ApiError("invalid_request", f"{where}: content of type {kind!r} is not supported (text and "
                       "image_url only)", param=where)
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
