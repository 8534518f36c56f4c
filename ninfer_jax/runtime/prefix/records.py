"""What the cache manager remembers: each lane's cache bookkeeping while it runs, and each finished request's
record (spec §8.3) for `Engine.cache_record`."""

from __future__ import annotations

import collections
import dataclasses

from ninfer_jax.prefix_cache import PlannedTap
from ninfer_jax.prefix_cache.tree import BlockNode, Snapshot


@dataclasses.dataclass(eq=False)
class LaneRecord:
    """One lane's cache bookkeeping, from admission to release (the cache manager is its only writer)."""

    enabled: bool  # False: the engine's cache is off, or the request opted out (a disabled request, §7.7)
    hashes: list[int]  # lookup_hash of block b; generated blocks' hashes are chained on as they commit
    path: list[BlockNode] = dataclasses.field(default_factory=list)  # node of block b, every committed block
    source: Snapshot | None = None  # the snapshot the lane resumed from
    taps: list[PlannedTap] = dataclasses.field(default_factory=list)  # planned, not realised yet, by position
    # (tap, index slot, chunk) written by a chunk, waiting for publication; chunks counts the lane's chunks
    staged: list[tuple[PlannedTap, int, int]] = dataclasses.field(default_factory=list)
    chunks: int = 0
    last_tap: Snapshot | None = None
    deepest: int = 0  # frontier of the deepest snapshot on the lane's path
    cached_prefix_tokens: int = 0
    source_kind: str = "root"
    restored_host_bytes: int = 0

    def summary(self, cached_tokens: int) -> dict:
        """The per-request record: reuse tokens, the matched prefix, the source kind and the Host bytes."""
        return {"cached_tokens": cached_tokens, "cached_prefix_tokens": self.cached_prefix_tokens,
                "source": self.source_kind, "restored_host_bytes": self.restored_host_bytes}


class FinishedRecords:
    """The records of the most recent finished requests, oldest dropped first."""

    def __init__(self, capacity: int = 1024):
        self.capacity = capacity
        self._records: collections.OrderedDict[str, dict] = collections.OrderedDict()

    def add(self, request_id: str, record: dict) -> None:
        self._records[request_id] = record
        while len(self._records) > self.capacity:
            self._records.popitem(last=False)

    def get(self, request_id: str) -> dict | None:
        return self._records.get(request_id)


def count_by_tier(copies) -> dict[str, int]:
    """Counts entries by where their copies are: (on the Device, on the Host) pairs -> device/host/both."""
    out = {"device": 0, "host": 0, "both": 0}
    for device, host in copies:
        if device or host:
            out["both" if device and host else "device" if device else "host"] += 1
    return out
