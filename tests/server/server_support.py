"""Shared pieces of the server tests: a live server on a loopback thread, the real engine (one per session),
and a scripted engine whose output and prefix reuse the tests choose.

NOTE: not a conftest.py (see tests/frontend/frontend_support.py): test modules import this by name.
The real engine is the built-in tiny checkpoint, built once per session with a short context (decode
cost grows with max_model_len on CPU) and compiled on first use, through a persistent XLA cache that
the subprocess tests share.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import anthropic
import numpy as np
import openai
import pytest

from ninfer_jax import EngineStoppedError, InvalidRequestError, PromptTooLongError, SamplingParams
from ninfer_jax.frontend import PreparedPrompt, load_chat_template, load_tokenizer, prepare_tokens
from ninfer_jax.model.tiny import default_checkpoint
from ninfer_jax.runtime.request import Metrics, StreamEvent, Usage
from ninfer_jax.server.app import create_app
from ninfer_jax.server.serving import OrderlyServer, server_config

XLA_CACHE = Path(os.environ["JAX_COMPILATION_CACHE_DIR"])  # the run's compilation cache (conftest.py)
# The real engine's settings in these tests (and in the subprocess tests, as ninfer-serve flags).
ENGINE_OPTIONS = dict(dtype="float32", max_concurrency=4, prefill_chunk=256, max_model_len=2048, warmup=False)
SERVE_FLAGS = ["--dtype", "float32", "--max-concurrency", "4", "--prefill-chunk", "256", "--max-model-len", "2048",
               "--no-warmup"]

# A Qwen3.5 tool call as the model writes it, and its rendering in the next prompt.
CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n"
        "</parameter>\n</function>\n</tool_call>")
RENDERED_CALL = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n"


def subprocess_env() -> dict[str, str]:
    """Environment for a server subprocess: CPU jax, sharing the session's compiled programs."""
    return {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_COMPILATION_CACHE_DIR": str(XLA_CACHE),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "PYTHONUNBUFFERED": "1"}


@functools.cache
def real_engine():
    """The built-in tiny checkpoint's Engine, shared by every server test module of the session."""
    from ninfer_jax import Engine

    return Engine.from_pretrained(None, **ENGINE_OPTIONS)


@functools.cache
def tiny_frontend():
    """The built-in checkpoint's tokenizer and chat template (no model load)."""
    path = default_checkpoint()
    return load_tokenizer(path, required=True), load_chat_template(path)


class LiveServer:
    """The app for `engine` served by uvicorn on a loopback thread: `with LiveServer(engine) as s: s.url`.
    `app_options`: create_app's (limits, allowed_origins); engine None: attached later."""

    def __init__(self, engine: Any, api_key: str | None = None, **app_options: Any):
        self.app = create_app(engine, api_key=api_key, **app_options)
        self.context = self.app.state.context
        self._socket = socket.socket()
        self._socket.bind(("127.0.0.1", 0))
        port = self._socket.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        # The engine outlives each module's server: the session shares it.
        self.server = OrderlyServer(server_config(self.app, "127.0.0.1", port), self.context, stop_engine=False)
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._socket]}, daemon=True)

    def __enter__(self) -> LiveServer:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self._thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self._thread.join(30)
        self._socket.close()


@pytest.fixture(scope="module")
def server(engine):
    """The module's `engine` fixture served on loopback, one server per module."""
    with LiveServer(engine) as live:
        yield live


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


def sse_events(lines) -> list[tuple[str | None, Any]]:
    """(event name, decoded data) for each server-sent event of an iterable of text lines."""
    events, name = [], None
    for line in lines:
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            data = line[6:]
            events.append((name, data if data == "[DONE]" else json.loads(data)))
            name = None
    return events


