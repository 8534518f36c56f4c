"""Chained per-block lookup hashes of a prompt (spec §5.1); shared by the frontend and prefix_cache/.

lookup_hash(b) = xxh3_64(lookup_hash(b-1) as 8 little-endian bytes
                         || tokens[64b : 64b+64] as little-endian uint32
                         || extra(b) as 8 little-endian bytes),   lookup_hash(-1) = seed.

Only full blocks are hashed. A hash selects a child in the block tree; a hit still compares tokens and
extra exactly, so collisions cost a compare, never a false hit.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

BLOCK_TOKENS = 64
_UINT32_MAX = 2**32 - 1


def chain_block_hashes(
    token_ids: Sequence[int] | np.ndarray,
    extra_keys: Sequence[int] | np.ndarray | None = None,
    seed: int = 0,
) -> np.ndarray:
    """Lookup hashes of every full 64-token block of `token_ids`.

    Args:
        token_ids: the prompt, [n] non-negative ids below 2**32.
        extra_keys: per full block, the uint64 `extra` (the media key; 0 where no Vision item overlaps);
            None means all zeros. Its length must be n // 64.
        seed: lookup_hash(-1).

    Returns:
        [n // 64] uint64.
    """
    tokens = np.asarray(token_ids)
    if tokens.ndim != 1:
        raise ValueError(f"token_ids must be 1-D, got shape {tokens.shape}")
    if tokens.size and (tokens.min() < 0 or tokens.max() > _UINT32_MAX):
        raise ValueError("token ids must lie in [0, 2**32)")
    n_blocks = tokens.size // BLOCK_TOKENS
    block_bytes = tokens[: n_blocks * BLOCK_TOKENS].astype("<u4").tobytes()
    extras = np.zeros(n_blocks, "<u8") if extra_keys is None else np.asarray(extra_keys).astype("<u8")
    if extras.shape != (n_blocks,):
        raise ValueError(f"extra_keys must hold one key per full block ({n_blocks}), got shape {extras.shape}")
    extra_bytes = extras.tobytes()

    hashes = np.empty(n_blocks, np.uint64)
    previous = int(seed) & 0xFFFF_FFFF_FFFF_FFFF
    stride = BLOCK_TOKENS * 4
    for b in range(n_blocks):
        message = (
            previous.to_bytes(8, "little")
            + block_bytes[b * stride : (b + 1) * stride]
            + extra_bytes[b * 8 : (b + 1) * 8]
        )
        previous = xxhash.xxh3_64_intdigest(message)
        hashes[b] = previous
    return hashes
