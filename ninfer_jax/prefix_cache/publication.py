"""Snapshot publication, supersession and image write-through (spec §7.4, §7.7, §9.2, §9.3).

A tap or endpoint goes through three calls:

  1. ``begin``: the lineage's older snapshots are superseded first (the snapshot the request
     resumed from; for a tap also the prompt's previous tap), then a staging slot is taken in
     §9.2 order with the new snapshot's estimated priority; None means the snapshot is skipped.
  2. ``publish``: the staging slot becomes the image's Device copy (an endpoint's tail page
     becomes the cache's); a duplicate (anchor, tail) is a no-op that returns the slot and
     refreshes the existing snapshot (retained again; a Tap republished as a Boundary becomes one).
  3. ``write``: D2H write-through of the image (and tail) into Host slabs, GDSF-bounded: the
     write never evicts a snapshot worth more than the new one, which then stays Device-only.

Supersession (§9.3): a superseded snapshot is only useful to a request that diverges before
the newer one; it is the first Host victim and the first slot to give up. A Boundary is
superseded only while the tree below its anchor is one chain (no other conversation has
continued from it). A hit, or a duplicate publication, retains a superseded snapshot again.

Invariants: ``staging_slots`` are exactly the slots in the ACTIVE state; a published image's
slot is CACHED and ``slot_owner[slot]`` is its snapshot; taps and boundaries carry no tail
(the tap planner floors them to 64); ``supersede``/``retain`` keep ``retained_below`` along the
path and the GDSF dirty set in step.
"""

from __future__ import annotations

from .eviction import EvictionLists, GdsfPolicy
from .hashing import BLOCK_TOKENS, encode_tokens
from .host_slabs import HostSlabPool, SlabState
from .pools import DevicePagePool, OwnerState, SnapshotSlotPool
from .reclaim import Reclaimer
from .results import HostWrite, PrefixCacheStats, PublishResult, Reclaimed, SlotGrant
from .tree import ABSENT, FILLING, RESIDENT, BlockNode, BlockTree, Snapshot, SnapshotKind

TAP_KINDS = (SnapshotKind.TAP, SnapshotKind.BOUNDARY)


