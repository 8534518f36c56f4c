"""Liveness and Device LRU (spec §13.1): live_snapshots_below, losing the last copy, tail-first LRU."""

from ninfer_jax.prefix_cache import Residency
from prefix_helpers import make_index, node_at, prompt, run, start


def ids(nodes):
    return [n.id for n in nodes]


def test_live_snapshots_below_follows_publish_eviction_and_subtree_deletion():
    idx = make_index(device_pages=64, slots=6, host_slabs=0)
    trunk = prompt(1, 2, 3, 4, tail=1)
    t128, t256 = run(idx, trunk, taps=(128, 256)).published
    n1, n2, n3, n4 = (node_at(idx, trunk, d) for d in range(4))
    assert [n.live_below for n in (n1, n2, n3, n4)] == [2, 2, 1, 1]
    branch = prompt(1, 2, 5, 6, tail=1)
    b256 = run(idx, branch, taps=(256,)).published[0]
    n5, n6 = node_at(idx, branch, 2), node_at(idx, branch, 3)
    assert [n.live_below for n in (n1, n2, n3, n4, n5, n6)] == [3, 3, 1, 1, 1, 1]
    idx.check_invariants()
    # LRU (no Host tier, all unbacked): n4 n3 | n6 n5 n2 n1 ; one eviction loses n4 and t256
    assert ids(idx.lists.unbacked) == ids([n4, n3, n6, n5, n2, n1])
    out = idx.reclaim_device_pages(idx.pages.num_free + 1)
    assert out.lost_nodes == [n4.id] and out.deleted_snapshots == [t256.id]
    assert [n.live_below for n in (n1, n2, n3)] == [2, 2, 0]
    idx.check_invariants()
    out = idx.reclaim_device_pages(idx.pages.num_free + 2)  # n3 (dead KV), then n6 with b256
    assert out.lost_nodes == [n3.id, n6.id] and out.deleted_snapshots == [b256.id]
    assert [n.live_below for n in (n1, n2, n5)] == [1, 1, 0]
    idx.check_invariants()
    out = idx.reclaim_device_pages(idx.pages.num_free + 2)  # n5, then n2 with t128
    assert out.lost_nodes == [n5.id, n2.id] and out.deleted_snapshots == [t128.id]
    assert n1.live_below == 0 and idx.tree.snapshots == {}
    idx.check_invariants()


def test_losing_the_last_copy_deletes_exactly_the_subtree_snapshots():
    idx = make_index(device_pages=64, slots=6, host_slabs=0)
    chain = prompt(1, 2, 3, tail=10)
    lane = run(idx, chain, taps=(128,), endpoint=True)
    tap_b, endpoint_c = lane.published
    side = prompt(1, 4, tail=1)
    tap_d = run(idx, side, taps=(128,)).published[0]
    n_a, n_b, n_d = node_at(idx, chain, 0), node_at(idx, chain, 1), node_at(idx, side, 1)
    idx.pin_snapshot(tap_d)  # keeps n_d and n_a
    idx.check_invariants()
    out = idx.reclaim_device_pages(idx.pages.capacity)
    assert sorted(out.deleted_snapshots) == sorted([tap_b.id, endpoint_c.id])
    assert n_b.id in out.lost_nodes and n_a.id not in out.lost_nodes and n_d.id not in out.lost_nodes
    assert endpoint_c.tail_page == -1 and tap_b.device_slot == -1
    assert set(idx.tree.snapshots.values()) == {tap_d}
    assert n_a.live_below == 1 and n_d.live_below == 1
    assert idx.slots.num_free == idx.slots.capacity - 1
    idx.check_invariants()
    idx.unpin_snapshot(tap_d)
    idx.check_invariants()


def test_device_lru_releases_tail_first():
    idx = make_index(host_slabs=0)
    tokens = prompt(1, 2, 3, 4, tail=1)
    run(idx, tokens)
    nodes = [node_at(idx, tokens, d) for d in range(4)]
    assert ids(idx.lists.unbacked) == ids(nodes[::-1])
    lost = []
    for _ in range(4):
        lost += idx.reclaim_device_pages(idx.pages.num_free + 1).lost_nodes
        idx.check_invariants()
    assert lost == ids(nodes[::-1])


def test_device_lru_hit_moves_the_whole_path_to_mru():
    idx = make_index()
    a, b = prompt(1, 2, 3, tail=1), prompt(4, 5, 6, tail=1)
    run(idx, a, taps=(128,))
    run(idx, b)
    na = [node_at(idx, a, d) for d in range(3)]
    nb = [node_at(idx, b, d) for d in range(3)]
    assert ids(idx.lists.backed) == ids(na[::-1] + nb[::-1])
    lane = start(idx, a)  # resumes from the tap at 128: pins a1, a2; touches a3 (recomputed)
    assert lane.base == 128
    assert ids(idx.lists.backed) == ids(nb[::-1] + [na[2]])
    lane.commit_through(len(a))
    lane.release()
    assert ids(idx.lists.backed) == ids(nb[::-1] + na[::-1])
    idx.check_invariants()


def test_device_lru_consumes_backed_entries_before_unbacked():
    idx = make_index()
    a, b = prompt(1, 2, 3, tail=1), prompt(4, 5, 6, tail=1)
    run(idx, a)                            # written through: backed
    lane = start(idx, b)
    lane.commit_through(len(b))
    idx.complete_host_write(idx.release_path(lane.path), ok=False)  # write failed: unbacked
    idx.free_pages([p for p in lane.pages.values() if idx.pages.is_state(p, 1)])
    na = [node_at(idx, a, d) for d in range(3)]
    nb = [node_at(idx, b, d) for d in range(3)]
    assert ids(idx.lists.backed) == ids(na[::-1]) and ids(idx.lists.unbacked) == ids(nb[::-1])
    out = idx.reclaim_device_pages(idx.pages.num_free + 4)
    assert out.node_device_dropped == ids(na[::-1]) and out.lost_nodes == [nb[2].id]
    assert all(n.device_state is Residency.ABSENT and n.host_state is Residency.RESIDENT for n in na)
    idx.check_invariants()


def test_device_lru_never_returns_pinned_entries():
    idx = make_index(host_slabs=0)
    a, b = prompt(1, 2, 3, tail=1), prompt(4, 5, tail=1)
    run(idx, a)
    run(idx, b)
    na = [node_at(idx, a, d) for d in range(3)]
    idx.pin_path(na[2])
    assert idx.available_pages() == idx.pages.capacity - 3
    out = idx.reclaim_device_pages(idx.pages.capacity)
    assert len(out.lost_nodes) == 2 and not set(ids(na)) & set(out.lost_nodes)
    assert idx.pages.num_free == idx.pages.capacity - 3
    assert all(n.device_state is Residency.RESIDENT for n in na)
    idx.check_invariants()
    idx.unpin_path(na[2])
    assert ids(idx.lists.unbacked) == ids(na[::-1])
    idx.check_invariants()
