"""What of the Host tier a restart keeps, and how much of it a Host tier can take back (spec §5.5).

The index side of persistence, free of files and device memory: `collect` lists what a save writes (every
retained snapshot whose image, tail and anchor path are Host-resident, and exactly those paths, parents first);
`plan` chooses what a Host tier of a given size loads back (all of it when it fits, else whole snapshots
greedily by density, each with the path blocks it needs); `PrefixIndex.adopt_saved` rebuilds the chosen
entries Host-only. Superseded snapshots, dead KV and Device-only content are not saved.
"""

from __future__ import annotations

import dataclasses

from .cost import CacheCostModel
from .hashing import BLOCK_TOKENS
from .host_slabs import SlabState
from .tree import RESIDENT, BlockNode, Snapshot, SnapshotKind


@dataclasses.dataclass(frozen=True, slots=True)
class SavedBlock:
    """One block of the save: `parent` is its parent's row in the block table (-1: the root)."""

    parent: int
    lookup_hash: int
    extra: int
    tokens: bytes
    slab: int  # the saving process's slab (where its bytes come from)


@dataclasses.dataclass(frozen=True, slots=True)
class SavedSnapshot:
    """One snapshot of the save, anchored on block table row `anchor` (-1: the root)."""

    kind: str
    anchor: int
    tail_tokens: bytes
    tail_extra: int
    hits: int
    image_slabs: tuple[int, ...]  # the saving process's slabs
    tail_slab: int  # -1 without a tail

    @property
    def slab_count(self) -> int:
        return len(self.image_slabs) + (self.tail_slab >= 0)


@dataclasses.dataclass(frozen=True)
class SavedCache:
    """The block table (parents before children) and the snapshot table of one save."""

    blocks: tuple[SavedBlock, ...]
    snapshots: tuple[SavedSnapshot, ...]

    @property
    def slab_count(self) -> int:
        return len(self.blocks) + sum(s.slab_count for s in self.snapshots)


@dataclasses.dataclass(frozen=True)
class LoadPlan:
    """Rows of the tables to load, ascending (file order); slabs = the Host slabs they take."""

    blocks: tuple[int, ...]
    snapshots: tuple[int, ...]
    slabs: int

    def complete(self, saved: SavedCache) -> bool:
        return len(self.snapshots) == len(saved.snapshots) and len(self.blocks) == len(saved.blocks)


def collect(tree) -> SavedCache:
    """The save of a BlockTree: retained snapshots complete on the Host with a Host-resident anchor path."""
    keep: list[tuple[Snapshot, list[BlockNode]]] = []
    for s in tree.snapshots.values():
        if s.superseded or s.image_host is not RESIDENT or (s.tail_len and s.tail_host is not RESIDENT):
            continue
        path = s.anchor.path()
        if all(n.host_state is RESIDENT for n in path):
            keep.append((s, path))
    rows: dict[BlockNode, int] = {}
    blocks: list[SavedBlock] = []
    for s, path in keep:
        for node in path:  # root to leaf: a parent always has its row first
            if node not in rows:
                rows[node] = len(blocks)
                parent = rows[node.parent] if node.parent.parent is not None else -1
                blocks.append(SavedBlock(parent, node.lookup_hash, node.extra, node.tokens, node.host_slab))
    snapshots = tuple(
        SavedSnapshot(s.kind.value, rows[s.anchor] if s.anchor.parent is not None else -1, s.tail_tokens,
                      s.tail_extra, s.hits, tuple(s.host_slabs), s.tail_slab if s.tail_len else -1)
        for s, _ in keep)
    return SavedCache(tuple(blocks), snapshots)


def plan(saved: SavedCache, free_slabs: int, cost: CacheCostModel, slab_bytes: int) -> LoadPlan:
    """What a Host tier with `free_slabs` free slabs loads of `saved`.

    All of it when it fits. Otherwise whole snapshots, greedily by GDSF density without its time-dependent base:
    (1 + hits) x the prefill a restore saves from the root, per byte of image, tail and anchor path; each
    snapshot brings the path blocks it needs that are not chosen yet, and no others.
    """
    if saved.slab_count <= free_slabs:
        return LoadPlan(tuple(range(len(saved.blocks))), tuple(range(len(saved.snapshots))), saved.slab_count)
    paths = [_path_rows(saved, s.anchor) for s in saved.snapshots]

    def density(i: int) -> float:
        s = saved.snapshots[i]
        frontier = BLOCK_TOKENS * len(paths[i]) + len(s.tail_tokens) // 4
        return (1 + s.hits) * cost.prefill_seconds(0, frontier) / ((s.slab_count + len(paths[i])) * slab_bytes)

    chosen_blocks: set[int] = set()
    chosen: list[int] = []
    left = free_slabs
    for i in sorted(range(len(saved.snapshots)), key=density, reverse=True):
        new = [b for b in paths[i] if b not in chosen_blocks]
        need = len(new) + saved.snapshots[i].slab_count
        if need <= left:
            chosen.append(i)
            chosen_blocks.update(new)
            left -= need
    return LoadPlan(tuple(sorted(chosen_blocks)), tuple(sorted(chosen)), free_slabs - left)


def _path_rows(saved: SavedCache, row: int) -> list[int]:
    out = []
    while row >= 0:
        out.append(row)
        row = saved.blocks[row].parent
    return out



def adopt(index, saved: SavedCache, plan: LoadPlan, slabs: list[int]) -> None:
    """Rebuilds the planned entries of `saved` in the empty `index`, Host-only, parents before children
    (PrefixIndex.adopt_saved)."""
    if index.tree.nodes or index.tree.snapshots:
        raise ValueError("a saved cache loads only into an empty index")
    if len(slabs) != plan.slabs:
        raise ValueError(f"the plan takes {plan.slabs} slabs, got {len(slabs)}")
    taken = iter(slabs)
    nodes: dict[int, BlockNode] = {}
    for row in plan.blocks:  # ascending rows: parents first
        b = saved.blocks[row]
        node = index.tree.add_child(index.tree.root if b.parent < 0 else nodes[b.parent], b.lookup_hash,
                                   b.tokens, b.extra)
        node.host_slab, node.host_state = next(taken), RESIDENT
        index.slabs.set_state(node.host_slab, SlabState.NODE)
        nodes[row] = node
    for row in plan.snapshots:
        saved_s = saved.snapshots[row]
        anchor = index.tree.root if saved_s.anchor < 0 else nodes[saved_s.anchor]
        s = index.tree.new_snapshot(SnapshotKind(saved_s.kind), anchor, saved_s.tail_tokens, saved_s.tail_extra)
        s.host_slabs, s.image_host = [next(taken) for _ in saved_s.image_slabs], RESIDENT
        for slab in s.host_slabs:
            index.slabs.set_state(slab, SlabState.IMAGE)
        if saved_s.tail_slab >= 0:
            s.tail_slab, s.tail_host = next(taken), RESIDENT
            index.slabs.set_state(s.tail_slab, SlabState.TAIL)
        _, owner, moved = index.tree.attach_snapshot(s)
        index.gdsf.on_publish(s)
        s.hits = saved_s.hits
        index.gdsf.mark_id(owner)
        index.gdsf.mark_through(moved)
        index.lists.refresh_snapshot(s)
    for node in nodes.values():
        index.lists.refresh_node(node)
        index.gdsf.mark_node_owner(node)


__all__ = ["LoadPlan", "SavedBlock", "SavedCache", "SavedSnapshot", "adopt", "collect", "plan"]
