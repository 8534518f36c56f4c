"""HostSlabPool (spec §13.1), Device id pools, options (§14.2) and the cost model (§6.2)."""

import pytest

from ninfer_jax.prefix_cache import (CacheCostModel, DevicePagePool, HostSlabPool, OwnerState, PoolExhausted,
                                     PrefixCacheOptions, SlabState)
from ninfer_jax.prefix_cache.options import GiB, tap_spacing_problem


def test_slab_bytes_round_the_block_bundle_to_4k_and_images_span_whole_slabs():
    pool = HostSlabPool(budget_bytes=100 * 8192, block_bundle_bytes=5000, image_bytes=3 * 8192 + 1)
    assert pool.slab_bytes == 8192 and pool.image_slabs == 4 and pool.num_slabs == 100
    assert pool.slabs_for_snapshot(with_tail=True) == 5


def test_host_budget_below_one_snapshot_plus_one_block_is_a_startup_error():
    with pytest.raises(ValueError, match="below one snapshot plus one block"):
        HostSlabPool(budget_bytes=4 * 4096, block_bundle_bytes=4096, image_bytes=4 * 4096)
    assert HostSlabPool(5 * 4096, 4096, 4 * 4096).num_slabs == 5
    disabled = HostSlabPool(0, 4096, 4 * 4096)
    assert not disabled.enabled and disabled.num_slabs == 0 and disabled.num_chunks == 0


def test_host_slab_pool_exhaustion_and_reuse():
    pool = HostSlabPool(8 * 4096, 4096, 2 * 4096)
    first = pool.allocate(5, SlabState.NODE)
    assert first == [0, 1, 2, 3, 4] and pool.num_free == 3
    with pytest.raises(PoolExhausted):
        pool.allocate(4)
    assert pool.num_free == 3  # a failed allocation takes nothing
    pool.free([3, 1, 2])
    again = pool.allocate(4, SlabState.IMAGE)
    assert again == [1, 2, 3, 5]  # freed slabs come back smallest first: consecutive runs
    assert pool.allocate(2) == [6, 7]  # FILLING by default: write-through destinations
    assert pool.ledger() == {"free": 0, "node": 2, "image": 4, "tail": 0, "filling": 2, "capacity": 8}
    pool.check({0: SlabState.NODE, 4: SlabState.NODE, 1: SlabState.IMAGE, 2: SlabState.IMAGE,
                3: SlabState.IMAGE, 5: SlabState.IMAGE, 6: SlabState.FILLING, 7: SlabState.FILLING})
    with pytest.raises(ValueError, match="freed twice"):
        pool.free([6, 6])


def test_host_slab_chunks_never_split_a_slab_and_runs_stop_at_chunk_edges():
    pool = HostSlabPool(10 * 4096 + 100, 4096, 2 * 4096, max_chunk_bytes=3 * 4096 + 4095)
    assert pool.slabs_per_chunk == 3 and pool.num_slabs == 10 and pool.num_chunks == 4
    assert [pool.chunk_bytes(c) for c in range(4)] == [3 * 4096, 3 * 4096, 3 * 4096, 4096]
    for slab in range(pool.num_slabs):
        chunk, offset = pool.location(slab)
        assert offset + pool.slab_bytes <= pool.chunk_bytes(chunk)
    assert pool.location(4) == (1, 4096)
    runs = pool.runs([1, 2, 3, 4, 5, 7, 9])
    assert [(r.start, r.first, r.count, r.chunk, r.offset) for r in runs] == [
        (0, 1, 2, 0, 4096), (2, 3, 3, 1, 0), (5, 7, 1, 2, 4096), (6, 9, 1, 3, 0)]
    paired = pool.runs([3, 4, 5], pages=[10, 11, 13])
    assert [(r.first, r.count) for r in paired] == [(3, 2), (5, 1)]
    with pytest.raises(IndexError):
        pool.location(10)


