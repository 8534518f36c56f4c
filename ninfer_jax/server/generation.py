"""One request on the engine, as the HTTP handlers see it: events, refusals, cancellation on disconnect.

`EngineRun` wraps `engine.astream`. Engine refusals (prompt too long, bad parameters, engine stopped)
become `ApiError`s at the first event, before any response byte is sent, so they get a proper status.
`until_disconnect` races an awaitable against the client leaving; when the client leaves first, the
engine request is cancelled (it ends at the next unit boundary) and `ClientGone` is raised.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Any, TypeVar

from fastapi import Request

from ninfer_jax import EngineStoppedError, InvalidRequestError, PromptTooLongError, SamplingParams

from .context import ServerContext
from .errors import ApiError, ClientGone

T = TypeVar("T")

# finish_reason values after which a request produced an answer (the rest are failures).
ANSWERED = ("stop", "length")


@dataclasses.dataclass
class Outcome:
    """A finished request, accumulated from its events."""

    token_ids: list[int]
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    ttft_s: float | None
    error: str | None


def sampling_params(engine: Any, **fields: Any) -> SamplingParams:
    """SamplingParams from the fields a request set; one it left unset (None) takes the engine's default (the
    checkpoint's generation_config.json, `engine.sampling_defaults`), else SamplingParams'. Invalid values are a
    400."""
    given = {key: value for key, value in fields.items() if value is not None}
    try:
        return SamplingParams(**{**engine.sampling_defaults, **given})
    except (ValueError, TypeError) as error:
        field = next((key for key in fields if str(error).startswith(key)), None)  # messages start with the field
        raise ApiError("invalid_request", str(error), param=field) from None


def default_max_tokens(engine: Any, prompt_tokens: int) -> int:
    """max_tokens of a chat request that sets none: the context the prompt leaves, at most the checkpoint's
    max_new_tokens (vLLM's rule)."""
    room = max(1, engine.max_model_len - prompt_tokens)
    return min(room, engine.sampling_defaults.get("max_tokens", room))


async def prepare_sampling(ctx: Any, sampling: SamplingParams, param: str = "response_format") -> None:
    """Compiles a response_format's grammar in the server's frontend threads (ctx.frontend), so the event loop
    never waits on it (the engine then finds it compiled); a schema the grammar library refuses is a 400 naming
    `param`, the request field it came from."""
    if sampling.response_format is None:
        return
    try:
        await ctx.frontend.run(ctx.engine.prepare_sampling, sampling)
    except InvalidRequestError as error:
        raise ApiError("invalid_request", str(error), param=param) from None


def failure(finish_reason: str, error: str | None) -> ApiError:
    """The ApiError for a request the engine ended without an answer."""
    if finish_reason == "unavailable":
        return ApiError("unavailable", "the server is shutting down; retry on another instance")
    if finish_reason == "cancelled":
        return ApiError("unavailable", "the request was cancelled")
    return ApiError("server_error", f"the engine failed: {error or finish_reason}")


class EngineRun:
    """The events of one engine request, what they added up to, and its count in the server metrics and place in
    the request queue (both settled once: at its final event, its refusal, or when cancelled first)."""

    def __init__(self, engine: Any, prompt: Any, sampling: SamplingParams, request_id: str,
                 ctx: ServerContext, events: AsyncIterator[Any] | None = None):
        """Submits the request unless `events` are given (one of a group `sample_runs` submitted, which took the
        group's places). Raises ApiError when the request queue is full."""
        if events is None:
            ctx.enter_queue(1)
        self.engine, self.request_id, self.metrics, self._queue = engine, request_id, ctx.metrics, ctx.queue
        self.token_ids: list[int] = []
        self.text = ""
        self.logprobs: list[dict] = []  # the engine's entries, when the request asked for logprobs
        self.prompt_logprobs: tuple | None = None  # the engine's prompt entries, when it asked for them
        self.last: Any = None  # the final StreamEvent, once it came
        # `events`: a request already submitted (one of a group, `sample_runs`); otherwise submitted here.
        self._events = events if events is not None else engine.astream(prompt, sampling, request_id=request_id)
        self._admitted: Any = None  # the first event's usage (cached tokens are fixed at admission)
        self._refused = False  # the engine refused it before any work
        self._counted = False
        self._last_token_at: float | None = None

    @property
    def finished(self) -> bool:
        return self.last is not None or self._refused

    async def next_event(self) -> Any:
        """The next StreamEvent. Raises ApiError for a refusal before any work."""
        try:
            event = await self._events.__anext__()
        except (PromptTooLongError, InvalidRequestError, EngineStoppedError) as error:
            self._refused = True
            self._leave_queue()
            raise _refusal(error) from None
        if self._admitted is None and event.usage is not None:
            self._admitted = event.usage
        if event.token_ids:  # the inter-token latency as the client sees it, from the second token on
            now = time.perf_counter()
            if self._last_token_at is not None:
                self.metrics.observe_tokens(len(event.token_ids), now - self._last_token_at)
            self._last_token_at = now
        self.token_ids += event.token_ids
        self.text += event.text
        self.logprobs += event.logprobs or ()
        self.prompt_logprobs = event.prompt_logprobs or self.prompt_logprobs
        if event.finish_reason is not None:
            self.last = event
            outcome = self.outcome()
            self._count(outcome.finish_reason, outcome.completion_tokens, event.metrics)
            await self._events.aclose()  # the source waits at its last yield; end it now, not at garbage collection
        return event

    async def events(self, first: Any) -> AsyncIterator[Any]:
        """`first` (an event already taken) and every later one, through the final event."""
        event = first
        while True:
            yield event
            if event.finish_reason is not None:
                return
            event = await self.next_event()

    async def collect(self) -> Outcome:
        """Runs the request to its end (a cancelled one ends with its "cancelled" event)."""
        while self.last is None:
            await self.next_event()
        return self.outcome()

    def outcome(self) -> Outcome:
        """What the request added up to (after its final event)."""
        final = self.last.usage
        return Outcome(
            self.token_ids, self.text, self.last.finish_reason,
            self.prompt_tokens or (final.prompt_tokens if final else 0),
            final.completion_tokens if final else len(self.token_ids),
            self.cached_tokens or (final.cached_tokens if final else 0),
            self.last.metrics.ttft_s if self.last.metrics else None, self.last.error,
        )

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens reused from the prefix cache, known from the first event on."""
        return self._admitted.cached_tokens if self._admitted else 0

    @property
    def prompt_tokens(self) -> int:
        return self._admitted.prompt_tokens if self._admitted else 0

    def cancel(self) -> None:
        """Cancels the request unless it has finished (the client left, or its batch failed)."""
        if not self.finished and not self._counted:
            self.engine.cancel(self.request_id)
            self._count("cancelled", len(self.token_ids), None)

    async def close(self) -> None:
        """Cancels the request unless it finished, and closes its event source (a source left waiting at a yield
        would end only when garbage-collected). No task may be awaiting `next_event` meanwhile."""
        self.cancel()
        await self._events.aclose()

    def raise_if_failed(self) -> None:
        """Raises the ApiError of a request that ended without an answer (after its final event)."""
        if self.last is not None and self.last.finish_reason not in ANSWERED:
            raise failure(self.last.finish_reason, self.last.error)

    def _leave_queue(self) -> None:
        if self._queue is not None:
            self._queue, queue = None, self._queue
            queue.leave()

    def _count(self, finish_reason: str, completion_tokens: int, timing: Any) -> None:
        self._leave_queue()
        if not self._counted:
            self._counted = True
            self.metrics.observe_finish(finish_reason, self.prompt_tokens, completion_tokens, self.cached_tokens,
                                        timing)


def sample_runs(engine: Any, prompt: Any, sampling: SamplingParams, n: int, request_id: str,
                ctx: ServerContext) -> list[EngineRun]:
    """The `n` samples of one prompt (OpenAI's `n`). n = 1: one request named `request_id`; more: one group of
    `engine.submit_samples`, which computes the prompt once, each with its seed (`SamplingParams.samples`). Raises
    ApiError for a refusal or a full request queue."""
    if n == 1:
        return [EngineRun(engine, prompt, sampling, request_id, ctx)]
    loop = asyncio.get_running_loop()
    queues: list[asyncio.Queue] = [asyncio.Queue() for _ in range(n)]
    samplings = sampling.samples(n)
    sinks = [lambda event, q=q: loop.call_soon_threadsafe(q.put_nowait, event) for q in queues]
    ctx.enter_queue(n)
    try:
        ids = engine.submit_samples(prompt, samplings, sinks)
    except (PromptTooLongError, InvalidRequestError, EngineStoppedError) as error:
        ctx.queue.leave(n)
        raise _refusal(error) from None
    return [EngineRun(engine, prompt, s, rid, ctx, events=_drain(q)) for s, rid, q in zip(samplings, ids, queues)]


async def _drain(events: asyncio.Queue) -> AsyncIterator[Any]:
    """A submitted request's events, through its final one."""
    while True:
        event = await events.get()
        yield event
        if event.finish_reason is not None:
            return


async def interleave(runs: Sequence[EngineRun], first: Any) -> AsyncIterator[tuple[int, Any]]:
    """(index, event) for every event of `runs` as it comes, through each run's final event; `first` is runs[0]'s
    first event, already taken (`first_event`). Events that arrive together come in index order."""
    yield 0, first
    waiting = {asyncio.ensure_future(run.next_event()): i for i, run in enumerate(runs)
               if i > 0 or first.finish_reason is None}
    try:
        while waiting:
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=waiting.__getitem__):
                index = waiting.pop(task)
                event = task.result()
                yield index, event
                if event.finish_reason is None:
                    waiting[asyncio.ensure_future(runs[index].next_event())] = index
    finally:
        await _cancel_and_wait(*waiting)  # so that no run is mid-event when the caller closes them


def _refusal(error: Exception) -> ApiError:
    if isinstance(error, PromptTooLongError):
        return ApiError("context_length", str(error), param="messages")
    if isinstance(error, EngineStoppedError):
        return ApiError("unavailable", f"the server is shutting down ({error})")
    return ApiError("invalid_request", str(error))


async def until_disconnect(request: Request, work: Awaitable[T], *runs: EngineRun) -> T:
    """Awaits `work` unless the client disconnects first; then cancels `runs` and raises ClientGone."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        for run in runs:
            run.cancel()
        raise ClientGone(", ".join(run.request_id for run in runs) or "a request before its prompt was ready")
    finally:
        await _cancel_and_wait(watcher, task)


async def close_runs(runs: Sequence[EngineRun]) -> None:
    """Closes every run (`EngineRun.close`); the unfinished ones are cancelled."""
    for run in runs:
        await run.close()


async def _cancel_and_wait(*tasks: asyncio.Future) -> None:
    """Cancels the tasks that have not finished and waits until they have (a cancelled task only ends at its next
    await)."""
    pending = [task for task in tasks if not task.done()]
    for task in pending:
        task.cancel()
    if pending:
        await asyncio.wait(pending)


async def _disconnected(request: Request) -> None:
    # The body has been read, so the next ASGI message is the disconnect (uvicorn blocks until then).
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def first_event(request: Request, run: EngineRun) -> Any:
    """A stream's first event, taken before the response starts, so that a refusal or a request the
    engine ended at once (server stopping) is answered with its own status instead of a stream."""
    first = await until_disconnect(request, run.next_event(), run)
    run.raise_if_failed()
    return first
