"""The engine's startup as the server sees it: built in a thread while the server already answers, its progress
for the readiness endpoint, and a log line as each stage ends.

`Engine.from_pretrained(progress=...)` reports ("loading", layers done, layers), ("compiling", programs done,
programs), ("restoring", 0|1, 1), then ("ready", 1, 1). The server is ready once the engine is attached to the
context (`ServerContext.attach`), which happens after from_pretrained returns. A stop during startup abandons
the build (cli.py exits without waiting for it).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("ninfer_jax.server")

UNITS = {"loading": "layers", "compiling": "programs", "restoring": "prefix cache file"}


@dataclasses.dataclass
class Startup:
    """Written by the build thread (`progress`, `fail`), read by the event loop: single attribute writes."""

    stage: str = "starting"
    done: int = 0
    total: int = 0
    error: str | None = None  # why the engine could not be built
    began: float = dataclasses.field(default_factory=time.monotonic)
    stage_began: float = dataclasses.field(default_factory=time.monotonic)
    reported: float = dataclasses.field(default_factory=time.monotonic)  # the last report's time

    def progress(self, stage: str, done: int, total: int) -> None:
        """The engine's progress callback. Logs each stage as it completes."""
        now = time.monotonic()
        if stage != self.stage:  # it began when the previous stage's last report came
            self.stage, self.stage_began = stage, self.reported
        self.done, self.total, self.reported = done, total, now
        if stage == "ready":
            log.info("startup | ready | %.1f s", now - self.began)
        elif done == total and stage in UNITS:
            log.info("startup | %s | %d/%d %s | %.1f s", stage, done, total, UNITS[stage], now - self.stage_began)

    def fail(self, error: str) -> None:
        self.error = error

    def describe(self) -> dict[str, Any]:
        """The readiness endpoint's body while the engine is not attached."""
        if self.error is not None:
            return {"status": "failed", "error": self.error}
        return {"status": "loading", "stage": self.stage, "done": self.done, "total": self.total,
                "unit": UNITS.get(self.stage, ""), "elapsed_s": round(time.monotonic() - self.began, 1)}

    def summary(self) -> str:
        """The stage in words, for a 503's message: "compiling, 3/12 programs"."""
        unit = UNITS.get(self.stage)
        return f"{self.stage}, {self.done}/{self.total} {unit}" if unit and self.total else self.stage


def build_in_background(build: Callable[[Callable[[str, int, int], None]], Any], startup: Startup,
                        on_ready: Callable[[Any], None], on_failure: Callable[[str], None]) -> threading.Thread:
    """Runs `build(progress)` in a daemon thread; then `on_ready(engine)`, or `on_failure(message)` when it
    raised. Both are called from that thread."""
    def run() -> None:
        try:
            engine = build(startup.progress)
        except Exception as error:  # options the engine refuses, a checkpoint it cannot serve, a device error
            message = f"{type(error).__name__}: {error}" if not isinstance(error, ValueError) else str(error)
            startup.fail(message)
            log.error("cannot start | %s", message)
            on_failure(message)
            return
        on_ready(engine)

    thread = threading.Thread(target=run, name="ninfer-startup", daemon=True)
    thread.start()
    return thread
