"""Supersession and snapshot placement (spec §13.1): lineages, Boundaries, Device slots, Host writes."""

import numpy as np
import pytest

from ninfer_jax.prefix_cache import Residency, SnapshotKind
from prefix_helpers import make_index, prompt, run, start


def test_lineage_previous_snapshot_is_superseded_and_a_hit_retains_it():
    idx = make_index()
    turn1 = prompt(1, 2, 3, tail=10)
    t128, e1 = run(idx, turn1, taps=(128,), endpoint=True).published
    assert not t128.superseded and not e1.superseded  # an endpoint leaves the last tap retained
    turn2 = np.concatenate([turn1, prompt(4, 5, tail=7)[:120]])
    lane = start(idx, turn2)
    assert lane.resumed_from is e1 and lane.base == e1.frontier == 202
    t256 = lane.tap(256)
    assert e1.superseded and not t128.superseded       # the lineage moved past e1
    t320 = lane.tap(320)
    assert t256.superseded                              # the previous tap of the same prompt
    e2 = lane.endpoint()
    assert not t320.superseded and not e2.superseded
    lane.release()
    assert list(idx.lists.superseded) == [e1, t256]
    idx.check_invariants()
    retry = np.concatenate([turn1, prompt(8, tail=40)[:40]])  # diverges right after e1
    lane = start(idx, retry)
    assert lane.resumed_from is e1 and not e1.superseded
    assert idx.stats.snapshots_retained_again == 1 and list(idx.lists.superseded) == [t256]
    lane.release()
    idx.check_invariants()


def test_boundary_is_superseded_only_while_the_tree_below_is_one_chain():
    idx = make_index()
    first = prompt(1, 2, 3, tail=1)
    lane = start(idx, first)
    boundary = lane.tap(128, SnapshotKind.BOUNDARY)
    lane.commit_through(len(first))
    lane.release()
    own_turn = prompt(1, 2, 3, 4, tail=1)              # the same conversation continues
    lane = start(idx, own_turn)
    assert lane.resumed_from is boundary
    lane.tap(256)
    assert boundary.superseded                          # one chain below it: a lineage snapshot
    lane.release()
    other = prompt(1, 2, 7, 8, tail=1)                  # another conversation shares it
    lane = start(idx, other)
    assert lane.resumed_from is boundary and not boundary.superseded  # the hit retains it
    lane.tap(256)
    assert not boundary.superseded                      # two branches below: stays retained
    lane.release()
    idx.check_invariants()


def test_device_slot_acquisition_follows_the_spec_order():
    idx = make_index(slots=3)
    s_a = run(idx, prompt(1, 2, tail=1), taps=(128,), write_snapshots=False).published[0]  # Device-only
    s_b = run(idx, prompt(3, 4, tail=1), taps=(128,)).published[0]                        # Host-backed
    lane_c = start(idx, prompt(5, 6, 7, 8, tail=1))
    t1 = lane_c.tap(128)                               # the last free slot
    lane_c.commit_through(256)
    grant = idx.begin_snapshot(256, previous_tap=t1, previous_frontier=128)
    # 1. no free slot -> 2. the superseded owner (t1, superseded just now, Device-only: deleted)
    assert t1.superseded and grant.reclaimed.deleted_snapshots == [t1.id]
    t2 = idx.publish_snapshot(grant.slot, SnapshotKind.TAP, lane_c.path[3]).snapshot
    idx.check_invariants()
    # 3. the least valuable Device-only owner, for a new snapshot worth at least as much
    idx.gdsf.refresh()
    assert s_a.h == pytest.approx(0.118 / 16384) and t2.h == pytest.approx(0.246 / 8192)
    lane_d = start(idx, prompt(*range(9, 17), tail=1))
    lane_d.commit_through(512)
    estimate = idx.gdsf.estimate(512, 0, 0)
    assert estimate == pytest.approx(0.502 / 40960) and estimate >= s_a.h
    grant = idx.begin_snapshot(512)
    assert grant.reclaimed.deleted_snapshots == [s_a.id] and idx.inflation == pytest.approx(0.118 / 16384)
    d512 = idx.publish_snapshot(grant.slot, SnapshotKind.TAP, lane_d.path[7]).snapshot
    # 4. a new snapshot worth less than every Device-only owner takes the least recently hit
    #    Host-backed owner's slot, which keeps its Host copy
    lane_e = start(idx, prompt(30, tail=1))
    lane_e.commit_through(64)
    idx.gdsf.refresh()
    assert idx.gdsf.estimate(64, 0, 0) < min(t2.h, d512.h)
    grant = idx.begin_snapshot(64)
    assert grant.reclaimed.snapshot_device_dropped == [s_b.id] and grant.reclaimed.deleted_snapshots == []
    assert idx.snapshot(s_b.id) is s_b and s_b.image_host is Residency.RESIDENT and s_b.device_slot == -1
    idx.publish_snapshot(grant.slot, SnapshotKind.TAP, lane_e.path[0])
    # otherwise the tap is skipped
    assert idx.begin_snapshot(64) is None and idx.stats.taps_skipped_no_slot == 1
    assert idx.stats.slot_evicted_superseded == 1 and idx.stats.slot_evicted_device_only == 1
    assert idx.stats.slot_evicted_host_backed == 1
    for lane in (lane_c, lane_d, lane_e):
        lane.release()
    idx.check_invariants()


def test_host_image_write_displaces_only_snapshots_worth_no_more():
    idx = make_index(host_slabs=8)
    s1 = run(idx, prompt(1, tail=1), taps=(64,)).published[0]                          # 3 slabs
    s2 = run(idx, prompt(2, 3, 4, 5, tail=1), taps=(256,), write_snapshots=False).published[0]  # +4
    assert idx.slabs.num_free == 1
    idx.gdsf.refresh()
    assert s1.h == pytest.approx(0.054 / 12288) and s2.h == pytest.approx(0.246 / 24576)
    write = idx.write_snapshot(s2)                      # worth more than s1: displaces it
    assert not write.empty and write.reclaimed.snapshot_host_dropped == [s1.id]
    idx.complete_host_write(write)
    assert idx.inflation == pytest.approx(0.054 / 12288)
    s3 = run(idx, prompt(6, tail=1), taps=(64,), write_snapshots=False).published[0]   # block takes the last slab
    idx.gdsf.refresh()
    assert s3.h == pytest.approx(0.054 / 12288 + 0.054 / 12288) and s3.h < s2.h
    write = idx.write_snapshot(s3)                      # s2 is worth more: refused, nothing evicted
    assert write.empty and write.reclaimed.snapshot_host_dropped == [] and write.reclaimed.deleted_snapshots == []
    assert s3.image_host is Residency.ABSENT and s2.image_host is Residency.RESIDENT
    assert idx.stats.host_image_writes_refused == 1
    idx.check_invariants()
