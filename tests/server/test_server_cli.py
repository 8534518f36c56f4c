"""ninfer-serve's options: the conflict rules (exit 2), the mapping onto Engine options, and the orderly
SIGTERM stop of a real server process (spec §5.5, §14.2)."""

from __future__ import annotations

import re
import signal
import threading
import types

import httpx
import openai
import pytest

from ninfer_jax.runtime.options import OPTIONS
from ninfer_jax.server.cli import UsageError, build_parser, main, serve_options
from ninfer_jax.server.images import ImageOptions
from ninfer_jax.server.limits import Limits
from ninfer_jax.server.subprocess_server import ServerProcess
from server_support import SERVE_FLAGS, sse_events, subprocess_env, wait_for


# the prefix cache's flags, which --no-prefix-reuse refuses
CACHE_FLAGS = sorted(o.flag for o in OPTIONS.values() if o.cache and o.flag and o.name != "no_prefix_reuse")


def _options(*argv):
    return serve_options(build_parser().parse_args(list(argv)))


def test_defaults_bind_loopback_and_serve_the_built_in_checkpoint():
    options = _options()
    assert (options.host, options.port, options.api_key) == ("127.0.0.1", 8000, None)
    # only what was given reaches the engine: every other value is the engine's own default or rule
    assert options.engine == {"path": None, "warmup": True}


def test_cache_options_reach_the_engine_under_the_spec_names(tmp_path):
    options = _options("--model", str(tmp_path), "--host-cache-mib", "1024", "--device-snapshot-slots", "6",
                       "--cache-taps-per-request", "3", "--cache-tap-ladder", "8192", "--cache-tap-min-gap", "2048",
                       "--prefix-cache-file", str(tmp_path / "cache.bin"), "--concurrent-prefill",
                       "--kv-capacity", "65536", "--prefill-chunk", "512", "--max-model-len", "4096",
                       "--batch-invariant", "--kernels", "pallas", "--prefill-attention", "cudnn",
                       "--dtype", "bfloat16", "--max-concurrency", "64", "--idle-prefill-chunk", "1024",
                       "--no-warmup")
    assert options.engine == {
        "path": str(tmp_path), "dtype": "bfloat16", "max_concurrency": 64, "kv_capacity": 65536, "warmup": False,
        "prefill_chunk": 512, "idle_prefill_chunk": 1024, "max_model_len": 4096, "concurrent_prefill": True,
        "batch_invariant": True, "kernels": "pallas", "prefill_attention": "cudnn",
        "host_cache_mib": 1024, "device_snapshot_slots": 6, "max_new_taps": 3, "tap_ladder_tokens": 8192,
        "tap_min_gap_tokens": 2048, "prefix_cache_file": str((tmp_path / "cache.bin").resolve()),
    }


def test_auto_values_reach_the_engine_as_auto():
    options = _options("--dtype", "auto", "--kv-capacity", "auto", "--no-prefix-reuse")
    assert options.engine == {"path": None, "dtype": "auto", "kv_capacity": "auto", "no_prefix_reuse": True,
                              "warmup": True}


def test_request_limits_and_origins_are_options_with_their_defaults_in_help():
    assert _options().limits == Limits() and _options().allowed_origins == ()
    options = _options("--max-request-bytes", "1024", "--max-prompt-chars", "5000", "--max-tools", "3",
                       "--allowed-origins", "https://a.example", "https://b.example")
    assert options.limits == Limits(max_request_bytes=1024, max_prompt_chars=5000, max_tools=3)
    assert options.allowed_origins == ("https://a.example", "https://b.example")
    text = " ".join(build_parser().format_help().split())
    for flag, default in [("--max-request-bytes", "default 33554432"), ("--max-prompt-chars", "default 16 per token"),
                          ("--max-json-depth", "default 64"), ("--max-prompts", "default 16"),
                          ("--max-stop-strings", "default 16"), ("--max-stop-chars", "default 256"),
                          ("--max-tools", "default 128"), ("--allowed-origins", "default none"),
                          ("--port", "default 8000")]:
        assert flag in text and default in text.split(flag + " ")[-1][:300], flag
    with pytest.raises(UsageError, match="--max-tools must be at least 1, got 0"):
        _options("--max-tools", "0")


