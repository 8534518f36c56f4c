"""Test helpers: small indexes, synthetic prompts, and a lane driver that plays the engine."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from ninfer_jax.prefix_cache import (BLOCK_TOKENS, CacheCostModel, CacheGeometry, OwnerState, PrefixCacheOptions,
                                     PrefixIndex, Snapshot, SnapshotKind, block_hashes, default_hash_fn)

BLOCK_BYTES = 4096
IMAGE_BYTES = 2 * 4096  # two slabs per image

# A cost model whose numbers are easy to write down: 1 ms per token, no chunk or pair cost,
# restoring one image (8192 B) takes 10 ms.
SIMPLE_COST = CacheCostModel(prefill_chunk_tokens=1 << 30, chunk_seconds=0.0, token_seconds=1e-3,
                             pair_seconds=0.0, h2d_bytes_per_second=IMAGE_BYTES / 0.01, restore_batch_seconds=0.0)


def make_index(device_pages: int = 64, slots: int = 4, host_slabs: int = 64, cost: CacheCostModel = SIMPLE_COST,
               hash_fn=default_hash_fn, max_concurrency: int = 2) -> PrefixIndex:
    options = PrefixCacheOptions.resolve(max_concurrency, 256, host_cache_bytes=host_slabs * BLOCK_BYTES,
                                         device_snapshot_slots=slots)
    return PrefixIndex(CacheGeometry(device_pages, BLOCK_BYTES, IMAGE_BYTES), options, cost, hash_fn)


def block(label: int) -> np.ndarray:
    """64 distinct tokens identified by ``label``."""
    return np.arange(64, dtype=np.int32) + 1000 * label


def prompt(*labels: int, tail: int = 0, tail_label: int = 999) -> np.ndarray:
    """Full blocks of the given labels, then ``tail`` tokens."""
    parts = [block(label) for label in labels] + [block(tail_label)[:tail]]
    return np.concatenate(parts).astype(np.int32)


@dataclasses.dataclass
class Lane:
    """One request driven through the index the way the engine would."""

    index: PrefixIndex
    tokens: np.ndarray
    hashes: list[int]
    path: list
    pages: dict
    base: int
    resumed_from: Snapshot | None
    previous_tap: Snapshot | None = None
    published: list = dataclasses.field(default_factory=list)

    @property
    def parent(self):
        return self.path[-1] if self.path else self.index.root

    def commit_through(self, frontier: int) -> None:
        """Commits every full block that ends at or before ``frontier``."""
        idx = self.index
        for b in range(len(self.path), frontier // BLOCK_TOKENS):
            commit = idx.commit_block(self.parent, self.tokens[64 * b:64 * b + 64], self.hashes[b], self.pages[b])
            self.path.append(commit.node)

    def tap(self, position: int, kind: SnapshotKind = SnapshotKind.TAP):
        """Takes and publishes a 64-aligned tap (commits the anchoring blocks first)."""
        assert position % 64 == 0
        self.commit_through(position)
        grant = self.index.begin_snapshot(position, kind=kind, resumed_from=self.resumed_from,
                                          previous_tap=self.previous_tap, previous_frontier=self._previous())
        if grant is None:
            return None
        result = self.index.publish_snapshot(grant.slot, kind, self.path[position // 64 - 1])
        self.previous_tap = result.snapshot
        self.published.append(result.snapshot)
        return result.snapshot

    def endpoint(self):
        """Publishes the endpoint at F = n with the partial last page as its tail."""
        n = len(self.tokens)
        self.commit_through(n)
        tail = n % 64
        grant = self.index.begin_snapshot(n, kind=SnapshotKind.ENDPOINT, resumed_from=self.resumed_from,
                                          previous_tap=self.previous_tap, previous_frontier=self._previous(),
                                          tail_len=tail)
        if grant is None:
            return None
        anchor = self.path[n // 64 - 1] if n >= 64 else self.index.root
        result = self.index.publish_snapshot(grant.slot, SnapshotKind.ENDPOINT, anchor,
                                             self.tokens[n - tail:] if tail else b"", 0,
                                             self.pages[n // 64] if tail else -1)
        self.published.append(result.snapshot)
        return result.snapshot

    def release(self, write: bool = True):
        """Releases the path (write-through completes at once when ``write``) and private pages."""
        idx = self.index
        host_write = idx.release_path(self.path)
        if write:
            idx.complete_host_write(host_write)
        private = [p for p in self.pages.values() if idx.pages.is_state(p, OwnerState.ACTIVE)]
        idx.free_pages(private)
        self.pages = {}
        return host_write

    def _previous(self) -> int:
        if self.previous_tap is not None:
            return self.previous_tap.frontier
        return self.base


def start(index: PrefixIndex, tokens: np.ndarray, extra_pages: int = 0) -> Lane:
    """Quotes, stages, activates and lands restores for ``tokens``; returns the lane."""
    hashes = block_hashes(tokens, hash_fn=index.hash_fn)
    n = len(tokens)
    quote = index.quote(tokens, hashes, entitlement_pages=math.ceil(n / 64) + extra_pages)
    assert quote.readiness.value == "ready", quote.readiness
    staging = index.stage(quote)
    path = index.activate(staging)
    index.complete_restore(staging)
    base = staging.reuse_tokens
    first = base // 64
    pages = {first + i: p for i, p in enumerate(staging.lane_pages)}
    return Lane(index, tokens, hashes, path, pages, base, staging.snapshot)


def run(index: PrefixIndex, tokens: np.ndarray, taps=(), endpoint: bool = False, write: bool = True,
        write_snapshots: bool = True) -> Lane:
    """A whole request: admission, taps, full-block commits, optional endpoint, release."""
    lane = start(index, tokens)
    for p in taps:
        lane.tap(p)
    lane.commit_through(len(tokens))
    if endpoint:
        lane.endpoint()
    lane.release(write)
    if write_snapshots:
        for s in lane.published:
            if index.snapshot(s.id) is s:
                index.complete_host_write(index.write_snapshot(s))
    return lane


def node_at(index: PrefixIndex, tokens: np.ndarray, depth: int):
    """The node of block ``depth`` on ``tokens``'s path (None when not cached)."""
    m = index.match(np.concatenate([tokens[:64 * (depth + 1)], tokens[:1]]))
    return m.path[depth] if len(m.path) > depth else None
