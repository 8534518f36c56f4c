"""OpenAI's Responses API: POST /v1/responses, the protocol current agent CLIs speak.

`input` is a string or a list of items: messages (roles user, assistant, system, developer; content a string
or `input_text` / `output_text` parts, and in user messages `input_image` parts with an `image_url`),
`function_call` and `function_call_output` items, and `reasoning` items (given back to the template as the next
assistant turn's reasoning). `instructions` is a system message first; function tools come in the flattened form
(`{"type": "function", "name": ...}`), `tool_choice` "required" or a named one forcing calls (tool_choice.py);
`text.format` is a response_format. The output is a `reasoning` item for the thinking text, a `message` with
`output_text`, and a `function_call` item per call; usage reports the prefix cache's reuse as
`input_tokens_details.cached_tokens`.

The server keeps no responses: `store` is answered `false`, and `previous_response_id`, `conversation` and
`prompt` are a 400 (send the conversation in `input`, as clients with `store: false` do).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ninfer_jax.frontend import Breakpoint
from ninfer_jax.runtime.thinking_budget import think_close_id

from .chat_prompt import ReasoningEffort, prepare_prompt, thinking_mode
from .errors import ApiError, openai_error, refuse_unsupported
from .generation import (ANSWERED, EngineRun, Outcome, default_max_tokens, failure, first_event, prepare_sampling,
                         sampling_params, until_disconnect)
from .images import image_part, url_source
from .limits import check_context
from .output_parser import OutputParser, Piece
from .request_body import read_request
from .sse import EventStream, sse
from .tool_calls import sent_arguments
from .tool_choice import openai_forced_tools, output_format

router = APIRouter()

_ROLES = ("user", "assistant", "system", "developer")


class Reasoning(BaseModel):
    """The request's reasoning: "none" or "minimal" effort turns thinking off, any other level on (Qwen3.5 has no
    levels); a summary is not written (the reasoning item carries the text itself)."""

    model_config = ConfigDict(extra="ignore")

    effort: ReasoningEffort | None = None


# Responses fields this server does not implement, refused unless neutral: background runs, stored conversations
# and prompts (the server keeps none)
_UNSUPPORTED = {"background": False, "conversation": None, "prompt": None}


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _no_unsupported_fields(cls, data: Any) -> Any:
        return refuse_unsupported(data, _UNSUPPORTED)

    model: str | None = None  # as chat completions': optional
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = Field(None, ge=1)
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    reasoning: Reasoning | None = None
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    metadata: dict[str, Any] | None = None
    user: str | None = None
    cache_salt: str | None = Field(None, min_length=1)  # vLLM's, as on chat completions
    priority: int = 0  # vLLM's, as on chat completions (--scheduling-policy priority)


@router.post("/v1/responses")
async def create_response(request: Request):
    ctx, body = await read_request(request, ResponsesRequest)
    engine = ctx.engine
    if body.previous_response_id is not None:
        raise ApiError("invalid_request", "previous_response_id is not supported: this server stores no responses; "
                       "send the whole conversation in input", param="previous_response_id")
    tools = _tools(body.tools) if body.tool_choice != "none" else None
    ctx.limits.check_counts(tools=len(body.tools or ()))
    messages = _messages(body)
    forced = openai_forced_tools(body.tool_choice, tools, parallel=body.parallel_tool_calls)
    response_format = output_format(forced, _response_format(body.text), "text.format")
    thinking = thinking_mode(ctx.default_thinking, reasoning_effort=body.reasoning and body.reasoning.effort,
                             response_format=response_format)
    prepared = await until_disconnect(request, prepare_prompt(
        ctx, messages, tools, (Breakpoint(len(messages) - 1, None, explicit=False),), enable_thinking=thinking,
        cache_salt=body.cache_salt))
    check_context(engine.max_model_len, prepared.num_tokens, body.max_output_tokens)
    sampling = sampling_params(
        engine, max_tokens=body.max_output_tokens or default_max_tokens(engine, prepared.num_tokens),
        temperature=body.temperature, top_p=body.top_p, response_format=response_format, priority=body.priority)
    await prepare_sampling(ctx, sampling, param="tools" if forced is not None else "response_format")
    response_id = f"resp_{uuid.uuid4().hex}"
    run = EngineRun(engine, prepared, sampling, response_id, ctx)
    limits = [n for n in (1 if body.parallel_tool_calls is False else None, body.max_tool_calls) if n is not None]
    parser = OutputParser(thinking=thinking, tools=tools, forced=forced, max_calls=min(limits, default=None))
    output = _Output(parser, think_close_id(engine.tokenizer))
    shell = _response(body, response_id, ctx.model_name)
    if body.stream:
        first = await first_event(request, run)
        return EventStream(_stream(run, first, output, shell))
    outcome = await until_disconnect(request, run.collect(), run)
    run.raise_if_failed()
    list(output.push(outcome.text, final=True))
    return JSONResponse(output.finished(shell, outcome))


async def _stream(run: EngineRun, first: Any, output: _Output, shell: dict[str, Any]) -> AsyncIterator[str]:
    """created, in_progress, each item's events as the text is parsed, then completed (or incomplete)."""
    sequence = 0

    def event(kind: str, **fields: Any) -> str:
        nonlocal sequence
        sequence += 1
        return sse({"type": kind, "sequence_number": sequence - 1, **fields}, event=kind)

    try:
        yield event("response.created", response=shell)
        yield event("response.in_progress", response=shell)
        async for update in run.events(first):
            for kind, fields in output.push(update.text, final=update.finish_reason is not None):
                yield event(kind, **fields)
        outcome = run.outcome()
        if outcome.finish_reason not in ANSWERED:
            _, body = openai_error(failure(outcome.finish_reason, outcome.error))
            yield event("error", **{k: body["error"][k] for k in ("code", "message", "param")}, error=body["error"])
            return
        done = output.finished(shell, outcome)
        yield event("response.completed" if done["status"] == "completed" else "response.incomplete", response=done)
    finally:
        await run.close()  # cancels it if the client left mid-stream


