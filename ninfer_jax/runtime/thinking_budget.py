"""A thinking budget: a request whose output starts inside the model's reasoning (`<think>` ends its prompt) may
think for `budget` generated tokens; past them, until its output holds the end-of-thinking token, that token is the
only one it may sample (Anthropic's `thinking.budget_tokens`; SGLang's thinking-budget logit processor).
"""

from __future__ import annotations

import numpy as np

THINK_CLOSE = "</think>"  # Qwen3.5's end of thinking, one token of its vocabulary


def think_close_id(tokenizer) -> int | None:
    """The token id of `THINK_CLOSE`, or None when the tokenizer (if any) spells it with several tokens."""
    ids = tokenizer.encode(THINK_CLOSE) if tokenizer is not None else []
    return ids[0] if len(ids) == 1 else None


class ThinkingBudget:
    """One request's budget, applied to its allowed-token mask before each sampled token. It scans the output
    once, token by token, for the end of thinking."""

    def __init__(self, budget: int, end_id: int):
        self.budget, self.end_id = budget, end_id
        self._scanned = 0
        self._closed = False

    def _read(self, output: list[int]) -> bool:
        """Whether `output` already ends the thinking."""
        if not self._closed and len(output) > self._scanned:
            self._closed = self.end_id in output[self._scanned:]
            self._scanned = len(output)
        return self._closed

    def binds(self, output: list[int], ahead: int) -> bool:
        """Whether the budget may force one of the `ahead + 1` tokens after `output`: it is spent by the last of them
        and `output` has not ended its thinking."""
        return len(output) + ahead >= self.budget and not self._read(output)

    def follows_output(self, output: list[int]) -> bool:
        """Whether the next token's mask may depend on the token in flight: from the budget's last token on, while
        the thinking is open (the lane then decodes only once the host has read each token)."""
        return self.binds(output, 1)

    def apply(self, row: np.ndarray, output: list[int]) -> None:
        """Leaves only the end-of-thinking token in `row` (int32 packed allowed tokens) once `output` has spent the
        budget with its thinking still open."""
        if self.binds(output, 0):
            row[:] = 0
            row.view(np.uint32)[self.end_id >> 5] = np.uint32(1 << (self.end_id & 31))
