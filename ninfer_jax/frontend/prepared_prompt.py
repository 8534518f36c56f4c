"""PreparedPrompt: a prompt's tokens, block hashes and tap hints, built off the worker (spec §5.1, §7.1, §8.3).

Tap hints are the Frontend's half of tap planning: positions where a recurrent-state snapshot is
likely to be reused. The planner (prefix_cache/) chooses among them; here they are only located.
A hint at token position p means "the state after the first p tokens". A character offset maps to
the number of tokens that end at or before it, so an offset inside a token rounds down to a prefix
other prompts can share.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ninfer_jax.prefix_cache.hashing import BLOCK_TOKENS, salt_key, salted_extra

from .block_hash import chain_block_hashes
from .chat_layout import ChatLayout
from .chat_template import ChatTemplate, Message
from .tokenizer import Tokenizer
from .vision_prompt import PromptMedia, VisionFrontend, expand_images, image_parts


class TapHintKind(enum.IntEnum):
    """Where a hint comes from; the planner's priority follows from it (spec §7.1)."""

    EXPLICIT = 0  # a client-named breakpoint (explicit evidence): priority 1
    AUTOMATIC = 1  # a protocol-automatic marker: planned as structural, published as an ordinary tap
    GENERATION_OPENER = 2  # start of the final assistant opener: priority 2
    END_OF_TOOLS = 3  # end of the tool definitions: priority 3
    END_OF_SYSTEM = 4  # end of the leading system/developer turn: priority 3
    MESSAGE_BOUNDARY = 5  # start of a message: where ladder taps snap to


@dataclass(frozen=True, order=True)
class TapHint:
    position: int  # tokens before the hinted point, 0 < position < len(token_ids)
    kind: TapHintKind


@dataclass(frozen=True)
class Breakpoint:
    """A client's request to cache the prompt up to the end of a message (or of one content part).

    explicit: True for client-named breakpoints (OpenAI breakpoints, Anthropic cache_control);
    False for protocol-automatic ones (OpenAI default caching, Anthropic automatic cache_control).
    """

    message_index: int
    part_index: int | None = None
    explicit: bool = True


