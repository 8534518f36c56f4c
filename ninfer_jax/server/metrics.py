"""The server's Prometheus metrics, through prometheus_client, named after vLLM's `vllm:` series
(docs/engine_notes.md lists each).

Two sources: what the server observes of each request on the event loop (HTTP responses, finishes, token counts,
the latency histograms), and the engine's numbers (running and waiting requests, KV and snapshot occupancy, the
prefix cache's hits), read at each scrape from `engine.published_stats()`, which never waits on the engine's
thread and walks no tier.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

CONTENT_TYPE = CONTENT_TYPE_LATEST
# From a millisecond (a cached short prompt) to tens of minutes (a long prompt queued behind others).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
INTER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                       5.0, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                   120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class ServerMetrics:
    """The series the server observes, in a registry of its own (one per app). Updated on the event loop only."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.responses = 0  # HTTP responses answered, for the stop's log line
        r = self.registry
        self.requests = Counter("ninfer_requests", "HTTP responses by endpoint and status code.",
                                ["endpoint", "status"], registry=r)
        self.finished = Counter("ninfer_request_finish", "Engine requests finished, by finish reason.", ["reason"],
                                registry=r)
        self.prompt_tokens = Counter("ninfer_prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter("ninfer_generation_tokens", "Generated tokens of finished requests.",
                                         registry=r)
        self.cached_tokens = Counter("ninfer_cached_tokens", "Prompt tokens of finished requests reused from the "
                                     "prefix cache.", registry=r)
        self.ttft = Histogram("ninfer_time_to_first_token_seconds", "Time from arrival to the first generated "
                              "token (engine-measured).", buckets=TTFT_BUCKETS, registry=r)
        self.inter_token = Histogram("ninfer_inter_token_latency_seconds", "Time between successive generated "
                                     "tokens as the server receives them.", buckets=INTER_TOKEN_BUCKETS, registry=r)
        self.queue_time = Histogram("ninfer_request_queue_time_seconds", "Time from arrival to getting a lane.",
                                    buckets=REQUEST_BUCKETS, registry=r)
        self.e2e = Histogram("ninfer_e2e_request_latency_seconds", "Time from arrival to the last token.",
                             buckets=REQUEST_BUCKETS, registry=r)

    def observe_response(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()
        self.responses += 1

    def observe_tokens(self, count: int, seconds: float) -> None:
        """`count` tokens that arrived together `seconds` after the previous ones: each took seconds / count."""
        for _ in range(count):
            self.inter_token.observe(seconds / count)

    def observe_finish(self, finish_reason: str, prompt: int, completion: int, cached: int, timing: Any) -> None:
        """A request's end; `timing` is its final event's Metrics (None: it ended before the engine did)."""
        self.finished.labels(finish_reason).inc()
        self.prompt_tokens.inc(prompt)
        self.generation_tokens.inc(completion)
        self.cached_tokens.inc(cached)
        for histogram, seconds in ((self.ttft, getattr(timing, "ttft_s", None)),
                                   (self.queue_time, getattr(timing, "queue_s", None)),
                                   (self.e2e, getattr(timing, "latency_s", None))):
            if seconds is not None:
                histogram.observe(seconds)

    def watch_engine(self, published: Callable[[], Mapping[str, Any] | None], in_flight: Callable[[], int]) -> None:
        """Adds the engine's series, read at each scrape: `published()` is the engine's published stats (None
        until it is built), `in_flight()` the server's engine requests in flight."""
        self.registry.register(_EngineCollector(published, in_flight))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """The engine's series from its published stats, at scrape time."""

    def __init__(self, published: Callable[[], Mapping[str, Any] | None], in_flight: Callable[[], int]):
        self.published, self.in_flight = published, in_flight

    def describe(self) -> list[Metric]:
        return []  # names checked at scrape, not at registration (which would read the stats)

    def collect(self) -> Iterator[Metric]:
        stats = self.published()
        yield _gauge("ninfer_server_ready", "1 once the engine is loaded and serves, else 0.", stats is not None)
        yield _gauge("ninfer_server_requests_in_flight", "Engine requests the server submitted and has not seen "
                     "end (running or waiting); bounded by --max-waiting-requests.", self.in_flight())
        if stats is None:
            return
        requests, pages = stats["requests"], stats["pages"]
        cache = stats.get("prefix_cache", {})
        yield _gauge("ninfer_num_requests_running", "Requests in a lane (prefilling or decoding).",
                     requests["running"])
        yield _gauge("ninfer_num_requests_waiting", "Requests waiting for a lane or for KV pages.",
                     requests["waiting"])
        yield _counter("ninfer_num_preemptions", "Running requests put back in the queue for a lane the KV pool "
                       "could not extend; each resumes from what the prefix cache kept.",
                       requests.get("requests_preempted", 0))
        busy = pages["active"] + pages["filling"]
        yield _gauge("ninfer_kv_cache_usage_perc", "Share of the KV pages held by running requests (0 to 1).",
                     busy / pages["capacity"] if pages["capacity"] else 0.0)
        yield _by_state("ninfer_kv_cache_pages", "KV pages by owner: free, active (a lane's), cached (the prefix "
                        "cache's), filling.", pages)
        yield _gauge("ninfer_kv_cache_capacity_pages", "KV pages in the pool (64 tokens each).", pages["capacity"])
        if "snapshot_slots" in cache:
            yield _by_state("ninfer_snapshot_slots", "Device snapshot slots (saved conversation states) by owner: "
                            "free, active (a tap's staging), cached, filling.", cache["snapshot_slots"])
        if cache.get("host_tier"):
            yield _by_state("ninfer_host_cache_slabs", "Host tier slabs by content: free, node (KV blocks), image "
                            "(snapshots), tail, filling.", cache["host_slabs"])
        hits = cache.get("reuse_tokens", 0)
        queries = hits + stats.get("tokens", {}).get("prompt", 0)  # every admitted prompt token: reused or computed
        yield _counter("ninfer_prefix_cache_queries", "Prompt tokens the engine needed: reused from the prefix "
                       "cache or computed.", queries)
        yield _counter("ninfer_prefix_cache_hits", "Prompt tokens reused from the prefix cache.", hits)
        yield _gauge("ninfer_prefix_cache_hit_rate", "Prefix cache hits over queries since the start (0 to 1).",
                     hits / queries if queries else 0.0)
        spec = stats.get("speculative")
        if spec:  # vLLM's spec_decode series
            yield _counter("ninfer_spec_decode_num_drafts", "Lane-rounds that verified at least one draft token.",
                           sum(spec["accept_length_histogram"].values()))
            yield _counter("ninfer_spec_decode_num_draft_tokens", "Draft tokens verified.", spec["drafted"])
            yield _counter("ninfer_spec_decode_num_accepted_tokens", "Draft tokens the model kept.", spec["accepted"])
            family = CounterMetricFamily("ninfer_spec_decode_accept_length", "Lane-rounds with drafts, by the tokens "
                                         "they emitted (kept drafts + 1).", labels=["length"])
            for length, count in spec["accept_length_histogram"].items():
                family.add_metric([str(length)], float(count))
            yield family
            family = CounterMetricFamily("ninfer_spec_decode_rounds", "Decode rounds by kind: verify (drafts fed) or "
                                         "plain (speculation paused, not paying, or not possible).", labels=["kind"])
            for kind in ("verify", "plain"):
                family.add_metric([kind], float(spec[f"{kind}_rounds"]))
            yield family
        vision = stats.get("vision")
        if vision:  # a model with a vision tower
            yield _counter("ninfer_vision_images_encoded", "Images the vision tower encoded.", vision["images_encoded"])
            yield _counter("ninfer_vision_encoder_cache_hits", "Images a prefill read from the encoder cache "
                           "instead of encoding them.", vision["image_cache_hits"])
            yield _gauge("ninfer_vision_encoder_cache_tokens", "Image tokens the encoder cache holds (at most "
                         "--vision-cache-tokens).", vision["cached_tokens"])
        yield _gauge("ninfer_engine_compiles_since_warmup", "Programs compiled while serving (0 when warmup "
                     "compiled every reachable shape).", stats.get("compiles_since_warmup", 0))
        yield _gauge("ninfer_engine_compiling_in_background", "1 while the programs past the first sizes still "
                     "compile (--background-compile); rounds are narrower and mixed steps wait until then.",
                     float(bool(stats.get("compiling_in_background", False))))
        yield _gauge("ninfer_engine_stats_age_seconds", "Age of the engine's published stats.",
                     stats.get("stats_age_s", 0.0))


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=float(value))


def _counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, documentation, value=float(value))


def _by_state(name: str, documentation: str, ledger: Mapping[str, int]) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, documentation, labels=["state"])
    for state, count in ledger.items():
        if state != "capacity":
            family.add_metric([state], float(count))
    return family
