"""The cache's cost model: prefill seconds and Host-to-Device restore seconds (spec §6.2, §11.4).

One calibrated model ranks admission sources (§6.2) and values snapshots for Host eviction
(§9.3), so eviction and admission agree about value. It only *ranks* choices: capacity and
validity checks never depend on it (§10 invariant 10).

    prefill_seconds(base, tokens) = chunk_seconds * ceil(tokens / prefill_chunk_tokens)
                                  + token_seconds * tokens
                                  + pair_seconds * (base * tokens + tokens * (tokens + 1) / 2)
    restore_seconds(bytes)        = bytes / h2d_bytes_per_second + restore_batch_seconds   (0 for 0 bytes)

The defaults are generic H200 figures for the 27B shape (about 10k prefill tok/s without
attention, cuDNN-class attention at ~600 TFLOP/s over 16 layers x 24 heads x 256 dims, pinned
H2D at 50 GB/s). The engine uses these defaults; calibrated values would go in through :meth:`replace`.
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class CacheCostModel:
    """Linear prefill model plus a bandwidth/latency restore model.

    Attributes:
      prefill_chunk_tokens: tokens per prefill pass (one chunk's fixed cost each).
      chunk_seconds: fixed cost of one prefill pass (weights streamed once).
      token_seconds: per-token cost (GEMMs, GDN).
      pair_seconds: per attention (query, key) pair, all full-attention layers.
      h2d_bytes_per_second: measured pinned Host-to-Device bandwidth.
      restore_batch_seconds: fixed latency of one restore batch.
    """

    prefill_chunk_tokens: int = 8192
    chunk_seconds: float = 4e-3
    token_seconds: float = 1.0e-4
    pair_seconds: float = 6.6e-13
    h2d_bytes_per_second: float = 50e9
    restore_batch_seconds: float = 50e-6

    def __post_init__(self):
        if self.prefill_chunk_tokens <= 0:
            raise ValueError(f"prefill_chunk_tokens must be positive, got {self.prefill_chunk_tokens}")
        if self.h2d_bytes_per_second <= 0:
            raise ValueError(f"h2d_bytes_per_second must be positive, got {self.h2d_bytes_per_second}")
        for name in ("chunk_seconds", "token_seconds", "pair_seconds", "restore_batch_seconds"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    def prefill_seconds(self, base: int, tokens: int) -> float:
        """Seconds to prefill ``tokens`` new tokens after ``base`` cached ones."""
        if tokens <= 0:
            return 0.0
        chunks = math.ceil(tokens / self.prefill_chunk_tokens)
        pairs = base * tokens + tokens * (tokens + 1) / 2
        return self.chunk_seconds * chunks + self.token_seconds * tokens + self.pair_seconds * pairs

    def restore_seconds(self, nbytes: int) -> float:
        """Seconds to copy ``nbytes`` from the Host tier in one restore batch (0 when nothing moves)."""
        if nbytes <= 0:
            return 0.0
        return nbytes / self.h2d_bytes_per_second + self.restore_batch_seconds

    def replace(self, **changes) -> "CacheCostModel":
        """Returns a copy with calibrated coefficients (uncalibrated terms keep their defaults)."""
        return dataclasses.replace(self, **changes)