@dataclass(frozen=True, eq=False)  # identity equality: arrays have no single truth value
class PreparedPrompt:
    token_ids: np.ndarray  # [n] int32, read-only
    block_hashes: np.ndarray  # [n // 64] uint64 chained lookup hashes (block_hash.py), read-only
    tap_hints: tuple[TapHint, ...] = ()  # sorted by (position, kind); no duplicates
    media: PromptMedia | None = None  # the images' spans, pixels, media keys and MRoPE positions
    salt: int = 0  # the cache salt's key (hashing.salt_key), folded into block 0's extra; 0: unsalted

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def vision_spans(self) -> tuple[tuple[int, int], ...]:
        """(begin, length) of each image's placeholder span: no resume or tap frontier lies strictly inside one."""
        return self.media.spans if self.media is not None else ()

    def block_extra(self, block: int) -> int:
        """Block `block`'s extra key (spec §5.1): its media key (0 where no image overlaps it), salted in block 0."""
        extra = self.media.extra(block) if self.media is not None else 0
        return salted_extra(extra, self.salt) if block == 0 else extra

    @functools.cached_property
    def block_extras(self) -> tuple[int, ...] | None:
        """Every block's extra key, the partial last block's included (a tail's key); None when all are 0. Kept:
        each admission attempt of a waiting request reads it."""
        if self.media is None and not self.salt:
            return None
        return tuple(self.block_extra(b) for b in range(-(-self.num_tokens // BLOCK_TOKENS)))


def prepare_tokens(token_ids: Sequence[int] | np.ndarray, hints: Sequence[TapHint] = (), *, images: Sequence = (),
                   vision: VisionFrontend | None = None, cache_salt: str | None = None) -> PreparedPrompt:
    """A prompt given as token ids: its block hashes, and the caller's tap hints (token ids carry no structure to
    read hints from). With `images` (encoded bytes or RGB uint8 arrays), each `vision.image_pad_id` in the ids, in
    order, expands to its image's span; hint positions count the ids as given. `cache_salt` (vLLM's): the prompt
    shares cached blocks only with prompts of the same salt (one tenant's cache kept from another's)."""
    tokens = np.array(token_ids, dtype=np.int32)
    if tokens.ndim != 1:
        raise ValueError(f"token_ids must be 1-D, got shape {tokens.shape}")
    media = None
    if len(images):
        tokens, media, shifted = expand_images(vision, tokens, [(f"images[{i}]", im) for i, im in enumerate(images)])
        hints = [TapHint(int(shifted[h.position]), h.kind) for h in hints]
    return _prepared(tokens, tuple(sorted(hints)), media, cache_salt)


def prepare_chat(
    tokenizer: Tokenizer,
    messages: Sequence[Message],
    tools: Sequence[Mapping[str, Any]] | None = None,
    *,
    enable_thinking: bool = True,
    breakpoints: Iterable[Breakpoint] = (),
    template: ChatTemplate | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    vision: VisionFrontend | None = None,
    cache_salt: str | None = None,
    **template_kwargs: Any,
) -> PreparedPrompt:
    """Renders a conversation, tokenizes it, and maps its structure and breakpoints to tap hints.

    Args:
        tokenizer: the checkpoint's tokenizer.
        messages: OpenAI-format messages (see ChatTemplate.render).
        tools: OpenAI-style tool definitions, or None.
        enable_thinking: Qwen3.5 thinking switch for the generation prompt.
        breakpoints: where the client asked to cache; each becomes an EXPLICIT or AUTOMATIC hint at
            the end of its message or content part.
        template: the checkpoint's template (load_chat_template); None means the built-in Qwen3.5 one.
        add_generation_prompt: append the assistant opener.
        continue_final_message: end the prompt inside the last (assistant) message, for the model to continue it
            (`ChatTemplate.render`).
        vision: the model's image expansion (None: a model without a vision tower). Image content parts are
            `{"type": "image", "image": <encoded bytes, or an RGB uint8 array>}`.
        cache_salt: as `prepare_tokens`'.
        template_kwargs: further template variables.

    Raises:
        ChatTemplateError: the template rejected the conversation.
        IndexError: a breakpoint names a message or part that does not exist.
        ImageError: an image part cannot be used (the message names the part).
    """
    rendered = (template or ChatTemplate.qwen35()).render(
        messages, tools, add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking,
        continue_final_message=continue_final_message, **template_kwargs
    )
    ids, offsets = tokenizer.encode_with_offsets(rendered.text)
    hinted = _structural_offsets(rendered.layout) + _breakpoint_offsets(rendered.layout, breakpoints, len(messages))
    # Running maximum: a position counts only tokens that, with all before them, end by the offset.
    prefix_ends = np.maximum.accumulate(np.array([end for _, end in offsets] or [0], dtype=np.int64))
    positions = np.searchsorted(prefix_ends, [offset for offset, _ in hinted], side="right")
    tokens, media = np.array(ids, dtype=np.int32), None
    parts = image_parts(rendered.messages)
    if parts:
        tokens, media, shifted = expand_images(vision, tokens, parts)
        positions = shifted[positions]
    hints = {TapHint(int(p), kind) for p, (_, kind) in zip(positions, hinted) if 0 < p < len(tokens)}
    return _prepared(tokens, tuple(sorted(hints)), media, cache_salt)


def _structural_offsets(layout: ChatLayout) -> list[tuple[int, TapHintKind]]:
    offsets = [(start, TapHintKind.MESSAGE_BOUNDARY) for start in layout.message_starts]
    for offset, kind in (
        (layout.generation_opener, TapHintKind.GENERATION_OPENER),
        (layout.tools_end, TapHintKind.END_OF_TOOLS),
        (layout.system_end, TapHintKind.END_OF_SYSTEM),
    ):
        if offset is not None:
            offsets.append((offset, kind))
    return offsets


def _breakpoint_offsets(
    layout: ChatLayout, breakpoints: Iterable[Breakpoint], num_messages: int
) -> list[tuple[int, TapHintKind]]:
    offsets = []
    for point in breakpoints:
        if not 0 <= point.message_index < num_messages:
            raise IndexError(f"breakpoint names message {point.message_index} of {num_messages}")
        if not layout.located:
            continue  # a template that is not ChatML-shaped: nothing to anchor the breakpoint to
        if point.part_index is None:
            offset = layout.message_ends[point.message_index]
        else:
            parts = layout.part_ends[point.message_index]
            if not 0 <= point.part_index < len(parts):
                raise IndexError(
                    f"breakpoint names part {point.part_index} of message {point.message_index}, "
                    f"which has {len(parts)}"
                )
            offset = parts[point.part_index]
        offsets.append((offset, TapHintKind.EXPLICIT if point.explicit else TapHintKind.AUTOMATIC))
    return offsets


def keep_last_tokens(prompt: PreparedPrompt, keep: int) -> PreparedPrompt:
    """vLLM's truncate_prompt_tokens: the prompt's last `keep` tokens (the prompt itself when it has no more), its
    tap hints inside them shifted along, its salt kept. Raises ValueError for a prompt with images that is longer:
    a cut could split an image's span."""
    cut = prompt.num_tokens - keep
    if cut <= 0:
        return prompt
    if prompt.media is not None:
        raise ValueError("truncate_prompt_tokens cannot cut a prompt with images")
    hints = tuple(TapHint(h.position - cut, h.kind) for h in prompt.tap_hints if h.position > cut)
    return _hashed(np.array(prompt.token_ids[cut:]), hints, None, prompt.salt)


def continue_prompt(prompt: PreparedPrompt, tokens: Sequence[int] | np.ndarray) -> PreparedPrompt:
    """The prompt followed by `tokens` of text (a preempted request's output): its hints, media and salt kept, the
    block hashes chained on as the cache chains a generated block's."""
    ids = np.concatenate([prompt.token_ids, np.asarray(tokens, np.int32)])
    media = prompt.media.continued(len(ids)) if prompt.media is not None else None
    return _hashed(ids, prompt.tap_hints, media, prompt.salt)


def _prepared(tokens: np.ndarray, hints: tuple[TapHint, ...], media: PromptMedia | None = None,
              cache_salt: str | None = None) -> PreparedPrompt:
    if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
        raise ValueError("cache_salt must be a non-empty string")
    return _hashed(tokens, hints, media, salt_key(cache_salt) if cache_salt is not None else 0)


def _hashed(tokens: np.ndarray, hints: tuple[TapHint, ...], media: PromptMedia | None, salt: int) -> PreparedPrompt:
    tokens.setflags(write=False)
    prompt = PreparedPrompt(token_ids=tokens, block_hashes=np.zeros(0, np.uint64), tap_hints=hints, media=media,
                            salt=salt)
    extras = prompt.block_extras
    hashes = chain_block_hashes(tokens, None if extras is None else extras[: len(tokens) // BLOCK_TOKENS])
    hashes.setflags(write=False)
    return replace(prompt, block_hashes=hashes)
