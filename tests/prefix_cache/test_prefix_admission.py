"""Admission arithmetic (spec §13.1): fallback order, Blocked vs Infeasible, backfill, cache_epoch."""

import numpy as np
import pytest

from ninfer_jax.prefix_cache import (OwnerState, Readiness, Residency, SnapshotKind, StaleQuoteError,
                                     backfill_admissible, block_hashes)
from ninfer_jax.prefix_cache.admission import make_quote
from prefix_helpers import SIMPLE_COST, make_index, node_at, prompt, run, start


def two_candidates(cost=SIMPLE_COST):
    """t_dev: a tap at 128, all on the Device. e_star: an endpoint at 400 (tail of 16) whose
    blocks 3-6 and tail are Host-only. B = blocks 1-7 + 1 token matches both (n = 449)."""
    idx = make_index(device_pages=32, cost=cost)
    t_dev = run(idx, prompt(1, 2, tail=1), taps=(128,)).published[0]
    e_star = run(idx, prompt(1, 2, 3, 4, 5, 6, tail=16, tail_label=7), endpoint=True).published[0]
    idx.pin_snapshot(t_dev)
    idx.reclaim_device_pages(idx.pages.capacity)  # everything else drops its Device copy
    idx.unpin_snapshot(t_dev)
    b = prompt(1, 2, 3, 4, 5, 6, 7, tail=1)
    return idx, t_dev, e_star, b


def quote_with(idx, b, free, evictable, entitlement=8):
    m = idx.match(b)
    return make_quote(m, entitlement, idx.cost, block_bytes=4096, image_bytes=8192, free_pages=free,
                      evictable_pages=evictable, capacity_pages=idx.pages.capacity, epoch=idx.cache_epoch)


def test_candidates_are_root_deepest_and_deepest_device_with_their_figures():
    idx, t_dev, e_star, b = two_candidates()
    m = idx.match(b)
    assert m.deepest is e_star and m.deepest_device is t_dev and len(m.path) == 6
    q = idx.quote(b, entitlement_pages=8)
    root, star, dev = q.candidates
    assert root.snapshot is None and root.need_pages == 8 and root.cost_seconds == pytest.approx(0.449)
    # e_star: 4 Host blocks + Host tail = 5 * 4096 B at 819.2 kB/s = 25 ms, then 49 tokens
    assert (star.host_path_blocks, star.host_tail, star.host_image) == (4, True, False)
    assert star.transfer_bytes == 20480 and star.cost_seconds == pytest.approx(0.025 + 0.049)
    assert star.need_pages == 4 + 1 + (8 - 6) and star.own_evictable == 2
    assert dev.transfer_bytes == 0 and dev.cost_seconds == pytest.approx(0.321)
    assert dev.need_pages == 8 - 2 and dev.own_evictable == 2
    assert q.readiness is Readiness.READY and q.source is star and q.reuse_tokens == 400


def test_fallback_order_is_chosen_then_deepest_device_then_root():
    idx, t_dev, e_star, b = two_candidates()
    assert quote_with(idx, b, free=5, evictable=4).source.snapshot is e_star   # 7 <= 9 - 2
    assert quote_with(idx, b, free=4, evictable=4).source.snapshot is t_dev    # e_star: 7 > 6
    blocked = quote_with(idx, b, free=3, evictable=4)                          # root: 8 > 7
    assert blocked.readiness is Readiness.TEMPORARILY_BLOCKED and blocked.source is None
    # a slow link makes the Device-resident snapshot the cheapest choice
    slow = SIMPLE_COST.replace(h2d_bytes_per_second=4096.0)
    idx_slow, t_dev_slow, _, b = two_candidates(slow)
    assert quote_with(idx_slow, b, free=20, evictable=0).source.snapshot is t_dev_slow


def test_fallback_reaches_the_root_when_a_snapshot_pins_its_own_evictable_pages():
    idx = make_index(device_pages=32)
    e_dev = run(idx, prompt(1, 2, tail=22, tail_label=3), endpoint=True).published[0]
    b = prompt(1, 2, 3, 4, tail=1)                        # n = 257, entitlement 5
    q = quote_with(idx, b, free=0, evictable=5, entitlement=5)
    dev = q.candidates[1]
    assert dev.snapshot is e_dev and dev.need_pages == 3 and dev.own_evictable == 3  # 2 nodes + tail
    assert q.readiness is Readiness.READY and q.source.snapshot is None              # root: 5 <= 5
    assert quote_with(idx, b, free=1, evictable=5, entitlement=5).source.snapshot is e_dev


def test_blocked_versus_permanently_infeasible():
    idx = make_index(device_pages=8)
    holder = start(idx, prompt(1, 2, 3, 4, 5, tail=1))          # an active lane holds 6 pages
    b = prompt(9, tail=100)
    assert idx.quote(b, entitlement_pages=4).readiness is Readiness.TEMPORARILY_BLOCKED
    assert idx.quote(b, entitlement_pages=9).readiness is Readiness.PERMANENTLY_INFEASIBLE
    holder.commit_through(320)
    page_of_block_4 = holder.pages[4]
    holder.release()                                           # its blocks become evictable cache
    q = idx.quote(b, entitlement_pages=4)
    assert q.readiness is Readiness.READY and idx.pages.num_free == 3
    staging = idx.stage(q)
    deepest = node_at(idx, prompt(1, 2, 3, 4, 5, tail=1), 4)
    assert len(staging.lane_pages) == 4 and staging.reclaimed.node_device_dropped == [deepest.id]
    assert staging.reclaimed.freed_pages == [page_of_block_4]  # tail-first: the deepest block goes
    idx.check_invariants()