def wait_for(predicate, timeout: float = 30.0, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(interval)


class ScriptedEngine:
    """The Engine surface the server uses, without a model.

    Each request generates the next text of `script` (or `default_text`), tokenized with the real
    Qwen3.5 tokenizer and emitted one token per event, `token_delay` seconds apart, ending "stop"
    (or "length" at max_tokens). Prefix reuse is simulated as content addressing would give it: the
    longest common prefix with an earlier prompt, in whole 64-token blocks, at most n - 1 tokens.
    """

    model_name = "scripted-tiny"

    def __init__(self, *, max_model_len: int = 4096, token_delay: float = 0.0):
        self.tokenizer, self.chat_template = tiny_frontend()
        self.max_model_len = max_model_len
        self.token_delay = token_delay
        self.default_text = "Hello from the scripted engine."
        self.script: collections.deque[str] = collections.deque()
        self.prompts: list[PreparedPrompt] = []  # every admitted prompt, in order
        self.cached: list[int] = []  # the reuse each admitted prompt was given
        self.sampling: list[SamplingParams] = []
        self.counters: collections.Counter[str] = collections.Counter()
        self.sampling_defaults: dict = {}  # a checkpoint's generation_config.json defaults (Engine's)
        self.running = 0
        self._cancelled: set[str] = set()
        self._stopping = False

    def rendered(self, index: int = -1) -> str:
        """The text of an admitted prompt, special tokens included."""
        return self.tokenizer.decode(self.prompts[index].token_ids)

    def say(self, *texts: str) -> None:
        """The next requests' outputs, in order."""
        self.script.extend(texts)

    async def astream(self, prompt, sampling: SamplingParams | None = None, request_id: str | None = None):
        sampling = sampling or SamplingParams()
        if self._stopping:
            raise EngineStoppedError("engine is stopped")
        prepared = self._prepare(prompt)
        n = prepared.num_tokens
        if n + 1 > self.max_model_len:
            raise PromptTooLongError(f"prompt has {n} tokens; max_model_len is {self.max_model_len}, "
                                     "leaving no room for output")
        cached = self._reuse(prepared)
        self.prompts.append(prepared)
        self.cached.append(cached)
        self.sampling.append(sampling)
        self.counters["requests_submitted"] += 1
        text = self.script.popleft() if self.script else self.default_text
        tokens = self.tokenizer.encode(text)
        started = time.perf_counter()
        self.running += 1
        try:
            yield StreamEvent(request_id, (), "", None, Usage(n, 0, cached), Metrics(None, None))
            out: list[int] = []
            shown, reason, last = "", "stop", ((), "")
            for token in tokens:
                await asyncio.sleep(self.token_delay)
                if request_id in self._cancelled or self._stopping:
                    reason = "cancelled" if request_id in self._cancelled else "unavailable"
                    break
                out.append(token)
                full = self.tokenizer.decode(out, skip_special_tokens=True)
                stop_at = min((full.find(s) for s in sampling.stop if s in full), default=-1)
                if stop_at >= 0:
                    reason, last = "stop", ((token,), full[len(shown):stop_at])
                    break
                delta, shown = full[len(shown):], full
                if len(out) >= sampling.max_tokens:
                    reason, last = "length", ((token,), delta)
                    break
                yield StreamEvent(request_id, (token,), delta, None, None, None, self._logprobs(sampling, (token,)))
            new, delta = last
            self.counters[f"finished_{reason}"] += 1
            ttft = time.perf_counter() - started
            yield StreamEvent(request_id, new, delta, reason, Usage(n, len(out), cached), Metrics(ttft, ttft),
                              self._logprobs(sampling, new))
        finally:
            self.running -= 1

    def prepare_sampling(self, sampling: SamplingParams) -> None:
        """Engine.prepare_sampling: nothing to compile, the script is the output whatever its constraint."""

    def cancel(self, request_id: str) -> bool:
        self._cancelled.add(request_id)
        return True

    def stop(self) -> None:
        self._stopping = True

    def stats(self) -> dict:
        return {"requests": {"running": self.running, "waiting": 0, **self.counters},
                "tokens": {"prompt": sum(p.num_tokens for p in self.prompts)},
                "pages": {"free": 8, "active": 0, "cached": 0, "filling": 0, "capacity": 8},
                "slots": {"active": 4, "snapshot": 5},
                "prefix_cache": {"hits": sum(1 for _ in self.prompts), "reused_tokens": 0},
                "failed": None}

    def published_stats(self) -> dict:
        return {**self.stats(), "stats_age_s": 0.0}

    @staticmethod
    def _logprobs(sampling: SamplingParams, tokens: tuple[int, ...]) -> tuple[dict, ...] | None:
        """The engine's entry format; the chosen token scores -0.5, alternative k -(k + 1)."""
        if sampling.logprobs is None or not tokens:
            return None
        return tuple({"token_id": t, "logprob": -0.5, "top": [(t + k, -(k + 1.0)) for k in range(sampling.logprobs)]}
                     for t in tokens)

    def _prepare(self, prompt) -> PreparedPrompt:
        if isinstance(prompt, PreparedPrompt):
            return prompt
        if isinstance(prompt, str):
            return prepare_tokens(self.tokenizer.encode(prompt))
        if not prompt or not all(isinstance(t, int) for t in prompt):
            raise InvalidRequestError("prompt token ids must be a flat list of integers")
        return prepare_tokens(prompt)

    def _reuse(self, prepared: PreparedPrompt) -> int:
        best = 0
        for earlier in self.prompts:
            m = min(len(earlier.token_ids), prepared.num_tokens - 1)
            same = np.flatnonzero(earlier.token_ids[:m] != prepared.token_ids[:m])
            common = int(same[0]) if same.size else m
            best = max(best, common // 64 * 64)
        return best
