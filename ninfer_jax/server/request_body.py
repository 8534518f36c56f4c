"""Reads an API request: its API key, its JSON body into the endpoint's pydantic model, and its model name.

Every failure is an ApiError: 400 for a body that is not JSON or fails its schema (never FastAPI's 422),
401 for a bad key, 404 for a model this server does not serve.
"""

from __future__ import annotations

import json
from typing import TypeVar

import pydantic
from fastapi import Request

from .context import ServerContext, context
from .errors import ApiError, is_anthropic, validation_error

Model = TypeVar("Model", bound=pydantic.BaseModel)


async def read_request(request: Request, model: type[Model]) -> tuple[ServerContext, Model]:
    ctx = context(request)
    body = await parse_body(request, model)
    served = ctx.engine.model_name
    name = getattr(body, "model", served)
    if name != served:
        if is_anthropic(request.url.path):
            raise ApiError("not_found", f"model: {name}")
        raise ApiError("not_found", f"The model `{name}` does not exist. This server serves `{served}`.",
                       param="model", code="model_not_found")
    return ctx, body


async def parse_body(request: Request, model: type[Model]) -> Model:
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ApiError("invalid_request", f"the request body is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise ApiError("invalid_request", "the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as error:
        raise validation_error(error) from None
