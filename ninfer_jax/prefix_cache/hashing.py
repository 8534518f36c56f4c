"""Block keys and chained lookup hashes (spec §5.1).

Block ``b`` of a prompt covers absolute positions ``[64b, 64b + 64)``. Its key is
``(parent node, tokens[64b .. 64b+63], extra)`` where ``extra`` is the media key of the
Vision items that overlap the block (0 when none does); a request's cache salt is folded into
block 0's extra (:func:`salted_extra`), so salted prompts share blocks, and everything below
them, only with prompts of the same salt. The lookup hash chains over the prompt::

    lookup_hash(b) = xxh3_64(lookup_hash(b - 1) || tokens[64b .. 64b+63] || extra)
    lookup_hash(-1) = LOOKUP_HASH_SEED

with every integer serialised little-endian (the previous hash and ``extra`` as 8 bytes,
each token as a 4-byte int32).

Invariants:
  * a lookup hash only *selects* a child in its parent's child map; equality of a block
    is always decided by comparing the 256 token bytes and ``extra`` exactly, so a forced
    constant hash (``hash_fn=lambda data: 0``) can never produce a false hit;
  * tokens are kept as ``bytes`` in the int32 little-endian encoding of
    :func:`encode_tokens`, so exact comparison is one ``memcmp``.

The Frontend computes the hashes once per prompt, off the scheduler thread; the index never hashes
on its hot path (the hash function is injectable for tests).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np
import xxhash

BLOCK_TOKENS = 64
"""Tokens per block (one KV page)."""

TOKEN_BYTES = 4
"""Bytes per token in the exact-identity encoding (int32, little-endian)."""

BLOCK_TOKEN_BYTES = BLOCK_TOKENS * TOKEN_BYTES
"""Bytes of one block's tokens in that encoding (256)."""

LOOKUP_HASH_SEED = 0
"""lookup_hash(-1)."""

HashFn = Callable[[bytes], int]
"""Maps bytes to a 64-bit unsigned int; ``xxhash.xxh3_64_intdigest`` by default."""

default_hash_fn: HashFn = xxhash.xxh3_64_intdigest

_TOKEN_DTYPE = np.dtype("<i4")


def encode_tokens(tokens) -> bytes:
    """Returns ``tokens`` as little-endian int32 bytes (the exact-identity encoding).

    Args:
      tokens: ``bytes`` already in that encoding (returned unchanged), a numpy array or any
        sequence of ints. A numpy int32 array is the cheap path (one copy).
    """
    if isinstance(tokens, (bytes, bytearray, memoryview)):
        data = bytes(tokens)
        if len(data) % TOKEN_BYTES:
            raise ValueError(f"token bytes length {len(data)} is not a multiple of {TOKEN_BYTES}")
        return data
    return np.asarray(tokens).astype(_TOKEN_DTYPE, copy=False).tobytes()


def block_lookup_hash(previous: int, block_tokens: bytes, extra: int = 0,
                      hash_fn: HashFn = default_hash_fn) -> int:
    """Returns lookup_hash(b) from lookup_hash(b - 1), the block's 256 token bytes and its extra key."""
    return hash_fn(previous.to_bytes(8, "little") + block_tokens + extra.to_bytes(8, "little"))


def block_hashes(tokens, extras: Sequence[int] | None = None, *, hash_fn: HashFn = default_hash_fn,
                 seed: int = LOOKUP_HASH_SEED) -> list[int]:
    """Returns the chained lookup hash of every *full* block of ``tokens``.

    Args:
      tokens: the prompt (see :func:`encode_tokens`).
      extras: per-block media keys; missing entries (or ``None``) mean 0.
      hash_fn: injectable for tests (e.g. a constant to force collisions).
      seed: lookup_hash(-1).
    """
    data = encode_tokens(tokens)
    out: list[int] = []
    previous = seed
    for b in range(len(data) // BLOCK_TOKEN_BYTES):
        extra = extras[b] if extras is not None and b < len(extras) else 0
        start = b * BLOCK_TOKEN_BYTES
        previous = block_lookup_hash(previous, data[start:start + BLOCK_TOKEN_BYTES], extra, hash_fn)
        out.append(previous)
    return out


def salt_key(salt: str) -> int:
    """A cache salt's 64-bit key (vLLM's ``cache_salt``); never 0, which means "no salt"."""
    return default_hash_fn(b"cache_salt\0" + salt.encode("utf-8")) or 1


def salted_extra(extra: int, salt: int) -> int:
    """Block 0's extra key under a salt key: ``extra`` unchanged when ``salt`` is 0."""
    if not salt:
        return extra
    return default_hash_fn(salt.to_bytes(8, "little") + extra.to_bytes(8, "little")) or 1


@dataclasses.dataclass(frozen=True)
class VisionItem:
    """One Vision item of a prompt: what its media key covers (§5.1).

    Attributes:
      digest: the content digest of the media (32 bytes).
      modality: 0 image, 1 video (any small int the Frontend fixes).
      grid: the item's patch grid (t, h, w).
      begin: first token position of the item's placeholder span.
      length: number of placeholder tokens.
    """

    digest: bytes
    modality: int
    grid: tuple[int, ...]
    begin: int
    length: int

    def encode(self) -> bytes:
        if len(self.digest) != 32:
            raise ValueError(f"VisionItem.digest must be 32 bytes, got {len(self.digest)}")
        fields = np.asarray([self.modality, len(self.grid), *self.grid, self.begin, self.length], dtype="<i8")
        return self.digest + fields.tobytes()

    @property
    def end(self) -> int:
        return self.begin + self.length


def media_keys(num_blocks: int, items: Sequence[VisionItem]) -> list[int]:
    """Returns media_key(b) for blocks ``0 .. num_blocks-1`` (spec §5.1).

    media_key(b) is 0 when no item overlaps block b; otherwise xxh3_64 over every item up to
    and including the last one overlapping b (earlier items change later MRoPE positions).
    Items are taken in order of their span begin.
    """
    ordered = sorted(items, key=lambda item: item.begin)
    encoded = [item.encode() for item in ordered]
    keys = [0] * num_blocks
    for b in range(num_blocks):
        lo, hi = b * BLOCK_TOKENS, (b + 1) * BLOCK_TOKENS
        last = -1
        for j, item in enumerate(ordered):
            if item.begin < hi and item.end > lo:
                last = j
        if last >= 0:
            keys[b] = default_hash_fn(b"".join(encoded[:last + 1]))
    return keys


def strictly_inside(position: int, spans: Sequence[tuple[int, int]]) -> tuple[int, int] | None:
    """Returns the ``(begin, length)`` span that contains ``position`` strictly inside, else None.

    A frontier at a span's begin or end is a valid resume point; one strictly inside is not.
    """
    for begin, length in spans:
        if begin < position < begin + length:
            return begin, length
    return None
