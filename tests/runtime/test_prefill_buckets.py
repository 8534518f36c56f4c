"""The compiled prefill chunk lengths: few programs, and little padding on compute-bound chunks."""

import pytest

from ninfer_jax.runtime.device.buckets import StepSizes, idle_chunk_sizes, pow2_buckets, prefill_buckets


@pytest.mark.parametrize("chunk, expected", [
    (64, (64,)),
    (256, (64, 256)),
    (512, (64, 256, 512)),
    (2048, (64, 256, 512, 1024, 1536, 2048)),
    (8192, (64, 256, 1024, 2048, 4096, 6144, 8192)),
])
def test_buckets_are_geometric_while_short_then_quarters_of_the_chunk(chunk, expected):
    assert prefill_buckets(chunk) == expected


@pytest.mark.parametrize("chunk", [512, 1024, 2048, 4096, 8192, 2112])
def test_a_compute_bound_chunk_pads_by_less_than_a_quarter_of_the_chunk(chunk):
    buckets = prefill_buckets(chunk)
    quarter = max(512, chunk // 4)
    for n in range(512, chunk + 1, 64):
        padded = next(b for b in buckets if n <= b)
        assert padded - n < quarter, (n, padded)
    assert buckets[-1] == chunk and list(buckets) == sorted(set(buckets))


@pytest.mark.parametrize("chunk, idle, expected", [
    (8192, 8192, ()),
    (8192, 32768, (16384, 32768)),
    (2048, 32768, (16384, 32768)),  # a short chunk adds no more programs
    (8192, 20032, (9984, 20032)),
    (64, 256, (128, 256)),
    (2048, 2112, (2112,)),
])
def test_idle_passes_are_the_idle_chunk_and_its_half_where_longer_than_the_prefill_chunk(chunk, idle, expected):
    assert idle_chunk_sizes(chunk, idle) == expected


def test_the_first_sizes_are_one_pass_and_one_round_with_the_full_sampler_only():
    configured = StepSizes(prefill_buckets(4096), idle_chunk_sizes(4096, 16384), pow2_buckets(256), (8, 64),
                           (1, 2, 4, 8, 16), (256, 1024))
    first = configured.first()
    assert first == StepSizes((1024,), (), (8,), (), (8,), (1024,), copies=True, greedy=False)
    assert first.has("decode", 8) and not first.has("decode", 8, full=False) and not first.has("decode", 4)
    assert configured.has("decode", 4, full=False) and configured.has("idle", 16384, full=False)
    # Sizes all above the limits: the smallest of each, so every request still fits.
    assert StepSizes((2048, 4096), (), (16, 32)).first() == StepSizes((2048,), (), (16,), greedy=False)
