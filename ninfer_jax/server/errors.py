"""API errors, and the two wire shapes they take: OpenAI's and Anthropic's.

Handlers raise `ApiError` with a protocol-neutral `kind`; `app.py` renders it in the shape of the
protocol the request path belongs to. Status codes and `type` strings follow each provider:

  kind              OpenAI                                  Anthropic
  invalid_request   400 invalid_request_error               400 invalid_request_error
  context_length    400 invalid_request_error (code         400 invalid_request_error
                    context_length_exceeded)
  authentication    401 invalid_request_error (code         401 authentication_error
                    invalid_api_key)
  not_found         404 invalid_request_error (code         404 not_found_error
                    model_not_found for models)
  too_large         413 invalid_request_error               413 request_too_large
  media_type        415 invalid_request_error               415 invalid_request_error
  loading           503 server_error                        503 overloaded_error
  overloaded        503 server_error                        503 overloaded_error
  unavailable       503 server_error                        529 overloaded_error
  server_error      500 server_error                        500 api_error
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pydantic

OPENAI_STATUS_TYPE = {
    "invalid_request": (400, "invalid_request_error"),
    "context_length": (400, "invalid_request_error"),
    "authentication": (401, "invalid_request_error"),
    "not_found": (404, "invalid_request_error"),
    "too_large": (413, "invalid_request_error"),
    "media_type": (415, "invalid_request_error"),
    "loading": (503, "server_error"),
    "overloaded": (503, "server_error"),
    "unavailable": (503, "server_error"),
    "server_error": (500, "server_error"),
}
ANTHROPIC_STATUS_TYPE = {
    "invalid_request": (400, "invalid_request_error"),
    "context_length": (400, "invalid_request_error"),
    "authentication": (401, "authentication_error"),
    "not_found": (404, "not_found_error"),
    "too_large": (413, "request_too_large"),
    "media_type": (415, "invalid_request_error"),
    "loading": (503, "overloaded_error"),
    "overloaded": (503, "overloaded_error"),
    "unavailable": (529, "overloaded_error"),
    "server_error": (500, "api_error"),
}


@dataclasses.dataclass
class ApiError(Exception):
    """An error answered to the client; `kind` is a key of the tables above."""

    kind: str
    message: str
    param: str | None = None  # OpenAI's `param` (the offending field), when known
    code: str | None = None  # OpenAI's `code`, when it has one
    retry_after: int | None = None  # seconds, sent as Retry-After (the server is loading, or its queue is full)

    def __str__(self) -> str:
        return self.message


class ClientGone(Exception):
    """The client disconnected before its answer was ready; its engine request was cancelled."""


def is_anthropic(path: str) -> bool:
    """Whether a request path belongs to the Anthropic protocol (its errors take Anthropic's shape)."""
    return path.startswith("/v1/messages")


def openai_error(error: ApiError) -> tuple[int, dict[str, Any]]:
    status, kind = OPENAI_STATUS_TYPE[error.kind]
    code = error.code or {"context_length": "context_length_exceeded", "authentication": "invalid_api_key"}.get(
        error.kind
    )
    return status, {"error": {"message": error.message, "type": kind, "param": error.param, "code": code}}


def anthropic_error(error: ApiError) -> tuple[int, dict[str, Any]]:
    status, kind = ANTHROPIC_STATUS_TYPE[error.kind]
    return status, {"type": "error", "error": {"type": kind, "message": error.message}}


def validation_error(error: pydantic.ValidationError) -> ApiError:
    """A request body that failed its schema, as one 400 naming every bad field (`a.0.b: why`)."""
    problems = []
    for item in error.errors(include_url=False):
        location = ".".join(str(part) for part in item["loc"])
        message = item["msg"].removeprefix("Value error, ")  # our validators' own words
        problems.append(f"{location}: {message}" if location else message)
    first = error.errors(include_url=False)[0]["loc"] if error.error_count() else ()
    param = "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else str(p)) for i, p in enumerate(first))
    return ApiError("invalid_request", "; ".join(problems), param=param or None)


def refuse_unsupported(data: Any, fields: dict[str, Any]) -> Any:
    """`data` (a request body, before validation) unless it sends one of `fields`, which the server does not
    implement, at other than its neutral value (an empty list or string counts as None): a field that would change
    the answer is refused, never ignored. Raises ValueError, which validation answers as a 400."""
    if isinstance(data, dict):
        for name, neutral in fields.items():
            if name in data and data[name] != neutral and not (neutral is None and data[name] in ([], "")):
                raise ValueError(f"{name} is not supported by this server (send it as {json.dumps(neutral)} "
                                 f"or leave it out)")
    return data
