"""Runs the app under uvicorn with the orderly stop of spec §5.5.

On SIGTERM or Ctrl+C the server (1) stops accepting connections, (2) calls `engine.stop()`, which
ends running and queued requests as "unavailable" at the next unit boundary — their clients get
OpenAI 503 / Anthropic 529 overloaded_error, or an error event inside a stream — and (3) exits once
those answers are out; `engine.stop()` then saves the prefix cache file. A second Ctrl+C exits at once: it abandons
that save (the previous file stays) and waits at most SAVE_ABANDON_WAIT_S for the stop to end. Unlike plain uvicorn,
it does not re-raise the signal afterwards, so an orderly stop exits with status 0.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import uvicorn

from .context import ServerContext

log = logging.getLogger("ninfer_jax.server")
SAVE_ABANDON_WAIT_S = 2.0  # after a second Ctrl+C, for the save to delete its temporary file (spec §5.5)


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
            log.warning("second interrupt | exiting now; a prefix cache save in progress is abandoned")
            self.force_exit = True
            if self.ctx.engine is not None:
                self.ctx.engine.abandon_save()
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
            await self._stop_engine(engine)
        self.ctx.frontend.shutdown()
        await super().shutdown(sockets)
        log.info("stopped | %d responses served", self.ctx.metrics.responses)

    async def _stop_engine(self, engine) -> None:
        """Runs engine.stop() on a daemon thread until it ends, or until SAVE_ABANDON_WAIT_S after a second
        interrupt: the process then exits without it."""
        stopped, failure = threading.Event(), []

        def stop():
            try:
                engine.stop()
            except BaseException as e:  # raised in the server's task below
                failure.append(e)
            finally:
                stopped.set()

        threading.Thread(target=stop, name="ninfer-stop", daemon=True).start()
        deadline = None
        while not stopped.is_set():
            if self.force_exit and deadline is None:
                deadline = time.monotonic() + SAVE_ABANDON_WAIT_S
            if deadline is not None and time.monotonic() > deadline:
                log.warning("exiting | the engine's stop did not end within %.0f s", SAVE_ABANDON_WAIT_S)
                return
            await asyncio.sleep(0.05)
        if failure:
            raise failure[0]


def server_config(app: Any, host: str, port: int, **kwargs: Any) -> uvicorn.Config:
    """uvicorn settings for the API: our logging, no access log, a short grace period for idle keep-alives."""
    kwargs.setdefault("timeout_graceful_shutdown", 30)
    return uvicorn.Config(app, host=host, port=port, log_config=None, access_log=False, lifespan="off", **kwargs)