class _Output:
    """The output items of one response, built from the parser's pieces; `push` gives the stream's events."""

    def __init__(self, parser: OutputParser, think_close: int | None):
        self.parser, self.think_close = parser, think_close
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the reasoning or message item text is being added to

    def push(self, text: str, final: bool) -> Iterator[tuple[str, dict[str, Any]]]:
        pieces = self.parser.push(text) + (self.parser.finish() if final else [])
        for piece in pieces:
            yield from self._piece(piece)
        if final:
            yield from self._close()

    def finished(self, shell: dict[str, Any], outcome: Outcome) -> dict[str, Any]:
        """The response object once generation ended."""
        complete = outcome.finish_reason == "stop"
        thought = any(i["type"] == "reasoning" for i in self.items)
        reasoning = self._reasoning_tokens(outcome.token_ids) if thought else 0
        return {**shell, "status": "completed" if complete else "incomplete",
                "incomplete_details": None if complete else {"reason": "max_output_tokens"},
                "output": self.items, "usage": {
                    "input_tokens": outcome.prompt_tokens,
                    "input_tokens_details": {"cached_tokens": outcome.cached_tokens},
                    "output_tokens": outcome.completion_tokens,
                    "output_tokens_details": {"reasoning_tokens": reasoning},
                    "total_tokens": outcome.prompt_tokens + outcome.completion_tokens}}

    def _piece(self, piece: Piece) -> Iterator[tuple[str, dict[str, Any]]]:
        if piece.kind == "tool_call":
            yield from self._close()
            call = piece.tool_call
            item = {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": f"call_{uuid.uuid4().hex[:24]}",
                    "name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False),
                    "status": "completed"}
            index = len(self.items)
            self.items.append(item)
            yield "response.output_item.added", {"output_index": index, "item": {**item, "arguments": "",
                                                                                   "status": "in_progress"}}
            where = {"item_id": item["id"], "output_index": index}
            yield "response.function_call_arguments.delta", {**where, "delta": item["arguments"]}
            yield "response.function_call_arguments.done", {**where, "name": item["name"],
                                                             "arguments": item["arguments"]}
            yield "response.output_item.done", {"output_index": index, "item": item}
            return
        kind = "reasoning" if piece.kind == "reasoning" else "message"
        if self.open is None or self.open["type"] != kind:
            yield from self._close()
            yield from self._open(kind)
        part = self.open["content"][0]
        part["text"] += piece.text
        delta = {"item_id": self.open["id"], "output_index": len(self.items) - 1, "content_index": 0,
                 "delta": piece.text}
        if kind == "reasoning":
            yield "response.reasoning_text.delta", delta
        else:
            yield "response.output_text.delta", {**delta, "logprobs": []}

    def _open(self, kind: str) -> Iterator[tuple[str, dict[str, Any]]]:
        if kind == "reasoning":
            item = {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [],
                    "content": [{"type": "reasoning_text", "text": ""}], "status": "in_progress"}
        else:
            item = {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "role": "assistant", "status": "in_progress",
                    "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]}
        self.open = item
        self.items.append(item)
        index = len(self.items) - 1
        yield "response.output_item.added", {"output_index": index, "item": {**item, "content": []}}
        yield "response.content_part.added", {"item_id": item["id"], "output_index": index, "content_index": 0,
                                              "part": dict(item["content"][0])}

    def _close(self) -> Iterator[tuple[str, dict[str, Any]]]:
        item, self.open = self.open, None
        if item is None:
            return
        item["status"] = "completed"
        index = self.items.index(item)
        part = item["content"][0]
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        if item["type"] == "reasoning":
            yield "response.reasoning_text.done", {**where, "text": part["text"]}
        else:
            yield "response.output_text.done", {**where, "text": part["text"], "logprobs": []}
        yield "response.content_part.done", {**where, "part": part}
        yield "response.output_item.done", {"output_index": index, "item": item}

    def _reasoning_tokens(self, token_ids: list[int]) -> int:
        """Generated tokens before the end of thinking (all of them when it never ended)."""
        if self.think_close is not None and self.think_close in token_ids:
            return token_ids.index(self.think_close)
        return len(token_ids)


def _response(body: ResponsesRequest, response_id: str, model: str) -> dict[str, Any]:
    """The response object as it stands before any output."""
    return {
        "id": response_id, "object": "response", "created_at": int(time.time()), "status": "in_progress",
        "model": model, "output": [], "usage": None, "error": None, "incomplete_details": None,
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
        "temperature": body.temperature, "top_p": body.top_p, "tools": body.tools or [],
        "tool_choice": body.tool_choice or "auto", "parallel_tool_calls": body.parallel_tool_calls is not False,
        "text": body.text or {"format": {"type": "text"}},
        "reasoning": body.reasoning and body.reasoning.model_dump(), "store": False, "previous_response_id": None,
        "truncation": "disabled", "metadata": body.metadata or {}, "user": body.user,
    }


def _messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The chat template's messages for `instructions` and `input`. Raises ApiError for an item it cannot render."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": body.instructions}] if body.instructions else []
    items = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    reasoning: str | None = None  # a reasoning item's text, for the assistant turn that follows it
    for index, item in enumerate(items):
        where = f"input[{index}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise ApiError("invalid_request", f"{where}.role: must be one of {', '.join(_ROLES)}",
                               param=f"{where}.role")
            message = {"role": "system" if role == "developer" else role,
                       "content": _content(item.get("content"), where, images=role == "user")}
            if role == "assistant" and reasoning is not None:
                message["reasoning_content"], reasoning = reasoning, None
            messages.append(message)
        elif kind == "function_call":
            arguments = sent_arguments(item.get("arguments"), f"{where}.arguments")
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": _field(item, "name", where), "arguments": arguments}}
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": ""}
                if reasoning is not None:
                    last["reasoning_content"], reasoning = reasoning, None
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": _field(item, "call_id", where),
                             "content": _content(output, where, images=False)})
        elif kind == "reasoning":
            parts = [part for key in ("content", "summary") if isinstance(item.get(key), list) for part in item[key]]
            reasoning = "\n".join(part["text"] for part in parts
                                  if isinstance(part, dict) and isinstance(part.get("text"), str))
        else:
            raise ApiError("invalid_request", f"{where}: items of type {kind!r} are not supported (message, "
                           "function_call, function_call_output, reasoning)", param=f"{where}.type")
    if not messages:
        raise ApiError("invalid_request", "input: must hold at least one message", param="input")
    return messages


