"""The producers that write FP8 rows for the FP8 GEMM (`pallas_kernels/fp8_rows.py`, interpret mode on CPU): the GDN
gated norm and the MLP's SwiGLU product against the model's own composition then `quantize_rows`, their Triton
lowering at real shapes, and the model's projections taking them, the add + norm kernel's FP8 rows too."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_support import INTERPRET, lower_for_h200
from ninfer_jax.model import ops, qwen3_5
from ninfer_jax.model.params import ConcatWeight, QuantizedWeight
from ninfer_jax.model.tiny import quantize_fp8_blocks
from pallas_kernels import fp8_rows

EPS = 1e-6


def _norm_inputs(t, hv, seed=0, core_dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    core = rng.standard_normal((t, hv, 128)) * 10.0 ** rng.uniform(-2, 1, (t, hv, 1))  # groups of every scale
    z = rng.standard_normal((t, hv, 128)) * 2
    core[0, 0] = 0  # a zero group keeps the smallest scale
    w = rng.standard_normal(128) * 0.5 + 1
    return jnp.asarray(core, core_dtype), jnp.asarray(z, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)


def _assert_equal_rows(got, want, t, groups):
    xq, xs = got
    assert xq.shape == (t, groups * 128) and xq.dtype == jnp.float8_e4m3fn and xs.shape == (groups, t)
    np.testing.assert_array_equal(np.asarray(xs), np.asarray(want[1]))
    np.testing.assert_array_equal(np.asarray(xq, np.float32), np.asarray(want[0], np.float32))


@pytest.mark.parametrize("t", [64, 40], ids=["whole-blocks", "padded-rows"])
@pytest.mark.parametrize("core_dtype", [jnp.float32, jnp.bfloat16], ids=["f32-core", "bf16-core"])
def test_gated_norm_equals_the_models_norm_then_the_rows_quantization(t, core_dtype):
    core, z, w = _norm_inputs(t, 3, seed=t, core_dtype=core_dtype)
    got = fp8_rows.gated_rms_norm_fp8(core, z, w, eps=EPS, interpret=INTERPRET)
    _assert_equal_rows(got, fp8_rows.norm_reference(core, z, w, EPS), t, 3)
    xq, xs = got
    assert float(xs[0, 0]) == pytest.approx(1e-12 / 448) and not np.asarray(xq[0, :128], np.float32).any()
    # each group's largest magnitude maps to e4m3's largest finite value
    np.testing.assert_array_equal(np.abs(np.asarray(xq[1:], np.float32)).reshape(t - 1, 3, 128).max(-1), 448)


def test_gated_norm_reads_z_in_place_from_the_in_projections_output():
    core, z, w = _norm_inputs(32, 2, seed=3)
    proj = jnp.concatenate([jnp.full((32, 96), jnp.nan, z.dtype), z.reshape(32, -1),
                            jnp.full((32, 16), jnp.nan, z.dtype)], axis=1)  # z's neighbours would show as NaN
    got = fp8_rows.gated_rms_norm_fp8(core, proj, w, eps=EPS, z_col=96, interpret=INTERPRET)
    _assert_equal_rows(got, fp8_rows.norm_reference(core, z, w, EPS), 32, 2)


@pytest.mark.parametrize("t", [32, 20], ids=["whole-blocks", "padded-rows"])
def test_swiglu_equals_the_models_product_then_the_rows_quantization(t):
    rng = np.random.default_rng(t)
    gu = jnp.asarray(rng.standard_normal((t, 2 * 256)) * 10.0 ** rng.uniform(-2, 1, (t, 1)) * 3, jnp.bfloat16)
    got = fp8_rows.swiglu_fp8(gu, interpret=INTERPRET)
    _assert_equal_rows(got, fp8_rows.swiglu_reference(gu), t, 2)


def test_refuses_shapes_other_than_whole_quantization_groups():
    core = jnp.zeros((16, 2, 64), jnp.bfloat16)
    assert not fp8_rows.norm_supported(64) and not fp8_rows.swiglu_supported(192)
    with pytest.raises(ValueError, match=r"\[T, Hv, 128\]"):
        fp8_rows.gated_rms_norm_fp8(core, core, jnp.zeros(64), eps=EPS, interpret=True)
    with pytest.raises(ValueError, match="multiple of 128"):
        fp8_rows.swiglu_fp8(jnp.zeros((16, 384), jnp.bfloat16), interpret=True)


@pytest.mark.parametrize("kernel", ["norm", "swiglu"])
def test_lowers_for_h200_at_real_shapes(kernel):
    """The 35B-A3B's value heads (z read from its in-projection's 12352 columns) and the 27B's MLP (I = 17408)."""
    lower_for_h200()
    if kernel == "norm":
        args = (jax.ShapeDtypeStruct((2048, 32, 128), jnp.bfloat16), jax.ShapeDtypeStruct((2048, 12352), jnp.bfloat16),
                jax.ShapeDtypeStruct((128,), jnp.bfloat16))
        fn = jax.jit(lambda c, z, w: fp8_rows.gated_rms_norm_fp8(c, z, w, eps=EPS, z_col=8192))
    else:
        args = (jax.ShapeDtypeStruct((2048, 2 * 17408), jnp.bfloat16),)
        fn = jax.jit(fp8_rows.swiglu_fp8)
    assert f"{'gated_rms_norm' if kernel == 'norm' else 'swiglu'}_fp8" in fn.trace(*args).lower(
        lowering_platforms=("cuda",)).as_text()


