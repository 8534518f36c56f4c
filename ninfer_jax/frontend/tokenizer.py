"""The checkpoint's tokenizer: `tokenizer.json` through Hugging Face `tokenizers`, plus its config.

A checkpoint without tokenizer files still serves token ids, so `load_tokenizer` returns None there
unless the caller needs text.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

from .bpe_merges import unicode_to_bytes
from .qwen35_files import write_qwen35_tokenizer_files

__all__ = ["Tokenizer", "TokenizerNotFoundError", "load_tokenizer", "write_qwen35_tokenizer_files"]


class TokenizerNotFoundError(FileNotFoundError):
    """The checkpoint directory has no tokenizer.json."""


class Tokenizer:
    """Text <-> token ids for one checkpoint. Thread-safe for encode/decode (the Rust core is)."""

    def __init__(self, backend: _HFTokenizer, config: dict | None = None):
        config = config or {}
        self._backend = backend
        added = backend.get_added_tokens_decoder()
        self._added_text = {token_id: token.content for token_id, token in added.items()}
        self.special_token_ids: frozenset[int] = frozenset(i for i, t in added.items() if t.special)
        # Ids the tokenizer knows; a model's embedding may be padded larger (Qwen3.5: 248320).
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.eos_token_id: int | None = self._id_of(config.get("eos_token"))
        self.pad_token_id: int | None = self._id_of(config.get("pad_token"))
        self.model_max_length: int | None = config.get("model_max_length")

    @classmethod
    def from_file(cls, tokenizer_json: str | Path, config: dict | None = None) -> Tokenizer:
        return cls(_HFTokenizer.from_file(str(tokenizer_json)), config)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; added-token spellings in it (e.g. `<|im_start|>`) become those tokens."""
        return self._backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """`encode` of each text, the texts spread over the Rust core's threads (a training corpus)."""
        return [e.ids for e in self._backend.encode_batch(list(texts), add_special_tokens=False)]

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids and each token's [start, end) character span in `text`."""
        encoding = self._backend.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json text (what grammar libraries read the vocabulary from)."""
        return self._backend.to_str()

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes a token stands for (a part of a UTF-8 character for some byte-level tokens).

        Ids the vocabulary lacks (the model's padding rows above vocab_size) stand for nothing, as in
        `decode`, which drops them.
        """
        text = self._added_text.get(token_id)
        if text is not None:
            return text.encode("utf-8")
        spelling = self._backend.id_to_token(token_id)
        if spelling is None:
            return b""
        table = unicode_to_bytes()
        return bytes(table[c] for c in spelling)

    def _id_of(self, token: str | dict | None) -> int | None:
        if isinstance(token, dict):  # older configs spell tokens as serialized AddedToken objects
            token = token.get("content")
        return None if token is None else self._backend.token_to_id(token)


def load_tokenizer(checkpoint_dir: str | Path, *, required: bool = False) -> Tokenizer | None:
    """Loads `tokenizer.json` (and `tokenizer_config.json` when present) from a checkpoint directory.

    Returns:
        The tokenizer, or None when the directory has no tokenizer.json and `required` is False.

    Raises:
        TokenizerNotFoundError: no tokenizer.json and `required` is True.
    """
    directory = Path(checkpoint_dir)
    tokenizer_json = directory / "tokenizer.json"
    if not tokenizer_json.is_file():
        if required:
            raise TokenizerNotFoundError(
                f"{directory} has no tokenizer.json: this checkpoint can only serve token ids "
                "(write one with ninfer_jax.frontend.write_qwen35_tokenizer_files for Qwen3.5)"
            )
        return None
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else None
    return Tokenizer.from_file(tokenizer_json, config)

