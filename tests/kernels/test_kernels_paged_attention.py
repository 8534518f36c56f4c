"""Paged attention kernels (pallas_kernels.paged_attention) against the jnp references, in Pallas
interpret mode on CPU. Fresh random inputs every run; pool rows the lane may not see (pages outside its
table, keys at or past its length) are NaN, so any leak into the softmax shows; interpret mode fills
outputs with NaN before the kernel runs, so unwritten rows fail the finiteness check.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from ninfer_jax.model import ops
from kernel_support import INTERPRET, attention64, lower_for_h200
from pallas_kernels import kv_quant, paged_attention
from pallas_kernels import reference as ref

PAGE = 64


@pytest.fixture
def rng():
    seed = int(np.random.SeedSequence().entropy % (2**32))
    return np.random.default_rng(seed), seed


def make_pool(r, pages, hkv, d):
    return (r.standard_normal((pages, PAGE, hkv, d)).astype(np.float32),
            r.standard_normal((pages, PAGE, hkv, d)).astype(np.float32))


def poison(pool, tables, lengths):
    """NaN everywhere except the first lengths[b] token rows of each lane's table."""
    out = np.full_like(pool, np.nan)
    for table, n in zip(tables, lengths):
        for i, page in enumerate(table):
            rows = max(0, min(PAGE, n - i * PAGE))
            out[page, :rows] = pool[page, :rows]
    return out


def decode_case(r, hq, hkv, d, lengths, max_pages):
    """A decode round's inputs: tables (each lane max_pages of its own), pools (and poisoned copies) and queries."""
    lanes = len(lengths)
    n_pages = lanes * max_pages + 5
    tables = r.permutation(n_pages)[: lanes * max_pages].reshape(lanes, max_pages).astype(np.int32)
    k, v = make_pool(r, n_pages, hkv, d)
    q = r.standard_normal((lanes, hq, d)).astype(np.float32)
    return tables, k, v, poison(k, tables, lengths), poison(v, tables, lengths), q


@pytest.mark.parametrize(
    "hq,hkv,d,lengths,max_pages,config",
    [
        (4, 2, 32, [1, 64, 65, 300], 6, None),
        (6, 1, 16, [130, 7], 3, paged_attention.DecodeConfig(num_splits=1, pages_per_block=1)),
        (8, 2, 64, [500, 129, 64], 8, paged_attention.DecodeConfig(num_splits=3, pages_per_block=2)),
        (2, 2, 16, [37], 4, paged_attention.DecodeConfig(num_splits=16)),  # more splits than pages
        (16, 2, 32, [700, 3], 24, paged_attention.DecodeConfig(min_pages_per_split=4)),  # 8 queries a head: 6 splits
        (4, 1, 16, [3000, 64, 1], 64, paged_attention.DecodeConfig(num_splits=5)),  # 47, 1, 1 pages over 5 splits
        (32, 2, 16, [129], 4, None),  # 16 queries per KV head: the partials need no spare row
    ],
)
def test_decode_matches_reference(rng, hq, hkv, d, lengths, max_pages, config):
    r, seed = rng
    tables, k, v, kp, vp, q = decode_case(r, hq, hkv, d, lengths, max_pages)
    args = (jnp.asarray(q), jnp.asarray(kp), jnp.asarray(vp), jnp.asarray(tables), jnp.asarray(lengths, jnp.int32))
    out = np.asarray(paged_attention.paged_decode_attention(*args, interpret=True, config=config))
    assert np.isfinite(out).all(), f"seed={seed}: NaN leaked or output unwritten"
    expect = np.asarray(ref.paged_decode_attention_ref(
        jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(tables), jnp.asarray(lengths, jnp.int32)))
    np.testing.assert_allclose(out, expect, rtol=2e-5, atol=2e-5, err_msg=f"seed={seed}")


