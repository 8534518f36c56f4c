"""Anthropic Messages request -> the chat template's messages and tools, and its cache breakpoints.

Blocks are walked in the protocol's prompt order (tools, system, messages) and converted to the
OpenAI-style messages the template renders: system blocks become the parts of one system message;
`tool_result` blocks become `tool` messages; an assistant's `thinking` becomes `reasoning_content`
and its `tool_use` blocks `tool_calls`. `image` blocks (base64 or url sources), in user messages and
inside tool results, become image parts in their place among the text (`images.py` reads their bytes).

`cache_control` is validated as the Messages API does: `type` must be "ephemeral", `ttl` "5m" or
"1h", at most four blocks may carry one (the top-level automatic marker takes a slot), a 1h marker
may not follow a 5m one, and empty text and thinking blocks cannot carry one. Each marker becomes a
client-named breakpoint, Breakpoint(message, part, explicit=True), at its block's end; the top-level
`cache_control` is protocol-automatic, Breakpoint(last message, explicit=False) (spec §7.1, §8.3).
A marker on a tool definition is counted and validated but maps to no breakpoint: the end of the
tools is already a structural tap hint of the prompt.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ninfer_jax.frontend import Breakpoint

from .anthropic_schema import MessagesRequest
from .errors import ApiError
from .images import IMAGE_MEDIA_TYPES, ImageSource, image_part, url_source

MAX_CACHE_MARKERS = 4
_TTLS = ("5m", "1h")


@dataclasses.dataclass(frozen=True)
class MessagesInput:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    breakpoints: tuple[Breakpoint, ...]
    marker_ttls: tuple[str, ...]  # the ttl of each cache_control marker, in prompt order


def messages_input(request: MessagesRequest) -> MessagesInput:
    """Converts and validates; raises ApiError (400) with the protocol's messages."""
    builder = _Builder()
    tools = None
    if request.tools:
        for index, tool in enumerate(request.tools):
            builder.marker(tool.cache_control, f"tools.{index}")
        if request.tools_enabled:
            tools = [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                                       "parameters": t.input_schema}} for t in request.tools]
    if request.system is not None:
        builder.system(request.system)
    for index, message in enumerate(request.messages):
        builder.message(message.role, message.content, f"messages.{index}")
    if request.cache_control is not None:
        builder.marker(request.cache_control, "cache_control", automatic=True)
    builder.check_limits()
    return MessagesInput(builder.messages, tools, tuple(builder.breakpoints), tuple(builder.ttls))


