"""The OpenAI endpoints on the real engine (built-in tiny checkpoint), driven by the official `openai` SDK:
chat and completions, streaming with usage, concurrent clients, and client disconnects cancelling work."""

from __future__ import annotations

import concurrent.futures

import httpx
import openai
import pytest

from ninfer_jax import SamplingParams
from server_support import oai, real_engine, server, sse_events, wait_for  # noqa: F401 (fixtures)


@pytest.fixture(scope="module")
def engine():
    return real_engine()



def _finished(engine, reason):
    return engine.stats()["requests"].get(f"finished_{reason}", 0)


def test_models_lists_the_served_checkpoint(oai, engine):
    assert [m.id for m in oai.models.list().data] == [engine.model_name]
    assert oai.models.retrieve(engine.model_name).id == engine.model_name
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        oai.models.retrieve("another-model")


def test_chat_completion_reports_usage_with_cached_tokens(oai, engine):
    response = oai.chat.completions.create(
        model=engine.model_name, messages=[{"role": "user", "content": "What is 2+2?"}], max_tokens=3, temperature=0,
        prompt_cache_key="session-1")
    choice = response.choices[0]
    assert choice.finish_reason in ("stop", "length")
    assert response.usage.completion_tokens <= 3
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens
    assert 0 <= response.usage.prompt_tokens_details.cached_tokens < response.usage.prompt_tokens
    # Thinking is on by default: the tiny model never closes </think>, so its words are reasoning.
    assert choice.message.content == "" and choice.message.reasoning_content


def test_completion_text_is_the_engines_greedy_output(oai, engine):
    response = oai.completions.create(model=engine.model_name, prompt="The capital of France is", max_tokens=4,
                                         temperature=0)
    expected = engine.generate("The capital of France is", SamplingParams(max_tokens=4, temperature=0))
    assert response.choices[0].text == expected.text
    assert response.usage.completion_tokens == len(expected.token_ids)


def test_completion_takes_token_ids_and_batches(oai, engine):
    response = oai.completions.create(model=engine.model_name, prompt=[[11, 22, 33], [44, 55]], max_tokens=2,
                                         temperature=0)
    assert [c.index for c in response.choices] == [0, 1]
    assert response.usage.prompt_tokens == 5


def test_a_cache_salt_shares_the_cache_only_with_requests_of_the_same_salt(oai, engine):
    ids = [(7 * i) % 500 + 3 for i in range(200)]

    def cached(**salt):
        response = oai.completions.create(model=engine.model_name, prompt=ids, max_tokens=2, temperature=0,
                                          extra_body=salt)
        return response.usage.prompt_tokens_details.cached_tokens

    assert cached(cache_salt="tenant-a") == 0
    assert cached(cache_salt="tenant-b") == cached() == 0
    assert cached(cache_salt="tenant-a") >= 128
    with pytest.raises(openai.BadRequestError, match="cache_salt"):
        cached(cache_salt="")


def test_reset_prefix_cache_empties_the_cache(oai, engine, server):
    ids = [(11 * i) % 500 + 3 for i in range(200)]

    def cached():
        response = oai.completions.create(model=engine.model_name, prompt=ids, max_tokens=2, temperature=0)
        return response.usage.prompt_tokens_details.cached_tokens

    cached()
    assert cached() >= 128
    for path in ("/reset_prefix_cache", "/flush_cache"):  # vLLM's, SGLang's
        reset = httpx.post(f"{server.url}{path}", timeout=60)
        assert reset.status_code == 200 and reset.json()["status"] == "ok"
        assert cached() == 0
    assert reset.json()["blocks"] >= 3


def test_chat_stream_ends_with_finish_reason_usage_chunk_and_done(oai, engine, server):
    stream = oai.chat.completions.create(
        model=engine.model_name, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_body={"chat_template_kwargs": {
            "enable_thinking": False}})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason in ("stop", "length")
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens <= 3
    assert usage.prompt_tokens_details.cached_tokens >= 0
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(text) > 0
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json={
            "model": engine.model_name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
            "temperature": 0, "stream": True}) as raw:
        events = sse_events(raw.iter_lines())
    assert events[-1] == (None, "[DONE]")


def test_continuous_usage_stats_count_each_choice_in_every_chunk(oai, engine):
    """vLLM's stream_options.continuous_usage_stats: every chunk's usage is its choice's prompt and its tokens so
    far, reaching what the final usage chunk counts."""
    stream = oai.chat.completions.create(
        model=engine.model_name, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0,
        stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    chunks = list(stream)
    final = chunks[-1].usage
    counted = [c.usage.completion_tokens for c in chunks[:-1]]
    assert counted == sorted(counted) and counted[0] == 0 and counted[-1] == final.completion_tokens > 0
    assert all(c.usage.prompt_tokens == final.prompt_tokens
               and c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks[:-1])
    stream = oai.completions.create(model=engine.model_name, prompt=[1000, 1001, 1002], max_tokens=3, temperature=0,
                                    n=2, stream=True, extra_body={"ignore_eos": True},
                                    stream_options={"include_usage": True, "continuous_usage_stats": True})
    chunks = list(stream)
    last = {c.choices[0].index: c.usage for c in chunks if c.choices}
    assert {i: (u.prompt_tokens, u.completion_tokens) for i, u in last.items()} == {0: (3, 3), 1: (3, 3)}
    assert chunks[-1].usage.completion_tokens == 6


def test_eight_concurrent_clients_are_all_answered_and_leave_no_pages(oai, engine):
    def ask(i):
        return oai.chat.completions.create(
            model=engine.model_name, messages=[{"role": "user", "content": f"Question number {i}?"}], max_tokens=4,
            temperature=0)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(ask, range(8)))
    assert all(r.choices[0].finish_reason in ("stop", "length") for r in responses)
    assert len({r.id for r in responses}) == 8
    stats = wait_for(lambda: (s := engine.stats())["requests"]["running"] == 0 and s)
    assert stats["pages"]["active"] == 0
    engine.check_ledger()


def test_stream_disconnect_cancels_the_engine_request(engine, server):
    before = _finished(engine, "cancelled")
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json={
            "model": engine.model_name, "messages": [{"role": "user", "content": "Talk forever"}],
            "max_tokens": 1500, "temperature": 0, "ignore_eos": True, "stream": True}) as response:
        lines = response.iter_lines()
        assert sum(line.startswith("data: ") for line in (next(lines), next(lines), next(lines), next(lines))) >= 2
    wait_for(lambda: _finished(engine, "cancelled") == before + 1)
    assert engine.stats()["pages"]["active"] == 0
    assert 'ninfer_request_finish_total{reason="cancelled"}' in httpx.get(f"{server.url}/metrics").text


def test_non_streaming_disconnect_cancels_the_engine_request(engine, server):
    before = _finished(engine, "cancelled")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json={
            "model": engine.model_name, "prompt": "Talk forever", "max_tokens": 1500, "temperature": 0,
            "ignore_eos": True}, timeout=httpx.Timeout(10, read=1.0))
    wait_for(lambda: _finished(engine, "cancelled") == before + 1)
    assert "499" in httpx.get(f"{server.url}/metrics").text