class SnapshotPublisher:
    """Takes staging slots, publishes snapshots, supersedes lineages, writes images to the Host."""

    def __init__(self, tree: BlockTree, pages: DevicePagePool, slots: SnapshotSlotPool, slabs: HostSlabPool,
                 lists: EvictionLists, gdsf: GdsfPolicy, reclaimer: Reclaimer, stats: PrefixCacheStats):
        self.tree = tree
        self.pages = pages
        self.slots = slots
        self.slabs = slabs
        self.lists = lists
        self.gdsf = gdsf
        self.reclaimer = reclaimer
        self.stats = stats
        self.staging_slots: set[int] = set()  # ACTIVE slots held by pending taps and endpoints
        self.tick = 0                         # recency clock for last_hit
        self._supersede_seq = 0

    # ---- taking and publishing -----------------------------------------------------------

    def begin(self, frontier: int, kind: SnapshotKind, resumed_from: Snapshot | None,
              previous_tap: Snapshot | None, previous_frontier: int, tail_len: int) -> SlotGrant | None:
        for old in (resumed_from, previous_tap if kind in TAP_KINDS else None):
            if old is not None and self.tree.snapshots.get(old.id) is old and old.frontier < frontier:
                self.supersede(old)
        out = Reclaimed()
        slot = self.reclaimer.acquire_slot(self.gdsf.estimate(frontier, previous_frontier, tail_len), out)
        if slot is None:
            if kind is SnapshotKind.ENDPOINT:
                self.stats.endpoints_skipped_no_slot += 1
            else:
                self.stats.taps_skipped_no_slot += 1
            return None
        self.staging_slots.add(slot)
        return SlotGrant(slot, out)

    def release_staging_slot(self, slot: int) -> None:
        self.staging_slots.remove(slot)
        self.slots.free_one(slot)

    def publish(self, slot: int, kind: SnapshotKind, anchor: BlockNode, tail_tokens, tail_extra: int,
                tail_page: int) -> PublishResult:
        tail = self._validate(slot, kind, anchor, tail_tokens, tail_page)
        self.tick += 1
        self.staging_slots.remove(slot)
        existing = self.tree.find_snapshot(anchor, tail, tail_extra)
        if existing is not None:
            self.slots.free_one(slot)
            existing.last_hit = self.tick
            if kind is SnapshotKind.BOUNDARY and existing.kind is SnapshotKind.TAP:
                existing.kind = kind  # a client breakpoint or structural boundary names a shared prefix
            if existing.superseded:
                self.retain(existing)
            self.stats.snapshots_duplicate += 1
            return PublishResult(existing, False, slot)
        s = self.tree.new_snapshot(kind, anchor, tail, tail_extra)
        s.device_slot, s.image_device = slot, RESIDENT
        self.slots.set_state(slot, OwnerState.CACHED)
        self.reclaimer.slot_owner[slot] = s
        if tail_page >= 0:
            s.tail_page, s.tail_device = tail_page, RESIDENT
            self.pages.set_state(tail_page, OwnerState.CACHED)
        s.last_hit = self.tick
        revived, owner, moved = self.tree.attach_snapshot(s)
        for node in revived:
            self.lists.refresh_node(node)
        self.gdsf.on_publish(s)
        self.gdsf.mark_id(owner)
        self.gdsf.mark_through(moved)
        self.lists.refresh_snapshot(s)
        self.stats.snapshots_published += 1
        return PublishResult(s, True)

    def _validate(self, slot, kind, anchor, tail_tokens, tail_page) -> bytes:
        if slot not in self.staging_slots:
            raise ValueError(f"slot {slot} is not a staging slot")
        tail = encode_tokens(tail_tokens)
        if len(tail) // 4 >= BLOCK_TOKENS:
            raise ValueError(f"a tail is at most {BLOCK_TOKENS - 1} tokens, got {len(tail) // 4}")
        if kind in TAP_KINDS and tail:
            raise ValueError("taps and boundaries are 64-aligned: they carry no tail")
        if anchor is not self.tree.root and self.tree.nodes.get(anchor.id) is not anchor:
            raise ValueError(f"anchor {anchor} is not in the tree")
        if anchor is self.tree.root and not tail:
            raise ValueError("a snapshot needs a frontier >= 1")
        if bool(tail) != (tail_page >= 0):
            raise ValueError("a tail page is given exactly when the snapshot has a tail")
        if tail_page >= 0 and not self.pages.is_state(tail_page, OwnerState.ACTIVE):
            raise ValueError(f"tail page {tail_page} is not a private page")
        return tail

    # ---- supersession --------------------------------------------------------------------

    def supersede(self, s: Snapshot) -> bool:
        if s.superseded:
            return False
        if s.kind is SnapshotKind.BOUNDARY and not self.tree.single_chain_below(s.anchor):
            return False
        self._supersede_seq += 1
        s.superseded, s.superseded_seq = True, self._supersede_seq
        self._retained_changed(s, -1)
        self.stats.snapshots_superseded += 1
        return True

    def retain(self, s: Snapshot) -> None:
        """A hit (or duplicate publication) on a superseded snapshot retains it again."""
        s.superseded, s.superseded_seq = False, 0
        self._retained_changed(s, 1)
        self.stats.snapshots_retained_again += 1

    def hit(self, s: Snapshot) -> None:
        """An admission resumes from ``s``: recency, frequency, L_s, and retained again."""
        self.tick += 1
        s.last_hit = self.tick
        self.gdsf.on_hit(s)
        if s.superseded:
            self.retain(s)

    def _retained_changed(self, s: Snapshot, delta: int) -> None:
        _, owner = self.tree.walk_counts(s.anchor, 0, delta, s.id)
        self.gdsf.mark_id(owner)
        self.gdsf.mark(s)
        self.gdsf.mark_below(s)
        self.lists.refresh_snapshot(s)

    # ---- Host write-through --------------------------------------------------------------

    def write(self, s: Snapshot) -> HostWrite:
        out = Reclaimed()
        image = s.image_host is ABSENT and s.image_device is RESIDENT
        tail = bool(s.tail_len) and s.tail_host is ABSENT and s.tail_device is RESIDENT
        if not self.slabs.enabled or not (image or tail) or self.tree.snapshots.get(s.id) is not s:
            return HostWrite([], [], None, [], -1, [], out)
        path = s.anchor.path()
        self.lists.pin_nodes(path, 1)
        s.pins += 1
        self.lists.refresh_snapshot(s)
        self.gdsf.refresh()
        k = (self.slabs.image_slabs if image else 0) + (1 if tail else 0)
        if not self.reclaimer.make_host_room(k, out, bound=self.gdsf.value(s)):
            self.stats.host_image_writes_refused += 1
            s.pins -= 1
            self.lists.refresh_snapshot(s)
            self.lists.pin_nodes(path, -1)
            return HostWrite([], [], None, [], -1, [], out)
        slabs = self.slabs.allocate(k, SlabState.FILLING)
        image_slabs = slabs[:self.slabs.image_slabs] if image else []
        tail_slab = slabs[-1] if tail else -1
        if image:
            s.host_slabs, s.image_host = image_slabs, FILLING
        if tail:
            s.tail_slab, s.tail_host = tail_slab, FILLING
        self.stats.host_image_writes += 1
        return HostWrite([], [], s, image_slabs, tail_slab, path, out)

    def complete_write(self, write: HostWrite, ok: bool) -> None:
        """The snapshot part of a landed (or failed) write; the caller unpins ``write.pinned``."""
        s = write.snapshot
        if write.image_slabs:
            if ok:
                s.image_host = RESIDENT
                for slab in write.image_slabs:
                    self.slabs.set_state(slab, SlabState.IMAGE)
            else:
                self.slabs.free(write.image_slabs)
                s.host_slabs, s.image_host = [], ABSENT
        if write.tail_slab >= 0:
            if ok:
                s.tail_host = RESIDENT
                self.slabs.set_state(write.tail_slab, SlabState.TAIL)
            else:
                self.slabs.free((write.tail_slab,))
                s.tail_slab, s.tail_host = -1, ABSENT
        s.pins -= 1
        self.lists.refresh_snapshot(s)
        self.gdsf.mark(s)
