"""GET /health and GET /metrics: the Prometheus exposition of requests by status, token counters, the TTFT
histogram, and the engine's own stats (prefix-cache counters, pages) as gauges."""

from __future__ import annotations

import re

import httpx
import pytest

from ninfer_jax.server.metrics import ServerMetrics
from server_support import ScriptedEngine, oai, server  # noqa: F401 (fixtures)

MODEL = ScriptedEngine.model_name


@pytest.fixture(scope="module")
def engine():
    return ScriptedEngine()



def _samples(text: str) -> dict[str, float]:
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


def test_health_reports_ok_and_the_model(server):
    response = httpx.get(f"{server.url}/health")
    assert response.status_code == 200 and response.json() == {"status": "ok", "model": MODEL}


def test_metrics_count_requests_tokens_and_time_to_first_token(server, oai, engine):
    for _ in range(2):
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}])
    httpx.get(f"{server.url}/v1/nothing-here")
    response = httpx.get(f"{server.url}/metrics")
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    samples = _samples(response.text)
    assert samples['ninfer_requests_total{endpoint="/v1/chat/completions",status="200"}'] == 2
    assert samples['ninfer_requests_total{endpoint="unmatched",status="404"}'] == 1
    assert samples['ninfer_request_finish_total{reason="stop"}'] == 2
    assert samples["ninfer_prompt_tokens_total"] == sum(p.num_tokens for p in engine.prompts)
    assert samples["ninfer_completion_tokens_total"] == 2 * len(engine.tokenizer.encode(engine.default_text))
    assert samples["ninfer_cached_tokens_total"] == sum(engine.cached)
    assert samples['ninfer_time_to_first_token_seconds_bucket{le="+Inf"}'] == 2
    assert samples["ninfer_time_to_first_token_seconds_count"] == 2
    assert samples["ninfer_prefix_cache_hits"] == 2  # engine.stats()["prefix_cache"], as gauges
    assert samples["ninfer_engine_pages_active"] == 0 and samples["ninfer_engine_pages_capacity"] == 8


def test_every_family_is_declared_once_with_help_and_type():
    metrics = ServerMetrics()
    metrics.observe_response("/v1/messages", 200)
    metrics.observe_finish("length", 10, 3, 0, 0.2)
    text = metrics.render({"prefix_cache": {"hits": 1}, "pages": {"free": 3}, "failed": None, "compiles": 2})
    declared = re.findall(r"^# TYPE (\S+) (\S+)$", text, flags=re.M)
    names = [name for name, _ in declared]
    assert len(names) == len(set(names))
    for line in text.splitlines():
        if not line.startswith("#"):
            family = re.match(r"[a-z_]+", line).group(0)
            assert any(family == n or family.startswith(n + "_") for n in names), line
    assert 'ninfer_time_to_first_token_seconds_bucket{le="0.25"} 1' in text
    assert 'ninfer_time_to_first_token_seconds_bucket{le="0.1"} 0' in text
    assert "ninfer_engine_compiles 2" in text and "failed" not in text
