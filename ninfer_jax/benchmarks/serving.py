"""The serving benchmark of issue 31: `ninfer-serve` under C concurrent clients (1, 16, 64, 256), each sending
streamed /v1/completions of token-id prompts with a fixed output length (ignore_eos), the pattern of vLLM's and
SGLang's serving benchmarks. Reports output and total tok/s, TTFT and TPOT p50/p99 per concurrency, and the
requests the server preempted meanwhile (its KV pool out of pages).

Workloads, both from a fixed seed so every run sends the same requests:
- "sharegpt": input and output lengths drawn from log-normal distributions whose means are the ShareGPT statistics
  the vLLM paper reports (Kwon et al., SOSP 2023, section 6.1: 161.31 input and 337.99 output tokens per request on
  average; the spread, sigma 1.0, is ours), kept within the bounds vLLM's benchmark applies to ShareGPT (input and
  output at least 4 tokens, input at most 1024, input + output at most 2048).
- "fixed": every request 1024 tokens in and 1024 out.
Prompts are random token ids, distinct per request, so no request reuses another's prefix.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import re
import time

import httpx
import numpy as np

SHAREGPT_MEAN_INPUT, SHAREGPT_MEAN_OUTPUT, SHAREGPT_SIGMA = 161.31, 337.99, 1.0
MIN_TOKENS, MAX_INPUT, MAX_TOTAL = 4, 1024, 2048
FIXED_INPUT = FIXED_OUTPUT = 1024
VOCAB_LOW, VOCAB_HIGH = 1000, 100_000  # ordinary text tokens of the Qwen3.5 vocabulary, no special ones
WORKLOADS = {
    "sharegpt": f"log-normal lengths with ShareGPT's means as the vLLM paper reports them ({SHAREGPT_MEAN_INPUT} in, "
                f"{SHAREGPT_MEAN_OUTPUT} out), sigma {SHAREGPT_SIGMA}, input {MIN_TOKENS}..{MAX_INPUT} and input + "
                f"output <= {MAX_TOTAL}",
    "fixed": f"{FIXED_INPUT} in, {FIXED_OUTPUT} out",
}


@dataclasses.dataclass(frozen=True)
class BenchRequest:
    prompt: list[int]
    output_tokens: int


def workload(name: str, count: int, seed: int = 0) -> list[BenchRequest]:
    """`count` requests of the named workload ("sharegpt" or "fixed"), the same for the same seed."""
    rng = np.random.default_rng(seed)
    if name == "fixed":
        lengths = [(FIXED_INPUT, FIXED_OUTPUT)] * count
    elif name == "sharegpt":
        lengths = []
        while len(lengths) < count:
            n, m = (round(_lognormal(rng, mean)) for mean in (SHAREGPT_MEAN_INPUT, SHAREGPT_MEAN_OUTPUT))
            if n >= MIN_TOKENS and m >= MIN_TOKENS and n <= MAX_INPUT and n + m <= MAX_TOTAL:
                lengths.append((n, m))
    else:
        raise ValueError(f"workload must be 'sharegpt' or 'fixed', got {name!r}")
    return [BenchRequest(rng.integers(VOCAB_LOW, VOCAB_HIGH, n).tolist(), m) for n, m in lengths]


def _lognormal(rng: np.random.Generator, mean: float) -> float:
    """A log-normal draw with the given mean and SHAREGPT_SIGMA."""
    return rng.lognormal(math.log(mean) - SHAREGPT_SIGMA**2 / 2, SHAREGPT_SIGMA)


@dataclasses.dataclass(frozen=True)
class Result:
    ok: bool
    input_tokens: int
    output_tokens: int
    ttft_s: float | None
    latency_s: float
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first (vLLM's TPOT); None for a request of one token."""
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