@pytest.mark.parametrize(
    "hq,hkv,d,lengths,max_pages,config,copies",
    [
        (4, 2, 32, [1, 64, 65, 300], 6, None, 1),
        (8, 2, 16, [700], 24, paged_attention.DecodeConfig(num_splits=13, combine_block=4), 2),  # 4 chunks, 1 ragged
        (6, 2, 16, [130, 7], 3, paged_attention.DecodeConfig(num_splits=1), 1),
    ],
    ids=["lanes", "one-lane-doubled-chunked", "one-split-group-of-3"],
)
def test_gated_decode_merges_the_splits_and_gates_as_float64(rng, hq, hkv, d, lengths, max_pages, config, copies):
    """`paged_decode_attention_gated`: attention times sigmoid(gate), the gate read from its columns of a wider
    projection, each lane's row written `copies` times, against float64 (one or several splits, chunks of the
    combine with a ragged last one, query groups padded to a spare row); compiled too on a GPU."""
    r, seed = rng
    lanes = len(lengths)
    tables, k, v, kp, vp, q = decode_case(r, hq, hkv, d, lengths, max_pages)
    proj = r.standard_normal((lanes, hq * 2 * d + 7)).astype(np.float32)  # head h: its query, then its gate
    out = np.asarray(paged_attention.paged_decode_attention_gated(
        jnp.asarray(q), jnp.asarray(kp), jnp.asarray(vp), jnp.asarray(tables), jnp.asarray(lengths, jnp.int32),
        jnp.asarray(proj), gate_col=d, gate_stride=2 * d, copies=copies, interpret=INTERPRET, config=config))
    gate = proj[:, : hq * 2 * d].reshape(lanes, hq, 2, d)[:, :, 1].astype(np.float64)
    attn = np.stack([attention64(q[b][None].astype(np.float64), k[tables[b]].reshape(-1, hkv, d).astype(np.float64),
                                 v[tables[b]].reshape(-1, hkv, d).astype(np.float64), np.array([n - 1]), n)[0]
                     for b, n in enumerate(lengths)])
    want = (attn / (1 + np.exp(-gate))).reshape(lanes, hq * d)
    assert out.shape == (copies * lanes, hq * d) and np.isfinite(out).all(), f"seed={seed}"
    tol = 1e-5 if INTERPRET else 2e-3  # compiled on a GPU the attention's float32 products are TF32
    np.testing.assert_allclose(out, np.tile(want, (copies, 1)), rtol=tol, atol=tol, err_msg=f"seed={seed}")


def test_gated_decode_writes_the_rows_quantized_as_the_out_projection_reads_them(rng):
    """fp8_out: the gated output's FP8 rows and scales equal `quantize_rows` of the bf16 output (bit for bit in
    interpret mode, to a code's rounding compiled), two 128-groups a head; the 35B-A3B's widths lower for the H200;
    a head of 64 is refused."""
    from pallas_kernels.fp8_matmul import quantize_rows

    r, seed = rng
    hq, hkv, d, lengths = 4, 2, 256, [1, 70, 300]
    tables, _, _, kp, vp, q = decode_case(r, hq, hkv, d, lengths, 5)
    proj = jnp.asarray(r.standard_normal((len(lengths), hq * 2 * d)) * 3, jnp.bfloat16)
    args = (jnp.asarray(q, jnp.bfloat16), jnp.asarray(kp, jnp.bfloat16), jnp.asarray(vp, jnp.bfloat16),
            jnp.asarray(tables), jnp.asarray(lengths, jnp.int32), proj)
    kw = dict(gate_col=d, gate_stride=2 * d, interpret=INTERPRET)
    rows = paged_attention.paged_decode_attention_gated(*args, **kw)
    xq, xs = paged_attention.paged_decode_attention_gated(*args, fp8_out=True, **kw)
    want_q, want_s = quantize_rows(rows)
    assert xq.dtype == jnp.float8_e4m3fn and xq.shape == rows.shape and xs.shape == (hq * d // 128, len(lengths))
    got, want = np.asarray(xq, np.float32), np.asarray(want_q, np.float32)
    if INTERPRET:
        np.testing.assert_array_equal(np.asarray(xs), np.asarray(want_s), err_msg=f"seed={seed}")
        np.testing.assert_array_equal(got, want, err_msg=f"seed={seed}")
    else:  # compiled, the kernel's float32 division may round a code the other way
        np.testing.assert_allclose(np.asarray(xs), np.asarray(want_s), rtol=1e-6, err_msg=f"seed={seed}")
        step = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(want), 2.0**-6))) - 3)  # e4m3's step at each code
        assert (np.abs(got - want) <= step).all() and np.mean(got != want) < 0.05, f"seed={seed}"
    with pytest.raises(ValueError, match="fp8_out"):
        paged_attention.paged_decode_attention_gated(args[0][..., :64], args[1][..., :64], args[2][..., :64],
                                                     *args[3:], fp8_out=True, gate_col=64, gate_stride=128,
                                                     interpret=True)
    lower_for_h200()
    sd, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    text = jax.jit(functools.partial(paged_attention.paged_decode_attention_gated, gate_col=256, gate_stride=512,
                                     fp8_out=True)).trace(
        sd((64, 16, 256), bf), sd((4096, PAGE, 2, 256), bf), sd((4096, PAGE, 2, 256), bf), sd((64, 64), jnp.int32),
        sd((64,), jnp.int32), sd((64, 9216), bf)).lower(lowering_platforms=("cuda",)).as_text()
    assert "paged_decode_combine_fp8" in text


