"""The GDN gated norm written quantized for the FP8 out-projection (`pallas_kernels/gated_norm.py`, interpret mode on
CPU) against the model's norm then `quantize_rows`, its Triton lowering at the 35B-A3B's heads, and the model's
out-projection taking it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_support import INTERPRET, lower_for_h200
from ninfer_jax.model import ops, qwen3_5
from ninfer_jax.model.params import QuantizedWeight
from ninfer_jax.model.tiny import quantize_fp8_blocks
from pallas_kernels import fp8_gemm, gated_norm

EPS = 1e-6


def _inputs(t, hv, seed=0, core_dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    core = rng.standard_normal((t, hv, 128)) * 10.0 ** rng.uniform(-2, 1, (t, hv, 1))  # groups of every scale
    z = rng.standard_normal((t, hv, 128)) * 2
    core[0, 0] = 0  # a zero group keeps the smallest scale
    w = rng.standard_normal(128) * 0.5 + 1
    return jnp.asarray(core, core_dtype), jnp.asarray(z, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)


@pytest.mark.parametrize("t", [64, 40], ids=["whole-blocks", "padded-rows"])
@pytest.mark.parametrize("core_dtype", [jnp.float32, jnp.bfloat16], ids=["f32-core", "bf16-core"])
def test_kernel_equals_the_models_norm_then_the_rows_quantization(t, core_dtype):
    core, z, w = _inputs(t, 3, seed=t, core_dtype=core_dtype)
    xq, xs = gated_norm.gated_rms_norm_fp8(core, z, w, eps=EPS, interpret=INTERPRET)
    want_q, want_s = gated_norm.reference(core, z, w, EPS)
    assert xq.shape == (t, 3 * 128) and xq.dtype == jnp.float8_e4m3fn and xs.shape == (3, t)
    np.testing.assert_array_equal(np.asarray(xs), np.asarray(want_s))
    np.testing.assert_array_equal(np.asarray(xq, np.float32), np.asarray(want_q, np.float32))
    assert float(xs[0, 0]) == pytest.approx(1e-12 / 448) and not np.asarray(xq[0, :128], np.float32).any()
    # each group's largest magnitude maps to e4m3's largest finite value
    np.testing.assert_array_equal(np.abs(np.asarray(xq[1:], np.float32)).reshape(t - 1, 3, 128).max(-1), 448)


def test_refuses_value_heads_other_than_one_quantization_group():
    core = jnp.zeros((16, 2, 64), jnp.bfloat16)
    assert not gated_norm.supported(64)
    with pytest.raises(ValueError, match=r"\[T, Hv, 128\]"):
        gated_norm.gated_rms_norm_fp8(core, core, jnp.zeros(64), eps=EPS, interpret=True)


def test_lowers_for_h200_at_the_35b_a3b_value_heads():
    lower_for_h200()
    args = (jax.ShapeDtypeStruct((2048, 32, 128), jnp.float32), jax.ShapeDtypeStruct((2048, 32, 128), jnp.bfloat16),
            jax.ShapeDtypeStruct((128,), jnp.bfloat16))
    lowered = jax.jit(lambda c, z, w: gated_norm.gated_rms_norm_fp8(c, z, w, eps=EPS)).trace(*args).lower(
        lowering_platforms=("cuda",))
    assert "gated_rms_norm_fp8" in lowered.as_text()


def test_gdn_out_projection_on_the_gemm_takes_the_norms_quantized_rows(monkeypatch):
    """With the FP8 GEMM taken (a Hopper GPU, fp8_activations, prefill rows), the gated norm hands the GEMM its rows
    already quantized; the product equals the norm's bf16 rows quantized by the GEMM itself. The kernels' jnp
    references stand in for them (Mosaic GPU does not run on CPU)."""
    t, hv, hidden = 48, 2, 256
    core, z, w = _inputs(t, hv, seed=7)
    values, scales = quantize_fp8_blocks(np.random.default_rng(8).standard_normal((hidden, hv * 128)).astype(
        np.float32) * 0.05)
    calls = []
    monkeypatch.setattr(fp8_gemm, "available", lambda: True)
    monkeypatch.setattr(gated_norm, "gated_rms_norm_fp8",
                        lambda c, zz, ww, eps: calls.append(c.shape) or gated_norm.reference(c, zz, ww, eps))
    monkeypatch.setattr(fp8_gemm, "fp8_gemm_rows",
                        lambda q, s, v, sc, out_dtype: fp8_gemm.reference_rows(q, s, v, sc).astype(out_dtype))
    monkeypatch.setattr(fp8_gemm, "fp8_gemm", lambda x, v, s: fp8_gemm.reference(x, v, s).astype(x.dtype))
    kc = ops.KernelConfig("pallas", fp8_activations=True)
    weight = QuantizedWeight(jnp.asarray(values), jnp.asarray(scales))
    got = ops.gated_norm_dot(kc, core, z, w, EPS, weight)
    assert calls == [(t, hv, 128)]
    normed = qwen3_5.gated_rms_norm(core.astype(z.dtype), z, w, EPS).reshape(t, -1)
    np.testing.assert_array_equal(np.asarray(got, np.float32),
                                  np.asarray(ops.quantized_dot(kc, normed, weight), np.float32))
    # off the GEMM (a decode round's rows, or no fp8_activations): the caller composes
    assert ops.gated_norm_dot(kc, core[:8], z[:8], w, EPS, weight) is None
    assert ops.gated_norm_dot(ops.KernelConfig("pallas"), core, z, w, EPS, weight) is None
