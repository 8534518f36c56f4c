"""The FastAPI application: OpenAI and Anthropic routes, /health (liveness), /health/ready (readiness), /metrics,
and errors in each protocol's shape.

An error's shape follows the request path: /v1/messages* answers as Anthropic, every other path as
OpenAI (errors.py). That covers FastAPI's own errors too (unknown route 404, wrong method 405, request
validation), which never reach a client in FastAPI's default `{"detail": ...}` shape, and any unhandled error
(a 500 that leaves the connection usable).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from . import anthropic_routes, openai_routes, responses
from .context import RETRY_AFTER_S, ServerContext
from .errors import ApiError, ClientGone, anthropic_error, is_anthropic, openai_error
from .images import ImageOptions
from .limits import Limits
from .metrics import CONTENT_TYPE

log = logging.getLogger("ninfer_jax.server")

_HTTP_KINDS = {401: "authentication", 404: "not_found", 503: "unavailable"}


def create_app(engine: Any = None, *, api_key: str | None = None, limits: Limits | None = None,
               images: ImageOptions | None = None, allowed_origins: Sequence[str] = (),
               default_thinking: bool = True, served_model_names: Sequence[str] = ()) -> FastAPI:
    """The server for `engine` (an ninfer_jax.Engine; None: attached later, `ServerContext.attach`, and until
    then generation answers 503). `api_key`: required on the API routes when set. `limits`: the request
    bounds. `images`: the bounds on image parts and whether image URLs are fetched. `allowed_origins`: web origins
    allowed to call the API from a browser (CORS; none by default).
    `default_thinking`: whether OpenAI-protocol requests think when they do not say. `served_model_names`: the
    names requests may give, the first reported (none: the checkpoint's name)."""
    app = FastAPI(title="ninfer-jax", docs_url=None, redoc_url=None, openapi_url=None)
    ctx = ServerContext(engine, api_key, limits or Limits(), images or ImageOptions(),
                        default_thinking=default_thinking, served_model_names=tuple(served_model_names))
    ctx.metrics.watch_engine(lambda: ctx.engine.published_stats() if ctx.engine is not None else None,
                             lambda: ctx.queue.in_flight)
    app.state.context = ctx
    app.include_router(openai_routes.router)
    app.include_router(anthropic_routes.router)
    app.include_router(responses.router)

    # Health and metrics run on the event loop and read only what the engine's thread published: they answer
    # at once however busy that thread is, and use no pool that other requests could fill.
    @app.get("/health")
    async def health() -> JSONResponse:
        """Liveness: 200 while the process serves (loading included); 503 once stopping or failed."""
        return _probe(ctx, readiness=False)

    @app.get("/health/ready")
    async def ready() -> JSONResponse:
        """Readiness: 200 once the engine serves; 503 with the startup's stage and progress until then."""
        return _probe(ctx, readiness=True)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE)

    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, error: ApiError) -> Response:
        return error_response(request.url.path, error)

    @app.exception_handler(ClientGone)
    async def on_client_gone(request: Request, error: ClientGone) -> Response:
        log.info("client disconnected | cancelled %s", error)
        return Response(status_code=499)  # nobody reads it; the status lands in the metrics

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, error: RequestValidationError) -> Response:
        return error_response(request.url.path, ApiError("invalid_request", str(error)))

    @app.exception_handler(HTTPException)
    async def on_http_error(request: Request, error: HTTPException) -> Response:
        kind = _HTTP_KINDS.get(error.status_code, "invalid_request")
        response = error_response(request.url.path,
                                  ApiError(kind, f"{request.method} {request.url.path}: {error.detail}"))
        if error.status_code not in _HTTP_KINDS:
            response.status_code = error.status_code  # e.g. 405, in the protocol's shape
        return response

    app.add_middleware(_AnswerUnhandled)
    app.add_middleware(_CountResponses, ctx=ctx)
    if allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["*"])
    return app


def error_response(path: str, error: ApiError) -> JSONResponse:
    """`error` in the shape of the protocol `path` belongs to."""
    status, body = (anthropic_error if is_anthropic(path) else openai_error)(error)
    headers = {"Retry-After": str(error.retry_after)} if error.retry_after is not None else {}
    if error.kind == "too_large":
        headers["Connection"] = "close"  # the rest of the body is not read: the connection cannot carry another
    return JSONResponse(body, status_code=status, headers=headers)


def _probe(ctx: ServerContext, readiness: bool) -> JSONResponse:
    """A health endpoint's answer: 503 when stopping or failed; while loading, 200 (liveness) or 503 with the
    startup's progress (readiness)."""
    failed = ctx.startup.error or (ctx.engine.published_stats().get("failed") if ctx.engine is not None else None)
    if ctx.stopping or failed:
        body = {"status": "stopping"} if ctx.stopping else {"status": "failed", "error": failed}
        return JSONResponse(body, status_code=503)
    if ctx.engine is None:
        if not readiness:
            return JSONResponse({"status": "loading", "stage": ctx.startup.stage})
        return JSONResponse(ctx.startup.describe(), status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})
    return JSONResponse({"status": "ready" if readiness else "ok", "model": ctx.model_name})


class _AnswerUnhandled:
    """ASGI middleware: an exception no handler took becomes a 500 in the protocol's shape, answered here so that
    the connection stays usable (an exception that reaches the server closes the connection). A response that
    already started (a stream) cannot be answered again: its exception goes on, and the connection closes."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as error:
            log.exception("unhandled error | %s %s", scope.get("method"), scope.get("path"))
            if started:
                raise
            response = error_response(scope.get("path", ""), ApiError(
                "server_error", f"internal error: {type(error).__name__}"))
            await response(scope, receive, send)


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
