"""The residual add + RMSNorm kernel (`pallas_kernels/rms_norm.py`, interpret mode on CPU) against the model's own
composition (`qwen3_5.rms_norm` after the add), and its Triton lowering at the models' hidden sizes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ninfer_jax.model import ops, qwen3_5
from kernel_support import INTERPRET, lower_for_h200
from pallas_kernels import fp8_matmul, rms_norm

EPS = 1e-6


def _inputs(rows, hidden, dtype, seed=0):
    rng = np.random.default_rng(seed)
    x, h = (jnp.asarray(rng.standard_normal((rows, hidden)) * 3, dtype) for _ in range(2))
    return x, h, jnp.asarray(rng.standard_normal(hidden) * 0.1, dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("rows", [1, 8])
@pytest.mark.parametrize("residual", [True, False], ids=["add", "no-add"])
@pytest.mark.parametrize("hidden", [256, 80], ids=["pow2", "masked"])  # 80: a block of 128, as the 27B's 5120
def test_add_and_norm_equal_the_models_composition(rows, dtype, residual, hidden):
    x, h, w = _inputs(rows, hidden, dtype, seed=rows)
    got_x, got_y = rms_norm.add_rms_norm(x, h if residual else None, w, eps=EPS, interpret=INTERPRET)
    want_x = x + h if residual else x
    want_y = qwen3_5.rms_norm(want_x, w, EPS)
    # The sum is rounded as the model's add: equal to the bit.
    np.testing.assert_array_equal(np.asarray(got_x, np.float32), np.asarray(want_x, np.float32))
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == jnp.float32 else dict(rtol=8e-3, atol=8e-3)  # 1 bf16 ulp
    np.testing.assert_allclose(np.asarray(got_y, np.float32), np.asarray(want_y, np.float32), **tol)
    assert got_y.dtype == x.dtype and got_x.dtype == x.dtype


def test_model_takes_the_kernel_only_for_decode_rows_it_holds():
    kc = ops.KernelConfig("pallas", interpret=INTERPRET, fuse_add_norm=True)
    x, h, w = _inputs(4, 64, jnp.float32)
    assert ops.add_rms_norm(kc, x, h, w, EPS) is not None
    assert ops.add_rms_norm(ops.KernelConfig("pallas", interpret=INTERPRET), x, h, w, EPS) is None  # flag off
    wide = jnp.zeros((ops.DECODE_MAX_ROWS + 1, 64), jnp.float32)
    assert ops.add_rms_norm(kc, wide, wide, w, EPS) is None  # a prefill chunk
    long = rms_norm.DEFAULT_CONFIG.max_hidden + 128
    past = jnp.zeros((1, long), jnp.float32)
    assert ops.add_rms_norm(kc, past, past, jnp.zeros(long), EPS) is None  # a row past the widest block
    got_x, got_y = qwen3_5.add_norm(kc, past + 1, past, jnp.zeros(long), EPS)  # the composition instead
    np.testing.assert_allclose(np.asarray(got_y), 1.0, rtol=1e-5)


def test_rejects_shapes_it_cannot_read_whole():
    x = jnp.zeros((2, 8), jnp.float32)
    with pytest.raises(ValueError, match="16 <= H"):
        rms_norm.add_rms_norm(x, x, jnp.zeros(8), eps=EPS, interpret=True)


def test_fused_norm_needs_the_pallas_backend():
    with pytest.raises(ValueError, match="fuse_add_norm"):
        ops.KernelConfig(fuse_add_norm=True)


@pytest.mark.parametrize("residual,hidden", [(True, 2048), (False, 2048), (True, 5120)],
                         ids=["35b-add", "35b-no-add", "27b-add"])
def test_lowers_to_triton_at_the_models_hidden_sizes(residual, hidden):
    lower_for_h200()
    row = jax.ShapeDtypeStruct((1, hidden), jnp.bfloat16)
    text = rms_norm.add_rms_norm.trace(row, row if residual else None, jax.ShapeDtypeStruct((hidden,), jnp.bfloat16),
                                       eps=EPS).lower(lowering_platforms=("cuda",)).as_text()
    assert "add_rms_norm" in text


def test_rows_of_h_past_xs_are_ignored():
    """A one-row projection's two-row matmul output comes whole (qwen3_5.dot(to_norm=True)): only row 0 is added,
    here as in the model's composition."""
    x, h, w = _inputs(1, 128, jnp.bfloat16, seed=5)
    two = jnp.concatenate([h, h * 100 + 7])
    got = rms_norm.add_rms_norm(x, two, w, eps=EPS, interpret=INTERPRET)
    want = rms_norm.add_rms_norm(x, h, w, eps=EPS, interpret=INTERPRET)
    for g, e in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(e, np.float32))
    kc = ops.KernelConfig("pallas", interpret=INTERPRET)  # the composition, kernel off
    comp_x, _ = qwen3_5.add_norm(kc, x, two, w, EPS)
    np.testing.assert_array_equal(np.asarray(comp_x, np.float32), np.asarray(x + h, np.float32))
    with pytest.raises(ValueError, match="R' >= R"):
        rms_norm.add_rms_norm(jnp.concatenate([x, x]), h, w, eps=EPS, interpret=True)


