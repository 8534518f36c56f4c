"""What one request may ask for, checked before any work; each bound is a server option (ninfer-serve flags).

The body size is checked while the body is read (413), the JSON depth and the prompt's characters before
tokenizing, the counts (prompts, stop strings, tools) after parsing, and `max_tokens` against the context
left once the prompt's tokens are known (vLLM's words). Every refusal names the option that sets the bound.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from .errors import ApiError

# NOTE: a 262,144-token context is about 1 MiB of English text, and at most 2-3 MiB as JSON-escaped CJK text
# or as token ids. Images come inline as base64, 4/3 of their bytes: 32 MiB (Anthropic's own bound) takes one
# image at --max-image-bytes' default (20 MiB, 27 MiB as base64) or a few screenshots, while a body's parse on
# the event loop stays in the tens of milliseconds (an image's data is one long string).
MAX_REQUEST_BYTES = 32 << 20
# A token of the Qwen3.5 tokenizer covers about 4 characters of prose and rarely more than 16 of anything
# (long runs of spaces): a prompt with more characters than 16 per token of context cannot fit it.
CHARS_PER_TOKEN = 16
# What waits for a lane when max_waiting_requests is unset: four requests per lane, so a queued request waits about
# four requests' time before it starts (a client does better retrying elsewhere past that), and at least 256, so a
# small engine still takes a burst of an agent fleet's requests at once.
WAITING_PER_LANE = 4
MIN_DEFAULT_WAITING = 256
RETRY_AFTER_BUSY_S = 1  # what a 503 for a full queue tells clients to wait: lanes free within a second or so


@dataclasses.dataclass(frozen=True)
class Limits:
    max_request_bytes: int = MAX_REQUEST_BYTES  # --max-request-bytes
    max_prompt_chars: int | None = None  # --max-prompt-chars; None: CHARS_PER_TOKEN per token of the context
    max_json_depth: int = 64  # --max-json-depth: tool schemas nest a few levels; nothing real nests 64
    max_prompts: int = 16  # --max-prompts: a completions batch runs at once; more lanes than that just queue
    max_stop_strings: int = 16  # --max-stop-strings (OpenAI takes 4)
    max_stop_chars: int = 256  # --max-stop-chars: each string is matched against the text after every token
    max_tools: int = 128  # --max-tools (OpenAI's own limit)
    max_n: int = 16  # --max-n: samples of one prompt; each holds a lane while it decodes
    max_waiting_requests: int | None = None  # --max-waiting-requests; None: default_max_waiting(lanes)

    def prompt_chars(self, max_model_len: int) -> int:
        """The bound on a request's characters of text for a context of `max_model_len` tokens."""
        return self.max_prompt_chars if self.max_prompt_chars is not None else CHARS_PER_TOKEN * max_model_len

    def check_counts(self, *, prompts: int = 1, stops: Sequence[str] = (), tools: int = 0, n: int = 1) -> None:
        """Raises ApiError (400) naming the option when a count or a stop string's length is over its bound."""
        if n > self.max_n:
            raise _over("n", f"n = {n} samples", self.max_n, "--max-n")
        if prompts > self.max_prompts:
            raise _over("prompt", f"{prompts} prompts", self.max_prompts, "--max-prompts")
        if len(stops) > self.max_stop_strings:
            raise _over("stop", f"{len(stops)} stop strings", self.max_stop_strings, "--max-stop-strings")
        longest = max(map(len, stops), default=0)
        if longest > self.max_stop_chars:
            raise _over("stop", f"a stop string of {longest} characters", self.max_stop_chars, "--max-stop-chars")
        if tools > self.max_tools:
            raise _over("tools", f"{tools} tools", self.max_tools, "--max-tools")


def default_max_waiting(lanes: int) -> int:
    """Engine requests that may wait for a lane when --max-waiting-requests is unset."""
    return max(MIN_DEFAULT_WAITING, WAITING_PER_LANE * lanes)


@dataclasses.dataclass
class RequestQueue:
    """The engine requests the server submitted and has not seen end (in a lane, or waiting for one), bounded by
    the engine's lanes plus max_waiting (None: `default_max_waiting`). Used on the event loop only."""

    max_waiting: int | None = None
    in_flight: int = 0

    def bound(self, lanes: int) -> int:
        return lanes + (self.max_waiting if self.max_waiting is not None else default_max_waiting(lanes))

    def enter(self, count: int, lanes: int) -> None:
        """Takes `count` places. Raises ApiError: 503 with Retry-After while the queue is full; 400 for more
        requests than it ever holds."""
        bound = self.bound(lanes)
        if count > bound:
            raise ApiError("invalid_request", f"the request runs {count} generations at once; this server queues at "
                           f"most {bound} ({lanes} lanes and --max-waiting-requests {bound - lanes})", param="n")
        if self.in_flight + count > bound:
            raise ApiError("overloaded", f"the server is busy: {self.in_flight} requests are running or waiting "
                           f"for one of {lanes} lanes, the most it queues (--max-waiting-requests {bound - lanes}); "
                           f"retry shortly", retry_after=RETRY_AFTER_BUSY_S)
        self.in_flight += count

    def leave(self, count: int = 1) -> None:
        self.in_flight -= count


def check_context(max_model_len: int, prompt_tokens: int, max_tokens: int | None) -> None:
    """Raises the context_length ApiError (vLLM's message) when the prompt and max_tokens exceed the context."""
    if max_tokens is not None and prompt_tokens + max_tokens > max_model_len:
        raise ApiError("context_length", (
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, {max_tokens} in the completion). "
            "Please reduce the length of the messages or completion."), param="max_tokens")


def _over(param: str, what: str, bound: int, flag: str) -> ApiError:
    return ApiError("invalid_request", f"the request has {what}; this server takes at most {bound} ({flag})",
                    param=param)
