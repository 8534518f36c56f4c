"""A client that leaves while its prompt is prefilled gets its request cancelled at once: the engine (the real
tiny model) stops it within a pass, before the whole prompt is computed, and serves the next request."""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlsplit

import httpx
import numpy as np
import pytest

from server_support import real_engine, server, wait_for  # noqa: F401 (fixtures)

PROMPT_TOKENS = 1900  # 8 passes of the tests' 256-token prefill chunk


@pytest.fixture(scope="module")
def engine():
    return real_engine()


def _prompt(seed: int, vocab: int) -> list[int]:
    """Token ids no earlier prompt shares a prefix with (nothing is reused from the cache)."""
    return np.random.default_rng(seed).integers(1000, vocab, PROMPT_TOKENS).tolist()


def _counters(engine) -> tuple[int, int]:
    stats = engine.stats()
    return stats["tokens"]["prompt"], stats["requests"].get("finished_cancelled", 0)


@pytest.mark.parametrize("stream", [False, True], ids=["blocking", "streaming"])
def test_a_client_leaving_mid_prefill_cancels_it_before_the_prompt_is_computed(server, engine, stream):
    model, vocab = engine.model_name, engine.config.vocab_size
    warm = httpx.post(f"{server.url}/v1/completions", timeout=300, json={
        "model": model, "prompt": _prompt(100 + stream, vocab), "max_tokens": 1})  # compiles the passes first
    assert warm.status_code == 200, warm.text
    prompt_before, cancelled_before = _counters(engine)

    body = json.dumps({"model": model, "prompt": _prompt(200 + stream, vocab), "max_tokens": 4,
                       "stream": stream}).encode()
    url = urlsplit(server.url)
    client = socket.create_connection((url.hostname, url.port), timeout=30)
    client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    wait_for(lambda: _counters(engine)[0] > prompt_before, timeout=60, interval=0.01)  # its first pass ran
    started = time.monotonic()
    health = httpx.get(f"{server.url}/health", timeout=5)
    assert health.status_code == 200 and time.monotonic() - started < 2.0
    client.close()

    wait_for(lambda: _counters(engine)[1] == cancelled_before + 1, timeout=60, interval=0.01)
    prompt_after, _ = _counters(engine)
    assert 0 < prompt_after - prompt_before < PROMPT_TOKENS
    after = httpx.post(f"{server.url}/v1/completions", timeout=120,
                       json={"model": model, "prompt": "Next request", "max_tokens": 2})
    assert after.status_code == 200 and after.json()["choices"][0]["finish_reason"] == "length"
