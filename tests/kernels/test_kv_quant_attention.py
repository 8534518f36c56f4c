"""Paged attention over quantized KV pools (pallas_kernels.paged_attention with kv_quant.QuantPages), in Pallas
interpret mode on CPU (compiled on a GPU, whose float32 dots are TF32: `F32_TOL`), against a float64 reference of
the quantized format: the planes dequantized in numpy (a decoder of this test's own), then attention in float64.
Rows a lane may not read hold NaN scales, so a read of them shows."""

from __future__ import annotations

import dataclasses
import re

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import kv_quant, paged_attention
from kernel_support import INTERPRET, attention64

PAGE = 64
F32_TOL = 1e-5 if INTERPRET else 2e-3  # float32 queries' products: exact on CPU, 10-bit mantissas on a GPU
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


def dequantize64(pool: kv_quant.QuantPages) -> np.ndarray:
    """float64 [P, 64, Hkv, D] of a quantized pool, from its planes' bytes."""
    values = np.asarray(pool.values.astype(jnp.float32) if pool.values.dtype != jnp.uint8 else pool.values)
    if pool.format.packed:
        values = np.concatenate([E2M1[values & 15], E2M1[values >> 4]], axis=-1)
    scales = np.asarray(pool.scales.astype(jnp.float32)).astype(np.float64)
    d = values.shape[-1]
    return values.astype(np.float64) * np.repeat(scales, d // scales.shape[-1], axis=-1)


def quantized_pool(r, profile_fmt, n_pages, hkv, d, scale):
    x = r.standard_normal((n_pages, PAGE, hkv, d)).astype(np.float32) * scale
    return kv_quant.QuantPages(*kv_quant.quantize(profile_fmt, jnp.asarray(x)), profile_fmt.name)


def poison(pool: kv_quant.QuantPages, tables, lengths) -> kv_quant.QuantPages:
    """NaN scales on every row outside the first lengths[b] rows of each lane's table."""
    keep = np.zeros(pool.scales.shape[:2], bool)
    for table, n in zip(tables, lengths):
        for i, page in enumerate(table):
            keep[page, : max(0, min(PAGE, n - i * PAGE))] = True
    scales = jnp.where(jnp.asarray(keep)[:, :, None, None], pool.scales.astype(jnp.float32), jnp.nan)
    return kv_quant.QuantPages(pool.values, scales.astype(pool.scales.dtype), pool.fmt)


def pools(r, profile, n_pages, hkv, d, v_mag=3.0):
    k_fmt, v_fmt = kv_quant.PROFILES[profile]
    return quantized_pool(r, k_fmt, n_pages, hkv, d, 2.0), quantized_pool(r, v_fmt, n_pages, hkv, d, v_mag)


# Between them the cases read every format as K and as V: INT8 groups, FP8 rows, NVFP4 nibbles; at D 128 an INT8
# row has 2 groups, each read and scaled on its own. The variants: the transposed products and the rows dequantized
# whole (`DecodeConfig.swap_ab`, `dequantize_rows`).
@pytest.mark.parametrize("profile,d,variant", [("int8", 128, None), ("k8v4", 128, None), ("nvfp4", 32, None),
                                               ("int8", 128, "swap_ab"), ("fp8", 64, "swap_ab"),
                                               ("int8", 128, "dequantize_rows"), ("k8v4", 128, "dequantize_rows")])
def test_decode_over_quantized_pages_matches_float64(profile, d, variant):
    r = np.random.default_rng(1)
    hq, hkv, lengths, max_pages = 4, 2, [1, 130, 200], 4
    n_pages = len(lengths) * max_pages + 3
    tables = r.permutation(n_pages)[: len(lengths) * max_pages].reshape(len(lengths), max_pages).astype(np.int32)
    k, v = pools(r, profile, n_pages, hkv, d)
    q = r.standard_normal((len(lengths), hq, d)).astype(np.float32)
    out = np.asarray(paged_attention.paged_decode_attention(
        jnp.asarray(q), poison(k, tables, lengths), poison(v, tables, lengths), jnp.asarray(tables),
        jnp.asarray(lengths, jnp.int32), interpret=INTERPRET,
        config=paged_attention.DecodeConfig(num_splits=2, prefetch=profile != "int8",
                                            **{variant: True} if variant else {})))
    k64, v64 = dequantize64(k), dequantize64(v)
    for b, n in enumerate(lengths):
        kb, vb = k64[tables[b]].reshape(-1, hkv, d), v64[tables[b]].reshape(-1, hkv, d)
        want = attention64(q[b][None].astype(np.float64), kb, vb, np.array([n - 1]), n)[0]
        np.testing.assert_allclose(out[b], want, rtol=F32_TOL, atol=F32_TOL * np.abs(want).max())


# bf16 queries take the GPU's operand dtypes: the pools' default configs (INT8 rows dequantized to float16, FP8 codes as
# float16 with the probabilities times the values' scales in float16 x 2^8; NVFP4 rows in f16), INT8 by scale group
# as FP8 ("groups"), and bf16 INT8 / FP8 operands
# (f16=False): within the rounding of p to 16 bits. Values of magnitude 1e-3 (FP8 scales near 2e-6) check that the
# f16 probabilities times scales keep their precision. D 256, the real head dim, scales the queries by 1/16, exactly.
# Rows dequantized whole (`dequantize_rows`) round each key and value to 16 bits as well as p: in bf16 (f16=False)
# three bf16 roundings, in f16 within the default bound (a bf16 row's error is 2-5x over it).
# NVFP4 rows in f16 (the quantized pools' default) and in bf16 (`bf16_nvfp4`) are exact.
@pytest.mark.parametrize("profile,f16,v_mag,variant", [
    ("fp8", True, 3.0, None), ("fp8", True, 1e-3, None), ("int8", True, 3.0, None), ("int8", False, 3.0, None),
    ("int8", True, 3.0, "groups"), ("int8", False, 3.0, "groups"),
    ("k8v4", True, 3.0, None), ("fp8", True, 1e-3, "swap_ab"), ("int8", True, 3.0, "swap_ab"),
    ("fp8", True, 1e-3, "dequantize_rows"),
    ("nvfp4", True, 3.0, None), ("nvfp4", False, 3.0, "bf16_nvfp4"), ("k8v4", False, 1e-3, "bf16_nvfp4")])
def test_decode_with_bf16_queries_matches_float64(profile, f16, v_mag, variant):
    r = np.random.default_rng(3)
    hq, hkv, d, lengths, max_pages = 4, 2, 256, [70, 200], 4
    n_pages = len(lengths) * max_pages + 1
    tables = r.permutation(n_pages)[: len(lengths) * max_pages].reshape(len(lengths), max_pages).astype(np.int32)
    k, v = pools(r, profile, n_pages, hkv, d, v_mag)
    q = jnp.asarray(r.standard_normal((len(lengths), hq, d)), jnp.bfloat16)
    config = paged_attention.default_decode_config(k, v)
    if variant == "bf16_nvfp4":
        assert k.format.packed or v.format.packed
        config = dataclasses.replace(config, num_splits=2, f16_keys=False, f16_values=False)
    else:  # "groups": INT8 read by scale group, not as its default's whole rows
        changes = {variant: True} if variant in ("swap_ab", "dequantize_rows") else {}
        config = dataclasses.replace(config, num_splits=2, f16_keys=config.f16_keys and f16,
                                     f16_values=config.f16_values and f16,
                                     **{"dequantize_rows": config.dequantize_rows and not variant, **changes})
    out = np.asarray(paged_attention.paged_decode_attention(
        q, k, v, jnp.asarray(tables), jnp.asarray(lengths, jnp.int32), interpret=INTERPRET, config=config))
    k64, v64, q64 = dequantize64(k), dequantize64(v), np.asarray(q.astype(jnp.float32), np.float64)
    for b, n in enumerate(lengths):
        kb, vb = k64[tables[b]].reshape(-1, hkv, d), v64[tables[b]].reshape(-1, hkv, d)
        want = attention64(q64[b][None], kb, vb, np.array([n - 1]), n)[0]
        bound = 3 * 4e-3 if config.dequantize_rows and not f16 else 4e-3  # bf16 rows: three roundings
        np.testing.assert_allclose(out[b], want, rtol=0, atol=bound * np.abs(want).max())


def test_f16_rows_past_its_range_saturate_instead_of_overflowing():
    """INT8 keys of magnitude 1e5 dequantized whole into float16 (largest 65504) read as 65504: finite scores."""
    r = np.random.default_rng(5)
    k, v = pools(r, "int8", 3, 1, 256)
    k = kv_quant.QuantPages(k.values, jnp.full_like(k.scales, 1e5 / 127), k.fmt)
    config = dataclasses.replace(paged_attention.default_decode_config(k, v), dequantize_rows=True)
    q = jnp.asarray(r.standard_normal((1, 2, 256)), jnp.bfloat16)
    out = paged_attention.paged_decode_attention(q, k, v, jnp.asarray([[2, 0]], jnp.int32),
                                                 jnp.asarray([100], jnp.int32), interpret=INTERPRET, config=config)
    assert np.isfinite(np.asarray(out)).all()


# Rows dequantized whole, read by scale group as decode reads them (`by_groups`: INT8's two groups a row at D 32,
# FP8 rows, NVFP4 halves), the default's mix (K8V4: K whole, V by groups), and gathered for cuDNN's path.
@pytest.mark.parametrize("profile,config", [
    (p, paged_attention.PrefillConfig(block_q=16, pages_per_block=2, by_groups="none")) for p in ("fp8", "nvfp4")
] + [(p, paged_attention.PrefillConfig(block_q=16, pages_per_block=2, by_groups="all")) for p in ("int8", "k8v4")]
  + [(p, paged_attention.PrefillConfig(block_q=32)) for p in ("nvfp4", "k8v4")]
  + [("k8v4", paged_attention.PrefillConfig(impl="cudnn", cudnn_segment_pages=1))])  # the gathered path
def test_prefill_over_quantized_pages_matches_float64(profile, config):
    r = np.random.default_rng(2)
    hq, hkv, d, t, base = 4, 2, 32, 40, 100
    max_pages = (base + t + PAGE - 1) // PAGE + 1
    table = r.permutation(max_pages + 3)[:max_pages].astype(np.int32)
    k, v = pools(r, profile, max_pages + 3, hkv, d)
    q = r.standard_normal((t, hq, d)).astype(np.float32)
    out = np.asarray(paged_attention.paged_prefill_attention(
        jnp.asarray(q), poison(k, [table], [base + t]), poison(v, [table], [base + t]), jnp.asarray(table),
        jnp.int32(base), interpret=INTERPRET or config.impl == "cudnn", config=config))  # cuDNN: 16-bit q only
    kb, vb = dequantize64(k)[table].reshape(-1, hkv, d), dequantize64(v)[table].reshape(-1, hkv, d)
    want = attention64(q.astype(np.float64), kb, vb, base + np.arange(t), base + t)
    np.testing.assert_allclose(out, want, rtol=F32_TOL, atol=F32_TOL * np.abs(want).max())



# bf16 queries read by scale group take decode's f16 operands: INT8 and FP8 codes and NVFP4 rows in f16 (exact), the
# probabilities times the values' scales in f16 x 2^8 (values of magnitude 1e-3 check its range), the queries rounded
# to f16: within 16-bit rounding of q and p, decode's bound.
@pytest.mark.parametrize("profile,v_mag", [("int8", 3.0), ("fp8", 1e-3), ("nvfp4", 3.0), ("k8v4", 3.0)])
def test_prefill_by_groups_with_bf16_queries_matches_float64(profile, v_mag):
    r = np.random.default_rng(4)
    hq, hkv, d, t, base = 4, 2, 256, 40, 100
    max_pages = (base + t + PAGE - 1) // PAGE + 1
    table = r.permutation(max_pages + 3)[:max_pages].astype(np.int32)
    k, v = pools(r, profile, max_pages + 3, hkv, d, v_mag)
    q = jnp.asarray(r.standard_normal((t, hq, d)), jnp.bfloat16)
    out = np.asarray(paged_attention.paged_prefill_attention(
        q, poison(k, [table], [base + t]), poison(v, [table], [base + t]), jnp.asarray(table), jnp.int32(base),
        interpret=INTERPRET, config=paged_attention.PrefillConfig(block_q=16, by_groups="all")))
    kb, vb = dequantize64(k)[table].reshape(-1, hkv, d), dequantize64(v)[table].reshape(-1, hkv, d)
    want = attention64(np.asarray(q.astype(jnp.float32), np.float64), kb, vb, base + np.arange(t), base + t)
    np.testing.assert_allclose(out, want, rtol=0, atol=4e-3 * np.abs(want).max())


def run_ptx(asm: str, word: int) -> list[int]:
    """An emulator of the few PTX instructions the kernels' inline conversions use, one instruction at a time: the
    32-bit input word in the last operand, the output registers' words in order."""
    outs = sorted({int(n) for n in re.findall(r"\$(\d+)", asm)})
    regs = {f"${outs[-1]}": word}

    def val(x):
        return int(x, 16) if x.startswith("0x") else int(x) if x.isdigit() else regs[x]

    def halves(w):
        return np.array([w & 0xFFFF, w >> 16], np.uint16).view(np.float16).astype(np.float32)

    def pack(h):
        lo, hi = np.asarray(h, np.float32).astype(np.float16).view(np.uint16)
        return int(lo) | int(hi) << 16

    for line in asm.strip("{}\n").split(";"):
        op, _, rest = line.strip().partition(" ")
        if not op or op.startswith(".reg"):
            continue
        d, *a = [x.strip() for x in rest.split(",")]
        a = [val(x) for x in a]
        if op == "prmt.b32":  # default mode: byte i of d is byte (selector nibble i's low 3 bits) of {a, b}, or
            src = a[0] | a[1] << 32  # with the nibble's bit 3 set, that byte's sign bit copied eight times
            picks = [(src >> 8 * ((a[2] >> 4 * i) & 7)) & 0xFF for i in range(4)]
            picks = [(0xFF if b & 0x80 else 0) if a[2] >> 4 * i & 8 else b for i, b in enumerate(picks)]
            regs[d] = sum(b << 8 * i for i, b in enumerate(picks))
        elif op == "lop3.b32":  # bit i of d is bit (a_i b_i c_i read as 3 bits, a the highest) of the table a[3]
            regs[d] = sum(((a[3] >> (4 * (a[0] >> i & 1) + 2 * (a[1] >> i & 1) + (a[2] >> i & 1))) & 1) << i
                          for i in range(32))
        else:
            regs[d] = {"mov.b32": lambda: a[0], "and.b32": lambda: a[0] & a[1], "or.b32": lambda: a[0] | a[1],
                       "xor.b32": lambda: a[0] ^ a[1], "shl.b32": lambda: (a[0] << a[1]) & 0xFFFFFFFF,
                       "shr.b32": lambda: a[0] >> a[1],
                       "mul.f16x2": lambda: pack(halves(a[0]) * halves(a[1])),
                       "sub.f16x2": lambda: pack(halves(a[0]) - halves(a[1]))}[op]()
    return [regs[f"${i}"] for i in outs[:-1]]


def test_the_inline_ptx_conversions_give_every_codes_exact_value():
    """`_S8_TO_F16_ASM` (INT8 codes) and `_E2M1_TO_F16_ASM` (NVFP4 bytes, low and high nibbles), run by an emulator
    of their instructions over words that put each of the 256 byte values in each of the four bytes: every output
    element equals the code's value (E2M1 from the e2m1 table of this file), in the order the inline asm packs
    them."""
    def f16s(words):
        return np.array(words, np.uint32).view(np.uint16).view(np.float16).astype(np.float64)

    for b in range(256):
        codes = [(b + i * 67) % 256 for i in range(4)]
        word = sum(c << 8 * i for i, c in enumerate(codes))
        got = f16s(run_ptx(paged_attention._S8_TO_F16_ASM, word))
        np.testing.assert_array_equal(got, np.array(codes, np.uint8).view(np.int8), err_msg=f"int8 {codes}")
        got = f16s([w for text in paged_attention._E2M1_TO_F16_ASM for w in run_ptx(text, word)])
        want = [E2M1[c & 15] for c in codes] + [E2M1[c >> 4] for c in codes]
        np.testing.assert_array_equal(got, want, err_msg=f"e2m1 {codes}")
        assert np.signbit(got).tolist() == np.signbit(want).tolist(), f"e2m1 {codes}: the sign of zero"
