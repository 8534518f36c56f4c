"""vLLM's `return_token_ids` on the real engine: the prompt's ids are the ones the engine was fed and each choice's
the ones it generated, in whole responses and in streams (an event's ids on its first chunk)."""

from __future__ import annotations

import httpx
import pytest

from ninfer_jax import SamplingParams
from server_support import real_engine, server, sse_events, tiny_frontend  # noqa: F401 (fixtures)

IDS = [785, 6722, 315, 9625, 374]


@pytest.fixture(scope="module")
def engine():
    return real_engine()


def _post(server, path, body, stream=False):
    body = {"model": real_engine().model_name, "max_tokens": 5, "temperature": 0, "return_token_ids": True, **body}
    if not stream:
        return httpx.post(f"{server.url}{path}", json=body, timeout=60).json()
    with httpx.stream("POST", f"{server.url}{path}", json={**body, "stream": True}, timeout=60) as response:
        return [data for _, data in sse_events(response.iter_lines()) if data != "[DONE]"]


def test_completions_return_the_prompt_and_generated_ids(server, engine):
    want = engine.generate(IDS, SamplingParams(max_tokens=5, temperature=0))
    choice = _post(server, "/v1/completions", {"prompt": IDS})["choices"][0]
    assert choice["prompt_token_ids"] == IDS and choice["token_ids"] == list(want.token_ids)
    chunks = _post(server, "/v1/completions", {"prompt": IDS}, stream=True)
    assert chunks[0]["choices"][0]["prompt_token_ids"] == IDS
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == list(want.token_ids)


def test_chat_returns_the_rendered_prompts_ids_and_each_choices(server, engine):
    messages = [{"role": "user", "content": "Hi"}]
    body = _post(server, "/v1/chat/completions", {"messages": messages, "n": 2})
    prompt = body["prompt_token_ids"]
    assert len(prompt) == body["usage"]["prompt_tokens"]
    assert tiny_frontend()[0].decode(prompt).endswith("<|im_start|>assistant\n<think>\n")
    want = engine.generate(prompt, SamplingParams(max_tokens=5, temperature=0))
    assert [c["token_ids"] for c in body["choices"]] == [list(want.token_ids)] * 2
    chunks = _post(server, "/v1/chat/completions", {"messages": messages}, stream=True)
    assert chunks[0]["prompt_token_ids"] == prompt
    assert [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids", ())] == list(want.token_ids)
