"""The engine's per-token logprobs ({"token_id", "logprob", "top": [(id, logprob), ...]}) in OpenAI's two formats."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def chat_logprobs(tokenizer: Any, entries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Chat completions: {"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}."""
    def one(token_id: int, logprob: float) -> dict[str, Any]:
        raw = _token_bytes(tokenizer, token_id)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}

    return {"content": [{**one(e["token_id"], e["logprob"]), "top_logprobs": [one(i, lp) for i, lp in e["top"]]}
                        for e in entries]}


def completion_logprobs(tokenizer: Any, entries: Sequence[dict[str, Any]], text_offset: int = 0) -> dict[str, Any]:
    """Legacy completions: parallel lists of tokens, their logprobs, top alternatives and text offsets. An entry
    whose logprob is None (an echoed prompt's first token, which nothing predicts) has null ones."""
    tokens = [token_text(tokenizer, e["token_id"]) for e in entries]
    offsets, at = [], text_offset
    for token in tokens:
        offsets.append(at)
        at += len(token)
    return {"tokens": tokens, "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [None if e["top"] is None else {token_text(tokenizer, i): lp for i, lp in e["top"]}
                             for e in entries],
            "text_offset": offsets}


def echoed_prompt(prompt_ids: Sequence[int], entries: Sequence[dict[str, Any] | None]) -> list[dict[str, Any]]:
    """The engine's prompt entries (None first) as `completion_logprobs` entries: the first token with null ones."""
    return [{"token_id": int(prompt_ids[0]), "logprob": None, "top": None}, *entries[1:]]


def vllm_prompt_logprobs(tokenizer: Any, entries: Sequence[dict[str, Any] | None]) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: per prompt token None (the first) or {token id: {logprob, decoded_token}} for the
    prompt's token and its top alternatives."""
    def one(token_id: int, logprob: float) -> tuple[str, dict[str, Any]]:
        return str(token_id), {"logprob": logprob, "decoded_token": token_text(tokenizer, token_id)}

    return [None if e is None else dict([one(e["token_id"], e["logprob"]), *(one(i, lp) for i, lp in e["top"])])
            for e in entries]


def _token_bytes(tokenizer: Any, token_id: int) -> bytes:
    """A token's raw bytes (part of a UTF-8 character for some); `token_id:N` without a tokenizer."""
    return f"token_id:{token_id}".encode() if tokenizer is None else tokenizer.token_bytes(token_id)


def token_text(tokenizer: Any, token_id: int) -> str:
    """A token's text: its bytes decoded (a partial UTF-8 character as U+FFFD)."""
    return _token_bytes(tokenizer, token_id).decode("utf-8", errors="replace")
