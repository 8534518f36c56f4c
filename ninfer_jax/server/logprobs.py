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
    """Legacy completions: parallel lists of tokens, their logprobs, top alternatives and text offsets."""
    tokens = [_token(tokenizer, e["token_id"]) for e in entries]
    offsets, at = [], text_offset
    for token in tokens:
        offsets.append(at)
        at += len(token)
    return {"tokens": tokens, "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{_token(tokenizer, i): lp for i, lp in e["top"]} for e in entries],
            "text_offset": offsets}


def _token_bytes(tokenizer: Any, token_id: int) -> bytes:
    """A token's raw bytes (part of a UTF-8 character for some); `token_id:N` without a tokenizer."""
    return f"token_id:{token_id}".encode() if tokenizer is None else tokenizer.token_bytes(token_id)


def _token(tokenizer: Any, token_id: int) -> str:
    return _token_bytes(tokenizer, token_id).decode("utf-8", errors="replace")
