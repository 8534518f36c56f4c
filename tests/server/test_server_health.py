"""Liveness (/health), readiness (/health/ready) and /metrics answered from the event loop: during startup with
its stage and progress, once the engine serves, and after it failed; never through the engine's thread."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import httpx
import pytest

from ninfer_jax.server.cli import main
from ninfer_jax.server.errors import ApiError
from ninfer_jax.server.frontend_pool import FrontendPool
from ninfer_jax.server.readiness import Startup
from server_support import LiveServer, ScriptedEngine

MODEL = ScriptedEngine.model_name
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}


class BusyEngine(ScriptedEngine):
    """An engine whose thread never answers: stats() blocks (as behind a long prefill)."""

    def __init__(self, failed: str | None = None):
        super().__init__()
        self.failed = failed

    def stats(self) -> dict:
        time.sleep(60)
        raise AssertionError("stats() was called")

    def published_stats(self) -> dict:
        return {**ScriptedEngine.stats(self), "requests": {"running": 1, "waiting": 0}, "failed": self.failed,
                "stats_age_s": 0.1}


def test_readiness_reports_the_startup_until_the_engine_is_attached():
    with LiveServer(None) as live:
        ctx = live.context
        assert httpx.get(f"{live.url}/health").json() == {"status": "loading", "stage": "starting"}
        ctx.startup.progress("compiling", 3, 12)
        ready = httpx.get(f"{live.url}/health/ready")
        assert ready.status_code == 503 and ready.headers["retry-after"] == "5"
        assert {k: v for k, v in ready.json().items() if k != "elapsed_s"} == {
            "status": "loading", "stage": "compiling", "done": 3, "total": 12, "unit": "programs"}
        chat = httpx.post(f"{live.url}/v1/chat/completions", json=CHAT)
        assert chat.status_code == 503 and chat.headers["retry-after"] == "5"
        assert chat.json()["error"]["message"] == ("the model is loading (compiling, 3/12 programs); retry in a few "
                                                   "seconds")
        message = httpx.post(f"{live.url}/v1/messages", json={**CHAT, "max_tokens": 4})
        assert message.status_code == 503 and message.json()["error"]["type"] == "overloaded_error"
        assert httpx.get(f"{live.url}/v1/models").status_code == 503
        assert "ninfer_server_ready 0.0" in httpx.get(f"{live.url}/metrics").text

        ctx.attach(ScriptedEngine())
        assert httpx.get(f"{live.url}/health/ready").json() == {"status": "ready", "model": MODEL}
        assert httpx.get(f"{live.url}/health").json() == {"status": "ok", "model": MODEL}
        assert httpx.post(f"{live.url}/v1/chat/completions", json=CHAT).status_code == 200
        assert "ninfer_server_ready 1.0" in httpx.get(f"{live.url}/metrics").text


def test_health_and_metrics_answer_at_once_while_the_engines_thread_is_busy():
    with LiveServer(BusyEngine()) as live:
        started = time.monotonic()
        health = httpx.get(f"{live.url}/health", timeout=5)
        metrics = httpx.get(f"{live.url}/metrics", timeout=5)
        assert time.monotonic() - started < 2.0
    assert health.json() == {"status": "ok", "model": MODEL}
    assert "ninfer_num_requests_running 1.0" in metrics.text and "ninfer_engine_stats_age_seconds 0.1" in metrics.text


def test_a_failed_engine_is_503_on_both_probes():
    with LiveServer(BusyEngine(failed="RuntimeError: device lost")) as live:
        for path in ("/health", "/health/ready"):
            response = httpx.get(f"{live.url}{path}", timeout=5)
            assert response.status_code == 503
            assert response.json() == {"status": "failed", "error": "RuntimeError: device lost"}


def test_startup_logs_a_line_per_stage_with_its_numbers(caplog):
    startup = Startup()
    with caplog.at_level(logging.INFO, logger="ninfer_jax.server"):
        for stage, done, total in [*[("loading", i, 8) for i in range(1, 9)], ("compiling", 1, 2),
                                   ("compiling", 2, 2), ("restoring", 0, 1), ("restoring", 1, 1), ("ready", 1, 1)]:
            startup.progress(stage, done, total)
    lines = [record.getMessage().rsplit(" | ", 1)[0] for record in caplog.records]
    assert lines == ["startup | loading | 8/8 layers", "startup | compiling | 2/2 programs",
                     "startup | restoring | 1/1 prefix cache file", "startup | ready"]


def test_an_engine_that_cannot_be_built_ends_the_server_with_status_2(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="ninfer_jax.server"):
        status = main([str(tmp_path / "missing"), "--port", "0", "--compile-cache-dir", "none"])
    messages = [record.getMessage() for record in caplog.records]
    assert status == 2
    assert any(m.startswith("listening | ") for m in messages)
    assert any(m.startswith("cannot start | ") and "missing" in m for m in messages)


def test_the_tokenizing_pool_drops_calls_whose_request_left_and_refuses_past_its_queue():
    async def scenario() -> tuple[list[str], str]:
        pool = FrontendPool(workers=1, max_waiting=1)
        release, ran = threading.Event(), []
        blocking = asyncio.ensure_future(pool.run(lambda: release.wait(10) and ran.append("first")))
        await asyncio.sleep(0.05)
        waiting = asyncio.ensure_future(pool.run(ran.append, "abandoned"))
        await asyncio.sleep(0.05)
        with pytest.raises(ApiError) as refused:
            await pool.run(ran.append, "over the queue")
        waiting.cancel()  # its client left before a thread took it
        await asyncio.gather(waiting, return_exceptions=True)  # the cancel reaches the pool's queue
        release.set()
        await blocking
        await pool.run(ran.append, "next")
        pool.shutdown()
        return ran, refused.value.kind

    ran, kind = asyncio.run(scenario())
    assert ran == ["first", "next"] and kind == "unavailable"
