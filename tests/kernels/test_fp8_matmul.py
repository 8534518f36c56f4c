"""The block-FP8 weight-only decode kernels against a float64 reference of the same weights, and the model's FP8
product (`ops.quantized_dot`) on the pallas backend against its reference at decode and prefill row counts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_support import INTERPRET, lower_for_h200
from ninfer_jax.model import ops
from ninfer_jax.model.params import QuantizedWeight
from ninfer_jax.model.tiny import quantize_fp8_blocks
from pallas_kernels import fp8_matmul

# float32 accumulation error; compiled on a GPU, the tensor-core kernels' float32 dots are TF32 (10-bit mantissas)
F32_TOL = 1e-5 if INTERPRET else 1e-3
K, N = 384, 256  # three 128-blocks of contraction, two of output: every program reads several scales
# up to 128 rows of both products (the default stops FP8 x FP8 at 32, where the wgmma GEMM starts to win)
WIDE = fp8_matmul.Fp8Config(max_rows=fp8_matmul.MAX_ROWS, dynamic_max_rows=fp8_matmul.MAX_ROWS)


def _weight(seed=0, k=K, n=N):
    """A block-FP8 weight [N, K] whose blocks' scales differ by orders of magnitude, and its float64 value."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)) * np.repeat(np.repeat(10.0 ** rng.uniform(-3, 0, (n // 128, k // 128)), 128, 0),
                                                128, 1)
    values, scales = quantize_fp8_blocks(w.astype(np.float32))
    exact = values.astype(np.float64) * np.repeat(np.repeat(scales.astype(np.float64), 128, 0), 128, 1)
    return jnp.asarray(values), jnp.asarray(scales), exact


@pytest.mark.parametrize("rows", [1, 2, 5, 16, 24, 40], ids=lambda r: f"{r}rows")
def test_weight_only_kernels_match_float64_reference(rows):
    """1 row takes the CUDA-core kernel, 2-16 the swap-AB tensor-core one (24 and 40: its wide tiles, 64 and 128 W
    rows a program); both equal x @ W in float64 to float32 accumulation error (W's FP8 values are exact in float32,
    times their own block's scale)."""
    values, scales, exact = _weight(rows)
    x = np.random.default_rng(10 + rows).standard_normal((rows, K)).astype(np.float32)
    got = np.asarray(fp8_matmul.fp8_matmul(jnp.asarray(x), values, scales, config=WIDE, interpret=INTERPRET),
                     np.float64)
    want = x.astype(np.float64) @ exact.T
    np.testing.assert_allclose(got, want, rtol=F32_TOL, atol=F32_TOL * np.abs(want).max())


@pytest.mark.parametrize("splits", [None, 1], ids=["splits", "one-split"])
@pytest.mark.parametrize("rows", [1, 8], ids=lambda r: f"{r}rows")
def test_bf16_rows_match_float64_reference(rows, splits):
    """The model's bf16 rows: at 1 row two 128-blocks a loop step (six blocks of K), at 8 rows the float16
    tensor-core product (each row scaled by a power of two into float16's range, exactly); partials added by XLA,
    or one split writing the result itself. Off by the bf16 output's rounding only."""
    values, scales, exact = _weight(30 + rows, k=768)
    x = jnp.asarray(np.random.default_rng(rows).standard_normal((rows, 768)) * 3e3, jnp.bfloat16)
    cfg = fp8_matmul.Fp8Config(cuda_core_splits=1, splits=1) if splits == 1 else None
    got = np.asarray(fp8_matmul.fp8_matmul(x, values, scales, config=cfg, interpret=INTERPRET).astype(jnp.float32),
                     np.float64)
    want = np.asarray(x.astype(jnp.float32), np.float64) @ exact.T
    np.testing.assert_allclose(got, want, rtol=2**-8, atol=2**-8 * np.abs(want).max())