@pytest.mark.parametrize(
    "t,base,hq,hkv,d,config",
    [
        (1, 0, 4, 2, 32, None),
        (17, 5, 4, 2, 32, None),
        (64, 64, 6, 2, 16, None),
        (70, 130, 4, 1, 32, paged_attention.PrefillConfig(block_q=16, pages_per_block=2)),
        (100, 0, 2, 2, 64, paged_attention.PrefillConfig(block_q=32)),
        # the gathered path ("cudnn"; XLA's attention in interpret mode): prefixes of 0, 1 and several segments
        (64, 0, 6, 2, 16, paged_attention.PrefillConfig(impl="cudnn")),
        (17, 5, 4, 2, 32, paged_attention.PrefillConfig(impl="cudnn", cudnn_segment_pages=1)),
        (70, 130, 4, 1, 32, paged_attention.PrefillConfig(impl="cudnn", cudnn_segment_pages=2)),
        (40, 300, 6, 2, 16, paged_attention.PrefillConfig(impl="cudnn", cudnn_segment_pages=1)),
    ],
)
def test_prefill_matches_reference(rng, t, base, hq, hkv, d, config):
    r, seed = rng
    max_pages = (base + t + PAGE - 1) // PAGE + 2  # table longer than the lane: tail entries are junk
    n_pages = max_pages + 4
    table = r.permutation(n_pages)[:max_pages].astype(np.int32)
    k, v = make_pool(r, n_pages, hkv, d)
    kp, vp = poison(k, [table], [base + t]), poison(v, [table], [base + t])
    q = r.standard_normal((t, hq, d)).astype(np.float32)
    out = np.asarray(paged_attention.paged_prefill_attention(
        jnp.asarray(q), jnp.asarray(kp), jnp.asarray(vp), jnp.asarray(table), jnp.int32(base), interpret=True,
        config=config))
    assert np.isfinite(out).all(), f"seed={seed}: NaN leaked or output unwritten"
    pos = base + jnp.arange(t, dtype=jnp.int32)
    expect = np.asarray(ref.paged_attention_ref(
        jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(table), pos, base + t))
    np.testing.assert_allclose(out, expect, rtol=2e-5, atol=2e-5, err_msg=f"seed={seed}")


def test_ops_dispatch_bf16(rng):
    r, seed = rng
    hq, hkv, d, t, base = 4, 2, 32, 40, 90
    k, v = make_pool(r, 6, hkv, d)
    k, v = jnp.asarray(k, jnp.bfloat16), jnp.asarray(v, jnp.bfloat16)
    table = jnp.asarray(r.permutation(6)[:3], jnp.int32)
    q = jnp.asarray(r.standard_normal((t, hq, d)), jnp.bfloat16)
    kc = ops.KernelConfig(backend="pallas", interpret=True)
    got = ops.attention_prefill(kc, q, k, v, table, jnp.int32(base))
    want = ops.attention_prefill(ops.REFERENCE, q, k, v, table, jnp.int32(base))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-2, atol=2e-2, err_msg=f"seed={seed}")
    tables = jnp.stack([table, table[::-1]])
    lengths = jnp.array([130, 64], jnp.int32)
    got = ops.attention_decode(kc, q[:2], k, v, tables, lengths)
    want = ops.attention_decode(ops.REFERENCE, q[:2], k, v, tables, lengths)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-2, atol=2e-2, err_msg=f"seed={seed}")


def test_rejects_bad_inputs():
    with pytest.raises(ValueError, match="pools"):
        paged_attention.paged_decode_attention(jnp.zeros((1, 4, 32)), jnp.zeros((3, 32, 2, 32)),
                                               jnp.zeros((3, 32, 2, 32)), jnp.zeros((1, 2), jnp.int32),
                                               jnp.ones((1,), jnp.int32), interpret=True)
    with pytest.raises(ValueError, match="does not hold 4 gates"):  # the last head's gate past the projection's end
        paged_attention.paged_decode_attention_gated(
            jnp.zeros((1, 4, 32)), jnp.zeros((3, 64, 2, 32)), jnp.zeros((3, 64, 2, 32)), jnp.zeros((1, 2), jnp.int32),
            jnp.ones((1,), jnp.int32), jnp.zeros((1, 255)), gate_col=32, gate_stride=64, interpret=True)
    with pytest.raises(ValueError, match="impl"):
        paged_attention.PrefillConfig(impl="flash")
    with pytest.raises(ValueError, match="by_groups"):
        paged_attention.PrefillConfig(by_groups=True)


def test_prefill_reads_4bit_pools_by_scale_group_by_default():
    """NVFP4 rows dequantized whole cost 5.5x their by-group read; INT8 and FP8 rows 1.5x less whole."""
    cfg = paged_attention.PrefillConfig()
    nvfp4, int8, fp8 = kv_quant.NVFP4_G16, kv_quant.INT8_G64, kv_quant.FP8_ROW256
    assert [cfg.reads_by_groups(f) for f in (None, int8, fp8, nvfp4)] == [False, False, False, True]
    assert [paged_attention.PrefillConfig(by_groups="all").reads_by_groups(f) for f in (None, int8, nvfp4)] == [
        False, True, True]
    assert not paged_attention.PrefillConfig(by_groups="none").reads_by_groups(nvfp4)


