"""Anthropic endpoints: POST /v1/messages (streaming or not) and POST /v1/messages/count_tokens.

Usage: `cache_read_input_tokens` is the engine's reuse (cached tokens, fixed at admission, spec §8.3);
`cache_creation_input_tokens` is the part of the prompt up to the deepest cache_control marker that
was not read from the cache (0 without a marker); `input_tokens` is the rest, so the three add up to
the prompt, as in the Messages API.

A stream is the protocol's exact sequence: message_start (with that usage), then per content block
content_block_start, (ping after the first start), content_block_delta..., content_block_stop, then
message_delta (stop_reason, output usage) and message_stop. A request the engine ends without an
answer is a 529 overloaded_error / 500 api_error before the stream starts, or an `error` event in it.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ninfer_jax.frontend import PreparedPrompt

from .anthropic_messages import MessagesInput, messages_input
from .anthropic_schema import CountTokensRequest, MessagesRequest
from .chat_prompt import marked_prefix_tokens, matched_stop, prepare_prompt
from .context import ServerContext
from .errors import ApiError, anthropic_error
from .generation import (ANSWERED, EngineRun, failure, first_event, prepare_sampling, sampling_params,
                         until_disconnect)
from .limits import check_context
from .output_parser import OutputParser, Piece
from .request_body import read_request
from .sse import EventStream, sse
from .tool_choice import anthropic_forced_tools

router = APIRouter()


@router.post("/v1/messages")
async def create_message(request: Request):
    ctx, body = await read_request(request, MessagesRequest)
    engine = ctx.engine
    ctx.limits.check_counts(stops=body.stop_sequences or (), tools=len(body.tools or ()))
    given = messages_input(body)
    single = bool((body.tool_choice or {}).get("disable_parallel_tool_use"))  # one tool call at most
    forced = anthropic_forced_tools(body.tool_choice, given.tools, parallel=not single)
    if forced is not None and body.enable_thinking:  # Anthropic's own rule: a forced call leaves no room to think
        raise ApiError("invalid_request", "thinking may not be enabled when tool_choice forces tool use",
                       param="tool_choice")
    # A last message of the assistant's is the start of its answer, which the model continues (Anthropic's prefill)
    prefilled = body.messages[-1].role == "assistant"
    prepared = await until_disconnect(request, prepare_prompt(ctx, given.messages, given.tools, given.breakpoints,
                                                              enable_thinking=body.enable_thinking,
                                                              continue_final_message=prefilled))
    check_context(engine.max_model_len, prepared.num_tokens, body.max_tokens)
    thinking = body.enable_thinking and not prefilled  # the answer starts inside its reasoning
    sampling = sampling_params(engine, max_tokens=body.max_tokens, temperature=body.temperature, top_p=body.top_p,
                               top_k=body.top_k, stop=tuple(body.stop_sequences or ()),
                               response_format=None if forced is None else forced.response_format(),
                               thinking_budget=body.thinking_budget if thinking else None)
    await prepare_sampling(ctx, sampling, param="tools")
    run = EngineRun(engine, prepared, sampling, f"msg_{uuid.uuid4().hex[:24]}", ctx)
    parser = OutputParser(thinking=thinking, tools=given.tools, forced=forced, max_calls=1 if single else None)
    if body.stream:
        first = await first_event(request, run)
        return EventStream(_stream(ctx, body, given, prepared, run, first, parser))
    await until_disconnect(request, run.collect(), run)
    run.raise_if_failed()
    blocks = _blocks(parser.push(run.text) + parser.finish())
    stop_reason, stop_sequence = _stop(ctx, body, run, blocks)
    return JSONResponse({
        "id": run.request_id, "type": "message", "role": "assistant", "model": ctx.model_name,
        "content": blocks or [{"type": "text", "text": ""}], "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": {**_input_usage(given, prepared, run), "output_tokens": run.outcome().completion_tokens},
    })


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> JSONResponse:
    ctx, body = await read_request(request, CountTokensRequest)
    ctx.limits.check_counts(tools=len(body.tools or ()))
    given = messages_input(body)
    prepared = await until_disconnect(request, prepare_prompt(
        ctx, given.messages, given.tools, given.breakpoints, enable_thinking=body.enable_thinking,
        continue_final_message=bool(body.messages) and body.messages[-1].role == "assistant"))
    return JSONResponse({"input_tokens": prepared.num_tokens})


# --- the stream ---------------------------------------------------------------------------------------

async def _stream(ctx: ServerContext, body: MessagesRequest, given: MessagesInput, prepared: PreparedPrompt,
                  run: EngineRun, first: Any, parser: OutputParser) -> AsyncIterator[str]:
    blocks = _BlockStream()
    try:
        yield sse({"type": "message_start", "message": {
            "id": run.request_id, "type": "message", "role": "assistant", "model": ctx.model_name,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {**_input_usage(given, prepared, run), "output_tokens": 0},
        }}, "message_start")
        async for event in run.events(first):
            for piece in parser.push(event.text) + (parser.finish() if event.finish_reason else []):
                for out in blocks.add(piece):
                    yield out
        if run.last.finish_reason not in ANSWERED:
            _, error = anthropic_error(failure(run.last.finish_reason, run.last.error))
            yield sse(error, "error")
            return
        if not blocks.started:
            for out in blocks.add(Piece("content", "")):
                yield out
        for out in blocks.close():
            yield out
        stop_reason, stop_sequence = _stop(ctx, body, run, blocks.kinds)
        yield sse({"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                   "usage": {"output_tokens": run.outcome().completion_tokens}}, "message_delta")
        yield sse({"type": "message_stop"}, "message_stop")
    finally:
        await run.close()  # cancels it if the client left mid-stream


class _BlockStream:
    """Turns parsed pieces into content-block events, opening and closing blocks as the kind changes."""

    def __init__(self) -> None:
        self.kinds: list[dict[str, Any]] = []  # one {"type": ...} per block opened
        self._open: str | None = None

    @property
    def started(self) -> bool:
        return bool(self.kinds)

    def add(self, piece: Piece) -> list[str]:
        out: list[str] = []
        kind = {"reasoning": "thinking", "content": "text", "tool_call": "tool_use"}[piece.kind]
        if kind != self._open or kind == "tool_use":
            out += self.close()
            block = _empty_block(kind, piece)
            self.kinds.append({"type": kind})
            out.append(sse({"type": "content_block_start", "index": self._index, "content_block": block},
                           "content_block_start"))
            if len(self.kinds) == 1:
                out.append(sse({"type": "ping"}, "ping"))
            self._open = kind
        if kind == "tool_use":
            delta = {"type": "input_json_delta", "partial_json": json.dumps(piece.tool_call.arguments,
                                                                           ensure_ascii=False)}
        elif kind == "thinking":
            delta = {"type": "thinking_delta", "thinking": piece.text}
        else:
            delta = {"type": "text_delta", "text": piece.text}
        if kind == "tool_use" or piece.text:
            out.append(sse({"type": "content_block_delta", "index": self._index, "delta": delta},
                           "content_block_delta"))
        return out

    def close(self) -> list[str]:
        if self._open is None:
            return []
        out = []
        if self._open == "thinking":  # no signature: the model's reasoning is returned as is
            out.append(sse({"type": "content_block_delta", "index": self._index,
                            "delta": {"type": "signature_delta", "signature": ""}}, "content_block_delta"))
        out.append(sse({"type": "content_block_stop", "index": self._index}, "content_block_stop"))
        self._open = None
        return out

    @property
    def _index(self) -> int:
        return len(self.kinds) - 1


# --- helpers ------------------------------------------------------------------------------------------

def _empty_block(kind: str, piece: Piece) -> dict[str, Any]:
    if kind == "thinking":
        return {"type": "thinking", "thinking": "", "signature": ""}
    if kind == "tool_use":
        return {"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}", "name": piece.tool_call.name,
                "input": {}}
    return {"type": "text", "text": ""}


def _blocks(pieces: list[Piece]) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    for piece in pieces:
        if piece.kind == "tool_call":
            blocks.append({**_empty_block("tool_use", piece), "input": piece.tool_call.arguments})
            continue
        kind, field = ("thinking", "thinking") if piece.kind == "reasoning" else ("text", "text")
        if blocks and blocks[-1]["type"] == kind:
            blocks[-1][field] += piece.text
        else:
            blocks.append({**_empty_block(kind, piece), field: piece.text})
    return blocks


def _stop(ctx: ServerContext, body: MessagesRequest, run: EngineRun,
          blocks: list[dict[str, Any]]) -> tuple[str, str | None]:
    if run.last.finish_reason == "length":
        return "max_tokens", None
    if any(block["type"] == "tool_use" for block in blocks):
        return "tool_use", None
    stop = matched_stop(ctx.engine, run.token_ids, run.text, body.stop_sequences or ())
    return ("stop_sequence", stop) if stop is not None else ("end_turn", None)


def _input_usage(given: MessagesInput, prepared: PreparedPrompt, run: EngineRun) -> dict[str, Any]:
    prompt, cached = run.prompt_tokens or prepared.num_tokens, run.cached_tokens
    created = max(0, marked_prefix_tokens(prepared) - cached) if given.marker_ttls else 0
    deepest_ttl = given.marker_ttls[-1] if given.marker_ttls else "5m"
    return {
        "input_tokens": prompt - cached - created,
        "cache_creation_input_tokens": created,
        "cache_read_input_tokens": cached,
        "cache_creation": {"ephemeral_5m_input_tokens": created if deepest_ttl == "5m" else 0,
                           "ephemeral_1h_input_tokens": created if deepest_ttl == "1h" else 0},
    }

