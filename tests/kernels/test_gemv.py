"""The split-K matrix-vector kernel (`pallas_kernels/gemv.py`, interpret mode on CPU) against a float64 numpy
product of the same (dtype-rounded) inputs, and its Triton lowering at a 35B-A3B projection's shape.

Small shapes, chosen so each case takes one path: several splits, splits clamped to K // block_k, the column
block halved until it divides N, one split writing x's dtype from the kernel, and the raw partial sums.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import _compat, gemv

INTERPRET = jax.default_backend() == "cpu"
F64 = np.float64


def _inputs(rows, k, n, dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((rows, k)), dtype)
    w = jnp.asarray(rng.standard_normal((k, n)) * k**-0.5, dtype)
    return x, w


def _want(x, w):
    """x @ w in float64 from the inputs as given (bf16 values are exact in float64)."""
    return np.asarray(x.astype(jnp.float32), F64) @ np.asarray(w.astype(jnp.float32), F64)


def _assert_close(got, want, dtype):
    # float32 products summed in float32: ~1e-5 of the largest output; a bf16 output: about one bf16 ulp.
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    scale = float(np.abs(want).max())
    np.testing.assert_allclose(np.asarray(got.astype(jnp.float32), F64), want, rtol=tol, atol=tol * scale)


# (K, N, config, splits it runs, column block it runs)
CASES = {
    "splits": (256, 64, gemv.GemvConfig(block_n=32, block_k=32, splits=4), 4, 32),
    "splits-clamped": (64, 32, gemv.GemvConfig(block_n=32, block_k=32, splits=8), 2, 32),
    "block-n-halved": (128, 64 * 3, gemv.GemvConfig(block_n=128, block_k=32, splits=2), 2, 64),
    "one-split": (128, 96, gemv.GemvConfig(block_n=32, block_k=64, splits=1), 1, 32),
}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_product_equals_float64_reference(case, rows, dtype):
    k, n, cfg, _, _ = CASES[case]
    x, w = _inputs(rows, k, n, dtype, seed=rows)
    got = gemv.gemv(x, w, config=cfg, interpret=INTERPRET)
    chex.assert_shape(got, (rows, n))
    chex.assert_type(got, dtype)
    chex.assert_tree_all_finite(got)  # interpret mode fills outputs with NaN: an unwritten column shows
    _assert_close(got, _want(x, w), dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_partial_sums_add_up_to_the_product(case, rows, dtype):
    """The float32 partials [S, R, N] sum to the float64 product of the (bf16-rounded) inputs: no bf16 rounding
    on this path, whatever the inputs' dtype."""
    k, n, cfg, splits, _ = CASES[case]
    x, w = _inputs(rows, k, n, dtype, seed=10 + rows)
    parts = gemv.gemv(x, w, config=cfg, partial=True, interpret=INTERPRET)
    chex.assert_shape(parts, (splits, rows, n))
    chex.assert_type(parts, jnp.float32)
    chex.assert_tree_all_finite(parts)
    want = _want(x, w)
    np.testing.assert_allclose(np.asarray(parts, F64).sum(axis=0), want, rtol=1e-5,
                               atol=1e-5 * float(np.abs(want).max()))


def test_each_split_covers_its_own_piece_of_k():
    """Split s sums rows [s K/S, (s+1) K/S) of the contraction: the partials are the per-piece products."""
    k, n, cfg, splits, _ = CASES["splits"]
    x, w = _inputs(1, k, n, jnp.float32, seed=3)
    parts = np.asarray(gemv.gemv(x, w, config=cfg, partial=True, interpret=INTERPRET), F64)
    piece = k // splits
    for s in range(splits):
        want = _want(x[:, s * piece:(s + 1) * piece], w[s * piece:(s + 1) * piece])
        np.testing.assert_allclose(parts[s], want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))