def test_decode_reads_int8_pools_as_f16_rows_and_the_rest_by_group_five_stages_deep():
    """On the H100 sweep INT8 read whole rows 1.2x faster than by group and FP8 1.4x slower; five stages beat three
    for FP8 and 4-bit pools."""
    plain = jnp.zeros((1, 64, 1, 32), jnp.bfloat16)
    int8, fp8, nvfp4 = (kv_quant.QuantPages(*kv_quant.quantize(f, plain), f.name)
                        for f in (kv_quant.INT8_G64, kv_quant.FP8_ROW256, kv_quant.NVFP4_G16))
    configs = [paged_attention.default_decode_config(k, v)
               for k, v in ((plain, plain), (int8, int8), (fp8, fp8), (int8, nvfp4), (nvfp4, nvfp4))]
    assert [(c.num_stages, c.dequantize_rows) for c in configs] == [(2, False), (5, True), (5, False), (5, False),
                                                                    (5, False)]
    assert configs[1].f16_keys and configs[1].f16_values


def test_one_lanes_splits_keep_a_minimum_of_pages():
    """Every split's partials are written and combined, reached by the lane's keys or not: a floor of pages per
    split bounds that traffic at one lane and a long max_model_len, and leaves 8 lanes' splits as they were."""
    floor1 = paged_attention.DecodeConfig(min_pages_per_split=1)
    assert floor1.splits(1, 2, 528) == 256  # 512 programs of 2 pages
    cfg = paged_attention.DecodeConfig(min_pages_per_split=8)
    assert cfg.splits(1, 2, 528) == 66
    assert cfg.splits(8, 2, 528) == floor1.splits(8, 2, 528) == 32
    assert cfg.splits(1, 2, 4) == 1
    with pytest.raises(ValueError, match="min_pages_per_split"):
        paged_attention.DecodeConfig(min_pages_per_split=0)


@pytest.mark.parametrize("profile", ["bfloat16", "int8", "fp8", "k8v4", "nvfp4"])  # plain; int8; fp8 rows; e2m1
def test_lowers_to_triton_at_real_shapes(profile):
    lower_for_h200()
    sd = jax.ShapeDtypeStruct
    bf = jnp.bfloat16

    def pools(hkv):
        """Abstract K and V pools of 4096 pages in the profile's layout."""
        return tuple(jax.tree.map(lambda a: sd((4096, *a.shape[1:]), a.dtype),
                                  kv_quant.empty_pool(fmt, (1, PAGE, hkv, 256), bf))
                     for fmt in kv_quant.PROFILES[profile])

    k, v = pools(4)
    text = paged_attention.paged_decode_attention.trace(
        sd((8, 24, 256), bf), k, v, sd((8, 512), jnp.int32), sd((8,), jnp.int32)
    ).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text
    # the transposed products (NVFP4's packed rows are refused), the rows dequantized whole or by scale group; NVFP4
    # rows in f16 (the inline asm)
    packed = profile in ("k8v4", "nvfp4")
    variants = [dict(dequantize_rows=True), dict(dequantize_rows=False)] + (
        [dict(f16_keys=True, f16_values=True)] if packed else [dict(swap_ab=True, dequantize_rows=False)])
    for variant in variants:
        config = dataclasses.replace(paged_attention.default_decode_config(k, v), **variant)
        text = paged_attention.paged_decode_attention.trace(
            sd((8, 24, 256), bf), k, v, sd((8, 512), jnp.int32), sd((8,), jnp.int32), config=config
        ).lower(lowering_platforms=("cuda",)).as_text()
        assert "triton" in text
    if packed:
        with pytest.raises(ValueError, match="not NVFP4's packed rows"):
            paged_attention.paged_decode_attention.trace(
                sd((8, 24, 256), bf), k, v, sd((8, 512), jnp.int32), sd((8,), jnp.int32),
                config=paged_attention.DecodeConfig(swap_ab=True))
    k_35b, v_35b = pools(2)  # 8 queries per KV head: a spare row for the padding
    text = paged_attention.paged_decode_attention.trace(
        sd((1, 16, 256), bf), k_35b, v_35b, sd((1, 528), jnp.int32), sd((1,), jnp.int32)
    ).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text
    for by_groups in ("none", "packed", "all"):  # a quantized pool read whole, by format, by scale group
        config = paged_attention.PrefillConfig(by_groups=by_groups)
        text = paged_attention.paged_prefill_attention.trace(
            sd((2048, 24, 256), bf), k, v, sd((600,), jnp.int32), sd((), jnp.int32), config=config
        ).lower(lowering_platforms=("cuda",)).as_text()
        assert "triton" in text
