"""Admission staging: from a Ready quote to a lane holding its path (spec §6.4, §6.5).

``stage`` is the materialisation transaction's first step:

  1. pin every path node up to the source's anchor (they leave the device LRU) and the source
     snapshot;
  2. evict from the device LRU until ``need_pages`` page groups are free, then reserve them:
     a FILLING page for each Host-only path block and a Host-only tail (each pinned by its
     restore), and the lane's ACTIVE pages (``entitlement - floor(F_s / 64)``);
  3. list the restores: (node, slab, page) per Host-only block, the tail's, and the image's
     slabs when it is not on the Device (else the Device slot the lane copies from).

The source counts a hit (recency, frequency, retained again if superseded); matched blocks
beyond the anchor (recomputed, §7.5) move to the MRU end, deepest first. ``activate`` turns
the admission pins into the lane's active refs and drops the snapshot pin; ``complete_restore``
makes restored copies Resident and drops the restore pins, before or after activation;
``cancel`` undoes a staging that was never activated.

Invariants: a FILLING page is never mapped by anyone else and never freed while pinned; the
arithmetic of ``admission.make_quote`` guarantees the eviction in step 2 succeeds for a quote
whose cache_epoch is current (a failure is an AssertionError, a bug).
"""

from __future__ import annotations

from .admission import AdmissionQuote
from .eviction import EvictionLists
from .hashing import BLOCK_TOKENS
from .pools import DevicePagePool, OwnerState
from .publication import SnapshotPublisher
from .reclaim import Reclaimer
from .results import BlockRestore, PrefixCacheStats, Reclaimed, Staging
from .tree import ABSENT, FILLING, RESIDENT, BlockNode


class AdmissionStager:
    """Pins, reserves and lists restores for admissions; hands paths to lanes."""

    def __init__(self, pages: DevicePagePool, lists: EvictionLists, reclaimer: Reclaimer,
                 publisher: SnapshotPublisher, stats: PrefixCacheStats):
        self.pages = pages
        self.lists = lists
        self.reclaimer = reclaimer
        self.publisher = publisher
        self.stats = stats

    def stage(self, quote: AdmissionQuote) -> Staging:
        src = quote.source
        s = src.snapshot
        path = quote.match.path[:s.anchor.depth + 1] if s is not None else []
        self.lists.pin_nodes(path, 1)
        if s is not None:
            s.pins += 1
            self.lists.refresh_snapshot(s)
        out = Reclaimed()
        if not self.reclaimer.evict_device(src.need_pages, out):
            raise AssertionError("a current Ready quote no longer fits: capacity arithmetic is wrong")
        restores = []
        for node in path:
            if node.device_state is ABSENT:
                page = self.pages.allocate_one(OwnerState.FILLING)
                node.device_page, node.device_state = page, FILLING
                node.pins += 1
                restores.append(BlockRestore(node, node.host_slab, page))
        tail_restore = None
        image_slabs: list[int] = []
        image_slot = -1
        if s is not None:
            if s.tail_len and s.tail_device is ABSENT:
                page = self.pages.allocate_one(OwnerState.FILLING)
                s.tail_page, s.tail_device = page, FILLING
                s.pins += 1
                tail_restore = BlockRestore(s.anchor, s.tail_slab, page)
            if s.image_device is RESIDENT:
                image_slot = s.device_slot
            else:
                image_slabs = list(s.host_slabs)
                s.pins += 1
            self.publisher.hit(s)
        lane = self.pages.allocate(max(0, quote.entitlement_pages - src.frontier // BLOCK_TOKENS),
                                   OwnerState.ACTIVE)
        for node in reversed(quote.match.path[len(path):]):
            self.lists.touch(node)
        st = self.stats
        st.admissions += 1
        st.admissions_from_snapshot += s is not None
        st.reuse_tokens += src.frontier
        st.restored_blocks += len(restores)
        st.restored_tails += tail_restore is not None
        st.restored_images += bool(image_slabs)
        return Staging(quote, src, list(path), s, lane, restores, tail_restore, image_slabs, image_slot, out)

    def activate(self, staging: Staging) -> list[BlockNode]:
        if staging.activated:
            raise ValueError("staging already activated")
        for node in staging.path:
            node.pins -= 1
            node.active_refs += 1
        if staging.snapshot is not None:
            staging.snapshot.pins -= 1
            self.lists.refresh_snapshot(staging.snapshot)
        staging.activated = True
        return list(staging.path)

    def complete_restore(self, staging: Staging) -> None:
        if staging.restored:
            return
        for r in staging.restores:
            r.node.device_state = RESIDENT
            self.pages.set_state(r.page, OwnerState.CACHED)
            r.node.pins -= 1
            self.lists.refresh_node(r.node)
        s = staging.snapshot
        # NOTE: only a snapshot with a restore in flight is still pinned here; one restored
        # from its Device slot may have been evicted since activation and must not be touched.
        if s is not None and (staging.tail_restore is not None or staging.image_slabs):
            if staging.tail_restore is not None:
                s.tail_device = RESIDENT
                self.pages.set_state(staging.tail_restore.page, OwnerState.CACHED)
                s.pins -= 1
            if staging.image_slabs:
                s.pins -= 1
            self.lists.refresh_snapshot(s)
        staging.restored = True

    def cancel(self, staging: Staging) -> None:
        if staging.activated:
            raise ValueError("an activated lane releases its path with release_path")
        self.complete_restore(staging)
        self.lists.pin_nodes(staging.path, -1)
        if staging.snapshot is not None:
            staging.snapshot.pins -= 1
            self.lists.refresh_snapshot(staging.snapshot)
        self.pages.free(staging.lane_pages)
        staging.lane_pages = []
        staging.activated = True
