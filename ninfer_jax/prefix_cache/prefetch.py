"""Prefetching the waiting FIFO head's Host-only path blocks into spare Device pages (spec §6.6).

While the head waits for a lane or for pages, its source's Host-only path blocks can be copied during the
wait instead of at admission. ``Prefetcher.plan`` takes the source admission would choose (the quote's
cheapest usable candidate), pins that source's path, and reserves a Filling page for each of up to
``max_blocks`` Host-only path blocks, shallowest first (the order a forward pass reads them). Pages come from
the free pool and from Host-backed cached entries, least recently used first: a prefetch never drops a
last copy. ``complete`` makes the copies Resident cached blocks and unpins the path, which rejoins the
device LRU at the MRU end (deepest first); a later admission finds them Device-resident and restores only
the rest. Active growth may evict them like any cache.

Invariants: the path stays pinned while a Filling page is in flight (pins are closed upward); the spare
room counted never includes the head's own path.
"""

from __future__ import annotations

from .admission import AdmissionQuote
from .eviction import EvictionLists
from .pools import DevicePagePool, OwnerState
from .reclaim import Reclaimer
from .results import BlockRestore, Prefetch, PrefixCacheStats, Reclaimed
from .tree import ABSENT, FILLING, RESIDENT


class Prefetcher:
    """Plans and completes prefetch batches for the blocked head."""

    def __init__(self, pages: DevicePagePool, lists: EvictionLists, reclaimer: Reclaimer, stats: PrefixCacheStats):
        self.pages = pages
        self.lists = lists
        self.reclaimer = reclaimer
        self.stats = stats

    def spare_pages(self) -> int:
        """Pages a prefetch may take: free ones and Host-backed cached entries (O(1))."""
        return self.pages.num_free + len(self.lists.backed)

    def plan(self, quote: AdmissionQuote, max_blocks: int) -> Prefetch | None:
        """A batch for the source admission would choose; None when it has nothing Host-only or no room."""
        usable = [c for c in quote.candidates if not c.filling]
        if not usable:
            return None
        source = min(usable, key=lambda c: (c.cost_seconds, c.transfer_bytes, -c.frontier))
        if source.snapshot is None or source.host_path_blocks == 0:
            return None
        path = quote.match.path[:source.snapshot.anchor.depth + 1]
        self.lists.pin_nodes(path, 1)  # first: the head's own path leaves the lists it would be counted in
        wanted = [n for n in path if n.device_state is ABSENT and n.host_state is RESIDENT]
        k = min(len(wanted), max_blocks, self.spare_pages())
        if k == 0:
            self.lists.pin_nodes(path, -1)
            return None
        out = Reclaimed()
        evicted = self.reclaimer.evict_device(k, out, backed_only=True)
        assert evicted, "spare_pages counted pages the backed list does not hold"
        restores = []
        for node in wanted[:k]:
            page = self.pages.allocate_one(OwnerState.FILLING)
            node.device_page, node.device_state = page, FILLING
            node.pins += 1
            restores.append(BlockRestore(node, node.host_slab, page))
        return Prefetch(restores, path, out)

    def complete(self, batch: Prefetch, ok: bool) -> None:
        """The copies landed (ok) or failed: destinations become Resident cached blocks, or are freed."""
        if batch.done:
            raise ValueError("prefetch already completed")
        for r in batch.restores:
            node = r.node
            node.pins -= 1
            if ok:
                node.device_state = RESIDENT
                self.pages.set_state(r.page, OwnerState.CACHED)
            else:
                self.pages.free_one(r.page)
                node.device_page, node.device_state = -1, ABSENT
        self.lists.pin_nodes(batch.pinned, -1)
        if ok:
            self.stats.prefetches += 1
            self.stats.prefetched_blocks += len(batch.restores)
        batch.done = True
