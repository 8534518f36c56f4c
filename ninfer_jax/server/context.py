"""What every handler shares: the engine, the server's metrics, the API key, and whether it is stopping."""

from __future__ import annotations

import dataclasses
import hmac
from typing import Any

from fastapi import Request

from .errors import ApiError
from .metrics import ServerMetrics


@dataclasses.dataclass
class ServerContext:
    engine: Any  # ninfer_jax.Engine, or any object with its surface
    api_key: str | None = None
    metrics: ServerMetrics = dataclasses.field(default_factory=ServerMetrics)
    stopping: bool = False  # set when the orderly stop begins; /health reports it

    def authorize(self, request: Request) -> None:
        """Accepts `Authorization: Bearer KEY` (OpenAI) or `x-api-key: KEY` (Anthropic) on every API route."""
        if self.api_key is None:
            return
        bearer = request.headers.get("authorization", "")
        offered = bearer[7:].strip() if bearer.lower().startswith("bearer ") else request.headers.get("x-api-key")
        if offered is None or not hmac.compare_digest(offered.encode(), self.api_key.encode()):
            raise ApiError("authentication", "invalid or missing API key" if offered is None else
                           "incorrect API key provided")


def context(request: Request) -> ServerContext:
    """The context of the app serving `request`, after checking its API key."""
    ctx: ServerContext = request.app.state.context
    ctx.authorize(request)
    return ctx
