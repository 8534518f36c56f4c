"""Server counters and their Prometheus text exposition (format 0.0.4), written by hand.

The server's own series: requests by endpoint and HTTP status, finished requests by finish reason,
prompt / completion / cached (reused) tokens, a time-to-first-token histogram, and whether the engine is
loaded. The stats the engine's thread last published (`published_stats()`) follow as gauges: `ninfer_prefix_cache_<counter>` for its prefix-cache counters and
`ninfer_engine_<section>_<key>` for every other number (pages, slots, requests, tokens).
"""

from __future__ import annotations

import bisect
import collections
from collections.abc import Mapping
from typing import Any

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class ServerMetrics:
    """Updated on the event loop only (no lock)."""

    def __init__(self) -> None:
        self.requests: collections.Counter[tuple[str, int]] = collections.Counter()
        self.finished: collections.Counter[str] = collections.Counter()
        self.tokens = {"prompt": 0, "completion": 0, "cached": 0}
        self.ttft_counts = [0] * (len(TTFT_BUCKETS) + 1)  # the last is +Inf
        self.ttft_sum = 0.0

    def observe_response(self, endpoint: str, status: int) -> None:
        self.requests[(endpoint, status)] += 1

    def observe_finish(self, finish_reason: str, prompt: int, completion: int, cached: int,
                       ttft_s: float | None) -> None:
        self.finished[finish_reason] += 1
        self.tokens["prompt"] += prompt
        self.tokens["completion"] += completion
        self.tokens["cached"] += cached
        if ttft_s is not None:
            self.ttft_counts[bisect.bisect_left(TTFT_BUCKETS, ttft_s)] += 1
            self.ttft_sum += ttft_s

    def render(self, engine_stats: Mapping[str, Any], ready: bool = True) -> str:
        lines: list[str] = []
        _family(lines, "ninfer_server_ready", "gauge", "1 once the engine is loaded and serves, else 0.",
                [({}, ready)])
        _family(lines, "ninfer_requests_total", "counter", "HTTP responses by endpoint and status code.",
                [({"endpoint": e, "status": str(s)}, n) for (e, s), n in sorted(self.requests.items())])
        _family(lines, "ninfer_request_finish_total", "counter", "Engine requests finished, by finish reason.",
                [({"reason": r}, n) for r, n in sorted(self.finished.items())])
        for kind, help_text in (("prompt", "Prompt tokens of finished requests."),
                                ("completion", "Generated tokens of finished requests."),
                                ("cached", "Prompt tokens reused from the prefix cache.")):
            _family(lines, f"ninfer_{kind}_tokens_total", "counter", help_text, [({}, self.tokens[kind])])
        self._render_ttft(lines)
        for section, values in engine_stats.items():
            if not isinstance(values, Mapping):
                if _is_number(values):
                    _family(lines, f"ninfer_engine_{_name(section)}", "gauge", f"Engine stats: {section}.",
                            [({}, values)])
                continue
            prefix = "ninfer_prefix_cache" if section == "prefix_cache" else f"ninfer_engine_{_name(section)}"
            for key, value in values.items():
                if _is_number(value):
                    _family(lines, f"{prefix}_{_name(key)}", "gauge", f"Engine stats: {section}.{key}.",
                            [({}, value)])
        return "\n".join(lines) + "\n"

    def _render_ttft(self, lines: list[str]) -> None:
        name = "ninfer_time_to_first_token_seconds"
        lines += [f"# HELP {name} Time from arrival to the first generated token (engine-measured).",
                  f"# TYPE {name} histogram"]
        running = 0
        for bound, count in zip((*TTFT_BUCKETS, float("inf")), self.ttft_counts):
            running += count
            label = "+Inf" if bound == float("inf") else repr(bound)
            lines.append(f'{name}_bucket{{le="{label}"}} {running}')
        lines += [f"{name}_sum {self.ttft_sum!r}", f"{name}_count {running}"]


def _family(lines: list[str], name: str, kind: str, help_text: str,
            samples: list[tuple[dict[str, str], float]]) -> None:
    lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    for labels, value in samples:
        rendered = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
        lines.append(f"{name}{{{rendered}}} {_number(value)}" if rendered else f"{name} {_number(value)}")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float))  # bools too: they render as 0 / 1


def _number(value: float) -> str:
    return str(int(value)) if isinstance(value, bool) or float(value).is_integer() else repr(float(value))


def _name(key: str) -> str:
    return "".join(c if c.isalnum() or c == "_" else "_" for c in str(key)).lower()


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