def test_image_options_are_flags_and_bad_values_are_refused():
    assert _options().images == ImageOptions()
    options = _options("--allow-image-urls", "--image-fetch-timeout-s", "2.5", "--max-image-bytes", "1024",
                       "--max-images-per-prompt", "4")
    assert options.images == ImageOptions(allow_image_urls=True, image_fetch_timeout_s=2.5, max_image_bytes=1024,
                                          max_images_per_prompt=4)
    with pytest.raises(UsageError, match="--max-images-per-prompt must be at least 1, got 0"):
        _options("--max-images-per-prompt", "0")
    with pytest.raises(UsageError, match="--image-fetch-timeout-s must be a positive number, got nan"):
        _options("--image-fetch-timeout-s", "nan")


def test_the_compile_cache_folder_is_an_option_and_none_turns_it_off(tmp_path):
    assert _options("--compile-cache-dir", str(tmp_path)).compile_cache == str(tmp_path)
    assert _options("--compile-cache-dir", "none").compile_cache == "none"


def test_prefix_cache_file_is_resolved_to_an_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert _options("--prefix-cache-file", "cache.bin").engine["prefix_cache_file"] == str(tmp_path / "cache.bin")


@pytest.mark.parametrize("flag", [f for f in CACHE_FLAGS if f != "--concurrent-prefill"])
def test_no_prefix_reuse_conflicts_with_every_cache_setting(flag, tmp_path):
    value = {"--prefix-cache-file": [str(tmp_path / "f")]}.get(flag, ["64"])
    with pytest.raises(UsageError, match=f"--no-prefix-reuse conflicts with {flag}: there is no prefix cache"):
        _options("--no-prefix-reuse", flag, *value)


def test_no_prefix_reuse_takes_coalescing_on_or_off():
    # coalescing is on by default: without a cache it has nothing to coalesce, whichever way it is set
    for switch in ("--concurrent-prefill", "--no-concurrent-prefill"):
        assert _options("--no-prefix-reuse", switch).engine["no_prefix_reuse"]


def test_every_prefix_cache_flag_is_a_spec_name():
    assert CACHE_FLAGS == ["--cache-tap-ladder", "--cache-tap-min-gap", "--cache-taps-per-request",
                           "--concurrent-prefill", "--device-snapshot-slots", "--host-cache-mib",
                           "--prefix-cache-file"]


@pytest.mark.parametrize("argv, message", [
    (["--prefix-cache-file", "{tmp}/c.bin", "--host-cache-mib", "0"],
     "--prefix-cache-file needs a Host tier; it conflicts with --host-cache-mib 0"),
    (["--prefix-cache-file", "{tmp}"], "--prefix-cache-file {tmp} is a directory"),
    (["--prefix-cache-file", "{tmp}/missing/c.bin"], "the directory {tmp}/missing does not exist"),
    (["--model", "{tmp}/a", "{tmp}/b"], "two models given"),
    (["--kernels", "reference", "--prefill-attention", "cudnn"], "conflicts with --kernels 'reference'"),
    (["--dtype", "float32", "--prefill-attention", "cudnn"], "conflicts with --dtype 'float32'"),
    (["--prefill-chunk", "4096", "--idle-prefill-chunk", "2048"],
     r"--idle-prefill-chunk must be at least --prefill-chunk \(4096\), got 2048"),
    (["--cache-tap-ladder", "1024", "--cache-tap-min-gap", "2048"],
     r"--cache-tap-min-gap \(2048\) must not exceed --cache-tap-ladder \(1024\)"),
    (["--port", "70000"], "--port must be in 0..65535"),
    (["--speculative", "ngram", "--mixed-prefill-tokens", "512"],
     "--mixed-prefill-tokens 512 conflicts with --speculative"),
])
def test_conflicting_options_are_refused_before_loading(argv, message, tmp_path):
    tmp = tmp_path.resolve()
    with pytest.raises(UsageError, match=message.format(tmp=tmp)):
        _options(*(arg.format(tmp=tmp) for arg in argv))


def test_options_that_conflict_only_on_some_devices_are_left_to_the_engine():
    # cudnn needs a GPU and bf16; with dtype auto the command line cannot know either
    assert _options("--prefill-attention", "cudnn").engine["prefill_attention"] == "cudnn"
    # an idle chunk alone may be below an MoE model's default prefill chunk but not a dense one's
    assert _options("--idle-prefill-chunk", "4096").engine["idle_prefill_chunk"] == 4096