def _content(content: Any, where: str, *, images: bool) -> str | list[dict[str, Any]]:
    """A message's content: its text parts joined, or, when it holds `input_image` parts (`images`: allowed
    here), the template's text and image parts in order."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError("invalid_request", f"{where}.content: expected a string or a list of text parts",
                       param=f"{where}.content")
    parts = []
    for index, part in enumerate(content):
        at = f"{where}.content[{index}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "input_image" and images:
            if part.get("file_id") is not None:
                raise ApiError("invalid_request", f"{at}.file_id: this server stores no files; send the image as "
                               "image_url (a data: URL)", param=f"{at}.file_id")
            parts.append(image_part(url_source(part.get("image_url"), f"{at}.image_url")))
        elif kind == "input_image":
            raise ApiError("invalid_request", f"{at}: images are accepted in user messages only", param=at)
        else:
            raise ApiError("invalid_request", f"{at}: content of type {kind!r} is not supported (input_text, "
                           "output_text, input_image)", param=at)
    if any(part["type"] == "image" for part in parts):
        return parts
    return "".join(part["text"] for part in parts)


def _field(item: dict[str, Any], name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str) or not value:
        raise ApiError("invalid_request", f"{where}.{name}: required", param=f"{where}.{name}")
    return value


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Flattened function tools in the chat template's nested form."""
    if not tools:
        return None
    nested = []
    for index, tool in enumerate(tools):
        if tool.get("type") != "function" or not isinstance(tool.get("name"), str) or not tool["name"]:
            raise ApiError("invalid_request", f"tools[{index}]: only function tools with a name are supported",
                           param=f"tools[{index}]")
        function = {"name": tool["name"], "parameters": tool.get("parameters") or {"type": "object", "properties": {}}}
        if tool.get("description"):
            function["description"] = tool["description"]
        nested.append({"type": "function", "function": function})
    return nested


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` as a chat response_format (the schema moves under `json_schema`)."""
    fmt = (text or {}).get("format")
    if fmt is not None and not isinstance(fmt, dict):
        raise ApiError("invalid_request", "text.format: expected an object with a type", param="text.format")
    if fmt is None or fmt.get("type") != "json_schema":
        return fmt
    return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}

