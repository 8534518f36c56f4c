"""Renders a chat request, or tokenizes a completions prompt, into the engine's PreparedPrompt in the server's
tokenizing threads (long prompts take a while; off the event loop, and apart from asyncio's default pool)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

from ninfer_jax.frontend import (Breakpoint, ChatTemplateError, PreparedPrompt, TapHintKind, prepare_chat,
                                 prepare_tokens)
from ninfer_jax.frontend.image_processing import ImageError
from ninfer_jax.runtime.request import InvalidRequestError, truncate_prompt

from .context import ServerContext
from .errors import ApiError
from .images import load_images


async def prepare_prompt(ctx: ServerContext, messages: Sequence[Mapping[str, Any]],
                         tools: Sequence[Mapping[str, Any]] | None, breakpoints: Iterable[Breakpoint],
                         *, enable_thinking: bool, template_kwargs: Mapping[str, Any] | None = None,
                         continue_final_message: bool = False,
                         cache_salt: str | None = None) -> PreparedPrompt:
    """prepare_chat with the engine's tokenizer, template and vision tower, in ctx's tokenizing threads, once the
    messages' image sources are read (`load_images`); continue_final_message: the prompt ends inside the last
    (assistant) message, which the model continues; cache_salt: vLLM's (`prepare_tokens`). Raises ApiError (400)
    when the model has no tokenizer, an image part cannot be used (named by its place in the request), or the
    template rejects the conversation."""
    engine = ctx.engine
    if engine.tokenizer is None:
        raise ApiError("invalid_request", f"model {engine.model_name} has no tokenizer files; chat needs text "
                       "(send token ids to /v1/completions)")
    kwargs = {key: value for key, value in (template_kwargs or {}).items() if key != "enable_thinking"}
    if continue_final_message:
        kwargs.update(add_generation_prompt=False, continue_final_message=True)
    messages, image_places = await load_images(ctx.images, engine, messages)
    try:
        return await ctx.frontend.run(
            prepare_chat, engine.tokenizer, messages, tools, enable_thinking=enable_thinking,
            breakpoints=tuple(breakpoints), template=engine.chat_template, vision=getattr(engine, "vision", None),
            cache_salt=cache_salt, **kwargs,
        )
    except ImageError as error:
        raise _image_error(str(error), image_places) from None
    except (ChatTemplateError, IndexError, TypeError) as error:
        raise ApiError("invalid_request", f"the chat template rejected the conversation: {error}") from None


def _image_error(message: str, places: dict[str, str]) -> ApiError:
    """The frontend's ImageError, which names the part by its place in the template's messages, as a 400 naming
    it by its place in the request (they differ where a protocol's blocks become other messages)."""
    place, colon, rest = message.partition(":")
    where = places.get(place) if colon else None
    return ApiError("invalid_request", f"{where}:{rest}" if where else message, param=where)


# OpenAI's reasoning efforts. Qwen3.5 thinks or does not: every level above "minimal" is the same thinking.
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]
NO_THINKING_EFFORTS = ("none", "minimal")


def thinking_mode(default: bool, *, template_kwargs: Mapping[str, Any] | None = None,
                  reasoning_effort: str | None = None, response_format: Mapping[str, Any] | None = None) -> bool:
    """Whether an OpenAI-protocol request thinks before it answers.

    `chat_template_kwargs.enable_thinking` decides when given. Otherwise a constrained output (a JSON, regex,
    choice or grammar `response_format`) runs without thinking: its grammar constrains every generated token, so
    thinking text could only be that output and would be taken for reasoning. Then `reasoning_effort` "none" or
    "minimal" turns thinking off and any other level on; without one, the server's default (--default-thinking)
    holds.
    """
    if template_kwargs and "enable_thinking" in template_kwargs:
        return bool(template_kwargs["enable_thinking"])
    if response_format and response_format.get("type") != "text":
        return False
    if reasoning_effort is not None:
        return reasoning_effort not in NO_THINKING_EFFORTS
    return default


async def prepare_completion_prompt(ctx: ServerContext, prompt: str | Sequence[int],
                                    cache_salt: str | None = None) -> PreparedPrompt:
    """A completions prompt (text, or token ids) tokenized in ctx's tokenizing threads, salted with `cache_salt`
    (`prepare_tokens`). Raises ApiError (400) for text to a model without a tokenizer, or token ids that are not
    32-bit integers."""
    tokenizer = ctx.engine.tokenizer
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ApiError("invalid_request", f"model {ctx.engine.model_name} has no tokenizer files; send token "
                           "ids", param="prompt")
        prepared = await ctx.frontend.run(lambda: prepare_tokens(tokenizer.encode(prompt), cache_salt=cache_salt))
    else:
        try:
            prepared = await ctx.frontend.run(lambda: prepare_tokens(prompt, cache_salt=cache_salt))
        except (OverflowError, ValueError, TypeError):
            raise ApiError("invalid_request", "prompt token ids must be integers of the vocabulary",
                           param="prompt") from None
    if prepared.num_tokens == 0:
        raise ApiError("invalid_request", "prompt must not be empty", param="prompt")
    return prepared


def truncated(engine: Any, prepared: PreparedPrompt, truncate: int | None) -> PreparedPrompt:
    """vLLM's truncate_prompt_tokens, before the context check (`truncate_prompt`); a prompt with images it would
    cut is a 400."""
    try:
        return truncate_prompt(prepared, truncate, engine.max_model_len)
    except InvalidRequestError as error:
        raise ApiError("invalid_request", str(error), param="truncate_prompt_tokens") from None


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
