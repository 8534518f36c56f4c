"""Typed results the index hands to the engine, and its stats counters.

Every mutation that frees or drops something reports it in a :class:`Reclaimed`; the engine
never needs to copy anything for an eviction (dropping a copy is bookkeeping, §6.4), but it
learns which ids became free and which entries lost their last copy. Results that ask for
copies (:class:`Staging`, :class:`HostWrite`) list exactly the (source, destination) ids.
"""

from __future__ import annotations

import dataclasses
import enum

from .admission import AdmissionQuote, SourceCandidate
from .tree import BlockNode, Snapshot


class CommitOutcome(enum.Enum):
    INSERTED = "inserted"    # a new node owns the lane's page
    ADOPTED = "adopted"      # a Host-only node adopted the lane's page as its Device copy
    DUPLICATE = "duplicate"  # the node already has a Device copy: the lane's page stays private


@dataclasses.dataclass(frozen=True, slots=True)
class BlockCommit:
    """Result of committing one full block (spec §7.6)."""

    node: BlockNode
    outcome: CommitOutcome

    @property
    def page_private(self) -> bool:
        """Whether the lane's page stays private (Duplicate) and is freed by the lane at finish."""
        return self.outcome is CommitOutcome.DUPLICATE


@dataclasses.dataclass(slots=True)
class Reclaimed:
    """What evictions freed or dropped during one call (ids, in the order it happened)."""

    freed_pages: list[int] = dataclasses.field(default_factory=list)
    freed_slabs: list[int] = dataclasses.field(default_factory=list)
    freed_slots: list[int] = dataclasses.field(default_factory=list)
    lost_nodes: list[int] = dataclasses.field(default_factory=list)          # deleted: no copy left
    deleted_snapshots: list[int] = dataclasses.field(default_factory=list)   # evicted or invalidated
    node_device_dropped: list[int] = dataclasses.field(default_factory=list)  # Host copy kept
    node_host_dropped: list[int] = dataclasses.field(default_factory=list)    # Device copy kept or lost
    snapshot_device_dropped: list[int] = dataclasses.field(default_factory=list)  # Host copy kept
    snapshot_host_dropped: list[int] = dataclasses.field(default_factory=list)    # Device copy kept


@dataclasses.dataclass(frozen=True, slots=True)
class PageGrant:
    """Pages a lane received, and what was evicted to free them."""

    pages: list[int]
    reclaimed: Reclaimed


@dataclasses.dataclass(frozen=True, slots=True)
class SlotGrant:
    """A staging Device snapshot slot for a tap or endpoint (spec §9.2)."""

    slot: int
    reclaimed: Reclaimed


@dataclasses.dataclass(frozen=True, slots=True)
class PublishResult:
    """``published`` is False for a duplicate: the existing snapshot was refreshed, the staging
    slot returned to the pool (``freed_slot``), and any tail page stays with the caller."""

    snapshot: Snapshot
    published: bool
    freed_slot: int = -1


@dataclasses.dataclass(frozen=True, slots=True)
class BlockRestore:
    """Copy Host slab ``slab`` into Device page group ``page`` for ``node``."""

    node: BlockNode
    slab: int
    page: int


@dataclasses.dataclass(slots=True)
class Staging:
    """A staged admission (spec §6.4): pins held, pages reserved, restores listed.

    The engine copies ``restores`` (and ``tail_restore``) slab -> page, the image from
    ``image_slabs`` (Host) or ``image_slot`` (Device) into the lane's state slot, then calls
    ``PrefixIndex.complete_restore``; ``activate`` hands the path to the lane.
    """

    quote: AdmissionQuote
    source: SourceCandidate
    path: list[BlockNode]
    snapshot: Snapshot | None
    lane_pages: list[int]
    restores: list[BlockRestore]
    tail_restore: BlockRestore | None
    image_slabs: list[int]
    image_slot: int
    reclaimed: Reclaimed
    activated: bool = False
    restored: bool = False

    @property
    def reuse_tokens(self) -> int:
        return self.source.frontier


@dataclasses.dataclass(slots=True)
class Prefetch:
    """A prefetch batch for a waiting FIFO head (spec §6.6): ``restores`` copy Host slabs into Device pages.

    The destinations are Filling, each pinned, and ``pinned`` (the head's source path) holds one pin each
    until the engine reports the copy with ``PrefixIndex.complete_prefetch``.
    """

    restores: list[BlockRestore]
    pinned: list[BlockNode]
    reclaimed: Reclaimed
    done: bool = False


@dataclasses.dataclass(slots=True)
class HostWrite:
    """A D2H write-through the engine performs, then reports with ``complete_host_write``.

    Block writes copy ``nodes[i]``'s Device page into ``node_slabs[i]``; a snapshot write copies
    the image into ``image_slabs`` (packed byte o in ``image_slabs[o // slab_bytes]``) and the
    tail page into ``tail_slab``. ``pinned`` is the path held until completion.
    """

    nodes: list[BlockNode]
    node_slabs: list[int]
    snapshot: Snapshot | None
    image_slabs: list[int]
    tail_slab: int
    pinned: list[BlockNode]
    reclaimed: Reclaimed
    done: bool = False

    @property
    def empty(self) -> bool:
        return not self.nodes and self.snapshot is None


@dataclasses.dataclass(slots=True)
class PrefixCacheStats:
    """Monotonic counters (spec §8.2 HybridPrefixCacheStats)."""

    lookups: int = 0
    admissions: int = 0
    admissions_from_snapshot: int = 0
    reuse_tokens: int = 0
    restored_blocks: int = 0
    restored_tails: int = 0
    restored_images: int = 0
    blocks_inserted: int = 0
    blocks_adopted: int = 0
    blocks_duplicate: int = 0
    snapshots_published: int = 0
    snapshots_duplicate: int = 0
    snapshots_superseded: int = 0
    snapshots_retained_again: int = 0
    taps_skipped_no_slot: int = 0
    endpoints_skipped_no_slot: int = 0
    device_evicted_backed: int = 0
    device_evicted_unbacked: int = 0
    nodes_lost: int = 0
    snapshots_deleted: int = 0
    slot_evicted_superseded: int = 0
    slot_evicted_device_only: int = 0
    slot_evicted_host_backed: int = 0
    host_block_writes: int = 0
    host_block_writes_refused: int = 0
    host_image_writes: int = 0
    host_image_writes_refused: int = 0
    host_dead_reclaimed: int = 0
    host_superseded_evicted: int = 0
    host_gdsf_evicted: int = 0
    host_gdsf_demoted: int = 0
    prefetches: int = 0
    prefetched_blocks: int = 0

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)