def test_partial_sums_are_added_in_the_kernel_as_the_split_product_adds_them():
    """h as a split product's float32 partial sums [S, R', H]: every form of the kernel adds them in
    `sum_partials`' order and rounding, so its outputs equal those of the summed product to the bit."""
    x, _, w = _inputs(3, 384, jnp.bfloat16, seed=11)
    parts = jnp.asarray(np.random.default_rng(12).standard_normal((4, 5, 384)) * 3, jnp.float32)
    h = fp8_matmul.sum_partials(parts, jnp.bfloat16)
    router = jnp.asarray(np.random.default_rng(13).standard_normal((8, 384)) * 0.1, jnp.bfloat16)
    for kernel, extra in ((rms_norm.add_rms_norm, ()), (rms_norm.add_rms_norm_fp8, ()),
                          (rms_norm.add_rms_norm_router, (router,))):
        got = kernel(x, parts, w, *extra, eps=EPS, interpret=INTERPRET)
        want = kernel(x, h, w, *extra, eps=EPS, interpret=INTERPRET)
        for g, e in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(e, np.float32))
    for g, e in zip(rms_norm.reference(x, parts, w, EPS), rms_norm.reference(x, h, w, EPS)):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(e, np.float32))
    with pytest.raises(ValueError, match="R' >= R"):  # bf16 partial sums are not a split product's
        rms_norm.add_rms_norm(x, parts.astype(jnp.bfloat16), w, eps=EPS, interpret=True)


@pytest.mark.parametrize("residual", [True, False], ids=["add", "no-add"])
@pytest.mark.parametrize("hidden", [256, 384], ids=["pow2-groups", "masked-group"])  # 384: 3 groups in a block of 4
def test_fp8_rows_equal_the_models_norm_then_the_rows_quantization(residual, hidden):
    x, h, w = _inputs(8, hidden, jnp.bfloat16, seed=hidden)
    x = x * jnp.asarray(10.0 ** np.linspace(-2, 1, 8)[:, None], jnp.bfloat16)  # rows of every scale
    h = h if residual else None
    got = rms_norm.add_rms_norm_fp8(x, h, w, eps=EPS, interpret=INTERPRET)
    want = rms_norm.reference(x, h, w, EPS)
    assert got[2].dtype == jnp.float8_e4m3fn and got[3].shape == (hidden // 128, 8)
    for g, e in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(e, np.float32))
    x_new, rows, *quantized = rms_norm.add_rms_norm_fp8(x, h, w, eps=EPS, with_rows=False, interpret=INTERPRET)
    assert rows is None
    for g, e in zip([x_new, *quantized], [got[0], *got[2:]]):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(e, np.float32))
    with pytest.raises(ValueError, match="a multiple of 128"):
        rms_norm.add_rms_norm_fp8(x[:, :80], None, w[:80], eps=EPS, interpret=True)


@pytest.mark.parametrize("rows, hidden, residual", [(1, 256, True), (2, 80, False)], ids=["one-lane", "masked"])
def test_the_norm_also_writes_the_router_logits_against_its_rows(rows, hidden, residual):
    """`add_rms_norm_router`: x + h and the norm equal `add_rms_norm`'s to the bit; the logits are the float64 dot
    products of the norm's bf16 rows with the router's rows, to float32 accumulation (the products are exact)."""
    x, h, w = (a.astype(jnp.bfloat16) for a in _inputs(rows, hidden, jnp.float32, seed=hidden))
    router = jnp.asarray(np.random.default_rng(1).standard_normal((16, hidden)) * 0.1, jnp.bfloat16)
    h = h if residual else None
    got_x, got_y, logits = rms_norm.add_rms_norm_router(x, h, w, router, eps=EPS, interpret=INTERPRET)
    want_x, want_y = rms_norm.add_rms_norm(x, h, w, eps=EPS, interpret=INTERPRET)
    np.testing.assert_array_equal(np.asarray(got_x, np.float32), np.asarray(want_x, np.float32))
    np.testing.assert_array_equal(np.asarray(got_y, np.float32), np.asarray(want_y, np.float32))
    want = np.asarray(want_y, np.float64) @ np.asarray(router, np.float64).T
    assert logits.shape == (rows, 16) and logits.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(logits), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    with pytest.raises(ValueError, match="multiple of"):
        rms_norm.add_rms_norm_router(x, h, w, router[:6], eps=EPS, interpret=True)


def test_router_logits_kernel_lowers_to_triton_at_the_35b_shapes():
    lower_for_h200()
    spec = jax.ShapeDtypeStruct
    text = rms_norm.add_rms_norm_router.trace(
        spec((1, 2048), jnp.bfloat16), spec((2, 2048), jnp.bfloat16), spec((2048,), jnp.bfloat16),
        spec((256, 2048), jnp.bfloat16), eps=EPS).lower(lowering_platforms=("cuda",)).as_text()
    assert "add_rms_norm_router" in text
