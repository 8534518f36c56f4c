"""Renders a chat request into the engine's PreparedPrompt, off the event loop (long prompts take a while)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ninfer_jax.frontend import Breakpoint, ChatTemplateError, PreparedPrompt, TapHintKind, prepare_chat

from .errors import ApiError


async def prepare_prompt(engine: Any, messages: Sequence[Mapping[str, Any]],
                         tools: Sequence[Mapping[str, Any]] | None, breakpoints: Iterable[Breakpoint],
                         *, enable_thinking: bool, template_kwargs: Mapping[str, Any] | None = None
                         ) -> PreparedPrompt:
    """prepare_chat with the engine's tokenizer and template. Raises ApiError (400) when the model has
    no tokenizer or the template rejects the conversation."""
    if engine.tokenizer is None:
        raise ApiError("invalid_request", f"model {engine.model_name} has no tokenizer files; chat needs text "
                       "(send token ids to /v1/completions)")
    kwargs = {key: value for key, value in (template_kwargs or {}).items() if key != "enable_thinking"}
    try:
        return await asyncio.to_thread(
            prepare_chat, engine.tokenizer, messages, tools, enable_thinking=enable_thinking,
            breakpoints=tuple(breakpoints), template=engine.chat_template, **kwargs,
        )
    except (ChatTemplateError, IndexError, TypeError) as error:
        raise ApiError("invalid_request", f"the chat template rejected the conversation: {error}") from None


def marked_prefix_tokens(prepared: PreparedPrompt) -> int:
    """Tokens up to the deepest client or protocol cache marker (0 without one)."""
    marks = [hint.position for hint in prepared.tap_hints
             if hint.kind in (TapHintKind.EXPLICIT, TapHintKind.AUTOMATIC)]
    return max(marks, default=0)


def matched_stop(engine: Any, token_ids: Sequence[int], text: str, stops: Sequence[str]) -> str | None:
    """The stop string that ended a generation, or None when an end-of-sequence token did.

    The engine cuts its text at the stop string it matched; decoding every generated token shows
    what was cut.
    """
    if not stops or engine.tokenizer is None:
        return None
    full = engine.tokenizer.decode(list(token_ids), skip_special_tokens=True)
    rest = full[len(text):] if full.startswith(text) else ""
    return next((stop for stop in stops if rest.startswith(stop)), None)
