"""A decode round's layout: its active lanes as rows, padded to the next compiled size; the sampler's top-k."""

import secrets

import jax
import numpy as np
import pytest

from ninfer_jax.runtime.device.buckets import pow2_buckets
from ninfer_jax.runtime.device.steps import DECODE_COLUMNS, pack_decode_inputs
from ninfer_jax.runtime.sampling import SamplerInputs, grouped_top_k


@pytest.mark.parametrize("lanes, sizes", [(256, (1, 2, 4, 8, 16, 32, 64, 128, 256)), (6, (1, 2, 4, 6)), (1, (1,))])
def test_round_sizes_are_powers_of_two_up_to_the_lane_count(lanes, sizes):
    assert pow2_buckets(lanes) == sizes


def test_a_round_packs_its_active_lanes_then_padding_rows_marked_past_every_lane():
    c, pages = 8, 3
    tokens, positions = np.arange(c) + 100, np.arange(c) + 200
    slots = np.array([7, 6, 5, 4, 3, 2, 1, 0])
    tables = np.arange(c * pages).reshape(c, pages)
    use_prev = np.zeros(c, bool)
    use_prev[5] = True
    sampler = SamplerInputs.empty(c)
    sampler.step[:] = np.arange(c) + 10
    sampler.min_p[:] = 0.5
    shift = -np.arange(c) * 3  # each lane's MRoPE delta
    packed = pack_decode_inputs([2, 5], 4, tokens, positions, tables, slots, use_prev, sampler.arrays(), shift)
    assert packed.shape == (4, DECODE_COLUMNS + pages) and packed.dtype == np.int32
    # tokens, positions, slots, active, use_prev, lane, then the sampler (step fifth, min_p sixth as float32 bits),
    # then the rope shift
    half = int(np.float32(0.5).view(np.int32))
    assert packed[0, :6].tolist() == [102, 202, 5, 1, 0, 2] and packed[0, 10:13].tolist() == [12, half, -6]
    assert packed[1, :6].tolist() == [105, 205, 2, 1, 1, 5] and packed[1, 10:13].tolist() == [15, half, -15]
    assert (packed[0, DECODE_COLUMNS:] == tables[2]).all() and (packed[1, DECODE_COLUMNS:] == tables[5]).all()
    padding = packed[2:]
    assert (padding[:, 5] == c).all() and (padding[:, 3] == 0).all() and (padding[:, 4] == 0).all()
    # Padding rows write their slot back unchanged: they take the slots of lanes not in the round (lanes 0, 1),
    # never an active lane's (a duplicate slot let a stale write land over the active lane's update).
    assert padding[:, 2].tolist() == [7, 6]
    full = pack_decode_inputs([2, 5], c, tokens, positions, tables, slots, use_prev, sampler.arrays())
    assert sorted(full[:, 2].tolist()) == sorted(slots.tolist())


@pytest.mark.parametrize("vocab, groups", [(4096, 16), (5003, 64), (40, 4)])
def test_grouped_top_k_equals_lax_top_k_values_and_ids_with_ties(vocab, groups):
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    # Values on a coarse grid: many ties, which lax.top_k breaks toward the lower id.
    x = np.round(rng.standard_normal((3, vocab)) * 4).astype(np.float32)
    x[1, vocab - 7:] = x[1].max()  # ties at the very end of the row, in the padded last group
    want = jax.lax.top_k(x, 20)
    got = jax.jit(grouped_top_k, static_argnums=(1, 2))(x, 20, groups)
    assert np.array_equal(np.asarray(got[0]), np.asarray(want[0])), f"seed={seed}"
    assert np.array_equal(np.asarray(got[1]), np.asarray(want[1])), f"seed={seed}"