def test_f32_rows_are_rounded_to_bf16_weights():
    """Mixed dtypes: x is rounded to w's dtype before the products (as the MoE kernels); the result is x's dtype."""
    x, w = _inputs(1, 128, 64, jnp.float32, seed=4)
    w = w.astype(jnp.bfloat16)
    got = gemv.gemv(x, w, config=gemv.GemvConfig(block_n=64, block_k=32, splits=2), interpret=INTERPRET)
    chex.assert_type(got, jnp.float32)
    _assert_close(got, _want(x.astype(jnp.bfloat16), w), jnp.float32)


def test_default_config_plans_at_the_output_projections():
    """The 35B-A3B's out_proj / o_proj [4096, 2048]: 64-column blocks, 16 splits of 4 steps; the 27B's out_proj
    [6144, 5120] the same blocks, 16 splits of 6 steps."""
    assert gemv._plan(4096, 2048, gemv.DEFAULT_CONFIG) == gemv._Plan(64, 64, 16, 4)
    assert gemv._plan(6144, 5120, gemv.DEFAULT_CONFIG) == gemv._Plan(64, 64, 16, 6)
    plan = gemv._plan(2048, 12352, gemv.GemvConfig(block_n=128, splits=8))  # 12352 = 64 x 193: 128 falls to 64
    assert (plan.block_n, plan.splits, plan.steps) == (64, 8, 4)


def test_rejects_shapes_it_cannot_tile():
    x, w = _inputs(1, 80, 64, jnp.float32)
    # K=80 clamps to one split of 64 rows, which leaves 16 over
    with pytest.raises(ValueError, match="K=80"):
        gemv.gemv(x, w, config=gemv.GemvConfig(block_k=64), interpret=True)
    assert not gemv.supported(x, w, gemv.GemvConfig(block_k=64))
    with pytest.raises(ValueError, match="disagree on K"):
        gemv.gemv(x, w[:64], interpret=True)
    x, w = _inputs(1, 64, 40, jnp.float32)
    with pytest.raises(ValueError, match="N=40"):  # 40 = 8 x 5: no column block of 16 or more divides it
        gemv.gemv(x, w, interpret=True)
    with pytest.raises(ValueError, match=r"\[R, K\]"):
        gemv.gemv(x[0], w, interpret=True)
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        gemv.gemv(x.astype(jnp.float16), w, interpret=True)


def test_supported_shapes():
    spec = jax.ShapeDtypeStruct
    assert gemv.supported(spec((1, 2048), jnp.bfloat16), spec((2048, 12352), jnp.bfloat16))
    assert gemv.supported(spec((8, 4096), jnp.bfloat16), spec((4096, 2048), jnp.bfloat16))
    assert not gemv.supported(spec((9, 4096), jnp.bfloat16), spec((4096, 2048), jnp.bfloat16))  # too many rows
    assert not gemv.supported(spec((1, 2048), jnp.bfloat16), spec((2048, 2056), jnp.bfloat16))  # N % 16
    assert not gemv.supported(spec((1, 2048), jnp.bfloat16), spec((1024, 2048), jnp.bfloat16))  # K mismatch


def test_config_rejects_bad_knobs():
    with pytest.raises(ValueError, match="block_n"):
        gemv.GemvConfig(block_n=48)
    with pytest.raises(ValueError, match="num_warps"):
        gemv.GemvConfig(num_warps=3)
    with pytest.raises(ValueError, match="splits"):
        gemv.GemvConfig(splits=0)


@pytest.mark.parametrize("partial", [False, True], ids=["sum", "partial"])
def test_lowers_to_triton_at_the_35b_out_projection(partial):
    """x [1, 4096] @ w [4096, 2048] bf16 (the GDN out-projection) lowers to one Triton kernel on any machine."""
    _compat.lower_for_h200()
    spec = jax.ShapeDtypeStruct
    text = gemv.gemv.trace(spec((1, 4096), jnp.bfloat16), spec((4096, 2048), jnp.bfloat16),
                           partial=partial).lower(lowering_platforms=("cuda",)).as_text()
    target = getattr(pltriton, "CUSTOM_CALL_TARGET_NAME", "__gpu$xla.gpu.triton")
    assert text.count(target) == 1 and "gemv" in text
    assert "dot_general" not in text