@pytest.mark.parametrize("rows", [2, 16, 100], ids=lambda r: f"{r}rows")
def test_fp8_activations_match_float64_reference_of_the_quantized_rows(rows):
    """With quantize_activations the product is FP8 x FP8: it equals, to float32 accumulation error, x quantized per
    token and 128-group (dequantized in float64) times W; and x's own product differs by the quantization's error."""
    values, scales, exact = _weight(20 + rows)
    x = np.random.default_rng(rows).standard_normal((rows, K)).astype(np.float32)
    got = np.asarray(fp8_matmul.fp8_matmul(jnp.asarray(x), values, scales, config=WIDE, quantize_activations=True,
                                           interpret=INTERPRET), np.float64)
    xq, xs = (np.asarray(a, np.float64) for a in fp8_matmul.quantize_rows(jnp.asarray(x)))
    x_seen = (xq.reshape(rows, K // 128, 128) * xs.T[..., None]).reshape(rows, K)
    want = x_seen @ exact.T
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    # e4m3 keeps 3 mantissa bits: each activation within 2^-4 of itself, so the product within about 2^-4 / 2
    plain = x.astype(np.float64) @ exact.T
    assert 1e-3 < np.linalg.norm(got - plain) / np.linalg.norm(plain) < 2**-5


def test_refuses_shapes_outside_whole_blocks_and_too_many_rows():
    values, scales, _ = _weight()
    with pytest.raises(ValueError, match="multiples of 128"):
        fp8_matmul.fp8_matmul(jnp.zeros((1, K - 64)), values[:, : K - 64], scales, interpret=INTERPRET)
    with pytest.raises(ValueError, match="129 rows exceed Fp8Config's limit of 128"):
        fp8_matmul.fp8_matmul(jnp.zeros((129, K)), values, scales, interpret=INTERPRET)
    with pytest.raises(ValueError, match="33 rows exceed Fp8Config's limit of 32"):
        fp8_matmul.fp8_matmul(jnp.zeros((33, K)), values, scales, quantize_activations=True, interpret=INTERPRET)
    with pytest.raises(ValueError, match="dynamic_max_rows <= 128"):
        fp8_matmul.Fp8Config(dynamic_max_rows=129)
    with pytest.raises(ValueError, match="cuda_core_max_rows <= max_rows"):
        fp8_matmul.Fp8Config(cuda_core_max_rows=8, dynamic_max_rows=4)
    with pytest.raises(ValueError, match="wide_tiles must rise in rows"):
        fp8_matmul.Fp8Config(wide_tiles=((128, 128, 8), (32, 64, 4)))


def test_wider_weight_only_rounds_take_wider_tiles():
    """(block_n, warps) by rows: 32 W rows a program to 16 rows, 64 to 32 rows, 128 on 8 warps to 128 rows (the
    H200 sweep's fastest); FP8 x FP8 keeps its own tile at every width."""
    cfg = fp8_matmul.DEFAULT_CONFIG
    assert [cfg.tile(m, False) for m in (2, 16, 17, 32, 33, 128)] == [(32, 4)] * 2 + [(64, 4)] * 2 + [(128, 8)] * 2
    assert {cfg.tile(m, True) for m in (2, 32, 128)} == {(64, 4)}


@pytest.mark.parametrize("rows", [2, 40, 130], ids=["decode-kernel", "wide-decode-kernel", "prefill-dequantized"])
def test_pallas_quantized_dot_matches_the_reference(rows):
    """The model's product on the pallas backend: a decode round's rows (up to 128) through the kernel, a prefill
    chunk's through the dequantized matmul; each equals the float32 reference."""
    values, scales, _ = _weight(7)
    w = QuantizedWeight(values, scales)
    x = jnp.asarray(np.random.default_rng(rows).standard_normal((rows, K)), jnp.float32)
    got = ops.quantized_dot(ops.KernelConfig("pallas", interpret=INTERPRET), x, w)
    want = ops.quantized_dot(ops.REFERENCE, x, w)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=F32_TOL,
                               atol=F32_TOL * float(jnp.abs(want).max()))


def test_blocked_weights_multiply_to_the_same_bits_as_their_rows():
    """A weight `blocked` ([K / 128, N, 128]) is read tile for tile as its [N, K] rows: one row, weight-only rows
    on the tensor cores and FP8 x FP8 rows give the same bits; `unblocked` lays it back; a blocked array of other
    widths is refused."""
    values, scales, _ = _weight(seed=4)
    blocked = fp8_matmul.blocked(values)
    assert blocked.shape == (K // 128, N, 128) and fp8_matmul.weight_dims(blocked) == (N, K)
    np.testing.assert_array_equal(np.asarray(fp8_matmul.unblocked(blocked), np.float32), np.asarray(values, np.float32))
    rng = np.random.default_rng(5)
    for rows, dynamic in ((1, False), (8, False), (8, True)):
        x = jnp.asarray(rng.standard_normal((rows, K)), jnp.bfloat16)
        got, want = (fp8_matmul.fp8_matmul(x, v, scales, quantize_activations=dynamic, interpret=INTERPRET)
                     for v in (blocked, values))
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    with pytest.raises(ValueError, match="multiples of"):
        fp8_matmul.fp8_matmul(x, blocked.reshape(K // 128, N * 2, 64), scales, interpret=True)


@pytest.mark.parametrize("rows,dynamic,k,n", [
    (1, False, 5120, 34816), (8, False, 5120, 34816), (64, True, 5120, 34816), (1, False, 17408, 5120)],
    ids=["gate_up-1row", "gate_up-8rows", "gate_up-64rows-dynamic", "down-1row"])
def test_lowers_to_triton_at_the_27b_mlp_shapes(rows, dynamic, k, n):
    lower_for_h200()
    spec = jax.ShapeDtypeStruct
    fn = jax.jit(lambda x, v, s: fp8_matmul.fp8_matmul(x, v, s, config=WIDE, quantize_activations=dynamic))
    for values in ((n, k), (k // 128, n, 128)):  # [N, K] and blocked
        text = fn.trace(spec((rows, k), jnp.bfloat16), spec(values, jnp.float8_e4m3fn),
                        spec((n // 128, k // 128), jnp.float32)).lower(lowering_platforms=("cuda",)).as_text()
        assert ("fp8_gemv" if rows == 1 else "fp8_fp8_swap_ab" if dynamic else "fp8_swap_ab") in text


@pytest.mark.parametrize("rows,dynamic,kernel", [
    (1, False, "fp8_gemv"), (128, False, "fp8_swap_ab"), (129, False, None),
    (2, True, "fp8_fp8_swap_ab"), (32, True, "fp8_fp8_swap_ab"), (33, True, None)])
def test_the_model_takes_the_decode_kernels_up_to_their_row_limits(rows, dynamic, kernel):
    """`ops.quantized_dot` on the pallas backend: 128 weight-only and 32 FP8 x FP8 rows at most through
    fp8_matmul (the H200 sweep's crossovers); past them no decode kernel (on a CPU: the dequantized matmul)."""
    kc = ops.KernelConfig("pallas", interpret=INTERPRET, fp8_activations=dynamic)
    spec = jax.ShapeDtypeStruct
    jaxpr = str(jax.make_jaxpr(lambda x, v, s: ops.quantized_dot(kc, x, QuantizedWeight(v, s)))(
        spec((rows, K), jnp.bfloat16), spec((N, K), jnp.float8_e4m3fn), spec((N // 128, K // 128), jnp.float32)))
    names = [n for n in ("fp8_gemv", "fp8_fp8_swap_ab", "fp8_swap_ab") if f"name={n}" in jaxpr]
    assert names == ([kernel] if kernel else [])