class _Builder:
    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.breakpoints: list[Breakpoint] = []
        self.ttls: list[str] = []

    # --- markers ---------------------------------------------------------------------------------
    def marker(self, control: Any, where: str, at: tuple[int, int | None] | None = None,
               automatic: bool = False) -> None:
        """Validates one cache_control value (None: absent) and records its breakpoint."""
        if control is None:
            return
        path = where if automatic else f"{where}.cache_control"
        if not isinstance(control, dict):
            raise ApiError("invalid_request", f"{path}: Input should be a valid dictionary")
        if control.get("type") != "ephemeral":
            raise ApiError("invalid_request", f"{path}.type: Input should be 'ephemeral'")
        ttl = control.get("ttl", "5m")
        if ttl not in _TTLS:
            raise ApiError("invalid_request", f"{path}.ttl: Input should be '5m' or '1h'")
        self.ttls.append(ttl)
        if automatic:
            if self.messages:
                self.breakpoints.append(Breakpoint(len(self.messages) - 1, None, explicit=False))
        elif at is not None:
            self.breakpoints.append(Breakpoint(at[0], at[1]))

    def check_limits(self) -> None:
        if len(self.ttls) > MAX_CACHE_MARKERS:
            raise ApiError("invalid_request", f"A maximum of {MAX_CACHE_MARKERS} blocks with cache_control may "
                           f"be provided. Found {len(self.ttls)}.")
        if "5m" in self.ttls and "1h" in self.ttls[self.ttls.index("5m"):]:
            raise ApiError("invalid_request", "a ttl='1h' cache_control block must not come after a ttl='5m' "
                           "cache_control block. Note that blocks are processed in the following order: "
                           "`tools`, `system`, `messages`.")

    # --- system ----------------------------------------------------------------------------------
    def system(self, system: str | list[dict[str, Any]]) -> None:
        if isinstance(system, str):
            self.messages.append({"role": "system", "content": system})
            return
        parts = []
        for index, block in enumerate(system):
            where = f"system.{index}"
            if block.get("type") != "text" or not isinstance(block.get("text"), str):
                raise ApiError("invalid_request", f"{where}.type: Input should be 'text'")
            self._no_marker_on_empty(block, where)
            self.marker(block.get("cache_control"), where, at=(0, len(parts)))
            parts.append({"type": "text", "text": block["text"]})
        self.messages.append({"role": "system", "content": parts})

    # --- messages --------------------------------------------------------------------------------
    def message(self, role: str, content: str | list[dict[str, Any]], where: str) -> None:
        if isinstance(content, str):
            self.messages.append({"role": role, "content": content})
        elif role == "user":
            self._user(content, where)
        else:
            self._assistant(content, where)

    def _user(self, blocks: list[dict[str, Any]], where: str) -> None:
        parts: list[dict[str, Any]] = []
        pending: list[tuple[Any, str, int]] = []  # markers on the text parts, placed once the message exists
        for index, block in enumerate(blocks):
            at = f"{where}.content.{index}"
            kind = block.get("type")
            if kind == "text":
                self._no_marker_on_empty(block, at)
                pending.append((block.get("cache_control"), at, len(parts)))
                parts.append({"type": "text", "text": _text(block, at)})
            elif kind == "image":
                pending.append((block.get("cache_control"), at, len(parts)))
                parts.append(_image(block, at))
            elif kind == "tool_result":
                self._flush_user(parts, pending)
                parts, pending = [], []
                self.messages.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                                      "content": self._tool_result_content(block, at)})
                self.marker(block.get("cache_control"), at, at=(len(self.messages) - 1, None))
            else:
                raise _unsupported(kind, at)
        self._flush_user(parts, pending)

    def _flush_user(self, parts: list[dict[str, Any]], pending: list[tuple[Any, str, int]]) -> None:
        if not parts:
            return
        self.messages.append({"role": "user", "content": parts})
        for control, at, part in pending:
            self.marker(control, at, at=(len(self.messages) - 1, part))

    def _tool_result_content(self, block: dict[str, Any], where: str) -> str | list[dict[str, Any]]:
        """A tool result's content: its text blocks joined by newlines, or, when it holds images, its parts."""
        content = block.get("content", "")
        if isinstance(content, str):
            return content
        parts: list[dict[str, Any]] = []
        for index, inner in enumerate(content or ()):
            at = f"{where}.content.{index}"
            kind = inner.get("type")
            if kind == "text":
                parts.append({"type": "text", "text": _text(inner, at)})
            elif kind == "image":
                parts.append(_image(inner, at))
            else:
                raise _unsupported(kind, at)
            # A marker inside a tool result ends with the result's message.
            self.marker(inner.get("cache_control"), at, at=(len(self.messages), None))
        if all(part["type"] == "text" for part in parts):
            return "\n".join(part["text"] for part in parts)
        return parts

    def _assistant(self, blocks: list[dict[str, Any]], where: str) -> None:
        index_of_message = len(self.messages)
        parts: list[dict[str, Any]] = []
        reasoning: list[str] = []
        calls: list[dict[str, Any]] = []
        for index, block in enumerate(blocks):
            at = f"{where}.content.{index}"
            kind = block.get("type")
            if kind == "text":
                self._no_marker_on_empty(block, at)
                self.marker(block.get("cache_control"), at, at=(index_of_message, len(parts)))
                parts.append({"type": "text", "text": _text(block, at)})
            elif kind in ("thinking", "redacted_thinking"):
                if block.get("cache_control") is not None:
                    raise ApiError("invalid_request", f"{at}.{kind}.cache_control: cache_control cannot be set "
                                   "for thinking blocks")
                if kind == "thinking":
                    reasoning.append(str(block.get("thinking", "")))
            elif kind == "tool_use":
                if not isinstance(block.get("name"), str) or not isinstance(block.get("input", {}), dict):
                    raise ApiError("invalid_request", f"{at}: tool_use needs a string `name` and an object `input`")
                calls.append({"id": block.get("id"), "type": "function",
                              "function": {"name": block["name"], "arguments": block.get("input", {})}})
                self.marker(block.get("cache_control"), at, at=(index_of_message, None))
            else:
                raise _unsupported(kind, at)
        message: dict[str, Any] = {"role": "assistant", "content": parts}
        if reasoning:
            message["reasoning_content"] = "\n".join(reasoning)
        if calls:
            message["tool_calls"] = calls
        self.messages.append(message)

    def _no_marker_on_empty(self, block: dict[str, Any], where: str) -> None:
        if block.get("cache_control") is not None and not str(block.get("text", "")).strip():
            raise ApiError("invalid_request", f"{where}: cache_control cannot be set for empty text blocks")


def _text(block: dict[str, Any], where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise ApiError("invalid_request", f"{where}.text: Field required")
    return text


def _image(block: dict[str, Any], where: str) -> dict[str, Any]:
    """An image block's part: a base64 source of one of the four media types, or a url source."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        if source.get("media_type") not in IMAGE_MEDIA_TYPES:
            raise ApiError("invalid_request", f"{where}.source.media_type: Input should be "
                           f"{', '.join(map(repr, IMAGE_MEDIA_TYPES))}, got {source.get('media_type')!r}")
        if not isinstance(source.get("data"), str):
            raise ApiError("invalid_request", f"{where}.source.data: Field required")
        return image_part(ImageSource(f"{where}.source.data", data=source["data"]))
    if kind == "url":
        return image_part(url_source(source.get("url"), f"{where}.source.url"))
    raise ApiError("invalid_request", f"{where}.source.type: Input should be 'base64' or 'url', got {kind!r}")


def _unsupported(kind: Any, where: str) -> ApiError:
    if kind == "image":
        return ApiError("invalid_request", f"{where}: images are accepted in user messages and tool results only")
    if kind in ("document", "search_result", "container_upload"):
        return ApiError("invalid_request", f"{where}: content blocks of type {kind!r} are not supported (text and "
                        "image only)")
    return ApiError("invalid_request", f"{where}.type: unknown content block type {kind!r}")
