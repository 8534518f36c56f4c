"""Dropping copies, losing the last copy, and the three eviction procedures (spec §9.1–§9.4).

:class:`Reclaimer` is the only code that frees pool ids owned by cache entries:

  * device LRU (§9.1): pop the head, backed entries first; a backed entry drops its Device
    copy, an unbacked one loses its last copy;
  * device snapshot slots (§9.2): free slot, else a superseded owner's (oldest supersession
    first; kept on the Host or deleted), else the lowest-H Device-only owner's when the new
    snapshot's estimated priority is at least as high (lost; L rises), else the least
    recently hit Host-backed owner's (Device copy dropped); otherwise no slot;
  * Host slabs (§9.3): dead-KV sweep, else the oldest superseded snapshot entirely (L
    unchanged), else the retained snapshot of minimum H (L := max(L, H)); a victim still
    complete on the Device only gives up its Host copy. An image write passes its own H as
    ``bound`` and stops rather than evict something worth more;
  * losing the last copy (§9.4): a node with neither copy is deleted with its subtree and
    every snapshot anchored in it, decrementing ``live_below`` along their paths.

Invariants relied on: pinned or referenced entries are never in a list and never chosen;
pins and refs are closed upward (a pinned node's parent is pinned or referenced, a pinned
snapshot's anchor path is pinned), so an unpinned subtree never contains a pinned entry —
``delete_subtree`` asserts it.
"""

from __future__ import annotations

from .eviction import EvictionLists, GdsfPolicy
from .host_slabs import HostSlabPool
from .pools import DevicePagePool, OwnerState, SnapshotSlotPool
from .results import PrefixCacheStats, Reclaimed
from .tree import ABSENT, RESIDENT, BlockNode, BlockTree, Snapshot


