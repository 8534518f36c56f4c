"""Host GDSF (spec §13.1): hand-computed priorities, dead KV first, exclusive paths, monotonic L.

Numbers use ``SIMPLE_COST``: prefill 1 ms per token (no chunk cost; pair cost only where set),
restoring one image 10 ms; a slab is 4096 B and an image takes 2 slabs (8192 B), so

    H(s) = L_s + (1 + hits) * C / Z,  C = prefill(F_a, F_s - F_a) - 0.010,
    Z = 8192 + 4096 * (exclusive Host-resident path blocks).
"""

import pytest

from ninfer_jax.prefix_cache import Residency
from prefix_helpers import SIMPLE_COST, make_index, node_at, prompt, run, start


def labels(first, count):
    return list(range(first, first + count))


def test_gdsf_two_siblings_hand_computed():
    idx = make_index(host_slabs=9, slots=1)
    x = prompt(1, 2, 3, 4, tail=1)
    y = prompt(1, 5, tail=1)
    sx = run(idx, x, taps=(256,)).published[0]
    sy = run(idx, y, taps=(128,)).published[0]  # takes sx's slot: sx is Host-only now
    idx.gdsf.refresh()
    # sx: C = 0.256 - 0.010, exclusive blocks 2, 3, 4 (block 1 is shared)
    assert sx.cost == pytest.approx(0.246) and sx.size == 8192 + 3 * 4096
    assert sx.h == pytest.approx(0.246 / 20480)        # 1.2012e-05
    # sy: C = 0.128 - 0.010, exclusive block 5
    assert sy.h == pytest.approx(0.118 / 12288)        # 9.6029e-06
    assert idx.slabs.num_free == 0 and sx.image_device is Residency.ABSENT
    out = idx.make_host_room(1)
    # sy has the lower H but is complete on the Device: it only gives up its Host copy
    assert out.snapshot_host_dropped == [sy.id] and out.deleted_snapshots == []
    assert idx.inflation == pytest.approx(0.118 / 12288)
    idx.check_invariants()


def test_gdsf_victim_exclusive_path_is_freed_next():
    idx = make_index(host_slabs=9, slots=1)
    x = prompt(1, 2, 3, 4, tail=1)
    sx = run(idx, x, taps=(256,)).published[0]
    run(idx, prompt(1, 5, tail=1), taps=(128,))
    idx.make_host_room(2)                        # demotes sy (see the sibling test)
    out = idx.make_host_room(3)                  # sx is Host-only: deleted, L := H(sx)
    assert out.deleted_snapshots == [sx.id] and idx.inflation == pytest.approx(0.246 / 20480)
    n1, n2, n3, n4 = (node_at(idx, x, d) for d in range(4))
    assert list(idx.lists.dead) == [n4, n3, n2]  # its exclusive path, deepest first; n1 still feeds sy
    out = idx.make_host_room(7)
    assert out.node_host_dropped == [n4.id, n3.id, n2.id] and out.deleted_snapshots == []
    assert n1.host_state is Residency.RESIDENT and n4.device_state is Residency.RESIDENT
    idx.check_invariants()


def test_gdsf_nested_ancestor_and_descendant_hand_computed():
    idx = make_index(cost=SIMPLE_COST.replace(pair_seconds=1e-7))
    sa = run(idx, prompt(*labels(1, 4), tail=1), taps=(256,)).published[0]
    lane = start(idx, prompt(*labels(1, 8), tail=1))
    assert lane.resumed_from is sa
    lane.resumed_from = None  # publish without lineage supersession
    sb = lane.tap(512)
    lane.release()
    idx.complete_host_write(idx.write_snapshot(sb))
    idx.gdsf.refresh()
    # sa: prefill(0, 256) = 0.256 + 1e-7 * 256 * 257 / 2 ; no exclusive blocks (sb is below)
    assert sa.cost == pytest.approx(0.256 + 1e-7 * 32896 - 0.010) and sa.size == 8192
    assert sa.hits == 1 and sa.h == pytest.approx(2 * 0.2492896 / 8192)  # the second request hit it
    # sb: valued against sa: prefill(256, 256) = 0.256 + 1e-7 * (256 * 256 + 256 * 257 / 2)
    assert sb.cost == pytest.approx(0.2558432) and sb.size == 8192 + 4 * 4096
    assert sb.h == pytest.approx(0.2558432 / 24576)
    # superseding sa makes sb carry the whole prefix: C from the root, all 8 blocks exclusive
    assert idx.supersede(sa)
    idx.gdsf.refresh()
    assert sb.cost == pytest.approx(0.512 + 1e-7 * 131328 - 0.010) and sb.size == 8192 + 8 * 4096
    assert sb.h == pytest.approx(0.5151328 / 40960)
    idx.check_invariants()


