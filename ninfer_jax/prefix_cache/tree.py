"""The block tree: nodes, snapshots, exact matching and the counters derived from them (spec §5.2, §5.3, §6.1).

A :class:`BlockNode` is one committed 64-token block: its exact tokens and extra key, the
Device page group and Host slab holding its KV, and its liveness counters. A
:class:`Snapshot` is a recurrent-state image at frontier ``F`` anchored on the node of the
last full block below ``F`` (the root when ``F < 64``), with an optional tail of
``F % 64`` tokens whose KV lives in one private page.

Invariants of the tree (rebuilt by ``check_invariants``):
  * identity: a node's tokens, extra key and lookup hash never change after insertion; a
    child is found by lookup hash and accepted only when its 256 token bytes and extra key
    are equal (colliding siblings hang off the same hash in a ``hash_next`` chain);
  * ``depth`` is the block index: a node covers ``[64 * depth, 64 * depth + 64)``; the root
    has depth -1 and no copies;
  * ``live_below(n)`` = number of snapshots whose path (anchor and its ancestors) includes n;
    ``retained_below(n)`` counts only retained (not superseded) ones and ``retained_sum(n)``
    adds their ids, so when ``retained_below == 1`` the sum *is* the id of the one retained
    snapshot below ``n`` (the owner of n's exclusive path bytes, §9.3);
  * at most one snapshot per (anchor, tail tokens, tail extra); ``frontier ==
    64 * (anchor.depth + 1) + tail_len``;
  * ``ancestor(s)`` is the nearest snapshot above ``s`` on its path (any kind, superseded or
    not), ``dependents(a)`` the snapshots whose ancestor is ``a`` (``root_dependents`` for
    ``None``): a new snapshot between them takes over the dependents below it, a removed one
    hands its dependents to its ancestor.

The tree does not know pools or eviction lists: callers refresh list membership for the
nodes whose counters cross zero (returned by the attach/detach walks).
"""

from __future__ import annotations

import enum
from typing import Iterator

from .hashing import BLOCK_TOKEN_BYTES, BLOCK_TOKENS


class Residency(enum.Enum):
    """One copy's state in one tier."""

    ABSENT = 0
    RESIDENT = 1
    FILLING = 2  # destination of an in-flight transfer; never read, never freed


class SnapshotKind(enum.Enum):
    TAP = "tap"                          # prompt tap (64-aligned)
    ENDPOINT = "endpoint"                # request finish/cancel, exact frontier, may own a tail
    BOUNDARY = "boundary"                # tap at a client breakpoint or structural boundary (§9.3)
    OUTPUT_BOUNDARY = "output_boundary"  # §12.3, not produced in this line


ABSENT, RESIDENT, FILLING = Residency.ABSENT, Residency.RESIDENT, Residency.FILLING


class BlockNode:
    """One committed block. Fields name the one place allowed to change them.

    ``device_page``/``device_state`` and ``host_slab``/``host_state``: the index's residency
    transitions. ``active_refs``: lanes mapping the node (commit, activate, release).
    ``pins``: admissions, restores and writes in flight (pin/unpin); a pinned or referenced
    node's parent is pinned or referenced too, so deleting an unpinned subtree never meets a
    pin. ``lru``/``dead``: list membership, set only by ``EvictionLists.refresh_node``.
    """

    __slots__ = ("id", "parent", "depth", "lookup_hash", "extra", "tokens", "children", "hash_next",
                 "device_page", "host_slab", "device_state", "host_state", "active_refs", "pins",
                 "live_below", "retained_below", "retained_sum", "lru", "dead", "snapshots")

    def __init__(self, ident: int, parent: "BlockNode | None", depth: int, lookup_hash: int,
                 tokens: bytes, extra: int):
        self.id = ident
        self.parent = parent
        self.depth = depth
        self.lookup_hash = lookup_hash
        self.extra = extra
        self.tokens = tokens
        self.children: dict[int, BlockNode] = {}
        self.hash_next: BlockNode | None = None
        self.device_page = -1
        self.host_slab = -1
        self.device_state = ABSENT
        self.host_state = ABSENT
        self.active_refs = 0
        self.pins = 0
        self.live_below = 0
        self.retained_below = 0
        self.retained_sum = 0
        self.lru = None
        self.dead = False
        self.snapshots: list[Snapshot] | None = None

    def __repr__(self) -> str:
        return (f"BlockNode(id={self.id}, depth={self.depth}, dev={self.device_state.name}, "
                f"host={self.host_state.name}, refs={self.active_refs}, pins={self.pins})")

    @property
    def is_root(self) -> bool:
        return self.parent is None

    def has_resident_copy(self) -> bool:
        return self.device_state is RESIDENT or self.host_state is RESIDENT

    def child_nodes(self) -> Iterator["BlockNode"]:
        """Every child, colliding siblings included."""
        for head in self.children.values():
            while head is not None:
                yield head
                head = head.hash_next

    def path(self) -> list["BlockNode"]:
        """Nodes from the root's child down to this node (empty for the root)."""
        out = []
        node = self
        while node.parent is not None:
            out.append(node)
            node = node.parent
        out.reverse()
        return out


