"""A lane's path of committed blocks: mapping a cached path, committing new blocks, and releasing the path with
the write-through of its Device-only blocks (spec §7.5-§7.7). The index bumps its epoch around each call."""

from __future__ import annotations

from .eviction import EvictionLists, GdsfPolicy
from .hashing import BLOCK_TOKEN_BYTES, encode_tokens
from .host_slabs import HostSlabPool, SlabState
from .pools import DevicePagePool, OwnerState
from .reclaim import Reclaimer
from .results import BlockCommit, CommitOutcome, HostWrite, PrefixCacheStats, Reclaimed
from .tree import ABSENT, FILLING, RESIDENT, BlockNode, BlockTree


class PathKeeper:
    """Active refs on the nodes of lanes' paths, block commits, and path release."""

    def __init__(self, tree: BlockTree, pages: DevicePagePool, slabs: HostSlabPool, lists: EvictionLists,
                 gdsf: GdsfPolicy, reclaimer: Reclaimer, stats: PrefixCacheStats):
        self.tree, self.pages, self.slabs, self.lists, self.gdsf = tree, pages, slabs, lists, gdsf
        self.reclaimer, self.stats = reclaimer, stats

    def acquire(self, path: list[BlockNode]) -> None:
        """PrefixIndex.acquire_path."""
        parent = self.tree.root
        for node in path:
            if node.parent is not parent or node.device_state is ABSENT:
                raise ValueError(f"{node} is not a Device-resident continuation of the path")
            parent = node
        for node in path:
            node.active_refs += 1
            self.lists.refresh_node(node)

    def commit(self, parent: BlockNode, tokens, block_hash: int, page: int, extra: int = 0) -> BlockCommit:
        """PrefixIndex.commit_block (spec §7.6)."""
        if parent.parent is not None and parent.active_refs == 0:
            raise ValueError(f"parent {parent} is not held by the committing lane")
        if type(tokens) is not bytes:
            tokens = encode_tokens(tokens)
        if len(tokens) != BLOCK_TOKEN_BYTES:
            raise ValueError(f"a block is {BLOCK_TOKEN_BYTES} token bytes, got {len(tokens)}")
        if not self.pages.is_state(page, OwnerState.ACTIVE):
            raise ValueError(f"page {page} is not a lane's private page")
        child = self.tree.find_child(parent, block_hash, tokens, extra)
        if child is None:
            child = self.tree.add_child(parent, block_hash, tokens, extra)
            outcome = CommitOutcome.INSERTED
            self.stats.blocks_inserted += 1
        elif child.device_state is ABSENT:
            outcome = CommitOutcome.ADOPTED
            self.stats.blocks_adopted += 1
        else:
            child.active_refs += 1
            self.lists.refresh_node(child)
            self.stats.blocks_duplicate += 1
            return BlockCommit(child, CommitOutcome.DUPLICATE)
        child.device_page = page
        child.device_state = RESIDENT
        self.pages.set_state(page, OwnerState.CACHED)
        child.active_refs += 1
        self.lists.refresh_node(child)
        return BlockCommit(child, outcome)

    def release(self, path: list[BlockNode]) -> HostWrite:
        """PrefixIndex.release_path (spec §7.7 step 2, §7.6 write-through)."""
        for node in path:
            if node.active_refs <= 0:
                raise ValueError(f"{node} is not held by a lane")
        pending = ([n for n in path if n.host_state is ABSENT and n.device_state is RESIDENT]
                   if self.slabs.enabled else [])
        if pending:
            self.lists.pin_nodes(path, 1)
        for node in reversed(path):
            node.active_refs -= 1
            self.lists.refresh_node(node)
        out = Reclaimed()
        if not pending:
            return HostWrite([], [], None, [], -1, [], out)
        chosen: list[BlockNode] = []
        for live in (True, False):
            group = [n for n in pending if (n.live_below > 0) is live]
            if group:
                self.reclaimer.make_host_room(len(chosen) + len(group), out, allow_snapshots=live)
                chosen += group[:max(0, min(len(group), self.slabs.num_free - len(chosen)))]
        self.stats.host_block_writes_refused += len(pending) - len(chosen)
        if not chosen:
            self.lists.pin_nodes(path, -1)
            return HostWrite([], [], None, [], -1, [], out)
        chosen.sort(key=lambda n: n.depth)
        slabs = self.slabs.allocate(len(chosen), SlabState.FILLING)
        for node, slab in zip(chosen, slabs):
            node.host_slab, node.host_state = slab, FILLING
        self.stats.host_block_writes += len(chosen)
        return HostWrite(chosen, slabs, None, [], -1, list(path), out)

    def complete_write(self, write: HostWrite, ok: bool) -> None:
        """The written blocks' Host copies become Resident (``ok``) or are freed."""
        for node, slab in zip(write.nodes, write.node_slabs):
            if ok:
                node.host_state = RESIDENT
                self.slabs.set_state(slab, SlabState.NODE)
                self.gdsf.mark_node_owner(node)
            else:
                self.slabs.free((slab,))
                node.host_slab, node.host_state = -1, ABSENT