def _weight(k, n, seed):
    values, scales = quantize_fp8_blocks(np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05)
    return QuantizedWeight(jnp.asarray(values), jnp.asarray(scales))


def test_projections_on_the_gemm_take_their_producers_fp8_rows(gemm_on_cpu):
    """With the FP8 GEMM taken (a Hopper GPU, fp8_activations, prefill rows), the gated norm and the SwiGLU hand it
    their rows already quantized; each product equals the producer's bf16 rows quantized by the GEMM itself."""
    t, hv = 48, 2
    core, z, w = _norm_inputs(t, hv, seed=7)
    kc = ops.KernelConfig("pallas", fp8_activations=True)
    out_w = _weight(hv * 128, 256, 8)
    proj = jnp.concatenate([jnp.zeros((t, 64), z.dtype), z.reshape(t, -1)], axis=1)
    got = ops.gated_norm_dot(kc, core, z, w, EPS, out_w, z_source=(proj, 64))
    normed = qwen3_5.gated_rms_norm(core.astype(z.dtype), z, w, EPS).reshape(t, -1)
    np.testing.assert_array_equal(np.asarray(got, np.float32),
                                  np.asarray(ops.quantized_dot(kc, normed, out_w), np.float32))
    x = jnp.asarray(np.random.default_rng(9).standard_normal((t, 128)), jnp.bfloat16)
    mlp = qwen3_5.MLPParams(gate_up=_weight(128, 512, 10), down=_weight(256, 128, 11))
    gu = ops.quantized_dot(kc, x, mlp.gate_up)
    np.testing.assert_array_equal(np.asarray(qwen3_5.mlp(mlp, x, kc), np.float32),
                                  np.asarray(ops.quantized_dot(kc, qwen3_5._mlp_act(gu), mlp.down), np.float32))
    assert gemm_on_cpu == [("norm", 64), ("swiglu",)]
    # off the GEMM (a decode round's rows, or no fp8_activations): the callers compose
    assert ops.gated_norm_dot(kc, core[:8], z[:8], w, EPS, out_w) is None
    assert ops.swiglu_dot(ops.KernelConfig("pallas"), gu, mlp.down) is None
    assert len(gemm_on_cpu) == 2


def test_split_products_reach_the_add_and_norm_as_partial_sums_and_equal_their_sum(gemm_on_cpu):
    """With fuse_partial_sums, the products that go straight to the add + norm on the GEMM (the SwiGLU's down, the
    GDN's gated-norm out-projection, `dot(to_norm=True)`) come as `PartialSums` where the GEMM splits K (here its
    reference in two ranges), and the add + norm, composed (80 rows: past the plain kernel's) or in the kernel
    writing FP8 rows, gives the summed product's bits; a product elsewhere and the switch off give the sum."""
    t, hv = 80, 2
    kc = ops.KernelConfig("pallas", interpret=True, fuse_add_norm=True, fuse_partial_sums=True, fp8_activations=True)
    off = dataclasses.replace(kc, fuse_partial_sums=False)
    rng = np.random.default_rng(21)
    x = jnp.asarray(rng.standard_normal((t, 256)), jnp.bfloat16)
    mlp = qwen3_5.MLPParams(gate_up=_weight(256, 1024, 22), down=_weight(512, 256, 23))
    core, z, norm_w = _norm_inputs(t, hv, seed=24)
    out_w, w = _weight(hv * 128, 256, 25), _weight(256, 256, 26)
    res_w = jnp.asarray(rng.standard_normal(256) * 0.1, jnp.bfloat16)
    for product in (lambda c: qwen3_5.mlp(mlp, x, c), lambda c: ops.gated_norm_dot(c, core, z, norm_w, EPS, out_w),
                    lambda c: qwen3_5.dot(c, x, w, to_norm=True)):
        split, whole = product(kc), product(off)
        assert isinstance(split, ops.PartialSums) and split.parts.shape == (2, t, 256)
        assert isinstance(whole, jax.Array)
        np.testing.assert_array_equal(np.asarray(split.summed(), np.float32), np.asarray(whole, np.float32))
        for fp8 in (None, "only"):
            got = qwen3_5.add_norm(kc, x, split, res_w, EPS, fp8)
            want = qwen3_5.add_norm(kc, x, whole, res_w, EPS, fp8)
            for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
                np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(e, np.float32))
    assert isinstance(qwen3_5.dot(kc, x, w), jax.Array)