class Snapshot:
    """A recurrent-state image at an exact frontier (spec §5.3).

    Residency of its three parts: the image (``device_slot``/``image_device``,
    ``host_slabs``/``image_host``) and the tail (``tail_page``/``tail_device``,
    ``tail_slab``/``tail_host``). ``pins`` counts admissions, restores and writes in flight
    (a pinned snapshot's anchor path is pinned too). GDSF fields (``l_base``, ``hits``,
    ``cost``, ``size``, ``h``) are written only by ``GdsfPolicy``; ``superseded`` and
    ``superseded_seq`` only by the index's supersession.
    """

    __slots__ = ("id", "kind", "anchor", "frontier", "tail_len", "tail_tokens", "tail_extra",
                 "tail_page", "tail_slab", "tail_device", "tail_host", "device_slot", "host_slabs",
                 "image_device", "image_host", "pins", "superseded", "superseded_seq", "ancestor",
                 "dependents", "hits", "l_base", "cost", "size", "h", "last_hit", "lru")

    def __init__(self, ident: int, kind: SnapshotKind, anchor: BlockNode, tail_tokens: bytes, tail_extra: int):
        self.id = ident
        self.kind = kind
        self.anchor = anchor
        self.tail_len = len(tail_tokens) // 4
        self.frontier = BLOCK_TOKENS * (anchor.depth + 1) + self.tail_len
        self.tail_tokens = tail_tokens
        self.tail_extra = tail_extra
        self.tail_page = -1
        self.tail_slab = -1
        self.tail_device = ABSENT
        self.tail_host = ABSENT
        self.device_slot = -1
        self.host_slabs: list[int] = []
        self.image_device = ABSENT
        self.image_host = ABSENT
        self.pins = 0
        self.superseded = False
        self.superseded_seq = 0
        self.ancestor: Snapshot | None = None
        self.dependents: dict[Snapshot, None] = {}
        self.hits = 0
        self.l_base = 0.0
        self.cost = 0.0
        self.size = 1
        self.h = 0.0
        self.last_hit = 0
        self.lru = None

    def __repr__(self) -> str:
        return (f"Snapshot(id={self.id}, {self.kind.value}, F={self.frontier}, "
                f"superseded={self.superseded}, dev={self.image_device.name}, host={self.image_host.name})")

    @property
    def retained(self) -> bool:
        return not self.superseded

    def image_valid(self) -> bool:
        return self.image_device is RESIDENT or self.image_host is RESIDENT

    def tail_valid(self) -> bool:
        return self.tail_len == 0 or self.tail_device is RESIDENT or self.tail_host is RESIDENT

    def device_complete(self) -> bool:
        """Image and tail both resident on the Device (restorable without the Host copy)."""
        return self.image_device is RESIDENT and (self.tail_len == 0 or self.tail_device is RESIDENT)

    def has_host_copy(self) -> bool:
        return self.image_host is RESIDENT or self.tail_host is RESIDENT


