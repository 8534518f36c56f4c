"""Eviction lists and GDSF valuation (spec §9.1, §9.3).

:class:`EvictionLists` is the one place that decides list membership, from an entry's state:

  * device LRU, two lists, backed entries always consumed first:
      - a node is listed iff ``device_state == RESIDENT and active_refs == 0 and pins == 0``;
      - a snapshot tail is listed iff ``tail_len > 0 and tail_device == RESIDENT and pins == 0``;
      - it is in the *backed* list iff its Host copy is RESIDENT, else in the *unbacked* one;
    an entry joins at the MRU end (release appends in reverse block order, so deeper blocks
    are evicted first); ``touch`` moves a listed entry to the MRU end;
  * dead KV: a node is listed iff ``host_state == RESIDENT and live_below == 0 and
    active_refs == 0 and pins == 0`` (no snapshot can ever resume through it);
  * superseded: every superseded snapshot, oldest supersession first;
  * host snapshots: every snapshot with a Host-resident image or tail.

:class:`GdsfPolicy` values snapshots with GreedyDual-Size-Frequency::

    H(s) = L_s + F(s) * C(s) / Z(s)
    C(s) = max(0, prefill_seconds(F_a, F_s - F_a) - restore_seconds(image_bytes))
           a = nearest retained snapshot above s on its path (F_a = 0 at the root)
    Z(s) = image host bytes + tail slab bytes + exclusive path bytes
           (Host-resident nodes on path(s) below which s is the only retained snapshot)
    F(s) = 1 + hits since publication;  L_s = L when s was published or last hit

Invariants: ``L`` never decreases; a snapshot not in ``dirty`` holds the H its current
neighbourhood gives (``check_invariants`` recomputes every clean one). Whatever changes a
snapshot's nearest retained ancestor or exclusive path marks it dirty: publication, hit,
supersession, retaining again, removal, and a Host copy of an exclusively owned node
appearing or disappearing.
"""

from __future__ import annotations

from collections import OrderedDict

from .cost import CacheCostModel
from .hashing import BLOCK_TOKENS
from .tree import RESIDENT, BlockNode, BlockTree, Snapshot


class EvictionLists:
    """Membership of the device LRU, dead-KV, superseded and Host-snapshot lists."""

    def __init__(self):
        self.backed: OrderedDict = OrderedDict()    # BlockNode | Snapshot (tail) -> None
        self.unbacked: OrderedDict = OrderedDict()
        self.dead: OrderedDict[BlockNode, None] = OrderedDict()
        self.superseded: OrderedDict[Snapshot, None] = OrderedDict()
        self.host_snapshots: dict[Snapshot, None] = {}

    @property
    def device_evictable(self) -> int:
        """Entries the device LRU can evict, each returning exactly one page group."""
        return len(self.backed) + len(self.unbacked)

    def refresh_node(self, node: BlockNode) -> None:
        free_of_users = node.active_refs == 0 and node.pins == 0
        target = None
        if free_of_users and node.device_state is RESIDENT:
            target = self.backed if node.host_state is RESIDENT else self.unbacked
        current = node.lru
        if current is not target:
            if current is not None:
                del current[node]
            if target is not None:
                target[node] = None
            node.lru = target
        dead = free_of_users and node.host_state is RESIDENT and node.live_below == 0
        if dead is not node.dead:
            if dead:
                self.dead[node] = None
            else:
                del self.dead[node]
            node.dead = dead

    def refresh_snapshot(self, s: Snapshot) -> None:
        target = None
        if s.tail_len and s.tail_device is RESIDENT and s.pins == 0:
            target = self.backed if s.tail_host is RESIDENT else self.unbacked
        if s.lru is not target:
            if s.lru is not None:
                del s.lru[s]
            if target is not None:
                target[s] = None
            s.lru = target
        if s.superseded:
            if s not in self.superseded:
                self.superseded[s] = None
        else:
            self.superseded.pop(s, None)
        if s.has_host_copy():
            self.host_snapshots[s] = None
        else:
            self.host_snapshots.pop(s, None)

    def forget_node(self, node: BlockNode) -> None:
        if node.lru is not None:
            del node.lru[node]
            node.lru = None
        if node.dead:
            del self.dead[node]
            node.dead = False

    def forget_snapshot(self, s: Snapshot) -> None:
        if s.lru is not None:
            del s.lru[s]
            s.lru = None
        self.superseded.pop(s, None)
        self.host_snapshots.pop(s, None)

    def pin_nodes(self, path: list[BlockNode], delta: int) -> None:
        """Adds ``delta`` (+1 / -1) pins to each node of a root path and refreshes membership
        deepest first, so an unpinned path joins the device LRU in reverse block order."""
        if delta < 0:
            for node in path:
                if node.pins + delta < 0:
                    raise ValueError(f"{node} is not pinned")
        for node in path:
            node.pins += delta
        for node in reversed(path):
            self.refresh_node(node)

    def touch(self, entry) -> None:
        """Moves a listed entry to the MRU end of its list."""
        if entry.lru is not None:
            entry.lru.move_to_end(entry)

    def next_device_victim(self):
        """The LRU head, backed entries first; None when nothing is evictable."""
        for lst in (self.backed, self.unbacked):
            if lst:
                return next(iter(lst))
        return None