def test_refused_options_exit_with_status_2_and_say_why(capsys):
    with pytest.raises(SystemExit) as stopped:
        main(["--no-prefix-reuse", "--host-cache-mib", "64"])
    assert stopped.value.code == 2
    assert "--no-prefix-reuse conflicts with --host-cache-mib" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--kv-capacity", "lots"], "--kv-capacity: must be 'auto' or a positive integer, got 'lots'"),
    (["--kv-capacity", "0"], "--kv-capacity: must be 'auto' or a positive integer, got 0"),
    (["--host-cache-mib", "-1"], "--host-cache-mib: must be 'auto' or >= 0, got -1"),
    (["--prefill-chunk", "0"], "--prefill-chunk: must be a positive multiple of 64, got 0"),
    (["--prefill-chunk", "100"], "--prefill-chunk: must be a positive multiple of 64, got 100"),
    (["--max-concurrency", "0"], "--max-concurrency: must be 'auto' or in 1..256, got 0"),
    (["--max-concurrency", "257"], "--max-concurrency: must be 'auto' or in 1..256, got 257"),
    (["--cache-tap-ladder", "32"], "--cache-tap-ladder: must be >= 64, got 32"),
    (["--kernels", "triton"], "--kernels: invalid choice: 'triton'"),
])
def test_malformed_values_exit_with_status_2(argv, message, capsys):
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == 2
    assert message in capsys.readouterr().err


def test_sigterm_answers_in_flight_requests_as_unavailable_then_exits_cleanly(tmp_path):
    server = ServerProcess(SERVE_FLAGS, env=subprocess_env(), log_file=tmp_path / "serve.log")
    with server:
        url = server.url
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        long = {"max_tokens": 1500, "temperature": 0, "ignore_eos": True}
        results: dict[str, object] = {}
        started = threading.Barrier(3)  # the two streams and this thread

        def openai_stream():
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0)
            stream = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "count"}], stream=True,
                max_tokens=long["max_tokens"], temperature=0, extra_body={"ignore_eos": True})
            chunks = 0
            try:
                for _ in stream:
                    chunks += 1
                    if chunks == 2:
                        started.wait()
            except openai.APIError as error:
                results["openai_stream"] = (chunks, error.message)

        def anthropic_stream():
            with httpx.stream("POST", f"{url}/v1/messages", json={
                    "model": model, "stream": True, "messages": [{"role": "user", "content": "count"}], **long},
                    timeout=120) as response:
                lines = response.iter_lines()
                next(line for line in lines if line.startswith("event: content_block_delta"))
                started.wait()
                results["anthropic_stream"] = sse_events(lines)[-1]

        def openai_blocking():
            response = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": "count", **long},
                                  timeout=120)
            results["openai_blocking"] = (response.status_code, response.json())

        threads = [threading.Thread(target=f) for f in (openai_stream, anthropic_stream, openai_blocking)]
        for thread in threads:
            thread.start()
        started.wait(timeout=120)
        wait_for(lambda: "ninfer_num_requests_running 3.0" in httpx.get(f"{url}/metrics").text)
        server.process.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(120)
    output = (tmp_path / "serve.log").read_text()
    assert server.exit_status == 0, output
    assert results["openai_stream"][0] >= 2 and "shutting down" in results["openai_stream"][1]
    assert results["anthropic_stream"] == ("error", {"type": "error", "error": {
        "type": "overloaded_error", "message": "the server is shutting down; retry on another instance"}})
    status, body = results["openai_blocking"]
    assert status == 503 and body["error"]["type"] == "server_error"
    order = [output.index(line) for line in ("serving | ", "stopping | SIGTERM", "engine stopped", "stopped | ")]
    assert order == sorted(order), output
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health")


def test_ctrl_c_stops_in_the_same_order_and_exits_cleanly(tmp_path):
    server = ServerProcess(SERVE_FLAGS, env=subprocess_env(), log_file=tmp_path / "serve.log")
    with server:
        server.process.send_signal(signal.SIGINT)
        assert server.process.wait(timeout=60) == 0
    output = (tmp_path / "serve.log").read_text()
    order = [output.index(line) for line in ("stopping | SIGINT", "engine stopped", "stopped | ")]
    assert order == sorted(order), output


class _SavingEngine:
    """An engine whose stop() is a save that ends only when abandoned (`ends`: or never)."""

    def __init__(self, ends: bool):
        self.ends, self.abandoned = ends, threading.Event()

    def stop(self):
        self.abandoned.wait(30 if self.ends else 0)
        if not self.ends:
            threading.Event().wait(30)

    def abandon_save(self):
        self.abandoned.set()


