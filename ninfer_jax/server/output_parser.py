"""Splits generated text into reasoning, answer text and tool calls, as it streams.

With thinking on, the Qwen3.5 prompt ends inside `<think>\\n`, so the model's text is reasoning up to
`</think>` and the answer after it. With tools, each `<tool_call>...</tool_call>` block in the answer
is a call (tool_calls.py parses it). The parser holds back only what may still turn into a marker (a
partial `</think>` or `<tool_call>`, and whitespace that would precede one), so the pieces of a stream
concatenate to the same result as parsing the whole text at once. Whitespace the template puts around
markers (`</think>\\n\\n`, `\\n\\n<tool_call>`) is format, not content, and is dropped. A forced tool choice's
output is its calls' JSON (tool_choice.py), read whole at the end.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from ninfer_jax.runtime.thinking_budget import THINK_CLOSE

from .tool_calls import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, ToolCall, parse_tool_call
from .tool_choice import ForcedTools


@dataclasses.dataclass(frozen=True)
class Piece:
    kind: Literal["reasoning", "content", "tool_call"]
    text: str = ""
    tool_call: ToolCall | None = None


class OutputParser:
    """One per generated sequence. push() text deltas in order, then finish()."""

    def __init__(self, *, thinking: bool, tools: Sequence[Mapping[str, Any]] | None = None,
                 forced: ForcedTools | None = None, keep_reasoning: bool = True, max_calls: int | None = None):
        """keep_reasoning False drops the reasoning pieces (vLLM's include_reasoning); max_calls: the calls given
        out at most, later ones dropped (OpenAI's parallel_tool_calls false, Anthropic's disable_parallel_tool_use)."""
        self._forced = forced  # the whole output is its calls' JSON, thinking or not (the grammar's)
        self._keep_reasoning, self._calls_left = keep_reasoning, max_calls
        self._mode = "reasoning" if thinking else "content"
        self._tools = list(tools) if tools else None  # None: tool calls are not parsed
        self._buffer = ""  # text received and not yet given out
        self._skip_space = thinking  # drop whitespace that opens the next section

    def push(self, text: str) -> list[Piece]:
        self._buffer += text
        if self._forced is not None:
            return []
        pieces: list[Piece] = []
        while self._step(pieces):
            pass
        return self._kept(pieces)

    def finish(self) -> list[Piece]:
        """The text still held; an unterminated tool call is given back as text."""
        if self._forced is not None:
            text, self._buffer = self._buffer, ""
            calls = self._forced.calls(text)
            if calls is None:
                return [Piece("content", text)] if text else []
            return self._kept([Piece("tool_call", tool_call=call) for call in calls])
        pieces = self.push("")
        rest, self._buffer = self._buffer, ""
        if self._mode == "tool_call":
            rest = TOOL_CALL_OPEN + rest
        if self._skip_space:
            rest = rest.lstrip()
        if rest:
            pieces += self._kept([Piece("reasoning" if self._mode == "reasoning" else "content", rest)])
        return pieces

    def _kept(self, pieces: list[Piece]) -> list[Piece]:
        kept = []
        for piece in pieces:
            if piece.kind == "reasoning" and not self._keep_reasoning:
                continue
            if piece.kind == "tool_call" and self._calls_left is not None:
                if self._calls_left == 0:
                    continue
                self._calls_left -= 1
            kept.append(piece)
        return kept

    def _step(self, pieces: list[Piece]) -> bool:
        """Consumes what it can of the buffer; True when the mode changed and another pass may consume more."""
        if self._skip_space:
            self._buffer = self._buffer.lstrip()
            if not self._buffer:
                return False
            self._skip_space = False
        if self._mode == "tool_call":
            end = self._buffer.find(TOOL_CALL_CLOSE)
            if end < 0:
                return False
            block, self._buffer = self._buffer[:end], self._buffer[end + len(TOOL_CALL_CLOSE) :]
            call = parse_tool_call(block, self._tools)
            if call is None:
                pieces.append(Piece("content", TOOL_CALL_OPEN + block + TOOL_CALL_CLOSE))
            else:
                pieces.append(Piece("tool_call", tool_call=call))
            self._mode, self._skip_space = "content", True
            return True
        marker = THINK_CLOSE if self._mode == "reasoning" else (TOOL_CALL_OPEN if self._tools is not None else None)
        kind = "reasoning" if self._mode == "reasoning" else "content"
        if marker is None:
            self._give(pieces, kind, len(self._buffer))
            return False
        at = self._buffer.find(marker)
        if at >= 0:
            self._give(pieces, kind, at, strip=True)
            self._buffer = self._buffer[len(marker) :]
            self._mode = "content" if self._mode == "reasoning" else "tool_call"
            self._skip_space = self._mode == "content"
            return True
        self._give(pieces, kind, len(self._buffer) - _held(self._buffer, marker))
        return False

    def _give(self, pieces: list[Piece], kind: str, upto: int, strip: bool = False) -> None:
        text, self._buffer = self._buffer[:upto], self._buffer[upto:]
        if strip:
            text = text.rstrip()
        if text:
            pieces.append(Piece(kind, text))  # type: ignore[arg-type]


def _held(text: str, marker: str) -> int:
    """Length of the tail of `text` that may still become `marker`: a partial marker and the
    whitespace before it (dropped if the marker completes)."""
    partial = next((k for k in range(min(len(marker) - 1, len(text)), 0, -1) if text.endswith(marker[:k])), 0)
    body = text[: len(text) - partial]
    return partial + (len(body) - len(body.rstrip()))
