"""A bounded loopback load test of `ninfer-serve`: requests/s and TTFT p50/p99 at 1, 8 and 32 concurrent clients,
then the probes: /health and /metrics latency during a long prefill, and a normal request's latency while large
bodies arrive.

    python scripts/load_test.py --out docs/benchmarks   # the built-in tiny checkpoint; server_load.{json,md}
    python scripts/load_test.py --smoke                 # levels 1 and 4, 2 requests each, short probes, a temp folder
    python scripts/load_test.py --levels 1 8 --requests-per-client 2 -- --max-concurrency 4   # serve args after --
    python scripts/load_test.py --serving -- /path/to/Qwen3.5-35B-A3B --max-concurrency 256   # the serving benchmark
    python scripts/load_test.py --serving --url http://127.0.0.1:8000   # the same against a server already running

With --serving it runs the serving benchmark instead (`ninfer_jax/benchmarks/serving.py`): ShareGPT-like and fixed
1k-in/1k-out token-id completions at --concurrency 1 16 64 256, output and total tok/s, TTFT and TPOT p50/p99,
written to serving_benchmark.{json,md}; with a server it starts, also the startup: seconds from the process's start
to /health/ready and to its first served completion (16 tokens in, 1 out).

The server runs as a subprocess on a free loopback port. Each level starts C clients at once; each client
sends its requests one after another: streamed chat completions (short distinct prompts, greedy, a fixed
number of tokens with ignore_eos), and its TTFT is the time to the first generated token. Every request
must succeed. Afterwards /metrics must show no request running and no page still active (the engine's
page ledger: active 0, free + cached = capacity) and no response other than 200; the server is then
stopped with SIGTERM and must exit 0.

The probes run on a second server (PROBE_SERVER_ARGS: a 32k context, compiles on first use). A warm-up request
compiles the prefill and decode programs; then one client sends a prompt of --probe-prefill-tokens token ids
(max_tokens 1) while two others poll /health and /metrics back to back, each on its own connection, until the
prefill ends. Then a short chat completion is timed --probe-requests times idle, and as often again, each time
while 8 clients send a body of --probe-body-mib MiB of text at once (the server refuses them by their
characters, before tokenizing). The clients share the server's machine. Targets: /health p99 within 50 ms,
/metrics p99 within 200 ms, the loaded median within 100 ms of the idle one.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import httpx

from ninfer_jax.benchmarks import report as reports
from ninfer_jax.benchmarks import serving
from ninfer_jax.server.subprocess_server import ServerProcess

DEFAULT_SERVER_ARGS = ["--max-model-len", "2048", "--prefill-chunk", "256", "--max-concurrency", "8"]
PROBE_SERVER_ARGS = ["--max-model-len", "32768", "--no-warmup"]
TARGETS_MS = {"health_p99": 50, "metrics_p99": 200, "body_median_delta": 100}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("server_args", nargs="*", help="ninfer-serve arguments (after --)")
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--requests-per-client", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--smoke", action="store_true", help="levels 1 and 4, 2 requests each, a temporary folder")
    parser.add_argument("--out", type=Path, help="report folder (default docs/benchmarks; with --smoke a temp folder)")
    parser.add_argument("--probe-prefill-tokens", type=int, default=32000)
    parser.add_argument("--probe-body-mib", type=float, default=5.0)
    parser.add_argument("--probe-requests", type=int, default=20)
    serving = parser.add_argument_group("the serving benchmark (--serving)")
    serving.add_argument("--serving", action="store_true", help="run the serving benchmark instead")
    serving.add_argument("--url", help="a server already running (default: start ninfer-serve with the args after --)")
    serving.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64, 256])
    serving.add_argument("--workloads", nargs="+", default=["sharegpt", "fixed"], choices=["sharegpt", "fixed"])
    serving.add_argument("--requests", type=int, help="requests per level (default: --per-client per client, at least "
                         "--min-requests)")
    serving.add_argument("--per-client", type=int, default=4, help="requests per client at each level; default 4")
    serving.add_argument("--min-requests", type=int, default=32, help="requests per level at least; default 32")
    serving.add_argument("--seed", type=int, default=0, help="the workloads' seed; default 0")
    args = parser.parse_args()
    if args.serving:
        return _serving_benchmark(args)
    if args.smoke:
        args.levels, args.requests_per_client = [1, 4], 2
        args.probe_prefill_tokens, args.probe_body_mib, args.probe_requests = 4096, 1.0, 5
    out = args.out or (Path(tempfile.mkdtemp(prefix="server_load_smoke-")) if args.smoke else reports.DOCS)
    server_args = args.server_args or DEFAULT_SERVER_ARGS

    server = ServerProcess(server_args)
    with server:
        url = server.url
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        asyncio.run(_warm(url, model, args.max_tokens))
        levels = [asyncio.run(_level(url, model, clients, args.requests_per_client, args.max_tokens))
                  for clients in args.levels]
        time.sleep(0.5)  # /metrics shows the stats the engine's thread publishes every 0.25 s
        ledger = _ledger(httpx.get(f"{url}/metrics").text)
    exit_status = server.exit_status
    with ServerProcess(PROBE_SERVER_ARGS) as probe_server:
        probes = asyncio.run(_probes(probe_server.url, args.probe_prefill_tokens, args.probe_body_mib,
                                     args.probe_requests))
    probes["server_args"], probes["server_exit_status"] = PROBE_SERVER_ARGS, probe_server.exit_status

    report = {
        **reports.run_meta(device=platform.processor() or platform.machine()),
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "cpus": os.cpu_count(), "processor": platform.processor() or platform.machine()},
        "server_args": server_args, "model": model, "max_tokens": args.max_tokens,
        "requests_per_client": args.requests_per_client, "levels": levels, "after": ledger,
        "server_exit_status": exit_status, "probes": probes,
    }
    failures = [f"{lv['clients']} clients: {lv['errors']} errors" for lv in levels if lv["errors"]]
    if ledger["pages_active"] != 0 or ledger["running"] != 0:
        failures.append(f"leak after the load: {ledger}")
    if ledger["non_200_responses"]:
        failures.append(f"{ledger['non_200_responses']} responses other than 200")
    if exit_status != 0 or probes["server_exit_status"] != 0:
        failures.append(f"server exit status {exit_status}, probe server {probes['server_exit_status']}")
    failures += [f"probe {name}: {probes[name]} ms over the target {target} ms"
                 for name, target in TARGETS_MS.items() if not probes[name] <= target]
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


# --- probes ---------------------------------------------------------------------------------------------

async def _probes(url: str, prefill_tokens: int, body_mib: float, requests: int) -> dict:
    """/health and /metrics latency during one long prefill; a normal request's latency idle and under large
    bodies (module docstring)."""
    async with httpx.AsyncClient(timeout=900) as client:
        model = (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]
        warm = await client.post(f"{url}/v1/completions", json={
            "model": model, "prompt": _token_prompt(0, 2100), "max_tokens": 2})  # compiles a pass and a round
        warm.raise_for_status()
        await _normal(client, url, model)
    prefill = await _during_prefill(url, model, prefill_tokens)
    idle, loaded, bodies = await _under_bodies(url, model, body_mib, requests)
    result = {
        "prefill_tokens": prefill_tokens, "prefill_s": prefill["prefill_s"], "prefill_status": prefill["status"],
        "health_samples": len(prefill["health"]), "metrics_samples": len(prefill["metrics"]),
        "health_p50": _ms(prefill["health"], 50), "health_p99": _ms(prefill["health"], 99),
        "health_max": _ms(prefill["health"], 100), "metrics_p50": _ms(prefill["metrics"], 50),
        "metrics_p99": _ms(prefill["metrics"], 99), "metrics_max": _ms(prefill["metrics"], 100),
        "body_mib": body_mib, "body_clients": 8, "bodies_sent": len(bodies),
        "body_statuses": sorted(set(bodies)), "normal_requests": requests,
        "idle_median": _ms(idle, 50), "idle_p99": _ms(idle, 99),
        "loaded_median": _ms(loaded, 50), "loaded_p99": _ms(loaded, 99),
    }
    result["body_median_delta"] = round(result["loaded_median"] - result["idle_median"], 1)
    print(f"probes | {prefill_tokens}-token prefill {prefill['prefill_s']:.1f} s | /health p99 "
          f"{result['health_p99']} ms | /metrics p99 {result['metrics_p99']} ms | normal request median "
          f"{result['idle_median']} ms idle, {result['loaded_median']} ms under {len(bodies)} bodies of "
          f"{body_mib} MiB", flush=True)
    return result


async def _during_prefill(url: str, model: str, tokens: int) -> dict:
    """Polls /health and /metrics back to back (a connection each) while one prompt of `tokens` is prefilled."""
    samples: dict[str, list[float]] = {"health": [], "metrics": []}
    done = asyncio.Event()

    async def poll(path: str) -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            while not done.is_set():
                started = time.perf_counter()
                (await client.get(f"{url}/{path}")).raise_for_status()
                samples[path].append(time.perf_counter() - started)
                await asyncio.sleep(0.01)

    async with httpx.AsyncClient(timeout=900) as client:
        pollers = [asyncio.ensure_future(poll(path)) for path in samples]
        started = time.perf_counter()
        response = await client.post(f"{url}/v1/completions", json={
            "model": model, "prompt": _token_prompt(1, tokens), "max_tokens": 1})
        seconds = time.perf_counter() - started
        done.set()
        await asyncio.gather(*pollers)
    return {**samples, "prefill_s": round(seconds, 2), "status": response.status_code}


async def _under_bodies(url: str, model: str, body_mib: float, requests: int
                        ) -> tuple[list[float], list[float], list[int]]:
    """A normal request's latencies idle, then each while 8 clients send a large body at once (each on its own
    connection, started just before it); the bodies' statuses."""
    body = json.dumps({"model": model, "max_tokens": 1, "messages": [
        {"role": "user", "content": "lorem ipsum " * int(body_mib * (1 << 20) / 12)}]}).encode()
    statuses: list[int] = []

    async def send_body() -> None:
        async with httpx.AsyncClient(timeout=120) as sender:
            response = await sender.post(f"{url}/v1/chat/completions", content=body,
                                         headers={"Content-Type": "application/json"})
            statuses.append(response.status_code)

    async with httpx.AsyncClient(timeout=120) as client:
        idle = [await _normal(client, url, model) for _ in range(requests)]
        loaded = []
        for _ in range(requests):
            senders = [asyncio.ensure_future(send_body()) for _ in range(8)]
            await asyncio.sleep(0.005)  # the bodies are on their way
            loaded.append(await _normal(client, url, model))
            await asyncio.gather(*senders)
    return idle, loaded, statuses