def test_a_norm_writes_the_fp8_rows_its_projection_takes(gemm_on_cpu, monkeypatch):
    """With fuse_add_norm and fp8_activations the add + norm kernel writes the FP8 rows of the product the norm goes
    to first where that product takes them: a decode round's 2-32 rows (the swap-AB kernel) and a prefill chunk's
    (the GEMM, here its reference; on CPU the kernels in interpret mode). The rows and products equal those of the
    norm and quantization op by op, and on CPU the composed norm's; the bf16 rows are kept only for a weight with an
    unquantized part (the GDN in-projection's [b | a]) and an MoE layer whose experts read FP8 rows; one row
    (a weight-only product) gets plain rows."""
    from pallas_kernels import rms_norm

    kernel = rms_norm.add_rms_norm_fp8
    monkeypatch.setattr(rms_norm, "add_rms_norm_fp8", lambda *a, interpret, **kw: kernel(*a, interpret=INTERPRET, **kw))
    w = _weight(256, 384, 1)
    with_plain = ConcatWeight((w, jnp.asarray(np.random.default_rng(2).standard_normal((256, 16)), jnp.bfloat16)))
    rng = np.random.default_rng(3)
    norm_w = jnp.asarray(rng.standard_normal(256) * 0.1, jnp.bfloat16)
    for t, interpret in ((8, INTERPRET), (96, False)):  # swap-AB rows, then GEMM rows
        kc = ops.KernelConfig("pallas", interpret=interpret, fuse_add_norm=True, fp8_activations=True)
        composed = dataclasses.replace(kc, fuse_add_norm=False)
        x, h = (jnp.asarray(rng.standard_normal((t, 256)) * 3, jnp.bfloat16) for _ in range(2))
        x_new, normed = qwen3_5.add_norm(kc, x, h, norm_w, EPS, ops.fp8_rows_for(kc, t, w))
        want_x, plain = qwen3_5.add_norm(composed, x, h, norm_w, EPS)
        assert isinstance(normed, ops.Fp8Rows) and normed.rows is None and normed.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(x_new, np.float32), np.asarray(want_x, np.float32))
        _, rows, xq, xs = rms_norm.reference(x, h, norm_w, EPS)  # op by op: every bf16 rounding kept
        for got, want in ((normed.xq, xq), (normed.xs, xs), (qwen3_5.dot(kc, normed, w),
                                                             qwen3_5.dot(kc, ops.Fp8Rows(None, xq, xs, x.dtype), w))):
            np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
        _, kept = qwen3_5.add_norm(kc, x, h, norm_w, EPS, ops.fp8_rows_for(kc, t, with_plain))
        np.testing.assert_array_equal(np.asarray(kept.rows, np.float32), np.asarray(rows, np.float32))
        if INTERPRET:  # XLA's CPU fusions keep those roundings too (on a GPU they skip some: excess precision)
            for got, want in ((qwen3_5.dot(kc, normed, w), qwen3_5.dot(kc, plain, w)),
                              (ops.quantized_dot(kc, kept, with_plain), ops.quantized_dot(kc, plain, with_plain))):
                np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    gate_up = _weight(256, 512, 4)
    experts = QuantizedWeight(jnp.stack([gate_up.values] * 8), jnp.stack([gate_up.scales] * 8))  # 8 of I = 256
    moe_layer = qwen3_5.MoEParams(router=None, gate_up=experts, down=None, shared=None, shared_gate=None)
    assert ops.fp8_rows_for(kc, 96, moe_layer, top_k=16) == "with_rows"  # 192 rows a expert: the grouped GEMM
    assert ops.fp8_rows_for(kc, 96, moe_layer, top_k=2) == "with_rows"  # 24 a expert: the FP8 x FP8 tiles
    assert ops.fp8_rows_for(kc, 8, moe_layer, top_k=2) is None  # 16 rows: the decode layout, weight-only
    kc = ops.KernelConfig("pallas", interpret=True, fuse_add_norm=True, fp8_activations=True)
    assert ops.fp8_rows_for(kc, 1, w) is None  # one row: weight-only
    assert ops.fp8_rows_for(kc, 8, jnp.zeros((256, 384), jnp.bfloat16)) is None  # a bf16 weight
    for off in (dataclasses.replace(kc, fp8_activations=False), dataclasses.replace(kc, fuse_add_norm=False)):
        assert ops.fp8_rows_for(off, 8, w) is None
