"""A bounded loopback load test of `ninfer-serve`: requests/s and TTFT p50/p99 at 1, 8 and 32 concurrent clients.

    python scripts/load_test.py --out docs/benchmarks   # the built-in tiny checkpoint; server_load.{json,md}
    python scripts/load_test.py --smoke                 # levels 1 and 4, 2 requests each, a temporary folder
    python scripts/load_test.py --levels 1 8 --requests-per-client 2 -- --max-concurrency 4   # serve args after --

The server runs as a subprocess on a free loopback port. Each level starts C clients at once; each client
sends its requests one after another: streamed chat completions (short distinct prompts, greedy, a fixed
number of tokens with ignore_eos), and its TTFT is the time to the first generated token. Every request
must succeed. Afterwards /metrics must show no request running and no page still active (the engine's
page ledger: active 0, free + cached = capacity) and no response other than 200; the server is then
stopped with SIGTERM and must exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from ninfer_jax.benchmarks import report as reports
from ninfer_jax.server.subprocess_server import ServerProcess

DEFAULT_SERVER_ARGS = ["--max-model-len", "2048", "--prefill-chunk", "256", "--max-concurrency", "8"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("server_args", nargs="*", help="ninfer-serve arguments (after --)")
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--requests-per-client", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--smoke", action="store_true", help="levels 1 and 4, 2 requests each, a temporary folder")
    parser.add_argument("--out", type=Path, help="report folder (default docs/benchmarks; with --smoke a temp folder)")
    args = parser.parse_args()
    if args.smoke:
        args.levels, args.requests_per_client = [1, 4], 2
    out = args.out or (Path(tempfile.mkdtemp(prefix="server_load_smoke-")) if args.smoke else reports.DOCS)
    server_args = args.server_args or DEFAULT_SERVER_ARGS

    server = ServerProcess(server_args)
    with server:
        url = server.url
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        asyncio.run(_warm(url, model, args.max_tokens))
        levels = [asyncio.run(_level(url, model, clients, args.requests_per_client, args.max_tokens))
                  for clients in args.levels]
        ledger = _ledger(httpx.get(f"{url}/metrics").text)
    exit_status = server.exit_status

    report = {
        **reports.run_meta(device=platform.processor() or platform.machine()),
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "cpus": os.cpu_count(), "processor": platform.processor() or platform.machine()},
        "server_args": server_args, "model": model, "max_tokens": args.max_tokens,
        "requests_per_client": args.requests_per_client, "levels": levels, "after": ledger,
        "server_exit_status": exit_status,
    }
    failures = [f"{lv['clients']} clients: {lv['errors']} errors" for lv in levels if lv["errors"]]
    if ledger["pages_active"] != 0 or ledger["running"] != 0:
        failures.append(f"leak after the load: {ledger}")
    if ledger["non_200_responses"]:
        failures.append(f"{ledger['non_200_responses']} responses other than 200")
    if exit_status != 0:
        failures.append(f"server exit status {exit_status}")
    report["ok"] = not failures
    _write(out, report)
    for line in failures:
        print("FAILED |", line)
    return 0 if not failures else 1


async def _one(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int) -> dict:
    started = time.perf_counter()
    ttft = None
    tokens = 0
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            return {"ok": False, "error": f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"}
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return {"ok": False, "error": chunk["error"]["message"]}
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            delta = chunk["choices"][0]["delta"] if chunk.get("choices") else {}
            if ttft is None and (delta.get("content") or delta.get("reasoning_content")):
                ttft = time.perf_counter() - started
    return {"ok": tokens == max_tokens and ttft is not None, "ttft": ttft, "latency": time.perf_counter() - started,
            "tokens": tokens, "error": None if tokens == max_tokens else f"{tokens} tokens"}


async def _level(url: str, model: str, clients: int, per_client: int, max_tokens: int) -> dict:
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        async def run_client(c: int) -> list[dict]:
            return [await _one(client, url, model, f"Client {c} asks question {r}: what is {c} times {r}?",
                               max_tokens) for r in range(per_client)]

        started = time.perf_counter()
        results = [r for rs in await asyncio.gather(*(run_client(c) for c in range(clients))) for r in rs]
        wall = time.perf_counter() - started
    good = [r for r in results if r["ok"]]
    ttfts = sorted(r["ttft"] for r in good)
    level = {"clients": clients, "requests": len(results), "errors": len(results) - len(good),
             "wall_s": round(wall, 3), "requests_per_s": round(len(good) / wall, 3),
             "output_tokens_per_s": round(sum(r["tokens"] for r in good) / wall, 1),
             "ttft_p50_ms": round(1000 * _percentile(ttfts, 50), 1) if ttfts else None,
             "ttft_p99_ms": round(1000 * _percentile(ttfts, 99), 1) if ttfts else None,
             "latency_p50_ms": round(1000 * statistics.median(r["latency"] for r in good), 1) if good else None,
             "first_errors": [r["error"] for r in results if not r["ok"]][:3]}
    print(f"{clients:>3} clients | {level['requests']} requests | {level['errors']} errors | "
          f"{level['requests_per_s']} req/s | {level['output_tokens_per_s']} tok/s | TTFT p50 "
          f"{level['ttft_p50_ms']} ms p99 {level['ttft_p99_ms']} ms", flush=True)
    return level


async def _warm(url: str, model: str, max_tokens: int) -> None:
    """One request first, so programs compiled on first use do not land in the first level."""
    async with httpx.AsyncClient(timeout=600) as client:
        await _one(client, url, model, "warm up", max_tokens)


def _ledger(metrics: str) -> dict:
    def value(name: str) -> float:
        found = re.search(rf"^{re.escape(name)} (\S+)$", metrics, flags=re.M)
        return float(found.group(1)) if found else 0.0

    statuses = re.findall(r'^ninfer_requests_total\{endpoint="[^"]*",status="(\d+)"\} (\S+)$', metrics, flags=re.M)
    return {"pages_active": value("ninfer_engine_pages_active"), "pages_free": value("ninfer_engine_pages_free"),
            "pages_cached": value("ninfer_engine_pages_cached"),
            "pages_capacity": value("ninfer_engine_pages_capacity"),
            "running": value("ninfer_engine_requests_running"), "waiting": value("ninfer_engine_requests_waiting"),
            "non_200_responses": sum(float(n) for status, n in statuses if status != "200"),
            "ledger_closes": value("ninfer_engine_pages_free") + value("ninfer_engine_pages_cached")
            == value("ninfer_engine_pages_capacity")}


def _percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile of sorted values."""
    rank = max(1, -(-len(values) * q // 100))
    return values[int(rank) - 1]


def _write(out: Path, report: dict) -> None:
    rows = "\n".join(
        f"| {lv['clients']} | {lv['requests']} | {lv['errors']} | {lv['requests_per_s']} | {lv['output_tokens_per_s']} "
        f"| {lv['ttft_p50_ms']} | {lv['ttft_p99_ms']} | {lv['latency_p50_ms']} |" for lv in report["levels"])
    after = report["after"]
    machine = report["machine"]
    reports.write_report(out, "server_load", report, f"""# ninfer-serve load test (loopback)

- command: `{report['command']}`
- {reports.run_line(report)}
- machine: {machine['platform']}, {machine['cpus']} CPUs ({machine['processor']}), Python {machine['python']}
- server: `ninfer-serve {' '.join(report['server_args'])}`, model `{report['model']}`
- load: each client sends {report['requests_per_client']} streamed chat completions one after another (greedy,
  {report['max_tokens']} output tokens each, ignore_eos); TTFT is the client's time to the first generated token

| clients | requests | errors | requests/s | output tok/s | TTFT p50 ms | TTFT p99 ms | latency p50 ms |
|---|---|---|---|---|---|---|---|
{rows}

After the load, from `/metrics`:
- requests running {int(after['running'])}, waiting {int(after['waiting'])}
- pages active {int(after['pages_active'])}; free {int(after['pages_free'])} + cached {int(after['pages_cached'])} of \
{int(after['pages_capacity'])} (ledger closes: {after['ledger_closes']})
- responses other than 200: {int(after['non_200_responses'])}
- server exit status after SIGTERM: {report['server_exit_status']}

Result: {'ok' if report['ok'] else 'FAILED'}.
""".splitlines())
    print(f"wrote {out / 'server_load.json'} and {out / 'server_load.md'}")


if __name__ == "__main__":
    sys.exit(main())
