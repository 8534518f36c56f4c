"""The FastAPI application: OpenAI and Anthropic routes, /health, /metrics, and errors in each protocol's shape.

An error's shape follows the request path: /v1/messages* answers as Anthropic, every other path as
OpenAI (errors.py). That covers FastAPI's own errors too (unknown route 404, wrong method 405, request
validation), which never reach a client in FastAPI's default `{"detail": ...}` shape.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from . import anthropic_routes, openai_routes
from .context import ServerContext
from .errors import ApiError, ClientGone, anthropic_error, is_anthropic, openai_error
from .metrics import CONTENT_TYPE

log = logging.getLogger("ninfer_jax.server")

_HTTP_KINDS = {401: "authentication", 404: "not_found", 503: "unavailable"}


def create_app(engine: Any, *, api_key: str | None = None) -> FastAPI:
    """The server for `engine` (an ninfer_jax.Engine). `api_key`: required on the API routes when set."""
    app = FastAPI(title="ninfer-jax", docs_url=None, redoc_url=None, openapi_url=None)
    ctx = ServerContext(engine, api_key)
    app.state.context = ctx
    app.include_router(openai_routes.router)
    app.include_router(anthropic_routes.router)

    @app.get("/health")
    async def health() -> JSONResponse:
        if ctx.stopping:
            return JSONResponse({"status": "stopping"}, status_code=503)
        stats = await asyncio.to_thread(engine.stats)
        if stats.get("failed"):
            return JSONResponse({"status": "failed", "error": stats["failed"]}, status_code=503)
        return JSONResponse({"status": "ok", "model": engine.model_name})

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        stats = await asyncio.to_thread(engine.stats)
        return PlainTextResponse(ctx.metrics.render(stats), media_type=CONTENT_TYPE)

    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, error: ApiError) -> Response:
        return _error_response(request, error)

    @app.exception_handler(ClientGone)
    async def on_client_gone(request: Request, error: ClientGone) -> Response:
        log.info("client disconnected | cancelled %s", error)
        return Response(status_code=499)  # nobody reads it; the status lands in the metrics

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, error: RequestValidationError) -> Response:
        return _error_response(request, ApiError("invalid_request", str(error)))

    @app.exception_handler(HTTPException)
    async def on_http_error(request: Request, error: HTTPException) -> Response:
        kind = _HTTP_KINDS.get(error.status_code, "invalid_request")
        response = _error_response(request, ApiError(kind, f"{request.method} {request.url.path}: {error.detail}"))
        if error.status_code not in _HTTP_KINDS:
            response.status_code = error.status_code  # e.g. 405, in the protocol's shape
        return response

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, error: Exception) -> Response:
        log.exception("unhandled error | %s %s", request.method, request.url.path)
        return _error_response(request, ApiError("server_error", f"internal error: {type(error).__name__}"))

    app.add_middleware(_CountResponses, ctx=ctx)
    return app


def _error_response(request: Request, error: ApiError) -> JSONResponse:
    status, body = (anthropic_error if is_anthropic(request.url.path) else openai_error)(error)
    return JSONResponse(body, status_code=status)


class _CountResponses:
    """ASGI middleware: counts every HTTP response by endpoint and status (a client that left counts as
    499). Pure ASGI, so streaming and disconnect detection pass through untouched."""

    def __init__(self, app: ASGIApp, ctx: ServerContext):
        self.app, self.ctx = app, ctx

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = [499]

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except Exception:
            status[0] = 500  # answered by the outermost error middleware
            raise
        finally:
            route = scope.get("route")
            endpoint = getattr(route, "path", None) or "unmatched"
            self.ctx.metrics.observe_response(endpoint, status[0])
