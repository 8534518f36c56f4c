"""Prompt logprobs through the OpenAI endpoints on the real engine: legacy completions' `echo` (lm-evaluation-harness's
loglikelihood request: echo, logprobs 1, max_tokens 1, token ids) and vLLM's `prompt_logprobs` extension."""

from __future__ import annotations

import httpx
import pytest

from ninfer_jax import SamplingParams
from server_support import real_engine, server, sse_events, tiny_frontend  # noqa: F401 (fixtures)

IDS = [785, 6722, 315, 9625, 374, 12095, 13, 576, 6722, 315]


@pytest.fixture(scope="module")
def engine():
    return real_engine()


def _post(server, path, body):
    return httpx.post(f"{server.url}{path}", json={"model": real_engine().model_name, **body}, timeout=120)


def test_an_echoed_completion_scores_its_prompt_as_lm_eval_asks(server, engine):
    response = _post(server, "/v1/completions", {"prompt": IDS, "max_tokens": 1, "echo": True, "logprobs": 1,
                                                  "temperature": 0})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    want = engine.generate(IDS, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1, logprobs=1))
    tokenizer = tiny_frontend()[0]
    assert choice["text"] == tokenizer.decode(IDS) + want.text
    lp = choice["logprobs"]
    assert len(lp["token_logprobs"]) == len(IDS) + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:len(IDS)] == pytest.approx([e["logprob"] for e in want.prompt_logprobs[1:]])
    assert lp["token_logprobs"][-1] == pytest.approx(want.logprobs[0]["logprob"])
    assert all(len(top) == 1 for top in lp["top_logprobs"][1:])
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    assert lp["tokens"][:len(IDS)] == [tokenizer.token_bytes(i).decode("utf-8", "replace") for i in IDS]


def test_echo_without_logprobs_prepends_the_prompt_text(server, engine):
    response = _post(server, "/v1/completions", {"prompt": "def add(a, b):", "max_tokens": 3, "echo": True,
                                                  "temperature": 0})
    want = engine.generate("def add(a, b):", SamplingParams(max_tokens=3, temperature=0))
    choice = response.json()["choices"][0]
    assert choice["text"] == "def add(a, b):" + want.text and choice["logprobs"] is None


def test_a_streamed_echo_sends_the_prompt_first(server, engine):
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=120, json={
            "model": engine.model_name, "prompt": IDS, "max_tokens": 2, "echo": True, "logprobs": 0,
            "temperature": 0, "stream": True}) as response:
        chunks = [data for _, data in sse_events(response.iter_lines()) if data != "[DONE]"]
    first = chunks[0]["choices"][0]
    assert first["text"] == tiny_frontend()[0].decode(IDS)
    assert len(first["logprobs"]["token_logprobs"]) == len(IDS) and first["logprobs"]["token_logprobs"][0] is None
    want = engine.generate(IDS, SamplingParams(max_tokens=2, temperature=0))
    assert "".join(c["choices"][0]["text"] for c in chunks) == first["text"] + want.text


def test_vllms_prompt_logprobs_on_completions_and_chat(server, engine):
    want = engine.generate(IDS, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2))
    choice = _post(server, "/v1/completions", {"prompt": IDS, "max_tokens": 1, "prompt_logprobs": 2,
                                                "temperature": 0}).json()["choices"][0]
    scored = choice["prompt_logprobs"]
    assert scored[0] is None and len(scored) == len(IDS)
    for token, entry, got in zip(IDS[1:], want.prompt_logprobs[1:], scored[1:]):
        assert got[str(token)]["logprob"] == pytest.approx(entry["logprob"])
        assert {int(k) for k in got} == {token, *(i for i, _ in entry["top"])}
    body = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
                                                   "prompt_logprobs": 0, "temperature": 0}).json()
    assert body["prompt_logprobs"][0] is None and len(body["prompt_logprobs"]) == body["usage"]["prompt_tokens"]
    assert all(len(e) == 1 for e in body["prompt_logprobs"][1:])  # the prompt's own token, no alternatives


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 1, "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 1, "stream": True}),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 21}),
])
def test_prompt_logprobs_the_server_cannot_give_are_refused(server, path, body):
    response = _post(server, path, body)
    assert response.status_code == 400 and "prompt_logprobs" in response.text


def test_return_tokens_as_token_ids_names_every_logprob_token_by_its_id(server, engine):
    body = {"max_tokens": 3, "temperature": 0, "logprobs": 2, "return_tokens_as_token_ids": True,
            "return_token_ids": True}
    choice = _post(server, "/v1/completions", {"prompt": IDS, **body}).json()["choices"][0]
    assert choice["logprobs"]["tokens"] == [f"token_id:{i}" for i in choice["token_ids"]]
    assert all(set(top) <= {f"token_id:{i}" for i in range(engine.config.vocab_size)}
               for top in choice["logprobs"]["top_logprobs"])
    chat = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], **body,
                                                  "logprobs": True, "top_logprobs": 2}).json()["choices"][0]
    content = chat["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{i}" for i in chat["token_ids"]]
    assert all(c["bytes"] == list(c["token"].encode()) and len(c["top_logprobs"]) == 2 for c in content)
