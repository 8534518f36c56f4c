"""OpenAI endpoints: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, and vLLM's /tokenize,
/detokenize and /reset_prefix_cache.

Usage reports the engine's reuse as `prompt_tokens_details.cached_tokens` (spec §8.3). A stream sends
the role first, then reasoning (`reasoning_content`), text and tool calls as they are parsed, a last
chunk with the finish reason, a usage chunk with `stream_options.include_usage` (with vLLM's
`continuous_usage_stats`, every chunk carries its choice's usage so far), and `[DONE]`. A
request the engine ends without an answer (server stopping, engine failure) is a 503/500 before the
stream starts, or an `{"error": ...}` event inside it, which the SDK raises as an APIError.

With `n > 1` the samples of a prompt are one engine group that computes the prompt once; choices carry their
index, a stream interleaves their chunks as they come, and usage counts each prompt once.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from .chat_prompt import prepare_completion_prompt, prepare_prompt, truncated
from .context import ServerContext, context
from .errors import ApiError, openai_error
from .generation import (
    ANSWERED, EngineRun, Outcome, close_runs, default_max_tokens, failure, first_event, interleave, prepare_sampling,
    sample_runs, sampling_params, until_disconnect,
)
from .limits import check_context
from .logprobs import chat_logprobs, completion_logprobs, echoed_prompt, token_text, vllm_prompt_logprobs
from .openai_messages import chat_input
from .openai_schema import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from .output_parser import OutputParser, Piece
from .request_body import read_request, unknown_model
from .sse import EventStream, sse

router = APIRouter()


@router.get("/v1/models")
async def list_models(request: Request) -> JSONResponse:
    """A card for each name the model is served under (vLLM's --served-model-name)."""
    ctx = context(request)
    engine = ctx.ready_engine()
    return JSONResponse({"object": "list", "data": [_model_card(engine, name) for name in ctx.model_names]})


@router.get("/v1/models/{model:path}")
async def retrieve_model(request: Request, model: str) -> JSONResponse:
    """OpenAI's models.retrieve: the served model's card, 404 for any other name."""
    ctx = context(request)
    engine = ctx.ready_engine()
    if model not in ctx.model_names:
        raise unknown_model(ctx, model)
    return JSONResponse(_model_card(engine, model))


def _model_card(engine, name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "ninfer-jax",
            "max_model_len": engine.max_model_len}


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    ctx, body = await read_request(request, ChatCompletionRequest)
    engine = ctx.engine
    ctx.limits.check_counts(stops=body.stop_strings(), tools=len(body.tools or ()), n=body.n)
    chat = chat_input(body)
    forced = body.forced_tools(chat.tools)
    thinking = body.thinking(ctx.default_thinking, forced)
    prepared = await until_disconnect(request, prepare_prompt(
        ctx, chat.messages, chat.tools, chat.breakpoints, enable_thinking=thinking,
        template_kwargs=body.template_kwargs(), continue_final_message=body.continue_final_message,
        cache_salt=body.cache_salt))
    prepared = truncated(engine, prepared, body.truncate_prompt_tokens)
    check_context(engine.max_model_len, prepared.num_tokens, body.output_limit)
    # a continued answer is past the template's think block: the model writes content from its first token
    reasoning = thinking and not body.continue_final_message
    sampling = _sampling(engine, body, body.output_limit or default_max_tokens(engine, prepared.num_tokens),
                         body.output_format(forced), body.thinking_token_budget if reasoning else None)
    await prepare_sampling(ctx, sampling, param="tools" if forced is not None else "response_format")
    response_id = f"chatcmpl-{uuid.uuid4().hex}"
    runs = sample_runs(engine, prepared, sampling, body.n, response_id, ctx)
    parsers = [OutputParser(thinking=reasoning, tools=chat.tools, forced=forced,
                            keep_reasoning=body.include_reasoning,
                            max_calls=1 if body.parallel_tool_calls is False else None) for _ in runs]
    if body.stream:
        first = await _first_event(request, runs)
        return EventStream(_chat_stream(ctx, body, response_id, runs, first, parsers, prepared.token_ids))
    outcomes = await _collect(request, runs)
    choices = []
    for index, (outcome, run, parser) in enumerate(zip(outcomes, runs, parsers)):
        message, calls = _message(parser.push(outcome.text) + parser.finish())
        logprobs = chat_logprobs(body.token_namer(engine), run.logprobs) if body.logprobs else None
        choices.append({"index": index, "message": message, "logprobs": logprobs,
                        "finish_reason": _finish(outcome.finish_reason, calls),
                        **({"token_ids": outcome.token_ids} if body.return_token_ids else {})})
    scored = {} if body.prompt_logprobs is None else {"prompt_logprobs": vllm_prompt_logprobs(
        engine.tokenizer, _top(runs[0].prompt_logprobs, body.prompt_logprobs))}  # one prompt: vLLM's top level
    if body.return_token_ids:
        scored["prompt_token_ids"] = [int(t) for t in prepared.token_ids]
    return JSONResponse({
        "id": response_id, "object": "chat.completion", "created": int(time.time()), "model": ctx.model_name,
        "choices": choices, "usage": _usage(outcomes, body.n), **scored,
    })


@router.post("/v1/completions")
async def completions(request: Request):
    ctx, body = await read_request(request, CompletionRequest)
    engine = ctx.engine
    prompts = body.prompts()
    ctx.limits.check_counts(prompts=len(prompts), stops=body.stop_strings(), n=body.n)
    if body.stream and len(prompts) > 1:
        raise ApiError("invalid_request", "streaming takes one prompt; send a batch without stream", param="prompt")
    prepared = await until_disconnect(request, asyncio.gather(*(prepare_completion_prompt(ctx, p, body.cache_salt)
                                                                   for p in prompts)))
    prepared = [truncated(engine, one, body.truncate_prompt_tokens) for one in prepared]
    for one in prepared:
        check_context(engine.max_model_len, one.num_tokens, body.max_tokens)
    sampling = _sampling(engine, body, body.max_tokens, body.structured_format())
    await prepare_sampling(ctx, sampling)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    # Choice p * n + i is sample i of prompt p (vLLM's order); the batch runs concurrently in the engine.
    runs = []
    try:
        for p, prompt in enumerate(prepared):
            runs += sample_runs(engine, prompt, sampling, body.n, f"{request_id}-{p}", ctx)
    except ApiError:
        await close_runs(runs)
        raise
    # with echo, each choice's text (and its logprobs) start with its prompt's
    echoes = [_Echo(engine.tokenizer, prompt, one.token_ids) if body.echo else None
              for prompt, one in zip(prompts, prepared) for _ in range(body.n)]
    if body.stream:
        first = await _first_event(request, runs)
        return EventStream(_completion_stream(ctx, body, request_id, runs, first, echoes,
                                              [prepared[i // body.n].token_ids for i in range(len(runs))]))
    outcomes = await _collect(request, runs)
    choices = []
    for i, (o, run, echo) in enumerate(zip(outcomes, runs, echoes)):
        entries = (echo.entries(run.prompt_logprobs, body.logprobs) if echo else []) + run.logprobs
        choices.append({"index": i, "text": (echo.text if echo else "") + o.text, "finish_reason": o.finish_reason,
                        "logprobs": _completion_logprobs(engine, body, entries)})
        if body.return_token_ids:
            choices[-1].update(prompt_token_ids=[int(t) for t in prepared[i // body.n].token_ids],
                               token_ids=o.token_ids)
        if body.prompt_logprobs is not None:
            choices[-1]["prompt_logprobs"] = vllm_prompt_logprobs(
                engine.tokenizer, _top(run.prompt_logprobs, body.prompt_logprobs))
    return JSONResponse({
        "id": request_id, "object": "text_completion", "created": int(time.time()), "model": ctx.model_name,
        "choices": choices, "usage": _usage(outcomes, body.n),
    })


@router.post("/tokenize")
async def tokenize(request: Request) -> JSONResponse:
    """vLLM's: a prompt's token ids, or chat messages' as the chat endpoint renders them (images as their
    placeholder tokens)."""
    ctx, body = await read_request(request, TokenizeRequest)
    engine = ctx.engine
    _require_tokenizer(engine)
    if body.messages is not None:
        chat_body = body.as_chat(ctx.model_name)
        ctx.limits.check_counts(tools=len(chat_body.tools or ()))
        chat = chat_input(chat_body)
        thinking = chat_body.thinking(ctx.default_thinking, chat_body.forced_tools(chat.tools))
        prepared = await until_disconnect(request, prepare_prompt(
            ctx, chat.messages, chat.tools, chat.breakpoints, enable_thinking=thinking,
            template_kwargs=chat_body.template_kwargs(), continue_final_message=chat_body.continue_final_message))
        ids = [int(t) for t in prepared.token_ids]
    else:
        text = body.prompt
        ids = await until_disconnect(request, ctx.frontend.run(lambda: engine.tokenizer.encode(text)))
    out: dict[str, Any] = {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}
    if body.return_token_strs:
        out["token_strs"] = [token_text(engine.tokenizer, i) for i in ids]
    return JSONResponse(out)


@router.post("/reset_prefix_cache")
@router.post("/flush_cache")
async def reset_prefix_cache(request: Request) -> JSONResponse:
    """vLLM's /reset_prefix_cache (SGLang's /flush_cache): deletes every cached prefix no running request holds,
    on both tiers; answers what went."""
    engine = context(request).ready_engine()
    freed = await asyncio.to_thread(engine.reset_prefix_cache)
    return JSONResponse({"status": "ok", **freed})


@router.post("/detokenize")
async def detokenize(request: Request) -> JSONResponse:
    """vLLM's: token ids back to text."""
    ctx, body = await read_request(request, DetokenizeRequest)
    engine = ctx.engine
    _require_tokenizer(engine)
    vocab = engine.config.vocab_size
    if any(not 0 <= t < vocab for t in body.tokens):
        raise ApiError("invalid_request", f"token ids must be in [0, {vocab})", param="tokens")
    tokens = body.tokens
    return JSONResponse({"prompt": await ctx.frontend.run(lambda: engine.tokenizer.decode(tokens))})


# --- streams ------------------------------------------------------------------------------------------

async def _chat_stream(ctx: ServerContext, body: ChatCompletionRequest, response_id: str, runs: list[EngineRun],
                       first: Any, parsers: list[OutputParser], prompt_ids) -> AsyncIterator[str]:
    """Chunks of every choice as they come (each names its index, as OpenAI interleaves them)."""
    head = {"id": response_id, "object": "chat.completion.chunk", "created": int(time.time()),
            "model": ctx.model_name}
    usage = _StreamUsage(body, [len(prompt_ids)] * len(runs))

    def chunk(index: int, delta: dict, finish_reason: str | None = None, logprobs: list | None = None,
              token_ids: list | None = None, extra: dict | None = None) -> str:
        scores = chat_logprobs(body.token_namer(ctx.engine), logprobs) if logprobs else None
        ids = {"token_ids": token_ids or []} if body.return_token_ids else {}
        return sse({**head, "choices": [{"index": index, "delta": delta, "logprobs": scores,
                                          "finish_reason": finish_reason, **ids}], **usage.field(index),
                    **(extra or {})})

    calls = [0] * len(runs)
    events = interleave(runs, first)
    prompt_field = {"prompt_token_ids": [int(t) for t in prompt_ids]} if body.return_token_ids else {}
    try:
        for index in range(len(runs)):
            yield chunk(index, {"role": "assistant", "content": ""}, extra=prompt_field)
        async for index, event in events:
            usage.generated[index] += len(event.token_ids)
            parser = parsers[index]
            pieces = parser.push(event.text) + (parser.finish() if event.finish_reason else [])
            # An event's logprobs and token ids ride on its first chunk (held-back text may leave it none of its own).
            scores = list(event.logprobs or ()) if body.logprobs else []
            ids = list(event.token_ids) if body.return_token_ids else []
            for piece in pieces:
                if piece.kind == "tool_call":
                    yield chunk(index, {"tool_calls": [{"index": calls[index], **_tool_call(piece)}]}, logprobs=scores,
                                token_ids=ids)
                    calls[index] += 1
                else:
                    key = "reasoning_content" if piece.kind == "reasoning" else "content"
                    yield chunk(index, {key: piece.text}, logprobs=scores, token_ids=ids)
                scores, ids = [], []
            if scores or ids:
                yield chunk(index, {}, logprobs=scores, token_ids=ids)
            if event.finish_reason is not None:
                outcome = runs[index].outcome()
                if outcome.finish_reason not in ANSWERED:
                    yield _error_event(outcome)
                    return
                yield chunk(index, {}, _finish(outcome.finish_reason, calls[index]))
        for out in _ending(head, body.include_usage, [run.outcome() for run in runs], body.n):
            yield out
    finally:
        await events.aclose()  # its tasks end before the runs close
        await close_runs(runs)  # cancels them if the client left mid-stream


async def _completion_stream(ctx: ServerContext, body: CompletionRequest, request_id: str, runs: list[EngineRun],
                             first: Any, echoes: list[_Echo | None], prompt_ids: list) -> AsyncIterator[str]:
    head = {"id": request_id, "object": "text_completion", "created": int(time.time()),
            "model": ctx.model_name}
    usage = _StreamUsage(body, [len(ids) for ids in prompt_ids])
    # with return_token_ids each choice's first chunk names its prompt's ids, and every chunk its own new ids
    unsent_prompt = [body.return_token_ids] * len(runs)

    def chunk(index: int, text: str, finish_reason: str | None = None, logprobs: dict | None = None,
              token_ids=()) -> str:
        ids = {}
        if body.return_token_ids:
            ids = {"token_ids": [int(t) for t in token_ids]}
            if unsent_prompt[index]:
                ids["prompt_token_ids"], unsent_prompt[index] = [int(t) for t in prompt_ids[index]], False
        return sse({**head, "choices": [{"index": index, "text": text, "logprobs": logprobs,
                                          "finish_reason": finish_reason, **ids}], **usage.field(index)})

    shown = [0] * len(runs)  # characters sent per choice: the text offset of its next event's tokens
    events = interleave(runs, first)
    try:
        async for index, event in events:
            usage.generated[index] += len(event.token_ids)
            echo = echoes[index]
            if echo is not None and (event.token_ids or event.finish_reason is not None):
                # its prompt first, once: with logprobs, after the prompt's event (which precedes the first token)
                echoes[index] = None
                entries = echo.entries(runs[index].prompt_logprobs, body.logprobs)
                yield chunk(index, echo.text, logprobs=_completion_logprobs(ctx.engine, body, entries))
                shown[index] += len(echo.text)
            if event.text or (event.logprobs and body.logprobs is not None) or (
                    event.token_ids and body.return_token_ids):
                logprobs = _completion_logprobs(ctx.engine, body, event.logprobs, shown[index])
                yield chunk(index, event.text, logprobs=logprobs, token_ids=event.token_ids)
                shown[index] += len(event.text)
            if event.finish_reason is not None:
                outcome = runs[index].outcome()
                if outcome.finish_reason not in ANSWERED:
                    yield _error_event(outcome)
                    return
                yield chunk(index, "", outcome.finish_reason)
        for out in _ending(head, body.include_usage, [run.outcome() for run in runs], body.n):
            yield out
    finally:
        await events.aclose()  # its tasks end before the runs close
        await close_runs(runs)  # cancels them if the client left mid-stream


# --- helpers ------------------------------------------------------------------------------------------

def _sampling(engine, body, max_tokens: int | None, response_format: dict[str, Any] | None,
              thinking_budget: int | None = None):
    return sampling_params(
        engine, max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
        min_p=body.min_p, seed=body.seed,
        stop=body.stop_strings(), stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=body.ignore_eos,
        include_stop_str_in_output=body.include_stop_str_in_output, skip_special_tokens=body.skip_special_tokens,
        logprobs=body.num_logprobs, prompt_logprobs=body.num_prompt_logprobs,
        presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty, min_tokens=body.min_tokens, logit_bias=body.logit_bias,
        allowed_token_ids=body.allowed_token_ids, bad_words=body.bad_words,
        truncate_prompt_tokens=body.truncate_prompt_tokens, response_format=response_format,
        thinking_budget=thinking_budget, priority=body.priority,
    )


def _completion_logprobs(engine, body: CompletionRequest, entries, offset: int = 0) -> dict | None:
    if body.logprobs is None or not entries:
        return None
    return completion_logprobs(body.token_namer(engine), entries, offset)


def _require_tokenizer(engine) -> None:
    """/tokenize and /detokenize need the checkpoint's tokenizer files: a 400 without them."""
    if engine.tokenizer is None:
        raise ApiError("invalid_request", f"model {engine.model_name} has no tokenizer files")


def _top(entries, k: int) -> list:
    """The engine's prompt entries with their top alternatives cut to k (None stays None)."""
    return [None if e is None else {**e, "top": e["top"][:k]} for e in entries or ()]


class _Echo:
    """A completions prompt echoed before its choice's text: the prompt as sent (token ids decoded) and, with
    logprobs, its tokens' entries (the first with null ones)."""

    def __init__(self, tokenizer, prompt, token_ids):
        self.text = prompt if isinstance(prompt, str) else tokenizer.decode(token_ids) if tokenizer else ""
        self.token_ids = token_ids

    def entries(self, prompt_logprobs, k: int | None) -> list[dict]:
        return [] if k is None or not prompt_logprobs else echoed_prompt(self.token_ids, _top(prompt_logprobs, k))


def _message(pieces: list[Piece]) -> tuple[dict[str, Any], int]:
    text = "".join(p.text for p in pieces if p.kind == "content")
    reasoning = "".join(p.text for p in pieces if p.kind == "reasoning")
    calls = [_tool_call(p) for p in pieces if p.kind == "tool_call"]
    message: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None,
                               "reasoning_content": reasoning or None}
    if calls:
        message["tool_calls"] = calls
    return message, len(calls)


def _tool_call(piece: Piece) -> dict[str, Any]:
    call = piece.tool_call
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)}}


def _finish(finish_reason: str, tool_calls: int) -> str:
    return "tool_calls" if tool_calls and finish_reason == "stop" else finish_reason


class _StreamUsage:
    """A stream's per-chunk usage field: null with include_usage, with vLLM's continuous_usage_stats its choice's
    prompt and the tokens it generated so far; absent otherwise. `generated` is counted by the stream."""

    def __init__(self, body: Any, prompt_tokens: list[int]):
        self.include, self.continuous = body.include_usage, body.continuous_usage
        self.prompt_tokens, self.generated = prompt_tokens, [0] * len(prompt_tokens)

    def field(self, index: int) -> dict[str, Any]:
        if not self.continuous:
            return {"usage": None} if self.include else {}
        prompt, done = self.prompt_tokens[index], self.generated[index]
        return {"usage": {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}}


def _usage(outcomes: list[Outcome], n: int = 1) -> dict[str, Any]:
    """Usage of `outcomes`, n samples per prompt: each prompt counts once, as OpenAI and vLLM count it, with the
    reuse of its first sample (the one that computed it); every sample's tokens count."""
    firsts = outcomes[::n]
    prompt = sum(o.prompt_tokens for o in firsts)
    completion = sum(o.completion_tokens for o in outcomes)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(o.cached_tokens for o in firsts)}}


async def _first_event(request: Request, runs: list[EngineRun]) -> Any:
    """runs[0]'s first event (a refusal is answered before the stream starts); the others are cancelled if it
    fails."""
    try:
        return await first_event(request, runs[0])
    except BaseException:
        await close_runs(runs)
        raise


async def _collect(request: Request, runs: list[EngineRun]) -> list[Outcome]:
    """Every run to its end, concurrently; all are cancelled if the client leaves or one is refused."""
    try:
        outcomes = await until_disconnect(request, asyncio.gather(*(run.collect() for run in runs)), *runs)
    finally:
        await close_runs(runs)  # cancels the rest of a batch one of whose prompts was refused
    for run in runs:
        run.raise_if_failed()
    return outcomes


def _error_event(outcome: Outcome) -> str:
    """The error event (which the SDK raises) for a request the engine ended without an answer."""
    _, error = openai_error(failure(outcome.finish_reason, outcome.error))
    return sse(error)


def _ending(head: dict[str, Any], include_usage: bool, outcomes: list[Outcome], n: int = 1) -> Iterator[str]:
    """A stream's end, after every choice's finish chunk: the usage chunk when asked for, and [DONE]."""
    if include_usage:
        yield sse({**head, "choices": [], "usage": _usage(outcomes, n)})
    yield sse("[DONE]")