@pytest.mark.parametrize("ends", [True, False], ids=["save-stops", "stop-hangs"])
def test_a_second_ctrl_c_abandons_the_save_and_exits_within_the_wait(ends, monkeypatch):
    """The first Ctrl+C starts the orderly stop, whose save runs on; the second abandons it (spec 5.5) and the
    server's stop returns once the save ends, or SAVE_ABANDON_WAIT_S later if the engine's stop does not end."""
    import asyncio
    import time

    import uvicorn

    from ninfer_jax.server import serving

    monkeypatch.setattr(serving, "SAVE_ABANDON_WAIT_S", 0.5)
    engine = _SavingEngine(ends)
    server = serving.OrderlyServer(uvicorn.Config(app=None), types.SimpleNamespace(engine=engine))

    async def scenario():
        stopping = asyncio.ensure_future(server._stop_engine(engine))
        server.handle_exit(signal.SIGINT, None)
        await asyncio.sleep(0.2)
        assert not stopping.done() and not engine.abandoned.is_set()  # the first press waits for the save
        began = time.monotonic()
        server.handle_exit(signal.SIGINT, None)
        await stopping
        return time.monotonic() - began

    waited = asyncio.run(scenario())
    assert engine.abandoned.is_set() and server.force_exit
    assert waited < 0.3 if ends else 0.5 <= waited < 1.5


def test_a_server_restarted_with_a_prefix_cache_file_serves_the_saved_prefix(tmp_path):
    """§5.5 through ninfer-serve: SIGTERM saves the Host tier; the restarted server loads it and the same
    conversation is served from it (usage.prompt_tokens_details.cached_tokens)."""
    cache = tmp_path / "prefix.cache"
    flags = [*SERVE_FLAGS, "--host-cache-mib", "64", "--prefix-cache-file", str(cache)]
    messages = [{"role": "system", "content": "You review code. " + "Check every path and every error. " * 40},
                {"role": "user", "content": "What does the cache keep across a restart?"}]

    def ask(url):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0)
        model = client.models.list().data[0].id
        return client.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0)

    with ServerProcess(flags, env=subprocess_env(), log_file=tmp_path / "first.log") as first:
        before = ask(first.url)
    assert first.exit_status == 0 and cache.exists()
    assert "prefix cache saved" in (tmp_path / "first.log").read_text()
    with ServerProcess(flags, env=subprocess_env(), log_file=tmp_path / "second.log") as second:
        after = ask(second.url)
    assert "prefix cache restored" in (tmp_path / "second.log").read_text()
    assert before.usage.prompt_tokens_details.cached_tokens == 0
    assert after.usage.prompt_tokens_details.cached_tokens >= 256  # the prompt's tap, restored from the file
    assert after.choices[0].message.content == before.choices[0].message.content


def test_a_vllm_command_line_carries_over(monkeypatch, capsys):
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    options = _options("--max-num-seqs", "64", "--kv-cache-dtype", "fp8", "--gpu-memory-utilization", "0.9",
                       "--enable-auto-tool-choice", "--tool-call-parser", "qwen3_coder", "--reasoning-parser", "qwen3",
                       "--trust-remote-code", "--no-enable-prefix-caching", "--seed", "42")
    assert options.engine == {"path": None, "max_concurrency": 64, "kv_dtype": "fp8", "no_prefix_reuse": True,
                              "seed": 42, "warmup": True}
    assert options.memory_fraction == 0.9 and _options().memory_fraction == 0.95
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.90")
    assert _options("--gpu-memory-utilization", "0.9").memory_fraction == 0.9  # the same share both ways
    for argv, message in ((["--gpu-memory-utilization", "0.8"], "XLA_PYTHON_CLIENT_MEM_FRACTION=0.90: give one"),
                          (["--gpu-memory-utilization", "1.5"], "must be in (0, 1], got 1.5"),
                          (["--enable-prefix-caching", "--no-prefix-reuse"], "give one")):
        with pytest.raises(UsageError, match=re.escape(message)):
            _options(*argv)
    # a parser of another format than Qwen3.5's is refused, not ignored
    with pytest.raises(SystemExit) as stopped:
        main(["--tool-call-parser", "hermes"])
    assert stopped.value.code == 2 and "invalid choice: 'hermes'" in capsys.readouterr().err