async def send(client: httpx.AsyncClient, url: str, model: str, request: BenchRequest) -> Result:
    """One streamed completion; its TTFT is the time to the first chunk with text."""
    body = {"model": model, "prompt": request.prompt, "max_tokens": request.output_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    started, ttft, tokens = time.perf_counter(), None, 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            text = (await response.aread())[:200]
            return Result(False, len(request.prompt), 0, None, time.perf_counter() - started,
                          f"HTTP {response.status_code}: {text!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return Result(False, len(request.prompt), tokens, ttft, time.perf_counter() - started,
                              chunk["error"]["message"])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if ttft is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                ttft = time.perf_counter() - started
    latency = time.perf_counter() - started
    ok = tokens == request.output_tokens
    return Result(ok, len(request.prompt), tokens, ttft, latency, None if ok else f"{tokens} tokens")


async def run_level(url: str, model: str, requests: list[BenchRequest], concurrency: int) -> dict:
    """Sends `requests` with at most `concurrency` in flight (each client takes the next when its last ends) and
    summarizes them."""
    queue = list(reversed(requests))
    results: list[Result] = []
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=3600, limits=limits) as client:
        async def worker() -> None:
            while queue:
                results.append(await send(client, url, model, queue.pop()))

        before = await preemptions(client, url)
        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - started
        after = await preemptions(client, url)
    return {**summarize(results, wall, concurrency),
            "preemptions": None if before is None or after is None else int(after - before)}


async def preemptions(client: httpx.AsyncClient, url: str) -> float | None:
    """The server's ninfer_num_preemptions_total from /metrics; None where it has no such series."""
    return metric_value((await client.get(f"{url}/metrics")).text, "ninfer_num_preemptions_total")


def metric_value(metrics: str, series: str) -> float | None:
    """One series' value in /metrics' text (`series` with its labels, as the text writes them); None where absent."""
    found = re.search(rf"^{re.escape(series)} (\S+)$", metrics, flags=re.M)
    return float(found.group(1)) if found else None


def summarize(results: list[Result], wall_s: float, concurrency: int) -> dict:
    good = [r for r in results if r.ok]
    ttft = sorted(r.ttft_s for r in good if r.ttft_s is not None)
    tpot = sorted(r.tpot_s for r in good if r.tpot_s is not None)
    output = sum(r.output_tokens for r in good)
    return {
        "concurrency": concurrency, "requests": len(results), "errors": len(results) - len(good),
        "wall_s": round(wall_s, 3), "input_tokens": sum(r.input_tokens for r in good), "output_tokens": output,
        "output_tok_s": round(output / wall_s, 1),
        "total_tok_s": round((output + sum(r.input_tokens for r in good)) / wall_s, 1),
        "ttft_p50_ms": _ms(ttft, 50), "ttft_p99_ms": _ms(ttft, 99),
        "tpot_p50_ms": _ms(tpot, 50), "tpot_p99_ms": _ms(tpot, 99),
        "first_errors": [r.error for r in results if not r.ok][:3],
    }


def _ms(values: list[float], q: float) -> float | None:
    """The nearest-rank percentile of sorted values, in ms."""
    if not values:
        return None
    rank = max(1, -(-len(values) * q // 100))
    return round(1000 * values[int(rank) - 1], 2)


def markdown(report: dict) -> list[str]:
    """The report's table rows, one per workload and concurrency."""
    lines = [("| workload | concurrency | requests | errors | output tok/s | total tok/s | TTFT p50 ms | TTFT p99 ms "
              "| TPOT p50 ms | TPOT p99 ms | preemptions |"), "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, levels in report["workloads"].items():
        for lv in levels:
            preempted = lv.get("preemptions")
            lines.append(f"| {name} | {lv['concurrency']} | {lv['requests']} | {lv['errors']} | {lv['output_tok_s']} "
                         f"| {lv['total_tok_s']} | {lv['ttft_p50_ms']} | {lv['ttft_p99_ms']} | {lv['tpot_p50_ms']} "
                         f"| {lv['tpot_p99_ms']} | {'-' if preempted is None else preempted} |")
    return lines
