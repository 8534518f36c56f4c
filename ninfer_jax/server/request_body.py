"""Reads an API request: its API key, the engine (once loaded), its JSON body into the endpoint's pydantic model,
and its model name.

Every failure is an ApiError, in this order, each before any costlier step: 401 for a bad key; 503 while the
model loads; 415 for a body that is not `application/json` (so a web page cannot make the server generate with
a plain form POST); 413 for a body over the size limit, found while reading it; 400 for a body that is not
JSON, nests too deep, has more characters of text than the context can take (an image's data is not text),
holds a lone surrogate or a non-finite number, or fails its schema (never FastAPI's 422); 404 for a model this
server does not serve.
"""

from __future__ import annotations

import json
import math
from typing import Any, TypeVar

import pydantic
from fastapi import Request

from .context import ServerContext, context
from .errors import ApiError, is_anthropic, validation_error

Model = TypeVar("Model", bound=pydantic.BaseModel)

# The fields an image's bytes come in: OpenAI's image_url.url, the Responses API's image_url, Anthropic's
# source.data and source.url.
_IMAGE_DATA_KEYS = frozenset(("url", "image_url", "data"))


async def read_request(request: Request, model: type[Model]) -> tuple[ServerContext, Model]:
    ctx = context(request)
    ctx.ready_engine()
    body = await parse_body(request, model, ctx)
    name = getattr(body, "model", None)
    if name is not None and name not in ctx.model_names:  # /tokenize and /detokenize may leave it out, as vLLM's
        if is_anthropic(request.url.path):
            raise ApiError("not_found", f"model: {name}")
        raise unknown_model(ctx, name)
    return ctx, body


def unknown_model(ctx: ServerContext, name: str) -> ApiError:
    """OpenAI's 404 for a model this server does not serve."""
    served = ", ".join(f"`{n}`" for n in ctx.model_names)
    return ApiError("not_found", f"The model `{name}` does not exist. This server serves {served}.", param="model",
                    code="model_not_found")


async def parse_body(request: Request, model: type[Model], ctx: ServerContext) -> Model:
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type != "application/json":
        raise ApiError("media_type", f"the request body must be JSON sent as Content-Type: application/json, "
                       f"got {media_type or 'no Content-Type'}")
    limits = ctx.limits
    raw = await _read(request, limits.max_request_bytes)
    try:
        data = json.loads(raw)
    except RecursionError:
        raise _too_deep(limits.max_json_depth) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ApiError("invalid_request", f"the request body is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise ApiError("invalid_request", "the request body must be a JSON object")
    chars, suspect = _scan(data, limits.max_json_depth)
    bound = limits.prompt_chars(ctx.engine.max_model_len)
    if chars > bound:
        raise ApiError("context_length", f"the request has {chars} characters of text; this server takes at most "
                       f"{bound} (--max-prompt-chars)")
    if suspect:
        _name_bad_value(data, "")
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as error:
        raise validation_error(error) from None


async def _read(request: Request, limit: int) -> bytes:
    """The body, refused (413) as soon as it is known to exceed `limit` bytes: from Content-Length before
    reading, or while reading a body sent without one."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise _too_large(len(body), limit)
    return bytes(body)


def _scan(data: dict, max_depth: int) -> tuple[int, bool]:
    """(characters of text, whether a string or number needs a closer look), walking the JSON without recursion.
    Raises the depth ApiError past `max_depth` levels."""
    chars, suspect = 0, False
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > max_depth:
            raise _too_deep(max_depth)
        if type(value) is dict:
            items = []
            for key, item in value.items():
                chars += len(key)
                suspect = suspect or not key.isascii()
                # An image's data (a data: URL, base64) is not text the tokenizer reads: --max-image-bytes
                # bounds it instead.
                if key in _IMAGE_DATA_KEYS and type(item) is str:
                    suspect = suspect or not item.isascii()
                else:
                    items.append(item)
            value = items
        for item in value:
            kind = type(item)
            if kind is str:
                chars += len(item)
                suspect = suspect or not item.isascii()
            elif kind is dict or kind is list:
                stack.append((item, depth + 1))
            elif kind is float and not math.isfinite(item):
                suspect = True
    return chars, suspect


def _name_bad_value(value: Any, where: str) -> None:
    """Raises the ApiError naming the first lone surrogate or non-finite number (recursion is bounded by the
    depth check); returns when every non-ASCII string is valid Unicode."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as error:
            code = ord(value[error.start])
            raise ApiError("invalid_request", f"{where or 'the body'} contains a lone surrogate (U+{code:04X}); "
                           "text must be valid Unicode", param=where or None) from None
    elif isinstance(value, float) and not math.isfinite(value):
        raise ApiError("invalid_request", f"{where} must be a finite number, got {value}", param=where or None)
    elif isinstance(value, dict):
        for key, item in value.items():
            _name_bad_value(key, f"{where} (a key)" if where else "a key")
            _name_bad_value(item, f"{where}.{key}" if where else key)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _name_bad_value(item, f"{where}[{index}]")


def _too_large(size: int, limit: int) -> ApiError:
    return ApiError("too_large", f"the request body has {size} bytes or more; this server takes at most {limit} "
                    "(--max-request-bytes)")


def _too_deep(max_depth: int) -> ApiError:
    return ApiError("invalid_request", f"the request body nests JSON more than {max_depth} levels deep "
                    "(--max-json-depth)")
