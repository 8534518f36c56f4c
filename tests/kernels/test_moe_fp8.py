"""The MoE expert kernels on block-FP8 experts (Qwen's FP8 packs quantize each expert per 128 x 128 block) against
a float64 reference on the same weights dequantized, on every path: the split-K matrix-vector pair (shared expert
riding along), the tiled decode, the prefill tiles reading FP8, and a long prefill's experts dequantized first; and
the prefill tiles multiplying FP8 x FP8 (quantize_activations) against a float64 reference of the quantized rows.
Shapes are the smallest with whole 128-blocks: E=4, K=2, H=256, I=128 (two contraction blocks in gate_up, block
scales that differ by orders of magnitude)."""


import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import triton as pltriton

from kernel_support import INTERPRET, lower_for_h200
from ninfer_jax.model.tiny import quantize_fp8_blocks
from pallas_kernels import fp8_matmul, moe
from pallas_kernels import reference as ref

E, K, H, I = 4, 2, 256, 128  # noqa: E741 (the docs' names)


def _fp8(rng, *shape):
    """Random block-FP8 weights [..., N, K] (per-block magnitudes 1e-2..1), stacked over the leading axes."""
    *lead, n, k = shape
    mats = []
    for _ in range(int(np.prod(lead, dtype=int))):
        mag = np.repeat(np.repeat(10.0 ** rng.uniform(-2, 0, (n // 128, k // 128)), 128, 0), 128, 1)
        mats.append(quantize_fp8_blocks((rng.standard_normal((n, k)) * mag * k**-0.5).astype(np.float32)))
    values = np.stack([m[0] for m in mats]).reshape(*lead, n, k)
    scales = np.stack([m[1] for m in mats]).reshape(*lead, n // 128, k // 128)
    return fp8_matmul.BlockFp8(jnp.asarray(values), jnp.asarray(scales))


def _case(t: int, seed: int):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((t, H)), jnp.float32)
    ids, w = ref.moe_route_ref(x, jnp.asarray(rng.standard_normal((E, H)), jnp.float32), K)
    gate_up, down = _fp8(rng, E, 2 * I, H), _fp8(rng, E, H, I)
    shared = ref.SharedExpert(_fp8(rng, 2 * I, H), _fp8(rng, H, I),
                              jnp.asarray(rng.random(t) + 0.1, jnp.float32))
    return x, ids, w, gate_up, down, shared


@pytest.mark.parametrize("t,config", [(1, None), (16, moe.MoeConfig(decode_shared_tile=True)),
                                      (40, None), (40, moe.MoeConfig(fp8_dequantize_rows_per_expert=8))],
                         ids=["gemv-with-shared", "tiled-decode-shared-tiles-and-expert", "prefill",
                              "long-prefill-dequantized"])
def test_fp8_experts_match_the_dequantized_reference(t, config):
    x, ids, w, gate_up, down, shared = _case(t, seed=t)
    got = moe.moe_experts(x, ids, w, gate_up, down, shared, config=config, interpret=INTERPRET)
    # float64 on the host: no GPU matmul of the reference's own (XLA may take another float32 algorithm per compile)
    want = _experts64(x, ids, w, gate_up, down, quantize=False, shared=shared)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_a_decode_rounds_fp8_shared_expert_stays_within_bf16_rounding():
    """bf16 rows of a decode round (the tiled decode layout) with an FP8 shared expert, which is dequantized for
    its two matmuls: the layer stays within the bf16 rounding of act and of each expert's output (a few 2**-9) of
    the float64 layer on the dequantized weights."""
    x, ids, w, gate_up, down, shared = _case(12, seed=5)
    x = x.astype(jnp.bfloat16)
    got = moe.moe_experts(x, ids, w, gate_up, down, shared, config=moe.DEFAULT_CONFIG, interpret=INTERPRET)
    want = _experts64(x.astype(jnp.float32), ids, w, gate_up, down, quantize=False, shared=shared)
    assert _rel(got, want) < 4 * 2.0**-9


def test_fp8_experts_off_the_block_grid_are_refused():
    x, ids, w, gate_up, down, _ = _case(2, seed=0)
    cut = fp8_matmul.BlockFp8(down.values[:, :, :64], down.scales)
    with pytest.raises(ValueError, match="must be \\[E, H, 2I\\]|multiples of 128"):
        moe.moe_experts(x, ids, w, gate_up, cut, interpret=INTERPRET)
    with pytest.raises(ValueError, match="both be block-FP8"):
        moe.moe_experts(x, ids, w, gate_up, fp8_matmul.dequantize(down), interpret=INTERPRET)


@pytest.mark.parametrize("tokens,fp8_rows", [(1, False), (8, False), (64, True), (512, False), (512, True)])
def test_fp8_experts_lower_to_triton_at_35b_a3b_shapes(tokens, fp8_rows):
    """Both kernels at each path's widths; the shared expert inside them up to `tiled_shared_max_tokens` (256)."""
    lower_for_h200()
    e, k, h, i = 256, 8, 2048, 512
    spec = jax.ShapeDtypeStruct

    def fp8(*shape):
        *lead, n, kk = shape
        return fp8_matmul.BlockFp8(spec(shape, jnp.float8_e4m3fn), spec((*lead, n // 128, kk // 128), jnp.float32))

    shared = ref.SharedExpert(fp8(2 * i, h), fp8(h, i), spec((tokens,), jnp.float32))
    args = (spec((tokens, h), jnp.bfloat16), spec((tokens, k), jnp.int32), spec((tokens, k), jnp.float32),
            fp8(e, 2 * i, h), fp8(e, h, i), shared)
    text = moe.moe_experts.trace(*args, quantize_activations=fp8_rows).lower(
        lowering_platforms=("cuda",)).as_text()
    target = getattr(pltriton, "CUSTOM_CALL_TARGET_NAME", "__gpu$xla.gpu.triton")
    assert text.count(target) == 2
    assert ("moe_gate_up_fp8_rows" in text) == fp8_rows
    assert ("stablehlo.dot_general" in text) == (tokens > 256)


def _fp8_rows64(a, group: int):
    """a [R, N] rounded as the kernels quantize rows: each `group` columns over their largest magnitude / 448, to
    e4m3 and back, in float64."""
    r, n = a.shape
    g = np.asarray(a, np.float64).reshape(r, n // group, group)
    scale = np.maximum(np.abs(g).max(-1, keepdims=True), 1e-12) / fp8_matmul.FP8_MAX
    codes = jnp.asarray(g / scale, jnp.float32).astype(jnp.float8_e4m3fn).astype(jnp.float32)
    return (np.asarray(codes, np.float64) * scale).reshape(r, n)


def _experts64(x, ids, w, gate_up, down, quantize: bool, shared=None, quantize_shared: bool = False):
    """The routed experts (and the shared one, when given) in float64 on the dequantized weights; quantize: the
    routed rows' x per token and 128-group, act per row and 128 columns, as the FP8 x FP8 paths round them (the
    shared expert's rows too with quantize_shared: in the kernels' tiles; else it takes the activations as they
    are)."""
    wg, wd = (np.asarray(fp8_matmul.dequantize(m), np.float64) for m in (gate_up, down))
    ids, w = np.asarray(ids), np.asarray(w, np.float64)
    x_rows = _fp8_rows64(np.asarray(x), 128) if quantize else np.asarray(x, np.float64)

    def expert(xr, g, d, quantize=quantize):
        gu = xr @ g
        act = (gu[:I] / (1 + np.exp(-gu[:I])) * gu[I:])[None]
        return ((_fp8_rows64(act, I) if quantize else act) @ d)[0]

    if shared is not None:
        sg, sd = (np.asarray(fp8_matmul.dequantize(m), np.float64) for m in (shared.gate_up, shared.down))
    out = np.zeros((x_rows.shape[0], H))
    for t in range(x_rows.shape[0]):
        for j in range(K):
            out[t] += w[t, j] * expert(x_rows[t], wg[ids[t, j]], wd[ids[t, j]])
        if shared is not None:
            xs = x_rows[t] if quantize_shared else np.asarray(x[t], np.float64)
            out[t] += float(shared.weight[t]) * expert(xs, sg, sd, quantize=quantize_shared)
    return out


def _rel(got, want):
    return np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want)


@pytest.mark.parametrize("config,with_shared", [
    (None, False), (dataclasses.replace(moe.FP8_NARROW_ROWS_CONFIG, tiled_shared_max_tokens=0), True),
    (dataclasses.replace(moe.FP8_NARROW_ROWS_CONFIG, tiled_shared_max_tokens=40), True)],
    ids=["32-row-tiles", "16-row-tiles-and-shared-matmuls", "16-row-tiles-and-shared-tiles"])
def test_fp8_activations_match_a_float64_reference_of_the_quantized_rows(config, with_shared):
    """quantize_activations in the prefill layout (80 routed rows) on 32- and 16-row tiles: x quantized per token and
    128-group, act per row and 128 columns in the gate_up kernel, every product FP8 x FP8; the shared expert's
    matmuls take x as it is, its rows in the tiles (three of 16) are quantized as the routed ones. Against float64
    with the same quantizations it differs only where act's float32 and float64 values round to neighbouring e4m3
    codes (one code: 2^-4 of an element, rare); against the unquantized activations by the two quantizations' error
    (about 2^-5 relative)."""
    x, ids, w, gate_up, down, shared = _case(40, seed=5)
    shared = shared if with_shared else None
    got = moe.moe_experts(x, ids, w, gate_up, down, shared, quantize_activations=True, config=config,
                          interpret=INTERPRET)
    in_tiles = with_shared and config.tiled_shared_max_tokens > 0
    assert _rel(got, _experts64(x, ids, w, gate_up, down, True, shared, quantize_shared=in_tiles)) < 2e-3
    assert 1e-3 < _rel(got, _experts64(x, ids, w, gate_up, down, False, shared)) < 2**-4
    with pytest.raises(ValueError, match="needs block-FP8 experts"):
        moe.moe_experts(x, jnp.asarray(ids), jnp.asarray(w, jnp.float32), fp8_matmul.dequantize(gate_up),
                        fp8_matmul.dequantize(down), quantize_activations=True, interpret=INTERPRET)


def test_fp8_tiles_read_the_rows_their_producer_quantized():
    """x_fp8 (x's FP8 rows from the norm before the layer) on the FP8 x FP8 tiles, the shared expert's among them:
    the rows `quantize_rows` gives x yield the layer on x exactly, and the tiles read them (other scales, another
    result)."""
    x, ids, w, gate_up, down, shared = _case(40, seed=9)
    x = x.astype(jnp.bfloat16)
    xq, xs = fp8_matmul.quantize_rows(x)

    def run(x_fp8):
        return np.asarray(moe.moe_experts(x, ids, w, gate_up, down, shared, quantize_activations=True, x_fp8=x_fp8,
                                          interpret=INTERPRET))

    on_x = run(None)
    np.testing.assert_array_equal(run((xq, xs)), on_x)
    assert _rel(run((xq, xs * 2)), on_x) > 0.1


def test_model_takes_fp8_activation_tiles_up_to_their_rows_per_expert(monkeypatch):
    """ops.moe_experts with fp8_activations: FP8 x FP8 tiles while the routed rows per expert stay within
    `fp8_dynamic_rows_per_expert`, the converted FP8 tiles past it (too few a expert for the grouped GEMM) and
    without fp8_activations."""
    from ninfer_jax.model import ops
    from ninfer_jax.model.params import QuantizedWeight

    x, ids, w, gate_up, down, shared = _case(40, seed=7)  # 80 routed rows over 4 experts: 20 a expert
    weights = [QuantizedWeight(m.values, m.scales) for m in (gate_up, down, shared.gate_up, shared.down)]

    def model(fp8_activations):
        kc = ops.KernelConfig("pallas", interpret=INTERPRET, fp8_activations=fp8_activations)
        return np.asarray(ops.moe_experts(kc, x, ids, w, *weights[:2], ref.SharedExpert(*weights[2:], shared.weight)))

    def kernel(quantize):
        return np.asarray(moe.moe_experts(x, ids, w, gate_up, down, shared, quantize_activations=quantize,
                                          interpret=INTERPRET))

    converted, dynamic = kernel(False), kernel(True)
    assert not np.array_equal(converted, dynamic)
    np.testing.assert_array_equal(model(True), dynamic)  # 20 a expert, within the default
    monkeypatch.setattr(moe, "DEFAULT_CONFIG", moe.MoeConfig(fp8_dynamic_rows_per_expert=19))
    np.testing.assert_array_equal(model(True), converted)
    np.testing.assert_array_equal(model(False), converted)


def test_grouped_gemm_path_matches_a_float64_reference_of_the_quantized_rows(monkeypatch):
    """On a Hopper GPU, FP8 x FP8 prefill rows from `fp8_grouped_rows_per_expert` a expert go through the grouped
    wgmma GEMM: here its jnp reference stands in for the kernel (Mosaic GPU needs the GPU; the kernel is checked
    against the same reference on the H200 by scripts/bench_fp8_kernels.py --only moe), so this pins the path's
    sort, gathers, folded routing weights and the sum back in token order, and the shared expert on the dense
    dequantized, against float64 with the same quantizations of the routed rows (float32 activations: no rounding
    between the products). silu(gate) * up goes through the FP8 rows kernel, here in interpret mode."""
    from pallas_kernels import fp8_gemm, fp8_rows

    t = 264  # 528 routed rows over 4 experts: 132 a expert, past the default 128
    x, ids, w, gate_up, down, shared = _case(t, seed=11)
    calls = []
    monkeypatch.setattr(fp8_gemm, "available", lambda: True)
    monkeypatch.setattr(fp8_gemm, "grouped_gemm", lambda *a, out_dtype, config=None: calls.append(a[0].shape)
                        or fp8_gemm.grouped_reference(*a, out_dtype=out_dtype))
    swiglu = fp8_rows.swiglu_fp8
    monkeypatch.setattr(fp8_rows, "swiglu_fp8", lambda gu: calls.append(gu.shape) or swiglu(gu, interpret=True))
    got = moe.moe_experts(x, ids, w, gate_up, down, shared, quantize_activations=True)
    assert calls == [(1024, H), (1024, 2 * I), (1024, I)]  # 528 rows and 127 padding a expert, in 128-row tiles
    assert _rel(got, _experts64(x, ids, w, gate_up, down, True, shared)) < 2e-3
    assert 1e-3 < _rel(got, _experts64(x, ids, w, gate_up, down, False, shared)) < 2**-4
    # x's FP8 rows from its producer (the norm before): the grouped GEMM reads them, not x (here another x's)
    other = x[::-1]
    assert moe.takes_grouped(t * K, E, H, I)
    np.testing.assert_array_equal(
        np.asarray(moe.moe_experts(x, ids, w, gate_up, down, quantize_activations=True,
                                   x_fp8=fp8_matmul.quantize_rows(other))),
        np.asarray(moe.moe_experts(other, ids, w, gate_up, down, quantize_activations=True)))


def test_fp8_experts_routing_in_their_first_kernel_equal_them_given_the_routing():
    """One lane's FP8 layer from its router's logits (`moe_experts_routed`) equals the same experts given the
    router kernel's ids, weights and shared gate, to the bit."""
    from pallas_kernels import moe_route

    x, _, _, gate_up, down, shared = _case(1, seed=5)
    rng = np.random.default_rng(5)
    logits = ref.moe_router_logits(x, jnp.asarray(rng.standard_normal((E, H)), jnp.float32))
    gate_w = jnp.asarray(rng.standard_normal((H, 1)) * 0.1, jnp.float32)
    ids, w, gate = moe_route.route(logits, x, gate_w, top_k=K, interpret=INTERPRET)
    want = moe.moe_experts(x, ids, w, gate_up, down, shared._replace(weight=gate), interpret=INTERPRET)
    got = moe.moe_experts_routed(x, logits, gate_up, down, shared._replace(weight=None), gate_w, top_k=K,
                                 interpret=INTERPRET)[0]
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