def test_backfill_proof_arithmetic_on_a_constructed_state():
    idx = make_index(device_pages=16, host_slabs=0)
    run(idx, prompt(20, 21, tail=1))                            # 2 cached, evictable pages
    donor = start(idx, prompt(1, 2, 3, 4, 5, tail=1), extra_pages=4)  # entitlement 10 pages
    head = idx.quote(prompt(7, tail=600), entitlement_pages=11)
    assert head.readiness is Readiness.TEMPORARILY_BLOCKED
    free, evictable = idx.pages.num_free, idx.lists.device_evictable
    assert (free, evictable) == (4, 2)
    donor_pages = len(donor.pages)
    assert donor_pages == 10
    # a 1-page borrower: 1 + 11 <= 4 + 2 + 10 holds; a 7-page one does not (7 + 11 > 16)
    assert backfill_admissible(1, head.candidates[0].need_pages, free, evictable, donor_pages)
    assert not backfill_admissible(7, head.candidates[0].need_pages, free, evictable, donor_pages)
    assert backfill_admissible(5, 11, 4, 2, 10) and not backfill_admissible(5, 11, 4, 2, 9)


def test_quote_goes_stale_on_every_mutation_and_not_on_reads():
    idx = make_index()
    b = prompt(1, 2, 3, tail=1)
    q = idx.quote(b, entitlement_pages=4)
    epoch = idx.cache_epoch
    idx.match(b)
    idx.quote(b, entitlement_pages=4)
    idx.check_invariants()
    assert idx.cache_epoch == epoch and idx.is_current(q)
    lane = start(idx, b)
    assert not idx.is_current(q)
    with pytest.raises(StaleQuoteError):
        idx.stage(q)
    mutations = [
        lambda: lane.commit_through(128),
        lambda: lane.tap(128),
        lambda: idx.pin_path(lane.path[0]),
        lambda: idx.unpin_path(lane.path[0]),
        lambda: lane.commit_through(192),
        lambda: idx.complete_host_write(lane.release()),
        lambda: idx.supersede(lane.published[0]),
        lambda: idx.allocate_pages(2),
        lambda: idx.reclaim_device_pages(idx.pages.capacity),
        lambda: idx.make_host_room(idx.slabs.num_slabs),
    ]
    for mutate in mutations:
        before = idx.cache_epoch
        mutate()
        assert idx.cache_epoch != before
    idx.check_invariants()


def test_stage_restores_host_only_parts_and_other_quotes_skip_filling_candidates():
    idx, t_dev, e_star, b = two_candidates()
    staging = idx.stage(idx.quote(b, entitlement_pages=8))
    assert staging.snapshot is e_star and staging.image_slot == e_star.device_slot and staging.image_slabs == []
    restored = [r.node for r in staging.restores]
    assert restored == [node_at(idx, b, d) for d in (2, 3, 4, 5)]
    assert all(r.node.device_state is Residency.FILLING and idx.pages.state(r.page) is OwnerState.FILLING
               and r.slab == r.node.host_slab for r in staging.restores)
    assert staging.tail_restore.slab == e_star.tail_slab and e_star.tail_device is Residency.FILLING
    assert len(staging.lane_pages) == 2 and e_star.hits == 1
    idx.check_invariants()
    other = idx.quote(b, entitlement_pages=8)       # e_star's blocks are still filling
    assert other.candidates[1].filling and other.source.snapshot is t_dev
    path = idx.activate(staging)
    idx.complete_restore(staging)
    assert all(n.device_state is Residency.RESIDENT and n.active_refs == 1 for n in path)
    assert e_star.tail_device is Residency.RESIDENT and e_star.pins == 0
    idx.check_invariants()
    idx.release_path(path)
    idx.free_pages(staging.lane_pages)
    idx.check_invariants()


def test_cancelled_staging_returns_its_reservation_and_pins():
    idx, t_dev, e_star, b = two_candidates()
    free = idx.pages.num_free + idx.lists.device_evictable
    staging = idx.stage(idx.quote(b, entitlement_pages=8))
    idx.cancel_staging(staging)
    assert e_star.pins == 0 and all(n.pins == 0 for n in staging.path)
    # the restored blocks and tail stay cached (evictable); the lane's reservation is free again
    assert idx.pages.num_free + idx.lists.device_evictable == free
    assert all(r.node.device_state is Residency.RESIDENT for r in staging.restores)
    assert e_star.device_complete()
    idx.check_invariants()


def test_match_accepts_numpy_hashes_and_reports_the_cached_prefix():
    idx = make_index()
    b = prompt(1, 2, 3, tail=1)
    run(idx, b)
    m = idx.match(b, np.asarray(block_hashes(b), dtype=np.uint64))
    assert m.cached_prefix_tokens == 192 and m.candidates == [] and m.deepest is None
    assert idx.quote(b, entitlement_pages=4).source.snapshot is None


def test_snapshot_kinds_validate_their_tails():
    idx = make_index()
    lane = start(idx, prompt(1, 2, tail=10))
    lane.commit_through(128)
    grant = idx.begin_snapshot(138, kind=SnapshotKind.ENDPOINT, tail_len=10)
    with pytest.raises(ValueError, match="64-aligned"):
        idx.publish_snapshot(grant.slot, SnapshotKind.TAP, lane.path[1], lane.tokens[128:138], 0, lane.pages[2])
    with pytest.raises(ValueError, match="tail page"):
        idx.publish_snapshot(grant.slot, SnapshotKind.ENDPOINT, lane.path[1], lane.tokens[128:138])
    idx.release_staging_slot(grant.slot)
    lane.release()
    idx.check_invariants()
