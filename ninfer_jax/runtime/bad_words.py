"""vLLM's `bad_words`: token sequences a request's output may not complete.

Each word is tokenized as it is written and, where that gives a different first token of the same length, with a
leading space (vLLM's rule, so a word is barred at the start of the text and inside it). A one-token sequence is
never sampled; a longer one's last token is barred whenever the output ends with the rest of it (the output only,
not the prompt, as vLLM checks).
"""

from __future__ import annotations

import numpy as np

from ninfer_jax.runtime.sampling import pack_token_bits


def token_sequences(words, tokenizer) -> list[tuple[int, ...]]:
    """The token sequences `words` bar: each word's own, and its spaced form where vLLM takes it too."""
    sequences: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(tokenizer.encode(word.lstrip()))
        if plain:
            sequences.append(plain)
        spaced = tuple(tokenizer.encode(" " + word.lstrip()))
        if spaced and (not plain or spaced[0] != plain[0] and len(spaced) == len(plain)):
            sequences.append(spaced)
    return sequences


class BadWords:
    """One request's barred sequences, applied to its allowed-token mask before each sampled token."""

    def __init__(self, sequences: list[tuple[int, ...]], vocab: int):
        singles = [s[0] for s in sequences if len(s) == 1]
        self._single = ~pack_token_bits(singles, vocab) if singles else None
        self._multi = [(s[:-1], s[-1]) for s in sequences if len(s) > 1]

    @property
    def follows_output(self) -> bool:
        """Whether the mask depends on the output's last tokens (a sequence of two or more)."""
        return bool(self._multi)

    def apply(self, row: np.ndarray, output: list[int]) -> None:
        """Clears from `row` (int32 packed allowed tokens) the tokens that would complete a barred sequence after
        `output`."""
        if self._single is not None:
            row &= self._single
        bits = row.view(np.uint32)
        for prefix, last in self._multi:
            n = len(prefix)
            if len(output) >= n and tuple(output[-n:]) == prefix:
                bits[last >> 5] &= np.uint32(~(1 << (last & 31)) & 0xFFFFFFFF)