def test_gdsf_frequency_protects_a_hit_snapshot():
    idx = make_index(host_slabs=8)
    s1 = run(idx, prompt(1, 2, tail=1), taps=(128,)).published[0]
    s2 = run(idx, prompt(3, 4, tail=1), taps=(128,)).published[0]
    for _ in range(2):
        start(idx, prompt(1, 2, tail=5)).release()  # two hits on s1
    idx.gdsf.refresh()
    assert s1.hits == 2 and s2.hits == 0
    assert s1.h == pytest.approx(3 * 0.118 / 16384) and s2.h == pytest.approx(0.118 / 16384)
    out = idx.make_host_room(1)
    assert out.snapshot_host_dropped == [s2.id] and idx.inflation == pytest.approx(0.118 / 16384)
    idx.check_invariants()


def test_dead_kv_is_reclaimed_before_any_snapshot():
    idx = make_index(host_slabs=11)
    s = run(idx, prompt(1, 2, tail=1), taps=(128,)).published[0]  # 2 blocks + 2 image slabs
    cancelled = prompt(7, 8, 9, tail=1)
    run(idx, cancelled)                                           # no snapshot: 3 dead blocks
    dead = [node_at(idx, cancelled, d) for d in range(3)]
    assert all(n.host_state is Residency.RESIDENT and n.live_below == 0 for n in dead)
    assert idx.slabs.num_free == 4
    out = idx.make_host_room(7)
    assert out.node_host_dropped == [dead[2].id, dead[1].id, dead[0].id]
    assert out.deleted_snapshots == [] and out.snapshot_host_dropped == [] and idx.inflation == 0.0
    assert s.image_host is Residency.RESIDENT
    idx.check_invariants()


def test_inflation_is_monotonic_even_when_a_victim_fell_below_it():
    idx = make_index(host_slabs=31, slots=1)
    a = run(idx, prompt(*labels(1, 9), tail=1), taps=(576,)).published[0]            # 5 exclusive
    b = run(idx, prompt(*labels(1, 4), *labels(20, 12), tail=1), taps=(1024,)).published[0]  # 12
    c = run(idx, prompt(*labels(40, 4), tail=1), taps=(256,)).published[0]           # own branch
    idx.gdsf.refresh()
    assert a.h == pytest.approx(0.566 / 28672)     # 1.974e-05
    assert b.h == pytest.approx(1.014 / 57344)     # 1.768e-05
    assert c.h == pytest.approx(0.246 / 24576)     # 1.001e-05
    assert idx.slabs.num_free == 0
    history = []
    out = idx.make_host_room(1)                    # c: complete on the Device, demoted
    history.append(idx.inflation)
    assert out.snapshot_host_dropped == [c.id]
    out = idx.make_host_room(3)                    # b: Host-only image, deleted
    history.append(idx.inflation)
    assert out.deleted_snapshots == [b.id]
    out = idx.make_host_room(16)                   # b's 12 exclusive blocks are dead KV
    history.append(idx.inflation)
    assert len(out.node_host_dropped) == 12 and out.deleted_snapshots == []
    idx.gdsf.refresh()
    assert a.h == pytest.approx(0.566 / 45056)     # exclusive path grew to 9 blocks: below L
    assert a.h < idx.inflation
    out = idx.make_host_room(17)
    history.append(idx.inflation)
    assert out.deleted_snapshots == [a.id]
    assert history == pytest.approx([0.246 / 24576, 1.014 / 57344, 1.014 / 57344, 1.014 / 57344])
    assert history == sorted(history)
    idx.check_invariants()
