"""`n > 1` on the real engine (built-in tiny checkpoint): the samples share one prefill through the cache, each
draws with its own seed (s + i, vLLM's rule), streams interleave choices by index, usage counts the prompt once,
a client that leaves cancels every sample, and n over --max-n is a 400 naming it."""

from __future__ import annotations

import uuid

import httpx
import pytest

from server_support import oai, real_engine, server, sse_events, wait_for  # noqa: F401 (fixtures)

NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def engine():
    return real_engine()


def _long_message() -> str:
    """A few hundred tokens no other test sends (so nothing of it is cached)."""
    return f"{uuid.uuid4().hex} " + " ".join(f"item {i} is {i * 7 % 13}" for i in range(80))


def test_n_4_chat_computes_the_prompt_once(oai, engine, server):
    registry = server.context.metrics.registry
    computed, reused = engine.stats()["tokens"]["prompt"], registry.get_sample_value("ninfer_cached_tokens_total")
    response = oai.chat.completions.create(
        model=engine.model_name, messages=[{"role": "user", "content": _long_message()}], n=4, max_tokens=6,
        temperature=1.0, seed=11, extra_body={**NO_THINKING, "ignore_eos": True})
    prompt = response.usage.prompt_tokens
    assert prompt > 300
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    assert all(c.finish_reason == "length" for c in response.choices)
    # The prompt counts once (OpenAI's and vLLM's usage); every sample's tokens count.
    assert response.usage.completion_tokens == 4 * 6
    assert response.usage.prompt_tokens_details.cached_tokens == 0
    computed = engine.stats()["tokens"]["prompt"] - computed
    reused = server.context.metrics.registry.get_sample_value("ninfer_cached_tokens_total") - reused
    # The first sample computes the prompt; the others reuse all of it but the tail after its last full block.
    assert computed == prompt + 3 * (prompt % 64)
    assert reused == 3 * (prompt // 64 * 64)
    assert len({c.message.content for c in response.choices}) > 1  # four seeds, four samples


def test_sample_i_draws_with_seed_plus_i(oai, engine):
    fields = dict(model=engine.model_name, prompt=[1000, 1001, 1002, 1003], max_tokens=6, temperature=1.0,
                  extra_body={"ignore_eos": True})
    three = oai.completions.create(**fields, n=3, seed=40)
    assert [c.index for c in three.choices] == [0, 1, 2]
    singles = [oai.completions.create(**fields, seed=40 + i).choices[0].text for i in range(3)]
    assert [c.text for c in three.choices] == singles
    assert three.usage.prompt_tokens == 4 and three.usage.completion_tokens == 18


def test_n_with_temperature_0_gives_identical_greedy_samples(oai, engine):
    response = oai.completions.create(model=engine.model_name, prompt=[7, 8, 9], n=3, max_tokens=5, temperature=0)
    texts = [c.text for c in response.choices]
    assert len(texts) == 3 and len(set(texts)) == 1
    assert texts[0] == oai.completions.create(model=engine.model_name, prompt=[7, 8, 9], max_tokens=5,
                                              temperature=0).choices[0].text


def test_batch_of_prompts_with_n_orders_choices_prompt_major(oai, engine):
    response = oai.completions.create(model=engine.model_name, prompt=[[11, 22, 33], [44, 55]], n=2, max_tokens=3,
                                      temperature=0)
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    assert response.choices[0].text == response.choices[1].text != ""
    assert response.choices[2].text == response.choices[3].text
    assert response.usage.prompt_tokens == 5 and response.usage.completion_tokens == 12


def test_completion_stream_interleaves_choices_that_equal_the_non_streamed(oai, engine):
    fields = dict(model=engine.model_name, prompt=[300, 301, 302], n=3, max_tokens=8, temperature=1.0, seed=3,
                  extra_body={"ignore_eos": True})
    expected = [c.text for c in oai.completions.create(**fields).choices]
    chunks = list(oai.completions.create(**fields, stream=True, stream_options={"include_usage": True}))
    texts, finished, order = ["", "", ""], {}, []
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] += choice.text
        order.append(choice.index)
        if choice.finish_reason:
            finished[choice.index] = choice.finish_reason
    assert texts == expected
    assert finished == {0: "length", 1: "length", 2: "length"}
    assert order != sorted(order)  # the samples decode together, so their chunks interleave
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24


def test_chat_stream_gives_each_choice_its_role_text_and_finish(oai, engine):
    stream = oai.chat.completions.create(
        model=engine.model_name, messages=[{"role": "user", "content": "Hi"}], n=2, max_tokens=4, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_body={**NO_THINKING, "ignore_eos": True})
    chunks = list(stream)
    roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role == "assistant"]
    texts = ["", ""]
    finishes = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert roles == [0, 1] and finishes == {0: "length", 1: "length"}
    assert texts[0] == texts[1] != ""  # greedy samples are equal
    assert chunks[-1].usage.completion_tokens == 8


def test_disconnect_cancels_every_sample(engine, server):
    before = engine.stats()["requests"].get("finished_cancelled", 0)
    with httpx.stream("POST", f"{server.url}/v1/completions", json={
            "model": engine.model_name, "prompt": "Talk forever", "n": 3, "max_tokens": 1500, "temperature": 1,
            "ignore_eos": True, "stream": True}) as response:
        lines = response.iter_lines()
        assert sum(line.startswith("data: ") for line in (next(lines), next(lines), next(lines), next(lines))) >= 2
    wait_for(lambda: engine.stats()["requests"].get("finished_cancelled", 0) == before + 3)
    assert wait_for(lambda: (s := engine.stats())["requests"]["running"] == 0 and s)["pages"]["active"] == 0


@pytest.mark.parametrize("path, body", [
    pytest.param("/v1/completions", {"prompt": "x"}, id="completions"),
    pytest.param("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}, id="chat"),
])
def test_n_over_the_bound_is_a_400_naming_the_option(engine, server, path, body):
    response = httpx.post(f"{server.url}{path}", json={"model": engine.model_name, "n": 17, **body})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "n" and "--max-n" in error["message"] and "16" in error["message"]
    assert httpx.post(f"{server.url}{path}", json={"model": engine.model_name, "n": 0, **body}).status_code == 400
