"""The decode rounds' Mosaic GPU block-FP8 kernel (pallas_kernels/fp8_swap_ab.py). It compiles only for a GPU, so on
CPU: its shape rules, input checks, K-split choice and that it lowers for the H200 at the 27B's shapes. Its arithmetic
is fp8_gemm.reference's (tests/kernels/test_fp8_gemm.py); the kernel is checked against it on the H200 by
scripts/bench_fp8_kernels.py --only swap."""

import jax.numpy as jnp
import pytest

from pallas_kernels import fp8_swap_ab as sw


def test_rows_pad_to_a_power_of_two_of_at_least_16():
    assert [sw.padded_rows(m) for m in (1, 15, 16, 17, 33, 64)] == [16, 16, 16, 32, 64, 64]


def test_supported_needs_whole_tiles_few_rows_and_scale_rows_in_fours():
    assert sw.supported(1, 5120, 34816) and sw.supported(64, 17408, 5120)
    assert not sw.supported(65, 5120, 34816)  # wider rounds run fp8_gemm
    assert not sw.supported(8, 5120 + 128, 34816)  # 41 scale blocks: a 164-byte row, not whole 16 bytes
    assert not sw.supported(8, 5120, 34816 + 64)  # half a CTA tile of W rows
    assert sw.supported(8, 5120, 64, sw.SwapConfig(compute_wgs=1)) and not sw.supported(8, 5120, 64)
    assert not sw.supported(8, 257 * 128 + 3 * 128, 128)  # 260 blocks: more than one TMA box of scales


def test_splits_give_every_sm_two_ctas_where_k_allows():
    """gate_up's 272 tiles already fill 132 SMs twice: one range; down's 40 tiles take 8 of its 136 blocks' ranges;
    a K of 4 blocks stops at 4 ranges, and a configured count wins."""
    assert sw.splits(34816, 5120, 132) == 1
    assert sw.splits(5120, 17408, 132) == 8
    assert sw.splits(5120, 6144, 132) == 8
    assert sw.splits(5120, 512, 132) == 4
    assert sw.splits(5120, 17408, 132, sw.SwapConfig(k_splits=2)) == 2
    assert sw.splits(34816, 5120, 132, sw.SwapConfig(compute_wgs=1)) == 1  # 544 tiles


def test_refuses_unsupported_inputs_with_the_rule():
    x = jnp.zeros((4, 512), jnp.bfloat16)
    values, scales = jnp.zeros((128, 512), jnp.float8_e4m3fn), jnp.ones((1, 4), jnp.float32)
    with pytest.raises(ValueError, match="1..64 rows"):
        sw.fp8_swap_ab(jnp.zeros((65, 512), jnp.bfloat16), values, scales)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        sw.fp8_swap_ab(x, values.astype(jnp.bfloat16), scales)
    with pytest.raises(ValueError, match="scales"):
        sw.fp8_swap_ab(x, values, jnp.ones((1, 3), jnp.float32))
    with pytest.raises(ValueError, match="k_splits 8 does not divide"):
        sw.fp8_swap_ab(x, values, scales, config=sw.SwapConfig(k_splits=8))
    with pytest.raises(ValueError, match="compute_wgs"):
        sw.SwapConfig(compute_wgs=3)


@pytest.mark.parametrize("rows,k,n,cfg", [(1, 5120, 34816, sw.DEFAULT_CONFIG), (8, 17408, 5120, sw.DEFAULT_CONFIG),
                                          (64, 6144, 5120, sw.SwapConfig(compute_wgs=1, stages=8)),
                                          (32, 5120, 16384, sw.SwapConfig(k_splits=2))],
                         ids=["one_row_gate_up", "down_splits", "64_rows_one_wg", "fixed_splits"])
def test_lowers_for_h200_at_the_27b_shapes(rows, k, n, cfg):
    """Mosaic GPU's lowering checks the wgmma operands, TMA copies, SMEM budget and pipeline without a GPU."""
    assert "mosaic_gpu" in sw.lower(rows, k, n, cfg).as_text()