def test_device_page_pool_ledger_and_owner_states():
    pool = DevicePagePool(6)
    pages = pool.allocate(4, OwnerState.ACTIVE)
    pool.set_state(pages[0], OwnerState.CACHED)
    pool.set_state(pages[1], OwnerState.FILLING)
    assert pool.ledger() == {"free": 2, "active": 2, "cached": 1, "filling": 1, "capacity": 6}
    pool.check({pages[0]: OwnerState.CACHED, pages[1]: OwnerState.FILLING}, unowned_ok=(OwnerState.ACTIVE,))
    with pytest.raises(AssertionError, match="no cache entry owns it"):
        pool.check({pages[0]: OwnerState.CACHED})
    with pytest.raises(ValueError, match="must stay allocated"):
        pool.set_state(5, OwnerState.CACHED)


def test_options_resolve_the_spec_defaults():
    with_host = PrefixCacheOptions.resolve(4, 8192)
    assert with_host == PrefixCacheOptions(host_cache_bytes=8 * GiB, device_snapshot_slots=5, max_new_taps=8,
                                           tap_ladder_tokens=16384, tap_min_gap_tokens=8192)
    without = PrefixCacheOptions.resolve(4, 1024, host_cache_bytes=0)
    assert without == PrefixCacheOptions(host_cache_bytes=0, device_snapshot_slots=6, max_new_taps=2,
                                         tap_ladder_tokens=4096, tap_min_gap_tokens=1024)
    assert with_host.host_tier and not without.host_tier
    explicit = PrefixCacheOptions.resolve(1, 512, 1 << 30, device_snapshot_slots=9, max_new_taps=0)
    assert explicit.device_snapshot_slots == 9 and explicit.max_new_taps == 0


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_concurrency=0, prefill_chunk=512), "max_concurrency"),
    (dict(max_concurrency=1, prefill_chunk=0), "prefill_chunk"),
    (dict(max_concurrency=1, prefill_chunk=512, host_cache_bytes=-1), "host_cache_bytes"),
    (dict(max_concurrency=1, prefill_chunk=512, device_snapshot_slots=0), "device_snapshot_slots"),
    (dict(max_concurrency=1, prefill_chunk=512, max_new_taps=-1), "max_new_taps"),
    (dict(max_concurrency=1, prefill_chunk=512, tap_ladder_tokens=32), "tap_ladder_tokens"),
    (dict(max_concurrency=1, prefill_chunk=512, tap_min_gap_tokens=8192), "must not exceed tap_ladder_tokens"),
])
def test_options_reject_invalid_and_conflicting_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PrefixCacheOptions.resolve(**kwargs)


def test_the_tap_gap_may_equal_the_ladder_but_not_exceed_it():
    assert tap_spacing_problem(4096, 4096) is None
    assert tap_spacing_problem(4096, 4160) == ("tap_min_gap_tokens (4160) must not exceed tap_ladder_tokens (4096): "
                                               "the first ladder step would always violate the gap")


def test_cost_model_prefill_and_restore_formulas():
    cost = CacheCostModel(prefill_chunk_tokens=1000, chunk_seconds=0.01, token_seconds=1e-4, pair_seconds=1e-9,
                          h2d_bytes_per_second=1e9, restore_batch_seconds=1e-3)
    # 2 chunks + 1500 tokens + pairs 500*1500 + 1500*1501/2
    assert cost.prefill_seconds(500, 1500) == pytest.approx(0.02 + 0.15 + 1e-9 * (750000 + 1125750))
    assert cost.prefill_seconds(500, 0) == 0.0
    assert cost.restore_seconds(0) == 0.0
    assert cost.restore_seconds(2 * 10**9) == pytest.approx(2.001)
    assert cost.replace(h2d_bytes_per_second=2e9).restore_seconds(2 * 10**9) == pytest.approx(1.001)
    with pytest.raises(ValueError, match="h2d_bytes_per_second"):
        CacheCostModel(h2d_bytes_per_second=0)


def test_prefix_cache_package_imports_no_jax():
    """Loaded without the parent package's __init__ (which brings up the Engine)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    code = ("import sys, types; pkg = types.ModuleType('ninfer_jax'); pkg.__path__ = ['ninfer_jax']; "
            "sys.modules['ninfer_jax'] = pkg; import ninfer_jax.prefix_cache; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'torch', 'flax')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
