"""vLLM's /tokenize and /detokenize on the real engine: a prompt's ids are the completions endpoint's, chat messages'
are the ids the chat endpoint feeds the engine, and ids go back to text; bad input is a 400."""

from __future__ import annotations

import httpx
import pytest

from server_support import real_engine, server, tiny_frontend  # noqa: F401 (fixtures)


@pytest.fixture(scope="module")
def engine():
    return real_engine()


def _post(server, path, body):
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def test_a_prompts_ids_round_trip(server, engine):
    text = "def add(a, b):\n    return a + b"
    got = _post(server, "/tokenize", {"prompt": text, "return_token_strs": True}).json()
    ids = tiny_frontend()[0].encode(text)
    assert got["tokens"] == ids and got["count"] == len(ids) and got["max_model_len"] == engine.max_model_len
    assert "".join(got["token_strs"]) == text
    assert _post(server, "/detokenize", {"model": engine.model_name, "tokens": ids}).json() == {"prompt": text}


def test_chat_messages_count_what_the_chat_endpoint_feeds_the_engine(server, engine):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    got = _post(server, "/tokenize", {"model": engine.model_name, "messages": messages}).json()
    usage = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "model": engine.model_name, "messages": messages, "max_tokens": 1}).json()["usage"]
    assert got["count"] == len(got["tokens"]) == usage["prompt_tokens"]
    assert "<|im_start|>user" in _post(server, "/detokenize", {"tokens": got["tokens"]}).json()["prompt"]
    continued = _post(server, "/tokenize", {"messages": [*messages, {"role": "assistant", "content": "Four"}],
                                            "continue_final_message": True, "add_generation_prompt": False}).json()
    text = _post(server, "/detokenize", {"tokens": continued["tokens"]}).json()["prompt"]
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nFour")


@pytest.mark.parametrize("path, body, status", [
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, 400),  # both
    ("/tokenize", {}, 400),  # neither
    ("/tokenize", {"messages": []}, 400),
    ("/tokenize", {"model": "other", "prompt": "x"}, 404),
    ("/detokenize", {"tokens": [-1]}, 400),
    ("/detokenize", {"tokens": [10**9]}, 400),
    ("/detokenize", {"tokens": "12"}, 400),
])
def test_bad_tokenize_requests_are_refused(server, path, body, status):
    response = _post(server, path, body)
    assert response.status_code == status, response.text
    assert "error" in response.json()
