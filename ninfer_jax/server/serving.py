"""Runs the app under uvicorn with the orderly stop of spec §5.5.

On SIGTERM or Ctrl+C the server (1) stops accepting connections, (2) calls `engine.stop()`, which
ends running and queued requests as "unavailable" at the next unit boundary — their clients get
OpenAI 503 / Anthropic 529 overloaded_error, or an error event inside a stream — and (3) exits once
those answers are out. A second Ctrl+C exits at once. Unlike plain uvicorn, it does not re-raise the
signal afterwards, so an orderly stop exits with status 0.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from collections.abc import Callable
from types import FrameType
from typing import Any

import uvicorn

from .context import ServerContext

log = logging.getLogger("ninfer_jax.server")


class OrderlyServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, ctx: ServerContext, *, stop_engine: bool = True):
        super().__init__(config)
        self.ctx = ctx
        self.stop_engine = stop_engine  # False where the engine outlives the server (tests share one)
        self.on_listening: Callable[[], None] | None = None  # called once the sockets listen (cli: build the engine)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and self.on_listening is not None:
            self.on_listening()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit and sig == signal.SIGINT:
            log.warning("second interrupt | exiting now")
            self.force_exit = True
        else:
            log.info("stopping | %s | no new connections; in-flight requests end as unavailable",
                     signal.Signals(sig).name)
            self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:
            server.close()  # stop accepting first
        self.ctx.stopping = True
        engine = self.ctx.engine  # None when stopped during startup
        if self.stop_engine and engine is not None:
            await asyncio.to_thread(engine.stop)
        self.ctx.frontend.shutdown()
        await super().shutdown(sockets)
        log.info("stopped | %d responses served", self.ctx.metrics.responses)


def server_config(app: Any, host: str, port: int, **kwargs: Any) -> uvicorn.Config:
    """uvicorn settings for the API: our logging, no access log, a short grace period for idle keep-alives."""
    kwargs.setdefault("timeout_graceful_shutdown", 30)
    return uvicorn.Config(app, host=host, port=port, log_config=None, access_log=False, lifespan="off", **kwargs)

