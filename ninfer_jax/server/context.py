"""What every handler shares: the engine (once built), its startup, the request limits and image options, the
tokenizing threads, the server's metrics, the API key, the bounded request queue, and whether it is stopping."""

from __future__ import annotations

import dataclasses
import hmac
from typing import Any

from fastapi import Request

from .errors import ApiError
from .frontend_pool import FrontendPool
from .images import ImageOptions
from .limits import Limits, RequestQueue
from .metrics import ServerMetrics
from .readiness import Startup

RETRY_AFTER_S = 5  # what a 503 during startup tells clients to wait


@dataclasses.dataclass
class ServerContext:
    engine: Any = None  # ninfer_jax.Engine, or any object with its surface; None until `attach`
    api_key: str | None = None
    limits: Limits = dataclasses.field(default_factory=Limits)
    images: ImageOptions = dataclasses.field(default_factory=ImageOptions)
    metrics: ServerMetrics = dataclasses.field(default_factory=ServerMetrics)
    startup: Startup = dataclasses.field(default_factory=Startup)
    frontend: FrontendPool = dataclasses.field(default_factory=FrontendPool)
    stopping: bool = False  # set when the orderly stop begins; /health reports it
    default_thinking: bool = True  # --default-thinking: OpenAI-protocol requests think unless they say otherwise
    served_model_names: tuple[str, ...] = ()  # --served-model-name; none: the checkpoint's name
    queue: RequestQueue = dataclasses.field(init=False)  # engine requests in flight, bounded (--max-waiting-requests)

    def __post_init__(self) -> None:
        self.queue = RequestQueue(self.limits.max_waiting_requests)
        if self.engine is not None:
            self._size_frontend()

    @property
    def model_names(self) -> tuple[str, ...]:
        """The names requests may give (the first is the one responses report), vLLM's --served-model-name."""
        return self.served_model_names or (self.engine.model_name,)

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    def enter_queue(self, count: int) -> None:
        """Takes `count` places in the request queue for the engine's lanes (raises ApiError when it is full)."""
        self.queue.enter(count, self.engine.published_stats()["slots"]["active"])

    def attach(self, engine: Any) -> None:
        """The engine is built: the server is ready (called from the startup thread)."""
        self.engine = engine
        self._size_frontend()

    def _size_frontend(self) -> None:
        """The tokenizing threads' queue holds at least what the request queue admits, so a burst the engine would
        queue is not refused before it is tokenized (256 clients at once against 66 places: 190 refused)."""
        lanes = self.engine.published_stats()["slots"]["active"]
        self.frontend.max_waiting = max(self.frontend.max_waiting, self.queue.bound(lanes) - self.frontend.workers)

    def ready_engine(self) -> Any:
        """The engine. Raises ApiError (503 with Retry-After) while it is still being built, or never will be."""
        engine = self.engine
        if engine is not None:
            return engine
        if self.startup.error is not None:
            raise ApiError("server_error", f"the model could not be loaded: {self.startup.error}")
        raise ApiError("loading", f"the model is loading ({self.startup.summary()}); retry in a few seconds",
                       retry_after=RETRY_AFTER_S)

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
