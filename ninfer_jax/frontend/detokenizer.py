"""Streaming detokenization: token ids in, text deltas out.

Byte-level BPE splits multi-byte UTF-8 characters across tokens (an emoji is often two or three
tokens). Decoding each token alone would emit U+FFFD for the halves; this feeds token bytes through an
incremental UTF-8 decoder instead, which holds an incomplete character back until it completes and
emits U+FFFD only for bytes no later token can complete. The concatenated deltas equal
`Tokenizer.decode` of all ids.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable

from .tokenizer import Tokenizer


class IncrementalDetokenizer:
    """One per generated sequence; not thread-safe."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self._tokenizer = tokenizer
        self._skip_ids = tokenizer.special_token_ids if skip_special_tokens else frozenset()
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Adds one token; returns the text that is now final (possibly empty)."""
        if token_id in self._skip_ids:
            return ""
        return self._utf8.decode(self._tokenizer.token_bytes(token_id))

    def push_many(self, token_ids: Iterable[int]) -> str:
        return "".join(self.push(token_id) for token_id in token_ids)

    def flush(self) -> str:
        """Ends the stream: bytes of a character that never completed become U+FFFD."""
        return self._utf8.decode(b"", final=True)
