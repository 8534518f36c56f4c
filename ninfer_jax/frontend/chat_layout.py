"""Locates a conversation's structure in a rendered ChatML prompt (character offsets).

Templates are opaque Jinja, so the layout is read back from the text: every ChatML turn opens with
`<|im_start|>role`, and messages render in order. Walking the messages with a cursor that moves past
each message's own content keeps text inside a message (a tool result quoting `<tool_response>`) from
being taken for structure. Consecutive tool messages share one user turn: the first starts at that
turn's `<|im_start|>user`, each later one at the newline before its `<tool_response>`.

Offsets at turn starts sit just before the `<|im_start|>` special token, so they are token boundaries.
Part ends and the tools end may fall inside a token; `prepared_prompt` rounds those down.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
_TOOL_RESPONSE = "<tool_response>"
_VISION_END = "<|vision_end|>"


@dataclass(frozen=True)
class ChatLayout:
    """Character offsets of a rendered conversation. Empty/None where the text is not ChatML-shaped.

    message_starts[i]: where message i's turn begins (for a leading system message: 0).
    message_ends[i]: where what follows message i begins (the next message, the generation opener,
        or the end of the text).
    part_ends[i][j]: the end of content part j of message i (a string content is one part); the
        message end where the part's text could not be found (e.g. reasoning rewritten by the template).
    tools_end: the end of the tool definitions and instructions inside the leading system turn.
    system_end: the end of the leading system turn, after its `<|im_end|>` and newline.
    generation_opener: the start of the final `<|im_start|>assistant` turn: the opener that
        add_generation_prompt appended, else the last assistant message.
    """

    message_starts: tuple[int, ...] = ()
    message_ends: tuple[int, ...] = ()
    part_ends: tuple[tuple[int, ...], ...] = ()
    tools_end: int | None = None
    system_end: int | None = None
    generation_opener: int | None = None

    @property
    def located(self) -> bool:
        return bool(self.message_starts)


def locate_chat_layout(
    text: str, messages: Sequence[Mapping[str, Any]], *, has_tools: bool, add_generation_prompt: bool
) -> ChatLayout:
    """Reads the layout of `messages` (as given to the template) back from their rendering `text`."""
    system_end = _leading_system_end(text)
    starts: list[int] = []
    raw_part_ends: list[list[int | None]] = []
    cursor = 0
    for index, message in enumerate(messages):
        start = _message_start(text, messages, index, cursor, system_end is not None)
        if start is None:
            return ChatLayout(system_end=system_end)
        ends, cursor = _part_ends(text, message.get("content"), start)
        starts.append(start)
        raw_part_ends.append(ends)

    opener = _generation_opener(text, messages, starts, add_generation_prompt)
    tail = opener if opener is not None and starts and opener > starts[-1] else len(text)
    message_ends = (*starts[1:], tail) if starts else ()
    part_ends = tuple(
        tuple(end if end is not None else message_end for end in ends)
        for ends, message_end in zip(raw_part_ends, message_ends)
    )
    tools_end = _tools_end(text, messages, system_end) if has_tools else None
    return ChatLayout(tuple(starts), message_ends, part_ends, tools_end, system_end, opener)


def _leading_system_end(text: str) -> int | None:
    if not text.startswith(IM_START + "system"):
        return None
    end = text.find(IM_END)
    if end < 0:
        return None
    end += len(IM_END)
    return end + 1 if text.startswith("\n", end) else end


def _message_start(
    text: str, messages: Sequence[Mapping[str, Any]], index: int, cursor: int, has_system_turn: bool
) -> int | None:
    role = messages[index].get("role")
    if index == 0 and role == "system" and has_system_turn:
        return 0
    if role == "tool" and index > 0 and messages[index - 1].get("role") == "tool":
        found = text.find(_TOOL_RESPONSE, cursor)
        if found < 0:
            return None
        return found - 1 if found > 0 and text[found - 1] == "\n" else found
    found = text.find(IM_START + ("user" if role == "tool" else str(role)), cursor)
    return found if found >= 0 else None


def _part_ends(text: str, content: Any, start: int) -> tuple[list[int | None], int]:
    """End offset of each content part found in order after `start`, and the cursor past them."""
    cursor = start + 1
    ends: list[int | None] = []
    for part in _content_parts(content):
        if isinstance(part, Mapping) and "text" not in part:  # image / video placeholder
            found = text.find(_VISION_END, cursor)
            end = found + len(_VISION_END) if found >= 0 else None
        else:
            end = _text_end(text, part["text"] if isinstance(part, Mapping) else str(part), cursor)
        ends.append(end)
        if end is not None:
            cursor = end
    return ends, cursor


def _text_end(text: str, part: str, cursor: int) -> int | None:
    core = part.strip()
    if not core:
        return None
    found = text.find(core, cursor)
    if found < 0:
        return None
    end = found + len(core)
    trailing = part[len(part.rstrip()) :]
    # The template trims only the message's outer whitespace; a middle part keeps its trailing spaces.
    return end + len(trailing) if trailing and text.startswith(trailing, end) else end


def _content_parts(content: Any) -> list[Any]:
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    return list(content)


def _generation_opener(
    text: str, messages: Sequence[Mapping[str, Any]], starts: list[int], add_generation_prompt: bool
) -> int | None:
    if add_generation_prompt:
        found = text.rfind(IM_START + "assistant")
        if found >= 0 and (not starts or found > starts[-1]):
            return found
    assistant_starts = [s for s, m in zip(starts, messages) if m.get("role") == "assistant"]
    return assistant_starts[-1] if assistant_starts else None


def _tools_end(text: str, messages: Sequence[Mapping[str, Any]], system_end: int | None) -> int | None:
    """Where the tool block of the leading system turn ends.

    Qwen3.5 renders the tools first and the system prompt after them; Qwen3 and others put the system
    prompt first. Either way the tools end where the system prompt begins (less the separating
    whitespace) or, when nothing follows them, at the turn's `<|im_end|>`.
    """
    if system_end is None:
        return None
    turn_end = text.rfind(IM_END, 0, system_end)
    system_text = ""
    if messages and messages[0].get("role") == "system":
        system_text = "".join(
            p if isinstance(p, str) else str(p.get("text", "")) for p in _content_parts(messages[0].get("content"))
        ).strip()
    found = text.find(system_text, 0, turn_end) if system_text else -1
    if found >= 0 and text.find("<tools>", 0, found) >= 0:
        return len(text[:found].rstrip())
    return turn_end