class GdsfPolicy:
    """GDSF priorities of snapshots, the inflation value L, and the dirty set.

    Args:
      tree: the block tree (snapshot registry and node counters).
      cost: the shared cost model.
      image_bytes: one image's packed bytes (restore cost).
      image_host_bytes: one image's Host footprint (``image_slabs * slab_bytes``).
      block_host_bytes: one slab (a node's or a tail's Host footprint).
    """

    def __init__(self, tree: BlockTree, cost: CacheCostModel, image_bytes: int, image_host_bytes: int,
                 block_host_bytes: int):
        self.tree = tree
        self.cost = cost
        self.image_bytes = image_bytes
        self.image_host_bytes = image_host_bytes
        self.block_host_bytes = block_host_bytes
        self.inflation = 0.0  # L
        self.dirty: dict[Snapshot, None] = {}

    # ---- dirty tracking ------------------------------------------------------------------

    def mark(self, s: Snapshot | None) -> None:
        if s is not None:
            self.dirty[s] = None

    def mark_id(self, sid: int) -> None:
        if sid:
            self.dirty[self.tree.snapshots[sid]] = None

    def mark_below(self, s: Snapshot) -> None:
        """Marks every snapshot whose nearest retained ancestor is or was reached through ``s``."""
        stack = list(s.dependents)
        while stack:
            d = stack.pop()
            self.dirty[d] = None
            if d.superseded:
                stack.extend(d.dependents)

    def mark_through(self, snapshots) -> None:
        """``snapshots`` changed ancestor: mark each, and through superseded ones their dependents."""
        for d in snapshots:
            self.dirty[d] = None
            if d.superseded:
                self.mark_below(d)

    def mark_node_owner(self, node: BlockNode) -> None:
        """A Host copy of ``node`` appeared or vanished: its exclusive owner's Z changed."""
        if node.retained_below == 1:
            self.mark_id(node.retained_sum)

    def forget(self, s: Snapshot) -> None:
        self.dirty.pop(s, None)

    # ---- valuation -----------------------------------------------------------------------

    def nearest_retained_frontier(self, s: Snapshot) -> int:
        a = s.ancestor
        while a is not None and a.superseded:
            a = a.ancestor
        return a.frontier if a is not None else 0

    def exclusive_path_bytes(self, s: Snapshot) -> int:
        if s.superseded:
            return 0
        total = 0
        node = s.anchor
        per = self.block_host_bytes
        while node.parent is not None and node.retained_below == 1:
            if node.host_state is RESIDENT:
                total += per
            node = node.parent
        return total

    def value(self, s: Snapshot) -> float:
        """Recomputes C, Z and H of ``s`` from its neighbourhood (L_s and hits unchanged)."""
        base = self.nearest_retained_frontier(s)
        saved = self.cost.prefill_seconds(base, s.frontier - base) - self.cost.restore_seconds(self.image_bytes)
        s.cost = max(0.0, saved)
        s.size = (self.image_host_bytes + (self.block_host_bytes if s.tail_len else 0)
                  + self.exclusive_path_bytes(s))
        s.h = s.l_base + (1 + s.hits) * s.cost / s.size
        return s.h

    def refresh(self) -> None:
        """Recomputes every dirty snapshot."""
        if self.dirty:
            for s in self.dirty:
                self.value(s)
            self.dirty.clear()

    def estimate(self, frontier: int, previous_frontier: int, tail_len: int) -> float:
        """Priority of a snapshot about to be taken: no hits, the blocks since the lineage's
        previous snapshot its own (spec §9.2 step 3)."""
        base = max(0, min(previous_frontier, frontier))
        saved = self.cost.prefill_seconds(base, frontier - base) - self.cost.restore_seconds(self.image_bytes)
        own_blocks = frontier // BLOCK_TOKENS - base // BLOCK_TOKENS
        size = self.image_host_bytes + (self.block_host_bytes if tail_len else 0) + own_blocks * self.block_host_bytes
        return self.inflation + max(0.0, saved) / size

    # ---- events --------------------------------------------------------------------------

    def on_publish(self, s: Snapshot) -> None:
        s.l_base = self.inflation
        s.hits = 0
        self.mark(s)

    def on_hit(self, s: Snapshot) -> None:
        s.l_base = self.inflation
        s.hits += 1
        self.mark(s)

    def raise_inflation(self, h: float) -> None:
        """L := max(L, H(victim)); L never decreases (H can fall below L when Z grows)."""
        if h > self.inflation:
            self.inflation = h

    def min_victim(self, candidates) -> Snapshot | None:
        """The candidate with the lowest H (ties: the first in iteration order), after refreshing dirty values."""
        self.refresh()
        best = None
        best_h = 0.0
        for s in candidates:
            h = s.h
            if best is None or h < best_h:
                best, best_h = s, h
        return best