class Reclaimer:
    """Frees ids of cache entries and applies §9's eviction orders."""

    def __init__(self, tree: BlockTree, pages: DevicePagePool, slots: SnapshotSlotPool, slabs: HostSlabPool,
                 lists: EvictionLists, gdsf: GdsfPolicy, stats: PrefixCacheStats):
        self.tree = tree
        self.pages = pages
        self.slots = slots
        self.slabs = slabs
        self.lists = lists
        self.gdsf = gdsf
        self.stats = stats
        self.slot_owner: list[Snapshot | None] = [None] * slots.capacity  # written only here and by publish

    # ---- nodes ---------------------------------------------------------------------------

    def drop_node_device(self, node: BlockNode, out: Reclaimed) -> None:
        """Drops the Device copy; without a Host copy the node loses its last copy."""
        if node.host_state is not RESIDENT:
            self.delete_subtree(node, out)
            return
        self.pages.free_one(node.device_page)
        out.freed_pages.append(node.device_page)
        out.node_device_dropped.append(node.id)
        node.device_page = -1
        node.device_state = ABSENT
        self.lists.refresh_node(node)

    def drop_node_host(self, node: BlockNode, out: Reclaimed) -> None:
        """Drops the Host copy; without a Device copy the node loses its last copy."""
        out.node_host_dropped.append(node.id)
        if node.device_state is not RESIDENT:
            self.delete_subtree(node, out)
            return
        self.slabs.free((node.host_slab,))
        out.freed_slabs.append(node.host_slab)
        node.host_slab = -1
        node.host_state = ABSENT
        self.gdsf.mark_node_owner(node)
        self.lists.refresh_node(node)

    def delete_subtree(self, node: BlockNode, out: Reclaimed) -> None:
        """Deletes ``node``, its descendants and every snapshot anchored among them (§9.4)."""
        nodes = self.tree.subtree(node)
        for n in nodes:
            assert n.active_refs == 0 and n.pins == 0, f"losing the last copy of {node} would delete held {n}"
        for n in nodes:
            for s in list(n.snapshots or ()):
                self.delete_snapshot(s, out)
        lists, pages, slabs = self.lists, self.pages, self.slabs
        for n in reversed(nodes):
            lists.forget_node(n)
            if n.device_page >= 0:
                pages.free_one(n.device_page)
                out.freed_pages.append(n.device_page)
                n.device_page = -1
            if n.host_slab >= 0:
                slabs.free((n.host_slab,))
                out.freed_slabs.append(n.host_slab)
                n.host_slab = -1
            n.device_state = n.host_state = ABSENT
            self.tree.remove_leaf(n)
            out.lost_nodes.append(n.id)
        self.stats.nodes_lost += len(nodes)

    # ---- snapshots -----------------------------------------------------------------------

    def delete_snapshot(self, s: Snapshot, out: Reclaimed) -> None:
        """Removes ``s`` with every copy; its dependents go to its ancestor."""
        assert s.pins == 0, f"deleting pinned {s}"
        if s.device_slot >= 0:
            self.slots.free_one(s.device_slot)
            self.slot_owner[s.device_slot] = None
            out.freed_slots.append(s.device_slot)
            s.device_slot = -1
        if s.host_slabs:
            self.slabs.free(s.host_slabs)
            out.freed_slabs.extend(s.host_slabs)
            s.host_slabs = []
        if s.tail_page >= 0:
            self.pages.free_one(s.tail_page)
            out.freed_pages.append(s.tail_page)
            s.tail_page = -1
        if s.tail_slab >= 0:
            self.slabs.free((s.tail_slab,))
            out.freed_slabs.append(s.tail_slab)
            s.tail_slab = -1
        s.image_device = s.image_host = s.tail_device = s.tail_host = ABSENT
        self.lists.forget_snapshot(s)
        dead, owner, handed = self.tree.detach_snapshot(s)
        self.gdsf.forget(s)
        self.gdsf.mark_id(owner)
        self.gdsf.mark_through(handed)
        for node in dead:
            self.lists.refresh_node(node)
        out.deleted_snapshots.append(s.id)
        self.stats.snapshots_deleted += 1

    def drop_snapshot_image_device(self, s: Snapshot, out: Reclaimed) -> None:
        """Frees the image's Device slot; the Host copy keeps the snapshot valid."""
        assert s.image_host is RESIDENT, f"{s} would lose its image"
        self.slots.free_one(s.device_slot)
        self.slot_owner[s.device_slot] = None
        out.freed_slots.append(s.device_slot)
        out.snapshot_device_dropped.append(s.id)
        s.device_slot = -1
        s.image_device = ABSENT

    def drop_snapshot_host(self, s: Snapshot, out: Reclaimed) -> None:
        """Frees the Host image and tail slabs of a snapshot complete on the Device."""
        assert s.device_complete(), f"{s} is not complete on the Device"
        if s.host_slabs:
            self.slabs.free(s.host_slabs)
            out.freed_slabs.extend(s.host_slabs)
            s.host_slabs = []
        if s.tail_slab >= 0:
            self.slabs.free((s.tail_slab,))
            out.freed_slabs.append(s.tail_slab)
            s.tail_slab = -1
        s.image_host = s.tail_host = ABSENT
        out.snapshot_host_dropped.append(s.id)
        self.lists.refresh_snapshot(s)

    def drop_tail_device(self, s: Snapshot, out: Reclaimed) -> None:
        """Drops the tail's Device page; an unbacked tail invalidates the snapshot."""
        if s.tail_host is not RESIDENT:
            self.delete_snapshot(s, out)
            return
        self.pages.free_one(s.tail_page)
        out.freed_pages.append(s.tail_page)
        s.tail_page = -1
        s.tail_device = ABSENT
        self.lists.refresh_snapshot(s)

    # ---- §9.1 device LRU -----------------------------------------------------------------

    def evict_device(self, want_free: int, out: Reclaimed, backed_only: bool = False) -> bool:
        """Evicts from the device LRU until ``want_free`` page groups are free (only Host-backed entries,
        which never lose a last copy, with ``backed_only``)."""
        lists = self.lists
        while self.pages.num_free < want_free:
            entry = next(iter(lists.backed), None) if backed_only else lists.next_device_victim()
            if entry is None:
                return False
            self.drop_device_entry(entry, out)
        return True

    def drop_device_entry(self, entry, out: Reclaimed) -> None:
        """Drops a device-LRU entry's page (a node's, or a snapshot's tail), counting it as an eviction."""
        if entry.lru is self.lists.backed:
            self.stats.device_evicted_backed += 1
        else:
            self.stats.device_evicted_unbacked += 1
        if type(entry) is BlockNode:
            self.drop_node_device(entry, out)
        else:
            self.drop_tail_device(entry, out)

    # ---- §9.2 device snapshot slots ------------------------------------------------------

    def acquire_slot(self, new_priority: float | None, out: Reclaimed) -> int | None:
        """A slot in §9.2 order, in the ACTIVE (staging) state; None when the tap is skipped."""
        if self.slots.num_free == 0:
            owners = [s for s in self.slot_owner if s is not None and s.pins == 0]
            superseded = [s for s in owners if s.superseded]
            device_only = [s for s in owners if s.image_host is ABSENT]
            victim = self.gdsf.min_victim(device_only) if device_only and not superseded else None
            if superseded:
                s = min(superseded, key=lambda x: x.superseded_seq)
                self.stats.slot_evicted_superseded += 1
                if s.image_host is RESIDENT:
                    self.drop_snapshot_image_device(s, out)
                else:
                    self.delete_snapshot(s, out)
            elif victim is not None and new_priority is not None and new_priority >= victim.h:
                self.gdsf.raise_inflation(victim.h)
                self.stats.slot_evicted_device_only += 1
                self.delete_snapshot(victim, out)
            else:
                backed = [s for s in owners if s.image_host is RESIDENT]
                if not backed:
                    return None
                s = min(backed, key=lambda x: (x.last_hit, x.id))
                self.stats.slot_evicted_host_backed += 1
                self.drop_snapshot_image_device(s, out)
        return self.slots.allocate_one(OwnerState.ACTIVE)

    # ---- §9.3 Host slabs -----------------------------------------------------------------

    def make_host_room(self, want_free: int, out: Reclaimed, *, bound: float | None = None,
                       allow_snapshots: bool = True) -> bool:
        """Frees Host slabs until ``want_free`` are free, in §9.3 order.

        Args:
          bound: H of the snapshot being written; stop before evicting a victim worth more.
          allow_snapshots: False limits the sweep to dead KV (writes of dead blocks).
        Returns:
          whether ``want_free`` slabs are free.
        """
        lists, stats = self.lists, self.stats
        while self.slabs.num_free < want_free:
            if lists.dead:
                stats.host_dead_reclaimed += 1
                self.drop_node_host(next(iter(lists.dead)), out)
                continue
            if not allow_snapshots:
                return False
            old = next((s for s in lists.superseded if s.pins == 0), None)
            if old is not None:
                stats.host_superseded_evicted += 1
                self.delete_snapshot(old, out)
                continue
            victim = self.gdsf.min_victim(s for s in lists.host_snapshots if s.pins == 0 and not s.superseded)
            if victim is None or (bound is not None and victim.h > bound):
                return False
            self.gdsf.raise_inflation(victim.h)
            if victim.device_complete():
                stats.host_gdsf_demoted += 1
                self.drop_snapshot_host(victim, out)
            else:
                stats.host_gdsf_evicted += 1
                self.delete_snapshot(victim, out)
        return True

    def demote_device(self) -> Reclaimed:
        """PrefixIndex.demote_device: the Device copy of every unheld entry that has a Host copy goes."""
        out = Reclaimed()
        for entry in list(self.lists.backed):
            self.drop_device_entry(entry, out)
        for s in list(self.tree.snapshots.values()):
            if s.device_slot >= 0 and s.image_host is RESIDENT and s.pins == 0:
                self.drop_snapshot_image_device(s, out)  # list membership does not depend on it
        return out

    def clear(self) -> Reclaimed:
        """PrefixIndex.clear: every unpinned snapshot, then every subtree no lane or copy holds, on both tiers."""
        out = Reclaimed()
        for s in list(self.tree.snapshots.values()):
            if s.pins == 0:
                self.delete_snapshot(s, out)
        # Holds are closed upward, so below an unheld node nothing is held.
        held = [self.tree.root]
        while held:
            node = held.pop()
            for child in list(node.child_nodes()):
                if child.active_refs == 0 and child.pins == 0:
                    self.delete_subtree(child, out)
                else:
                    held.append(child)
        return out