async def _normal(client: httpx.AsyncClient, url: str, model: str) -> float:
    """Seconds for a short greedy chat completion of one token."""
    started = time.perf_counter()
    response = await client.post(f"{url}/v1/chat/completions", json={
        "model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "temperature": 0})
    response.raise_for_status()
    return time.perf_counter() - started


def _token_prompt(seed: int, tokens: int) -> list[int]:
    """Token ids that share no prefix with another seed's (no prefix reuse)."""
    return [1000 + (seed * 7919 + i * 104729) % 100_000 for i in range(tokens)]


def _serving_benchmark(args: argparse.Namespace) -> int:
    """Each workload at each concurrency, on a server started here (or at --url); every request must succeed."""
    server = None if args.url else ServerProcess(args.server_args)
    launched = time.perf_counter()
    with server or contextlib.nullcontext(SimpleNamespace(url=args.url.rstrip("/"))) as running:
        ready_s = time.perf_counter() - launched
        model = httpx.get(f"{running.url}/v1/models").json()["data"][0]["id"]
        startup = None
        if server is not None:  # the process's start to /health/ready, and to its first served completion
            first = asyncio.run(serving.run_level(running.url, model, [serving.BenchRequest(_token_prompt(0, 16), 1)],
                                                  1))
            startup = {"ready_s": round(ready_s, 1), "first_response_s": round(time.perf_counter() - launched, 1),
                       "first_response_ok": first["errors"] == 0}
            polls = []  # /metrics latency while the background compile runs; the levels wait for its end
            while True:
                sent = time.perf_counter()
                text = httpx.get(f"{running.url}/metrics", timeout=300).text
                polls.append(time.perf_counter() - sent)
                if polls[-1] > 1:
                    print(f"startup | a /metrics poll took {polls[-1]:.1f} s, {sent - launched:.1f} s after the "
                          f"start", flush=True)
                if "ninfer_engine_compiling_in_background 1.0" not in text:
                    break
                time.sleep(0.5)
            startup["all_compiled_s"] = round(time.perf_counter() - launched, 1)
            startup["background_metrics_polls"] = {"polls": len(polls), "p50_ms": _ms(polls, 50),
                                                   "p99_ms": _ms(polls, 99), "max_ms": _ms(polls, 100)}
            print(f"startup | ready {startup['ready_s']} s | first completion {startup['first_response_s']} s"
                  f"{'' if startup['first_response_ok'] else ' (failed)'} | every program compiled "
                  f"{startup['all_compiled_s']} s | /metrics meanwhile {startup['background_metrics_polls']}",
                  flush=True)
        levels: dict[str, list[dict]] = {}
        for name in args.workloads:
            asyncio.run(serving.run_level(running.url, model, serving.workload(name, 1, args.seed + 1), 1))  # warm
            for clients in args.concurrency:
                count = args.requests or max(args.min_requests, args.per_client * clients)
                level = asyncio.run(serving.run_level(running.url, model, serving.workload(name, count, args.seed),
                                                      clients))
                print(f"{name} | {clients:>3} clients | {level['requests']} requests | {level['errors']} errors | "
                      f"{level['output_tok_s']} output tok/s | {level['total_tok_s']} total tok/s | TTFT p50 "
                      f"{level['ttft_p50_ms']} p99 {level['ttft_p99_ms']} ms | TPOT p50 {level['tpot_p50_ms']} p99 "
                      f"{level['tpot_p99_ms']} ms | {level['preemptions']} preemptions", flush=True)
                levels.setdefault(name, []).append(level)
    report = {**reports.run_meta(), "server_args": args.server_args, "url": args.url, "model": model,
              "seed": args.seed, "startup": startup, "workloads": levels}
    out = args.out or reports.DOCS
    reports.write_report(out, "serving_benchmark", report, [
        *reports.header("ninfer-serve serving benchmark", report,
                        f"server: {'`ninfer-serve ' + ' '.join(args.server_args) + '`' if server else args.url}, "
                        f"model `{model}`",
                        "load: streamed /v1/completions of token-id prompts, greedy, ignore_eos; C clients each send "
                        "the next request when their last ends; TTFT to the first chunk with text, TPOT (latency - "
                        "TTFT) / (output tokens - 1)",
                        f"workloads (seed {args.seed}): "
                        + "; ".join(f"{name}: {serving.WORKLOADS[name]}" for name in args.workloads),
                        *([f"startup: /health/ready {startup['ready_s']} s and the first served completion (16 "
                           f"tokens in, 1 out) {startup['first_response_s']} s after the server process started; "
                           f"every program compiled (the background compile's end) {startup['all_compiled_s']} s"]
                          if startup else [])),
        *serving.markdown(report)])
    errors = sum(lv["errors"] for lvs in levels.values() for lv in lvs)
    errors += startup is not None and not startup["first_response_ok"]
    return 1 if errors or (server is not None and server.exit_status != 0) else 0


def _ms(values: list[float], q: float) -> float:
    return round(1000 * _percentile(sorted(values), q), 1) if values else float("nan")


def _ledger(metrics: str) -> dict:
    def value(name: str) -> float:
        found = serving.metric_value(metrics, name)
        return 0.0 if found is None else found

    # The readiness polls while the server started answer 503 by design.
    statuses = re.findall(r'^ninfer_requests_total\{endpoint="(?!/health/ready")[^"]*",status="(\d+)"\} (\S+)$',
                          metrics, flags=re.M)
    pages = {state: value(f'ninfer_kv_cache_pages{{state="{state}"}}') for state in ("active", "free", "cached")}
    capacity = value("ninfer_kv_cache_capacity_pages")
    return {"pages_active": pages["active"], "pages_free": pages["free"], "pages_cached": pages["cached"],
            "pages_capacity": capacity, "running": value("ninfer_num_requests_running"),
            "waiting": value("ninfer_num_requests_waiting"),
            "non_200_responses": sum(float(n) for status, n in statuses if status != "200"),
            "ledger_closes": pages["free"] + pages["cached"] == capacity}


def _percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile of sorted values."""
    rank = max(1, -(-len(values) * q // 100))
    return values[int(rank) - 1]


def _write(out: Path, report: dict) -> None:
    rows = "\n".join(
        f"| {lv['clients']} | {lv['requests']} | {lv['errors']} | {lv['requests_per_s']} | {lv['output_tokens_per_s']} "
        f"| {lv['ttft_p50_ms']} | {lv['ttft_p99_ms']} | {lv['latency_p50_ms']} |" for lv in report["levels"])
    after, probes = report["after"], report["probes"]
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

## Liveness and large bodies

Server: `ninfer-serve {' '.join(probes['server_args'])}`, model `{report['model']}`.

| probe | samples | p50 ms | p99 ms | max ms | target |
|---|---|---|---|---|---|
| /health during a {probes['prefill_tokens']}-token prefill ({probes['prefill_s']} s) | {probes['health_samples']} \
| {probes['health_p50']} | {probes['health_p99']} | {probes['health_max']} | p99 <= {TARGETS_MS['health_p99']} |
| /metrics during the same prefill | {probes['metrics_samples']} | {probes['metrics_p50']} | {probes['metrics_p99']} \
| {probes['metrics_max']} | p99 <= {TARGETS_MS['metrics_p99']} |
| a 1-token chat completion, idle | {probes['normal_requests']} | {probes['idle_median']} | {probes['idle_p99']} | | |
| the same, each while 8 clients send a {probes['body_mib']} MiB body ({probes['bodies_sent']} sent, status \
{probes['body_statuses']}) | {probes['normal_requests']} | {probes['loaded_median']} | {probes['loaded_p99']} | \
| median within {TARGETS_MS['body_median_delta']} of idle ({probes['body_median_delta']:+}) |

Result: {'ok' if report['ok'] else 'FAILED'}.
""".splitlines())
    print(f"wrote {out / 'server_load.json'} and {out / 'server_load.md'}")


if __name__ == "__main__":
    sys.exit(main())
