"""Chained per-block lookup hashes of a prompt (spec §5.1), computed by the frontend off the worker.

The hash itself is `ninfer_jax.prefix_cache.hashing.block_hashes` (one definition for the frontend and
the index): lookup_hash(b) = xxh3_64(lookup_hash(b-1) as 8 little-endian bytes || tokens[64b : 64b+64]
as little-endian int32 || extra(b) as 8 little-endian bytes), lookup_hash(-1) = seed. A hash only selects
a child in the block tree; a hit still compares tokens and extra exactly.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ninfer_jax.prefix_cache.hashing import BLOCK_TOKENS, block_hashes

_INT32_MAX = 2**31 - 1


def chain_block_hashes(
    token_ids: Sequence[int] | np.ndarray,
    extra_keys: Sequence[int] | np.ndarray | None = None,
    seed: int = 0,
) -> np.ndarray:
    """Lookup hashes of every full 64-token block of `token_ids`: [n // 64] uint64.

    Args:
        token_ids: the prompt, [n] ids in [0, 2**31).
        extra_keys: per full block, the uint64 `extra` (the media key; 0 where no Vision item overlaps);
            None means all zeros. Its length must be n // 64.
        seed: lookup_hash(-1).
    """
    tokens = np.asarray(token_ids)
    if tokens.ndim != 1:
        raise ValueError(f"token_ids must be 1-D, got shape {tokens.shape}")
    if tokens.size and (tokens.min() < 0 or tokens.max() > _INT32_MAX):
        raise ValueError("token ids must lie in [0, 2**31)")
    n_blocks = tokens.size // BLOCK_TOKENS
    if extra_keys is not None and np.shape(extra_keys) != (n_blocks,):
        raise ValueError(f"extra_keys must hold one key per full block ({n_blocks}), got shape {np.shape(extra_keys)}")
    # dtype given: numpy would take a list mixing keys past 2**63 with small ones as float64, rounding the keys
    extras = None if extra_keys is None else [int(e) for e in np.asarray(extra_keys, dtype=np.uint64)]
    return np.asarray(block_hashes(tokens.astype(np.int32), extras, seed=int(seed)), dtype=np.uint64)
