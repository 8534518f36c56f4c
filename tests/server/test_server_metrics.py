"""GET /health and GET /metrics: the Prometheus exposition of requests by status, token counters, the latency
histograms, and the engine's published stats (requests running and waiting, KV and snapshot occupancy, prefix-cache
hits)."""

from __future__ import annotations

import re

import httpx
import pytest

from ninfer_jax.runtime.request import Metrics
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


def test_metrics_count_requests_tokens_and_latencies_and_read_the_engines_published_stats(server, oai, engine):
    for _ in range(2):
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}])
    httpx.get(f"{server.url}/v1/nothing-here")
    response = httpx.get(f"{server.url}/metrics")
    assert response.headers["content-type"].startswith("text/plain; version=")
    samples = _samples(response.text)
    generated = len(engine.tokenizer.encode(engine.default_text))
    assert samples['ninfer_requests_total{endpoint="/v1/chat/completions",status="200"}'] == 2
    assert samples['ninfer_requests_total{endpoint="unmatched",status="404"}'] == 1
    assert samples['ninfer_request_finish_total{reason="stop"}'] == 2
    assert samples["ninfer_prompt_tokens_total"] == sum(p.num_tokens for p in engine.prompts)
    assert samples["ninfer_generation_tokens_total"] == 2 * generated
    assert samples["ninfer_cached_tokens_total"] == sum(engine.cached)
    for histogram in ("time_to_first_token", "e2e_request_latency"):
        assert samples[f'ninfer_{histogram}_seconds_bucket{{le="+Inf"}}'] == 2
    # each token after a request's first is one inter-token interval; the scripted engine gives no queue time
    assert samples["ninfer_inter_token_latency_seconds_count"] == 2 * (generated - 1)
    assert samples["ninfer_request_queue_time_seconds_count"] == 0
    # the engine's published stats: the scripted engine's 8 pages, none held, and its prefix cache counters
    assert samples["ninfer_num_requests_running"] == 0 and samples["ninfer_num_requests_waiting"] == 0
    assert samples['ninfer_kv_cache_pages{state="free"}'] == samples["ninfer_kv_cache_capacity_pages"] == 8
    assert samples["ninfer_kv_cache_usage_perc"] == 0
    assert samples["ninfer_server_ready"] == 1 and samples["ninfer_server_requests_in_flight"] == 0


def test_every_family_is_declared_once_with_help_and_type_and_the_rates_follow_the_stats():
    metrics = ServerMetrics()
    metrics.observe_response("/v1/messages", 200)
    metrics.observe_finish("length", 10, 3, 0, Metrics(ttft_s=0.2, latency_s=0.5, queue_s=0.01))
    metrics.observe_tokens(2, 0.03)
    stats = {"requests": {"running": 3, "waiting": 5, "requests_preempted": 2}, "tokens": {"prompt": 300},
             "pages": {"free": 2, "active": 5, "cached": 2, "filling": 1, "capacity": 10},
             "prefix_cache": {"reuse_tokens": 100, "snapshot_slots": {"free": 1, "active": 0, "cached": 4,
                                                                       "filling": 0, "capacity": 5},
                              "host_tier": True, "host_slabs": {"free": 7, "node": 1, "capacity": 8}},
             "speculative": {"drafted": 30, "accepted": 21, "accept_length_histogram": {1: 2, 2: 3, 3: 1, 4: 4},
                             "verify_rounds": 7, "plain_rounds": 64},
             "vision": {"images_encoded": 6, "image_cache_hits": 2, "image_tokens_encoded": 600, "cached_images": 3,
                        "cached_tokens": 300, "capacity_tokens": 4096, "evictions": 1},
             "compiles_since_warmup": 0, "failed": None, "stats_age_s": 0.1}
    metrics.watch_engine(lambda: stats, lambda: 8)
    text = metrics.render().decode()
    declared = re.findall(r"^# TYPE (\S+) (\S+)$", text, flags=re.M)
    names = [name for name, _ in declared]
    assert len(names) == len(set(names))
    for line in text.splitlines():
        if not line.startswith("#"):
            family = re.match(r"[a-z0-9_]+", line).group(0)
            assert any(family == n or family.startswith(n + "_") for n in names), line
    samples = _samples(text)
    assert samples['ninfer_time_to_first_token_seconds_bucket{le="0.25"}'] == 1
    assert samples['ninfer_time_to_first_token_seconds_bucket{le="0.1"}'] == 0
    assert samples['ninfer_inter_token_latency_seconds_bucket{le="0.01"}'] == 0
    assert samples['ninfer_inter_token_latency_seconds_bucket{le="0.025"}'] == 2  # 0.015 s each
    assert samples["ninfer_kv_cache_usage_perc"] == 0.6  # active + filling of 10
    assert samples["ninfer_prefix_cache_queries_total"] == 400 and samples["ninfer_prefix_cache_hits_total"] == 100
    assert samples["ninfer_prefix_cache_hit_rate"] == 0.25
    assert samples['ninfer_snapshot_slots{state="cached"}'] == 4
    assert samples['ninfer_host_cache_slabs{state="node"}'] == 1
    assert samples["ninfer_num_requests_waiting"] == 5 and samples["ninfer_server_requests_in_flight"] == 8
    assert samples["ninfer_num_preemptions_total"] == 2
    assert samples["ninfer_spec_decode_num_drafts_total"] == 10
    assert samples["ninfer_spec_decode_num_draft_tokens_total"] == 30
    assert samples["ninfer_spec_decode_num_accepted_tokens_total"] == 21
    assert samples['ninfer_spec_decode_accept_length_total{length="4"}'] == 4
    assert samples['ninfer_spec_decode_rounds_total{kind="verify"}'] == 7
    assert samples['ninfer_spec_decode_rounds_total{kind="plain"}'] == 64
    assert samples["ninfer_vision_images_encoded_total"] == 6 and samples["ninfer_vision_encoder_cache_hits_total"] == 2
    assert samples["ninfer_vision_encoder_cache_tokens"] == 300
    assert "failed" not in text