class BlockTree:
    """Nodes and snapshots with stable int ids, exact child lookup and the path counters."""

    def __init__(self):
        self.root = BlockNode(0, None, -1, 0, b"", 0)
        self.nodes: dict[int, BlockNode] = {}
        self.snapshots: dict[int, Snapshot] = {}
        self.root_dependents: dict[Snapshot, None] = {}
        self._next_node_id = 1
        self._next_snapshot_id = 1

    # ---- nodes ---------------------------------------------------------------------------

    def find_child(self, parent: BlockNode, lookup_hash: int, tokens: bytes, extra: int) -> BlockNode | None:
        """The child of ``parent`` with exactly these tokens and extra key (hash only selects)."""
        child = parent.children.get(lookup_hash)
        while child is not None and (child.tokens != tokens or child.extra != extra):
            child = child.hash_next
        return child

    def add_child(self, parent: BlockNode, lookup_hash: int, tokens: bytes, extra: int) -> BlockNode:
        node = BlockNode(self._next_node_id, parent, parent.depth + 1, lookup_hash, tokens, extra)
        self._next_node_id += 1
        head = parent.children.get(lookup_hash)
        if head is None:
            parent.children[lookup_hash] = node
        else:
            node.hash_next = head.hash_next
            head.hash_next = node
        self.nodes[node.id] = node
        return node

    def remove_leaf(self, node: BlockNode) -> None:
        """Detaches a childless, snapshot-free node from the tree."""
        assert not node.children and not node.snapshots, f"{node} still has children or snapshots"
        parent = node.parent
        head = parent.children[node.lookup_hash]
        if head is node:
            if node.hash_next is None:
                del parent.children[node.lookup_hash]
            else:
                parent.children[node.lookup_hash] = node.hash_next
        else:
            while head.hash_next is not node:
                head = head.hash_next
            head.hash_next = node.hash_next
        node.hash_next = None
        del self.nodes[node.id]

    def subtree(self, node: BlockNode) -> list[BlockNode]:
        """``node`` and every descendant, parents before children."""
        out = [node]
        i = 0
        while i < len(out):
            out.extend(out[i].child_nodes())
            i += 1
        return out

    def walk(self, data: bytes, hashes, extras, limit: int) -> tuple[list[BlockNode], list[BlockNode]]:
        """Matches full blocks ``0 .. limit-1`` of ``data`` (int32 token bytes) from the root.

        Returns:
          (path, anchors): the matched nodes N_0..N_{k-1}, and the nodes among the root and
          the path that anchor at least one snapshot, in path order.
        """
        root = self.root
        anchors = [root] if root.snapshots else []
        path: list[BlockNode] = []
        push = path.append
        node = root
        size = BLOCK_TOKEN_BYTES
        off = 0
        limit = min(limit, len(hashes))
        n_extras = len(extras) if extras is not None else 0
        for b in range(limit):
            child = node.children.get(hashes[b])
            if child is None:
                break
            tok = data[off:off + size]
            off += size
            extra = extras[b] if b < n_extras else 0
            if child.tokens != tok or child.extra != extra:
                child = child.hash_next
                while child is not None and (child.tokens != tok or child.extra != extra):
                    child = child.hash_next
                if child is None:
                    break
            push(child)
            if child.snapshots:
                anchors.append(child)
            node = child
        return path, anchors

    # ---- snapshots -----------------------------------------------------------------------

    def find_snapshot(self, anchor: BlockNode, tail_tokens: bytes, tail_extra: int) -> Snapshot | None:
        for s in anchor.snapshots or ():
            if s.tail_tokens == tail_tokens and s.tail_extra == tail_extra:
                return s
        return None

    def new_snapshot(self, kind: SnapshotKind, anchor: BlockNode, tail_tokens: bytes, tail_extra: int) -> Snapshot:
        s = Snapshot(self._next_snapshot_id, kind, anchor, tail_tokens, tail_extra)
        self._next_snapshot_id += 1
        return s

    def attach_snapshot(self, s: Snapshot) -> tuple[list[BlockNode], int, list[Snapshot]]:
        """Registers a new retained snapshot: anchor list, ancestor/dependents, path counters.

        Returns:
          (revived, owner, moved): nodes whose ``live_below`` left zero, the id of the snapshot
          whose exclusive path shrank (0 if none), and the dependents ``s`` took over.
        """
        anchor = s.anchor
        if anchor.snapshots is None:
            anchor.snapshots = []
        anchor.snapshots.append(s)
        self.snapshots[s.id] = s
        above = self.nearest_above(s)
        s.ancestor = above
        siblings = above.dependents if above is not None else self.root_dependents
        # NOTE: before the counters walk, anchor.live_below counts the snapshots whose path
        # includes the anchor; when there are none (a new deepest tap, the common case) no
        # dependent can lie below s and the O(dependents x depth) scan is skipped.
        below = anchor.live_below if anchor.parent is not None else len(self.snapshots) - 1
        moved = [d for d in siblings if d.frontier > s.frontier and self.is_above(s, d)] if below else []
        for d in moved:
            del siblings[d]
            d.ancestor = s
            s.dependents[d] = None
        siblings[s] = None
        revived, owner = self.walk_counts(anchor, 1, 1, s.id)
        return revived, owner, moved

    def detach_snapshot(self, s: Snapshot) -> tuple[list[BlockNode], int, list[Snapshot]]:
        """Unregisters ``s``; its dependents go to its ancestor.

        Returns:
          (dead, owner, handed): nodes whose ``live_below`` reached zero (deepest first), the id
          of the snapshot whose exclusive path grew (0 if none), and the handed-over dependents.
        """
        anchor = s.anchor
        anchor.snapshots.remove(s)
        if not anchor.snapshots:
            anchor.snapshots = None
        del self.snapshots[s.id]
        above = s.ancestor
        siblings = above.dependents if above is not None else self.root_dependents
        del siblings[s]
        handed = list(s.dependents)
        for d in handed:
            d.ancestor = above
            siblings[d] = None
        s.dependents = {}
        s.ancestor = None
        dead, owner = self.walk_counts(anchor, -1, 0 if s.superseded else -1, s.id)
        return dead, owner, handed

    def walk_counts(self, anchor: BlockNode, live_delta: int, retained_delta: int,
                    sid: int) -> tuple[list[BlockNode], int]:
        """Adds the deltas to every node on path(anchor).

        Returns:
          (crossed, owner): nodes whose live count crossed zero (deepest first), and the id of
          the other retained snapshot whose exclusive path changed (count 1 <-> 2), or 0.
        """
        crossed: list[BlockNode] = []
        owner = 0
        node = anchor
        while node.parent is not None:
            if live_delta:
                before = node.live_below
                node.live_below = before + live_delta
                if before == 0 or node.live_below == 0:
                    crossed.append(node)
            if retained_delta:
                if retained_delta > 0:
                    if node.retained_below == 1 and not owner:
                        owner = node.retained_sum
                    node.retained_below += 1
                    node.retained_sum += sid
                else:
                    node.retained_below -= 1
                    node.retained_sum -= sid
                    if node.retained_below == 1 and not owner:
                        owner = node.retained_sum
            node = node.parent
        return crossed, owner

    def nearest_above(self, s: Snapshot) -> Snapshot | None:
        """The deepest other snapshot whose tokens ``[0, F)`` are a prefix of s's path."""
        best = None
        for x in s.anchor.snapshots or ():
            if (x is not s and x.tail_len < s.tail_len and s.tail_tokens.startswith(x.tail_tokens)
                    and (best is None or x.frontier > best.frontier)):
                best = x
        if best is not None:
            return best
        child, node = s.anchor, s.anchor.parent
        while node is not None:
            for x in node.snapshots or ():
                if child.tokens.startswith(x.tail_tokens) and (best is None or x.frontier > best.frontier):
                    best = x
            if best is not None:
                return best
            child, node = node, node.parent
        return None

    def is_above(self, x: Snapshot, s: Snapshot) -> bool:
        """Whether x's frontier lies on s's path strictly before s's frontier (tokens only)."""
        if x is s or x.frontier >= s.frontier:
            return False
        if x.anchor is s.anchor:
            return s.tail_tokens.startswith(x.tail_tokens)
        node = s.anchor
        target = x.anchor.depth + 1
        if node.depth < target:
            return False
        while node.depth > target:
            node = node.parent
        return node.parent is x.anchor and node.tokens.startswith(x.tail_tokens)

    def single_chain_below(self, node: BlockNode) -> bool:
        """Whether the tree below ``node`` never branches (no other conversation continued)."""
        while True:
            kids = iter(node.child_nodes())
            first = next(kids, None)
            if first is None:
                return True
            if next(kids, None) is not None:
                return False
            node = first

    def path_snapshots(self, anchor: BlockNode) -> Iterator[Snapshot]:
        """Every snapshot anchored on path(anchor) or the root."""
        node = anchor
        while node is not None:
            yield from node.snapshots or ()
            node = node.parent
