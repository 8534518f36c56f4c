"""The index's sanity check: rebuild every derived value from the tree and compare (spec §10).

``check_invariants(index)`` walks the tree from the root and recomputes, independently of the
incremental bookkeeping:

  * structure: parent/child/depth links, hash chains, exact-identity uniqueness among
    siblings, the node and snapshot registries;
  * residency: id fields agree with states, every node and snapshot is valid (§5.3: each
    part keeps a resident copy), Filling parts are pinned, active nodes have a Device copy,
    pins and refs are closed upward;
  * counters: ``live_below``, ``retained_below`` and ``retained_sum`` of every node;
  * snapshot links: ``ancestor`` is the nearest snapshot above on the path, ``dependents``
    its inverse;
  * lists: device LRU (backed/unbacked), dead KV, superseded (in supersession order), Host
    snapshots, and the ``lru``/``dead`` flags on entries;
  * pools: the owner state of every page group, slot and slab, with the ledgers adding up;
  * GDSF: ``L >= 0`` and every snapshot not marked dirty holds the H its neighbourhood gives.

Raises AssertionError with a message naming the entry on the first mismatch. O(nodes +
snapshots x depth): for tests, not for serving.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import TYPE_CHECKING

from .hashing import LOOKUP_HASH_SEED, block_lookup_hash
from .host_slabs import SlabState
from .pools import OwnerState
from .tree import ABSENT, FILLING, RESIDENT, SnapshotKind

if TYPE_CHECKING:
    from .index import PrefixIndex


def check_invariants(index: "PrefixIndex") -> None:
    nodes = _check_structure(index)
    _check_nodes(index, nodes)
    _check_snapshots(index)
    _check_counters(index, nodes)
    _check_links(index)
    _check_lists(index, nodes)
    _check_pools(index, nodes)
    _check_gdsf(index)


def _check_structure(index) -> list:
    tree = index.tree
    root = tree.root
    assert root.depth == -1 and root.parent is None and root.device_state is ABSENT, "root is malformed"
    reached = []
    stack = [root]
    while stack:
        node = stack.pop()
        keys = set()
        for h, head in node.children.items():
            child = head
            while child is not None:
                assert child.lookup_hash == h, f"{child} hangs off hash {h} but has {child.lookup_hash}"
                assert child.parent is node, f"{child}.parent is not {node}"
                assert child.depth == node.depth + 1, f"{child} depth {child.depth} under depth {node.depth}"
                assert len(child.tokens) == 256, f"{child} holds {len(child.tokens)} token bytes"
                chained = block_lookup_hash(node.lookup_hash if node is not root else LOOKUP_HASH_SEED, child.tokens,
                                            child.extra, index.hash_fn)
                assert child.lookup_hash == chained, f"{child}: its lookup hash is not its chain's ({chained})"
                key = (child.tokens, child.extra)
                assert key not in keys, f"{child}: two siblings with identical tokens and extra"
                keys.add(key)
                assert tree.nodes.get(child.id) is child, f"{child} is not registered under its id"
                reached.append(child)
                stack.append(child)
                child = child.hash_next
    assert len(reached) == len(tree.nodes), f"{len(tree.nodes)} registered nodes, {len(reached)} reachable"
    return reached


def _held(node) -> bool:
    return node.parent is None or node.active_refs > 0 or node.pins > 0


def _check_nodes(index, nodes) -> None:
    for n in nodes:
        assert n.active_refs >= 0 and n.pins >= 0, f"{n} has negative refs or pins"
        assert n.has_resident_copy(), f"{n} has no resident copy and was not deleted (§9.4)"
        assert (n.device_page >= 0) == (n.device_state is not ABSENT), f"{n} device page/state disagree"
        assert (n.host_slab >= 0) == (n.host_state is not ABSENT), f"{n} host slab/state disagree"
        if n.device_state is FILLING or n.host_state is FILLING:
            assert n.pins > 0, f"{n} is Filling but unpinned"
        if n.active_refs:
            assert n.device_state is not ABSENT, f"{n} is mapped by a lane without a Device copy"
        if n.active_refs or n.pins:
            assert _held(n.parent), f"{n} is held but its parent {n.parent} is not (pins must close upward)"


def _check_snapshots(index) -> None:
    tree = index.tree
    seen_keys = set()
    for sid, s in tree.snapshots.items():
        assert s.id == sid, f"{s} registered under id {sid}"
        a = s.anchor
        assert a is tree.root or tree.nodes.get(a.id) is a, f"{s} anchors on deleted {a}"
        assert s in (a.snapshots or ()), f"{s} missing from its anchor's list"
        assert s.frontier == 64 * (a.depth + 1) + s.tail_len >= 1, f"{s} frontier/tail mismatch"
        assert 0 <= s.tail_len < 64 and len(s.tail_tokens) == 4 * s.tail_len, f"{s} tail malformed"
        if s.kind in (SnapshotKind.TAP, SnapshotKind.BOUNDARY):
            assert s.tail_len == 0, f"{s}: taps are 64-aligned"
        key = (a.id, s.tail_tokens, s.tail_extra)
        assert key not in seen_keys, f"{s} duplicates another snapshot's (anchor, tail)"
        seen_keys.add(key)
        assert s.image_valid() and s.tail_valid(), f"{s} is invalid (§5.3) but still exists"
        assert (s.device_slot >= 0) == (s.image_device is not ABSENT), f"{s} slot/state disagree"
        assert (len(s.host_slabs) > 0) == (s.image_host is not ABSENT), f"{s} host slabs/state disagree"
        if s.host_slabs:
            assert len(s.host_slabs) == index.slabs.image_slabs, f"{s} image holds {len(s.host_slabs)} slabs"
        assert (s.tail_page >= 0) == (s.tail_device is not ABSENT), f"{s} tail page/state disagree"
        assert (s.tail_slab >= 0) == (s.tail_host is not ABSENT), f"{s} tail slab/state disagree"
        assert s.image_device is not FILLING, f"{s}: images restore into lane slots, never into their own"
        if FILLING in (s.image_host, s.tail_device, s.tail_host):
            assert s.pins > 0, f"{s} is Filling but unpinned"
        if s.pins:
            assert _held(a), f"{s} is pinned but its anchor {a} is not"
        assert (s.superseded_seq > 0) == s.superseded, f"{s} supersession order disagrees"
        if s.device_slot >= 0:
            assert index.reclaimer.slot_owner[s.device_slot] is s, f"slot {s.device_slot} owner is not {s}"
    for slot, owner in enumerate(index.reclaimer.slot_owner):
        if owner is not None:
            assert tree.snapshots.get(owner.id) is owner and owner.device_slot == slot, f"slot {slot} owner stale"


def _check_counters(index, nodes) -> None:
    live, retained, rsum = Counter(), Counter(), Counter()
    for s in index.tree.snapshots.values():
        node = s.anchor
        while node.parent is not None:
            live[node] += 1
            if not s.superseded:
                retained[node] += 1
                rsum[node] += s.id
            node = node.parent
    for n in nodes:
        assert n.live_below == live[n], f"{n}: live_below {n.live_below} != rebuilt {live[n]}"
        assert n.retained_below == retained[n], f"{n}: retained_below {n.retained_below} != {retained[n]}"
        assert n.retained_sum == rsum[n], f"{n}: retained_sum {n.retained_sum} != {rsum[n]}"


def _check_links(index) -> None:
    tree = index.tree
    for s in tree.snapshots.values():
        best = None
        for x in tree.path_snapshots(s.anchor):
            if tree.is_above(x, s) and (best is None or x.frontier > best.frontier):
                best = x
        assert s.ancestor is best, f"{s}.ancestor is {s.ancestor}, nearest above is {best}"
        for d in s.dependents:
            assert d.ancestor is s, f"{d} listed as dependent of {s} but its ancestor is {d.ancestor}"
    expected = {s for s in tree.snapshots.values() if s.ancestor is None}
    assert set(tree.root_dependents) == expected, "root dependents disagree with ancestor links"
    for s in tree.snapshots.values():
        want = {d for d in tree.snapshots.values() if d.ancestor is s}
        assert set(s.dependents) == want, f"{s}.dependents disagree with ancestor links"


def _check_lists(index, nodes) -> None:
    lists = index.lists
    backed, unbacked, dead = set(), set(), set()
    for n in nodes:
        if n.device_state is RESIDENT and n.active_refs == 0 and n.pins == 0:
            (backed if n.host_state is RESIDENT else unbacked).add(n)
        if n.host_state is RESIDENT and n.live_below == 0 and n.active_refs == 0 and n.pins == 0:
            dead.add(n)
    for s in index.tree.snapshots.values():
        if s.tail_len and s.tail_device is RESIDENT and s.pins == 0:
            (backed if s.tail_host is RESIDENT else unbacked).add(s)
    assert set(lists.backed) == backed, f"backed LRU {sorted(map(repr, set(lists.backed) ^ backed))} mismatched"
    assert set(lists.unbacked) == unbacked, \
        f"unbacked LRU {sorted(map(repr, set(lists.unbacked) ^ unbacked))} mismatched"
    for entry in backed:
        assert entry.lru is lists.backed, f"{entry}.lru flag wrong"
    for entry in unbacked:
        assert entry.lru is lists.unbacked, f"{entry}.lru flag wrong"
    assert set(lists.dead) == dead, f"dead list mismatched: {sorted(map(repr, set(lists.dead) ^ dead))}"
    for n in nodes:
        assert n.dead == (n in dead), f"{n}.dead flag wrong"
        if n not in backed and n not in unbacked:
            assert n.lru is None, f"{n}.lru set while not listed"
    snaps = index.tree.snapshots.values()
    superseded = [s for s in snaps if s.superseded]
    assert list(lists.superseded) == sorted(superseded, key=lambda s: s.superseded_seq), "superseded list order"
    assert set(lists.host_snapshots) == {s for s in snaps if s.has_host_copy()}, "host snapshot list mismatched"


def _check_pools(index, nodes) -> None:
    pages, slabs, slots = {}, {}, {}

    def own(table, ident, state, what):
        assert ident not in table, f"{what}: id {ident} has two owners"
        table[ident] = state

    for n in nodes:
        if n.device_page >= 0:
            own(pages, n.device_page, OwnerState.CACHED if n.device_state is RESIDENT else OwnerState.FILLING, n)
        if n.host_slab >= 0:
            own(slabs, n.host_slab, SlabState.NODE if n.host_state is RESIDENT else SlabState.FILLING, n)
    for s in index.tree.snapshots.values():
        if s.tail_page >= 0:
            own(pages, s.tail_page, OwnerState.CACHED if s.tail_device is RESIDENT else OwnerState.FILLING, s)
        if s.tail_slab >= 0:
            own(slabs, s.tail_slab, SlabState.TAIL if s.tail_host is RESIDENT else SlabState.FILLING, s)
        for slab in s.host_slabs:
            own(slabs, slab, SlabState.IMAGE if s.image_host is RESIDENT else SlabState.FILLING, s)
        if s.device_slot >= 0:
            own(slots, s.device_slot, OwnerState.CACHED, s)
    for slot in index.staging_slots:
        own(slots, slot, OwnerState.ACTIVE, "staging")
    index.pages.check(pages, unowned_ok=(OwnerState.ACTIVE,))
    index.slots.check(slots, unowned_ok=())
    index.slabs.check(slabs)


def _check_gdsf(index) -> None:
    gdsf = index.gdsf
    assert gdsf.inflation >= 0.0, "L is negative"
    for s in index.tree.snapshots.values():
        if s in gdsf.dirty:
            continue
        saved = (s.cost, s.size, s.h)
        gdsf.value(s)
        assert math.isclose(saved[2], s.h, rel_tol=1e-9, abs_tol=1e-15), (
            f"{s}: cached H {saved[2]!r} (C={saved[0]!r}, Z={saved[1]!r}) != recomputed {s.h!r} "
            f"(C={s.cost!r}, Z={s.size!r}): a change was not marked dirty")
    for s in gdsf.dirty:
        assert index.tree.snapshots.get(s.id) is s, f"dirty set holds deleted {s}"
