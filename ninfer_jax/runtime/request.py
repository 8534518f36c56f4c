"""Request state inside the scheduler, and the immutable results the API hands out."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from typing import Any, Callable

import numpy as np

from ninfer_jax.frontend.prepared_prompt import PreparedPrompt, keep_last_tokens, prepare_tokens
from ninfer_jax.runtime.sampling import SamplingParams


class InvalidRequestError(ValueError):
    """A request the engine refuses before any work (bad tokens, bad parameters)."""


class PromptTooLongError(InvalidRequestError):
    """A prompt longer than the context, or one that can never fit the KV pool."""


class EngineStoppedError(RuntimeError):
    """The engine is stopping or stopped and takes no new requests."""


_PROMPT_KEYS = frozenset(("prompt", "prompt_token_ids", "cache_salt"))


def prepare_prompt(prompt, tokenizer, vocab_size: int, max_model_len: int, pool_tokens: int,
                   truncate: int | None = None) -> PreparedPrompt:
    """A request's prompt checked before any work: non-empty ids in the vocabulary, room for one output token in
    the context, and a fit in a KV pool of `pool_tokens`. A prompt is text, token ids, a PreparedPrompt, or vLLM's
    prompt dict: {"prompt": text} or {"prompt_token_ids": ids}, with an optional "cache_salt". `truncate`
    (SamplingParams.truncate_prompt_tokens) keeps the last tokens first (`truncate_prompt`)."""
    salt = None
    if isinstance(prompt, Mapping):
        unknown = set(prompt) - _PROMPT_KEYS
        if unknown or ("prompt" in prompt) == ("prompt_token_ids" in prompt):
            raise InvalidRequestError(f"a prompt dict has prompt or prompt_token_ids, and may have cache_salt; got "
                                      f"{sorted(prompt)}")
        salt = prompt.get("cache_salt")  # checked by prepare_tokens
        prompt = prompt["prompt"] if "prompt" in prompt else prompt["prompt_token_ids"]
        if isinstance(prompt, PreparedPrompt):
            raise InvalidRequestError("a prompt dict holds text or token ids; salt a PreparedPrompt as it is made")
    if isinstance(prompt, PreparedPrompt):
        prepared = prompt
    elif isinstance(prompt, str):
        if tokenizer is None:
            raise InvalidRequestError("this checkpoint has no tokenizer files; send token ids")
        prepared = _salted_tokens(tokenizer.encode(prompt), salt)
    else:
        try:
            ids = np.asarray(prompt)
        except Exception:
            raise InvalidRequestError("prompt must be text, a list of token ids or a PreparedPrompt") from None
        if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
            raise InvalidRequestError("prompt token ids must be a flat list of integers")
        prepared = _salted_tokens(ids, salt)
    prepared = truncate_prompt(prepared, truncate, max_model_len)
    ids = prepared.token_ids
    n = len(ids)
    if n == 0:
        raise InvalidRequestError("prompt is empty")
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise InvalidRequestError(f"prompt token ids must be in [0, {vocab_size})")
    if n + 1 > max_model_len:
        raise PromptTooLongError(f"prompt has {n} tokens; max_model_len is {max_model_len}, leaving no room for output")
    if n + 1 > pool_tokens:
        raise PromptTooLongError(f"prompt has {n} tokens; the KV pool holds {pool_tokens} tokens")
    return prepared


def _salted_tokens(ids, salt: str | None) -> PreparedPrompt:
    """prepare_tokens, its refusals (a cache_salt that is no non-empty string) as InvalidRequestError."""
    try:
        return prepare_tokens(ids, cache_salt=salt)
    except ValueError as error:
        raise InvalidRequestError(str(error)) from None


def truncate_prompt(prepared: PreparedPrompt, truncate: int | None, max_model_len: int) -> PreparedPrompt:
    """vLLM's truncate_prompt_tokens: the prompt's last `truncate` tokens, -1 as many as max_model_len leaves room
    for one output token, None all of them. Raises InvalidRequestError for a longer prompt with images."""
    if truncate is None:
        return prepared
    try:
        return keep_last_tokens(prepared, max_model_len - 1 if truncate == -1 else truncate)
    except ValueError as error:
        raise InvalidRequestError(str(error)) from None


@dataclasses.dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclasses.dataclass(frozen=True)
class Metrics:
    """Seconds from the request's arrival: to its first token, to its last, to getting a lane, and to the
    dispatch of its first prefill chunk (the time between the last two waits behind other lanes' chunks)."""

    ttft_s: float | None
    latency_s: float | None
    queue_s: float | None = None
    first_scheduled_s: float | None = None
    drafted_tokens: int = 0  # speculative decoding: drafts verified for it, and those kept
    accepted_tokens: int = 0


@dataclasses.dataclass(frozen=True)
class StreamEvent:
    """New tokens of one request; finish_reason is set on its last event only."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None
    usage: Usage | None
    metrics: Metrics | None
    logprobs: tuple[dict, ...] | None = None
    error: str | None = None
    # With SamplingParams.prompt_logprobs, on one event before the first token's: an entry per prompt token as
    # `logprobs`' (None for the first, which nothing predicts)
    prompt_logprobs: tuple[dict | None, ...] | None = None


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str
    usage: Usage
    metrics: Metrics
    logprobs: tuple[dict, ...] | None = None
    error: str | None = None
    prompt_logprobs: tuple[dict | None, ...] | None = None


@dataclasses.dataclass(eq=False)
class Request:
    """One request's mutable state; only the scheduler's thread touches it after submission. The Scheduler
    writes lane, pages, computed, cached_tokens, reused, resume, preemptions and the timestamps; the OutputProcessor
    the output fields."""

    id: str
    prompt: Any  # PreparedPrompt
    sampling: SamplingParams
    seed: int
    sink: Callable[[StreamEvent], None]
    detokenizer: Any | None
    arrival: float = dataclasses.field(default_factory=time.perf_counter)
    group: str | None = None  # the n samples of one call: they share their prompt's prefill (spec §12.2)
    # Set while the request holds a lane.
    lane: int | None = None
    pages: list[int] = dataclasses.field(default_factory=list)  # page of block b at index b
    computed: int = 0  # tokens whose KV and state are in the lane's pages and slot
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache (fixed at its first admission)
    reused: int = 0  # tokens the lane's admission reused (a preempted request's next admission: its own output too)
    # After a preemption: the prompt and the output so far, which its next admission maps onto the cache and
    # prefills (`prefix`); None before.
    resume: PreparedPrompt | None = None
    preemptions: int = 0  # times it went back to the queue for another lane's pages
    output: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[dict] | None = None
    # With prompt logprobs: each prefill pass's first position and its scores on the device (the runner's
    # `prefill`), read once the last pass ends
    prompt_scores: list[tuple[int, tuple]] = dataclasses.field(default_factory=list)
    text: str = ""
    emitted_text: int = 0  # characters of `text` already sent
    emitted_tokens: int = 0
    admitted_at: float | None = None  # when it got a lane
    scheduled_at: float | None = None  # when its first prefill chunk was dispatched
    first_token_at: float | None = None
    finish_reason: str | None = None
    grammar: Any | None = None  # structured.Grammar of a response_format; advanced by the OutputProcessor
    allowed: np.ndarray | None = None  # allowed_token_ids as packed bits (sampling.pack_token_bits), constant
    bad_words: Any | None = None  # bad_words.BadWords of its sampling's bad_words
    thinking: Any | None = None  # thinking_budget.ThinkingBudget of its sampling's thinking_budget
    # A verify round fed drafts past a stop the host found (a stop string): the lane's state is past `computed`, so
    # its release takes no endpoint snapshot (its KV pages up to `computed` are exact).
    state_ahead: bool = False
    drafted: int = 0
    accepted: int = 0
    # MTP: the drafts its last verify round chained on the device, to follow its last token (empty: none)
    drafts: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int32))

    @property
    def mask_follows_output(self) -> bool:
        """Whether its allowed tokens depend on its last token (a grammar, a bad word of two or more tokens, or a
        thinking budget about to be spent): it then decodes only once the host has read that token."""
        return (self.grammar is not None or self.bad_words is not None and self.bad_words.follows_output
                or self.thinking is not None and self.thinking.follows_output(self.output))

    def processes_logits(self, ahead: int = 1) -> bool:
        """Whether one of its next `ahead + 1` tokens needs `process_logits`: every token when its sampling asks for
        processing; with a thinking budget alone, only where the budget may bind, so its lane verifies drafts and
        keeps the plain samplers until then."""
        return self.sampling.processed or self.thinking is not None and self.thinking.binds(self.output, ahead)

    def token_slice(self, start: int, end: int) -> np.ndarray:
        """Tokens [start, end) of the sequence: the prompt, then the generated tokens."""
        n = self.num_prompt
        if end <= n:
            return self.prompt.token_ids[start:end]
        out = np.asarray(self.output[max(0, start - n) : end - n], np.int32)
        return out if start >= n else np.concatenate([self.prompt.token_ids[start:], out])

    def sequence(self) -> np.ndarray:
        """The whole sequence so far: the prompt, then every generated token."""
        return self.token_slice(0, self.num_prompt + len(self.output))

    @property
    def prompt_ids(self) -> np.ndarray:
        return self.prompt.token_ids

    @property
    def num_prompt(self) -> int:
        return len(self.prompt.token_ids)

    @property
    def prefix(self) -> PreparedPrompt:
        """What an admission maps onto the cache and prefills: the prompt, or after a preemption the prompt and
        the output so far (whose last token's logits give its next token)."""
        return self.resume if self.resume is not None else self.prompt

    @property
    def prefilling(self) -> bool:
        return self.computed < self.prefix.num_tokens

    @property
    def decoding(self) -> bool:
        """Its prefix is computed and its admission's first token read: each round feeds its last token."""
        return self.num_prompt + len(self.output) > self.computed >= self.prefix.num_tokens

    @property
    def scores_prompt(self) -> bool:
        """Whether its prefill scores the prompt (prompt logprobs, sent once: never again after a preemption)."""
        return self.sampling.prompt_logprobs is not None and not self.output

    def usage(self) -> Usage:
        return Usage(self.num_prompt, len(self.output), self.cached_tokens)

    def metrics(self) -> Metrics:
        def since(t: float | None) -> float | None:
            return None if t is None else t - self.arrival

        end = time.perf_counter() if self.finish_reason else None
        return Metrics(since(self.first_token_at), since(end), since(self.admitted_at), since(self.scheduled_at),
                       self.drafted, self.accepted)
