"""Paged GQA attention over 64-token KV pages: prefill (a chunk of queries, causal) and decode (split-K).

Implements the contracts of `ninfer_jax.model.ops.attention_prefill` / `attention_decode`. The KV pool
layout is fixed: `[P, 64, Hkv, D]` per layer for K and for V; a lane's logical block b lives in page
`page_table[b]`. Kernels gather page rows by index arrays read inside the kernel (Triton has no scalar
prefetch): row r of a key block of `pages_per_block` pages is token r % 64 of page
`table[first + r // 64]`.

  decode: one program per (lane, KV head, split of the lane's pages: its kv length's pages spread evenly over the
    splits, so a short context still runs many programs). The program holds the whole query
    group of its KV head (padded to 16 rows for the matrix units), runs an online softmax over its pages
    and writes (o, max, sum) partials of the group's real rows (the padding rows share one spare row);
    a small jnp combine merges the splits (flash-decoding), or one kernel that also applies the attention's output
    gate (`paged_decode_attention_gated`).
  prefill: one program per (block of queries, query head), flash attention over the lane's keys
    [0, base + T): blocks wholly below the causal diagonal without a mask, the rest masked by absolute
    position. `PrefillConfig.impl = "cudnn"` instead runs cuDNN flash attention (GPU only) on gathered keys:
    the chunk's own (causal), then the prefix in fixed segments of pages (no mask), merged by log-sum-exp.

Keys at or past the valid length are never loaded (masked loads), so stale or poisoned pool rows cannot
leak into the softmax. Outputs are float32.

A pool may be quantized (`kv_quant.QuantPages`, a KV storage profile): the kernels read its value and scale planes
for the rows of each key block and dequantize them there, into the queries' dtype, so no full-precision copy of a
pool exists; a plain pool is read as it is, the queries rounded to its dtype.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import _compat, kv_quant
from pallas_kernels._blocks import is_pow2
from pallas_kernels.fp8_matmul import BLOCK as FP8_GROUP
from pallas_kernels.fp8_matmul import group_scale
from pallas_kernels.reference import PAGE

_F32 = jnp.float32
_NEG = -1e30  # finite "minus infinity": masked scores; never produces inf - inf
_MIN_ROWS = 16  # Triton dots need sides >= 16


def _dot_nt(a, b):
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=_F32)


def dot(a, b):
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=_F32)


@dataclasses.dataclass(frozen=True)
class _Pools:
    """How a kernel reads its K and V pools: their formats (None: plain) and plane counts, static."""

    k_fmt: kv_quant.Format | None
    v_fmt: kv_quant.Format | None

    @staticmethod
    def of(k_pages, v_pages) -> _Pools:
        return _Pools(kv_quant.format_of(k_pages), kv_quant.format_of(v_pages))

    @property
    def num_k(self) -> int:
        return 1 if self.k_fmt is None else 2

    @property
    def num_planes(self) -> int:
        return self.num_k + (1 if self.v_fmt is None else 2)

    def split(self, refs):
        """The kernel's plane refs -> (K refs, V refs, the rest)."""
        k, n = self.num_k, self.num_planes
        return refs[:k], refs[k:n], refs[n:]

    def compute_dtype(self, k_refs, q_dtype):
        """The products' operand dtype: a plain K pool's, else the queries'."""
        return k_refs[0].dtype if self.k_fmt is None else q_dtype


def _zero(ref):
    """The fill of a masked load from `ref`: Triton casts no integer constant to fp8, so a float one for float
    planes."""
    return 0.0 if jnp.issubdtype(ref.dtype, jnp.floating) else 0


def _load_rows(refs, fmt, page, row, kvh, d, valid, mask_keys, dtype):
    """Rows (page[i], row[i], kvh) [BK, D] of one pool, dequantized to `dtype` if quantized (plain: as stored)."""
    cols = jnp.arange(d, dtype=jnp.int32)

    def load(ref, c):
        idx = (page[:, None], row[:, None], kvh, c[None, :])
        if not mask_keys:
            return ref[idx]
        return _compat.load(ref.at[idx], mask=valid[:, None], other=_zero(ref))

    if fmt is None:
        return load(refs[0], cols)
    raw = load(refs[0], kv_quant.value_col(fmt, cols, d))
    scales = load(refs[1], cols // fmt.group_of(d))
    return kv_quant.decode(fmt, raw, scales, cols[None, :], d).astype(dtype)


def _key_block(page_of, first_page, n_valid_pages, kv_len, pages_per_block):
    """Rows of pages [first_page, first_page + pages_per_block) of one lane: (page ids, rows in their pages, key
    positions, key valid), each [BK]. page_of: logical block indices [BK] -> page ids [BK] (a gathered load of the
    lane's page table)."""
    r = jnp.arange(pages_per_block * PAGE, dtype=jnp.int32)
    logical = first_page + r // PAGE
    pos = logical * PAGE + r % PAGE
    return page_of(logical), r % PAGE, pos, (logical < n_valid_pages) & (pos < kv_len)


def _softmax_update(m, l, s, valid, keys: int = 1):
    """The running max and denominator after scores s [R, BK] (already masked; [BK, R] with keys=0), with the factor
    alpha [R] that rescales what was accumulated and the probabilities p (s's shape); valid: broadcasts to s, or
    None."""
    m_new = jnp.maximum(m, jnp.max(s, axis=keys))
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(s - jnp.expand_dims(m_new, keys))
    if valid is not None:
        p = jnp.where(valid, p, 0.0)
    return m_new, l * alpha + jnp.sum(p, axis=keys), alpha, p


# --------------------------------------------------------------------------------------------------
# Decode: split-K over the lane's pages.
# --------------------------------------------------------------------------------------------------


def _column_groups(fmt: kv_quant.Format | None, d: int, whole: bool = False) -> list[tuple[int, int]]:
    """How decode reads a pool's rows: (first column, width) of each scale group of an INT8 or FP8 pool, the two
    halves of an NVFP4 row (the low and the high nibbles of the same bytes), the whole row of a plain pool or, with
    `whole` (`DecodeConfig.dequantize_rows`), of an INT8 or FP8 pool (static). NVFP4's groups of 16 columns, each a
    dot of its own, measured 5x slower than dequantizing whole rows (docs/kernels_notes.md)."""
    if fmt is None or whole and not fmt.packed:
        return [(0, d)]
    if fmt.packed:
        return [(0, d // 2), (d // 2, d // 2)]
    g = fmt.group_of(d)
    return [(c, g) for c in range(0, d, g)]


def _operand_dtype(fmt: kv_quant.Format | None, q_dtype, pool_dtype, side: str, f16_keys=False, f16_values=False,
                   whole=False):
    """The dtype of a pool's products: a plain pool's own; float16 for FP8 keys when the queries are 16-bit (e4m3
    -> f16 is one packed conversion a pair, -> bf16 three), and for INT8 keys (`f16_keys`) or INT8 / FP8 values
    (`f16_values`), NVFP4 keys or values likewise (their rows dequantized in f16 by `_E2M1_TO_F16_ASM`); else the
    queries' (a float32 query keeps every product exact, as the interpret tests need). Codes are exact in f16 either
    way, and so are NVFP4's values times their e4m3 scales (6 significant bits, 2^-10 to 2688); f16 values carry the
    probabilities times scales in 11 bits instead of bf16's 8, their range kept by `_F16_VALUE_SHIFT`. INT8 and FP8
    `whole` rows are float16 by the same flags (codes times scales rounded to 11 bits, not 8), else the queries'."""
    if fmt is None:
        return pool_dtype
    if jnp.dtype(q_dtype).itemsize != 2:
        return q_dtype
    if whole and not fmt.packed:
        return jnp.float16 if (f16_keys if side == "k" else f16_values) else q_dtype
    if side == "k" and (fmt is kv_quant.FP8_ROW256 or f16_keys) or side == "v" and f16_values:
        return jnp.float16
    return q_dtype


# INT8 codes -> float16, exactly, four a 32-bit register by byte permutes instead of an int -> float conversion a
# code (those issue at a quarter of the ALU rate): x ^ 0x80 is x + 128 as an unsigned byte; under the high byte
# 0x64 it is the f16 1024 + x + 128, and subtracting 1152 (0x6480) leaves x.
_S8_TO_F16_ASM = """{
.reg .b32 t, hi, m;
xor.b32 t, $2, 0x80808080;
mov.b32 hi, 0x64646464;
mov.b32 m, 0x64806480;
prmt.b32 $0, t, hi, 0x5140;
prmt.b32 $1, t, hi, 0x7362;
sub.f16x2 $0, $0, m;
sub.f16x2 $1, $1, m;
}"""


def _e2m1_to_f16_asm(nibble: int) -> str:
    """Inline PTX: four bytes of NVFP4 codes (a byte holds columns j and j + D/2 in its low and high nibbles) -> the
    four values of their low (nibble 0) or high (1) nibbles in float16, exactly, two a register. Every e2m1 value's
    f16 has a zero low byte, so one byte permute looks up two codes' high bytes in the table of the eight magnitudes
    (their magnitude bits as its selectors) and puts them in the halves' high bytes, and one logic op ORs in the codes'
    signs, which a second permute moved to bits 15 and 31; the low nibbles are first shifted into the high ones. About
    2.4 instructions a code, against 3.5 for placing the bits by shifts and masks and multiplying by 2^14, and about
    11 for `kv_quant.e2m1_bf16`'s integer ops. (One program a nibble: jax's Pallas-Triton lowering of an asm with two
    results fails.)"""
    src = "$2" if nibble else "x"
    lines = [] if nibble else ["shl.b32 x, $2, 4;"]
    lines += ["mov.b32 lo, 0x3e3c3800;", "mov.b32 hi, 0x46444240;", "mov.b32 sgn, 0x80008000;"]
    for out, signs in ((0, "0x1100"), (1, "0x3322")):  # codes of bytes 0-1, then 2-3
        if out:
            lines.append(f"shr.b32 w, {src}, 16;")
        lines += [f"and.b32 i, {'w' if out else src}, 0x7070;", "prmt.b32 m, lo, hi, i;",
                  f"prmt.b32 s, {src}, {src}, {signs};", f"lop3.b32 ${out}, m, s, sgn, 0xf8;"]  # m | (s & sgn)
    return "{\n.reg .b32 x, lo, hi, sgn, w, i, m, s;\n" + "\n".join(lines) + "\n}"


_E2M1_TO_F16_ASM = (_e2m1_to_f16_asm(0), _e2m1_to_f16_asm(1))


# f16 values: the probabilities (<= 1) times the values' scales are taken times 2^8 before rounding to f16, and the
# output times 2^-8 (exact), so that small scales stay in f16's normal range: p x s underflows only below
# s = 2.4e-7 (a group whose largest magnitude is under 3e-5 for INT8, 1e-4 for FP8). s x 2^8 is clamped to f16's
# largest finite value, reached only by magnitudes over 32,512 (INT8) or 114,688 (FP8).
_F16_VALUE_SHIFT = 256.0
_F16_MAX = float(jnp.finfo(jnp.float16).max)


def _scores(qs, ks, product, by_key):
    """Scores summed over the keys' column groups: each group's product of queries and keys, times the keys'
    scales (`by_key` lays a [BK] vector along the scores' key axis) when the group has them."""
    s = None
    for q, (k, k_scale) in zip(qs, ks):
        part = product(q, k)
        part = part if k_scale is None else part * by_key(k_scale)
        s = part if s is None else s + part
    return s


def _weights(p, v_scale, v_shift: bool, by_key, dtype):
    """The probabilities a value group's product takes: times its scales when it has them (shifted by
    `_F16_VALUE_SHIFT` with f16 values), in the values' dtype."""
    if v_shift:
        v_scale = jnp.minimum(v_scale * _F16_VALUE_SHIFT, _F16_MAX)
    return (p if v_scale is None else p * by_key(v_scale)).astype(dtype)


def _unshifted(out, v_shift: bool):
    """A sum of `_weights`' products back at the values' scale."""
    return out * (1.0 / _F16_VALUE_SHIFT) if v_shift else out


def _bytes_to_f16(asm_text: str, codes):
    """One inline PTX conversion of byte codes to float16 values, an output per code: four codes (one 32-bit
    register) in, their four values (two registers) out."""
    (out,) = pltriton.elementwise_inline_asm(
        asm_text, args=[codes], constraints="=r,=r,r", pack=4,
        result_shape_dtypes=[jax.ShapeDtypeStruct(codes.shape, jnp.float16)])
    return out


def _codes_as(fmt, codes, dtype, asm: bool):
    """INT8 or FP8 codes -> `dtype` (exact): INT8 into float16 by `_S8_TO_F16_ASM` on the GPU (asm), else a cast."""
    if asm and fmt is kv_quant.INT8_G64 and dtype == jnp.float16:
        return _bytes_to_f16(_S8_TO_F16_ASM, codes)
    return codes.astype(dtype)


def _e2m1_halves(codes, dtype, asm: bool):
    """NVFP4 bytes [BK, D/2] -> the values of their low and high nibbles (a row's two halves), exact, in `dtype`: f16
    by `_E2M1_TO_F16_ASM` on the GPU, else by `kv_quant.e2m1_bf16`'s integer ops (a cast to f16 or f32 is exact)."""
    if asm and dtype == jnp.float16:
        return tuple(_bytes_to_f16(text, codes) for text in _E2M1_TO_F16_ASM)
    return tuple(kv_quant.e2m1_bf16(c).astype(dtype) for c in (codes & 15, codes >> 4))


def _fetch(refs, fmt, groups, page, row, kvh, valid, transposed=False, whole=False):
    """The raw planes of rows (page[i], row[i], kvh) for `_decode`, as stored (a flat tuple: it may be carried
    over a loop iteration): each group's values and, for INT8 and FP8, its scales [BK]; an NVFP4 row's bytes
    [BK, D/2] once for both halves, then each half's scales [BK, D/2 / 16]; with `whole`, an INT8 or FP8 row's
    values [BK, D] and scales [BK, D / group]. transposed: values [width, BK] (not with `whole`)."""
    values = refs[0]

    def load(ref, first, width):
        cols = first + jnp.arange(width, dtype=jnp.int32)
        if transposed:
            return _compat.load(ref.at[page[None, :], row[None, :], kvh, cols[:, None]], mask=valid[None, :],
                                other=_zero(ref))
        return _compat.load(ref.at[page[:, None], row[:, None], kvh, cols[None, :]], mask=valid[:, None],
                            other=_zero(ref))

    if fmt is None:
        return tuple(load(values, *grp) for grp in groups)
    scales = refs[1]
    if fmt.packed:
        g = fmt.group_of(2 * groups[0][1])
        return (load(values, 0, groups[0][1]),) + tuple(load(scales, c // g, w // g) for c, w in groups)
    if whole:
        d = groups[0][1]
        return load(values, 0, d), load(scales, 0, d // fmt.group_of(d))
    # the scales' 16-bit loads first, then the values' (the order measured on the H200, docs/kernels_notes.md)
    picks = [_compat.load(scales.at[page, row, kvh, j], mask=valid, other=_zero(scales)) for j in range(len(groups))]
    out = ()
    for grp, pick in zip(groups, picks):
        out += (load(values, *grp), pick)
    return out


def _per_column(s, width: int):
    """Scales [BK, n] -> [BK, width], each over its width / n columns."""
    return jnp.broadcast_to(s[:, :, None], (*s.shape, width // s.shape[1])).reshape(s.shape[0], width)


def _decode(fmt, groups, raw, dtype, asm=False, whole=False):
    """`_fetch`'s planes -> (values [BK, width] in `dtype`, scales [BK] f32 or None) of each group. An INT8 or FP8
    group's values are its codes unscaled (exact: int8 and e4m3 fit bf16 and f16), so the scale multiplies a score
    or a probability instead of every element. An NVFP4 row comes dequantized, exactly: e2m1 times e4m3 is 6
    significant bits, within bf16's 8. With `whole` an INT8 or FP8 row comes dequantized too, its codes times their
    group's scale rounded to `dtype` (in float16 held to its finite range: a magnitude past 65504 saturates)."""
    if fmt is None:
        return [(x, None) for x in raw]
    if fmt.packed:  # byte j holds columns j and j + D/2; bf16 or f16 products of codes and scales are exact
        prod = dtype if jnp.dtype(dtype).itemsize == 2 else jnp.bfloat16
        halves = _e2m1_halves(raw[0], prod, asm)
        return [((x * _per_column(s.astype(prod), width)).astype(dtype), None)
                for x, s, (_, width) in zip(halves, raw[1:], groups)]
    if whole:
        values, s = raw
        x = _codes_as(fmt, values, dtype, asm) * _per_column(s.astype(dtype), groups[0][1])
        return [(jnp.clip(x, -_F16_MAX, _F16_MAX) if dtype == jnp.float16 else x, None)]
    return [(_codes_as(fmt, raw[2 * j], dtype, asm), raw[2 * j + 1].astype(_F32)) for j in range(len(groups))]


def _decode_kernel(
    lengths_ref,  # [B] int32 (whole array)
    tables_ref,  # [B, max_pages] int32 (whole array)
    q_ref,  # [B, Hq, D] (whole array)
    *refs,  # the K pool's planes, the V pool's (whole pools, `_Pools`), then the outputs:
    # o [B, NS, Hkv, G', D] f32 (whole array): unnormalised partial outputs of the group's G query heads
    #   (G' = G + 1 when the group is padded to R rows: row G takes the padding rows)
    # m [B, NS, Hkv, G'] f32: running max of each partial
    # l [B, NS, Hkv, G'] f32: softmax denominator of each partial
    pools: _Pools,
    group: int,
    rows: int,
    num_splits: int,
    pages_per_block: int,
    prefetch: bool,
    f16_keys: bool,
    f16_values: bool,
    swap_ab: bool,
    dequantize_rows: bool,
    asm: bool,
    scale: float,
):
    """An INT8 or FP8 pool is read one scale group at a time: scores are sums of per-group products scaled by the
    keys' scales, and each group of output columns takes the probabilities scaled by the values' scales. No
    dequantized [keys, D] f32 block exists: at 2 pages a block, dequantizing every element ran INT8 at 1% and FP8 at
    8% of the copy rate, the group reads at 43% and 51%. An NVFP4 row's bytes are decoded once into its two halves
    by bit operations, 10x faster than e2m1 arithmetic in f32 (docs/kernels_notes.md). swap_ab: the products
    transposed, keys and values their left operand (scores [BK, R], outputs [width, R]), the query group their right.
    """
    k_refs, v_refs, (o_ref, m_ref, l_ref) = pools.split(refs)
    b, kvh, sp = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    d = q_ref.shape[-1]
    whole = dequantize_rows  # the helpers' name for it
    k_dtype = _operand_dtype(pools.k_fmt, q_ref.dtype, k_refs[0].dtype, "k", f16_keys, f16_values, whole)
    v_dtype = _operand_dtype(pools.v_fmt, q_ref.dtype, v_refs[0].dtype, "v", f16_keys, f16_values, whole)
    # f16 values of a quantized pool: probabilities x scales x 2^8 (`_F16_VALUE_SHIFT`), undone at the end
    v_shift = pools.v_fmt is not None and not pools.v_fmt.packed and not whole and v_dtype == jnp.float16
    length = lengths_ref[b]
    r = jnp.arange(rows, dtype=jnp.int32)
    head_ok = r < group
    heads = kvh * group + jnp.minimum(r, group - 1)
    k_groups, v_groups = _column_groups(pools.k_fmt, d, whole), _column_groups(pools.v_fmt, d, whole)
    keys = 0 if swap_ab else 1  # the keys' axis of the scores and probabilities; the query rows' is the other

    def by_row(x):  # a [R] vector against scores or outputs
        return jnp.expand_dims(x, keys)

    def by_key(x):  # a [BK] vector against scores
        return jnp.expand_dims(x, 1 - keys)

    qs = []
    for first_col, width in k_groups:
        cols = first_col + jnp.arange(width, dtype=jnp.int32)
        idx = (b, heads[None, :], cols[:, None]) if swap_ab else (b, heads[:, None], cols[None, :])
        q = _compat.load(q_ref.at[idx], mask=by_row(head_ok), other=0)  # [R, width], or [width, R]
        qs.append((q.astype(_F32) * scale).astype(k_dtype))

    n_pages = (length + PAGE - 1) // PAGE
    # The lane's own pages spread over the splits (not max_pages'): a short context still uses many programs
    pages_per_split = (n_pages + num_splits - 1) // num_splits
    first = sp * pages_per_split
    last = jnp.minimum(first + pages_per_split, n_pages)
    n_blocks = (jnp.maximum(last - first, 0) + pages_per_block - 1) // pages_per_block
    max_pages = tables_ref.shape[1]

    def page_of(logical):
        return tables_ref[b, jnp.minimum(logical, max_pages - 1)]

    def fetch(i):
        page, row, _, valid = _key_block(page_of, first + i * pages_per_block, last, length, pages_per_block)
        return (_fetch(k_refs, pools.k_fmt, k_groups, page, row, kvh, valid, whole=whole),
                _fetch(v_refs, pools.v_fmt, v_groups, page, row, kvh, valid, transposed=swap_ab, whole=whole))

    def body(i, carry):
        m, l, accs, raw = carry
        if prefetch:  # the next block's loads in flight while this one is computed
            nxt = fetch(i + 1)
        else:
            raw, nxt = fetch(i), None
        valid = _key_block(page_of, first + i * pages_per_block, last, length, pages_per_block)[3]
        s = _scores(qs, _decode(pools.k_fmt, k_groups, raw[0], k_dtype, asm, whole),
                    (lambda q, k: dot(k, q)) if swap_ab else _dot_nt, by_key)
        m, l, alpha, p = _softmax_update(m, l, jnp.where(by_key(valid), s, _NEG), by_key(valid), keys)
        new = []
        for acc, (v, v_scale) in zip(accs, _decode(pools.v_fmt, v_groups, raw[1], v_dtype, asm, whole)):
            w = _weights(p, v_scale, v_shift, by_key, v_dtype)
            new.append(acc * by_row(alpha) + (dot(v, w) if swap_ab else dot(w, v)))
        return m, l, tuple(new), nxt

    init = (jnp.full((rows,), _NEG, _F32), jnp.zeros((rows,), _F32),
            tuple(jnp.zeros((width, rows) if swap_ab else (rows, width), _F32) for _, width in v_groups),
            fetch(0) if prefetch else None)
    m, l, accs, _ = lax.fori_loop(0, n_blocks, body, init)
    # G real rows, then (when padded) one spare row that every padding row lands in (the combine never reads it)
    g = r if rows == o_ref.shape[3] else jnp.minimum(r, group)
    for (first_col, width), acc in zip(v_groups, accs):
        cols = first_col + jnp.arange(width, dtype=jnp.int32)
        idx = (b, sp, kvh, g[None, :], cols[:, None]) if swap_ab else (b, sp, kvh, g[:, None], cols[None, :])
        o_ref[idx] = _unshifted(acc, v_shift)
    m_ref[b, sp, kvh, g] = m
    l_ref[b, sp, kvh, g] = l


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Tuning knobs of paged decode (hashable: a static argument)."""

    num_splits: int | None = None  # splits of the page list; None: enough programs to fill the GPU
    pages_per_block: int = 2  # pages per key block (64 keys each)
    num_warps: int = 4
    num_stages: int = 2
    # quantized pools: load the next key block's planes into registers while this one is computed. Slower than
    # Triton's own pipelining on the H200 (INT8 322 against 286 us, FP8 380 against 252; docs/kernels_notes.md)
    prefetch: bool = False
    # INT8 keys as float16 (codes by byte permutes), and INT8 / FP8 values as float16; NVFP4 keys or values as float16
    # (`_E2M1_TO_F16_ASM`, 1.6-1.9x the bf16 rows decoded code by code on the H200) (`_operand_dtype`)
    f16_keys: bool = False
    f16_values: bool = False
    # keys and values as the products' left operand and the query group as their right (plain, INT8 and FP8 pools),
    # as fp8_matmul's swap AB: the 16-row minimum of a product falls on the group's 6 or 8 queries instead of the
    # keys, and the converted codes are the operand that may stay in registers. Slower for every pool on the H200
    # (fp8 323 against 212 us at 32k x 8 lanes, 3 stages; docs/benchmarks/kv_decode_sweep.md)
    swap_ab: bool = False
    # INT8 and FP8 rows dequantized whole (codes times their group's scale; float16 with f16_keys / f16_values, else
    # the queries' dtype), one product a block as NVFP4's rows, against a product a scale group with the scales on
    # scores and probabilities (`INT8_DECODE_CONFIG`). Not with swap_ab
    dequantize_rows: bool = False
    target_programs: int = 512  # for num_splits=None: aim for this many programs
    # for num_splits=None: no fewer of max_pages per split. Every split writes partials that the combine reads,
    # whether the lane's keys reach it or not: one lane of 2 KV heads with a 33k-token max_model_len took 256
    # splits, 8 MB of partials per layer for a lane of a thousand keys (docs/kernels_notes.md)
    min_pages_per_split: int = 4
    # splits a program of the gated combine (`paged_decode_attention_gated`) merges at once: 32 x D = 256 floats of
    # partial outputs are 64 a thread on its 4 warps
    combine_block: int = 32

    def __post_init__(self):
        for name in ("pages_per_block", "num_warps", "combine_block"):
            x = getattr(self, name)
            if not is_pow2(x):
                raise ValueError(f"DecodeConfig.{name} must be a power of 2, got {x}")
        if self.num_splits is not None and self.num_splits < 1:
            raise ValueError("DecodeConfig.num_splits must be >= 1")
        if self.num_stages < 1 or self.target_programs < 1 or self.min_pages_per_split < 1:
            raise ValueError("DecodeConfig.num_stages, target_programs and min_pages_per_split must be >= 1")
        if self.swap_ab and self.dequantize_rows:
            raise ValueError("DecodeConfig.swap_ab and dequantize_rows do not combine")

    def splits(self, lanes: int, kv_heads: int, max_pages: int) -> int:
        if self.num_splits is not None:
            return min(self.num_splits, max_pages)
        want = -(-self.target_programs // (lanes * kv_heads))
        return max(1, min(want, -(-max_pages // max(self.pages_per_block, self.min_pages_per_split))))


DEFAULT_DECODE_CONFIG = DecodeConfig()
# Quantized pools: one page a block, f16 operands (the fastest of the H200 sweep at 32k x 8 lanes: int8 268 us, fp8 212
# against 482 and 566 at 2 pages, bf16 values; NVFP4 rows to f16 by inline PTX, two codes a register: nvfp4 310 us,
# k8v4 249 against 581 and 428 decoded code by code), and five stages (an H100 sweep at 8k-131k: FP8 1.03-1.07x as
# fast as three, K8V4 1.05-1.17x, NVFP4 1.07-1.10x; docs/benchmarks/kv_decode_sweep.md)
QUANT_DECODE_CONFIG = DecodeConfig(pages_per_block=1, num_stages=5, f16_keys=True, f16_values=True)
# INT8 pools: rows dequantized whole into f16, one product a block against four by scale group: on the H100 241 us
# against 290 by group on three stages (the former default) at 32k x 8 lanes (78% of copy), 922 against 1110 at 131k
# (82%), error 1.9e-4 against 4.2e-4. FP8 rows read that way were 1.4x slower than by group
# (docs/benchmarks/kv_decode_sweep.md)
INT8_DECODE_CONFIG = dataclasses.replace(QUANT_DECODE_CONFIG, dequantize_rows=True)


def default_decode_config(k_pages, v_pages) -> DecodeConfig:
    """The decode config for these pools: DEFAULT_DECODE_CONFIG for plain ones, INT8_DECODE_CONFIG when the quantized
    ones are INT8, else QUANT_DECODE_CONFIG."""
    formats = {kv_quant.format_of(pages) for pages in (k_pages, v_pages)} - {None}
    if not formats:
        return DEFAULT_DECODE_CONFIG
    return INT8_DECODE_CONFIG if formats == {kv_quant.INT8_G64} else QUANT_DECODE_CONFIG


def _combine_splits(o, m, l):
    """Merge flash-decoding partials over axis 1: o [B, NS, Hkv, G, D], m/l [B, NS, Hkv, G]."""
    m_all = jnp.max(m, axis=1, keepdims=True)
    w = jnp.exp(m - m_all)
    num = jnp.sum(o * w[..., None], axis=1)
    den = jnp.sum(l * w, axis=1)
    return num / den[..., None]


def _paged_decode_call(q, k_pages, v_pages, page_tables, kv_lengths, *, config, interpret):
    lanes, hq, d = q.shape
    hkv = k_pages.shape[2]
    pools = _Pools.of(k_pages, v_pages)
    if config.swap_ab and any(f is not None and f.packed for f in (pools.k_fmt, pools.v_fmt)):
        raise ValueError("DecodeConfig.swap_ab reads plain, INT8 and FP8 pools, not NVFP4's packed rows")
    group = hq // hkv
    rows = max(_MIN_ROWS, pl.next_power_of_2(group))
    stored = group if rows == group else group + 1  # the partials' rows: the group's, and a spare for the padding
    max_pages = page_tables.shape[1]
    n_splits = config.splits(lanes, hkv, max_pages)
    pages_per_block = min(config.pages_per_block, pl.next_power_of_2(-(-max_pages // n_splits)))
    full = _compat.full_spec()
    o, m, l = pl.pallas_call(
        functools.partial(
            _decode_kernel,
            pools=pools,
            group=group,
            rows=rows,
            num_splits=n_splits,
            pages_per_block=pages_per_block,
            prefetch=config.prefetch and (pools.k_fmt is not None or pools.v_fmt is not None),
            f16_keys=config.f16_keys,
            f16_values=config.f16_values,
            swap_ab=config.swap_ab,
            dequantize_rows=config.dequantize_rows,
            asm=not interpret,
            scale=d**-0.5,
        ),
        grid=(lanes, hkv, n_splits),
        # lengths, tables, q, the pools' planes: whole arrays; pages gathered by table lookups in-kernel
        in_specs=[full] * (3 + pools.num_planes),
        out_specs=[full] * 3,  # partials written at [lane, split, kv head]
        out_shape=[
            jax.ShapeDtypeStruct((lanes, n_splits, hkv, stored, d), _F32),
            jax.ShapeDtypeStruct((lanes, n_splits, hkv, stored), _F32),
            jax.ShapeDtypeStruct((lanes, n_splits, hkv, stored), _F32),
        ],
        compiler_params=_compat.triton_params(config.num_warps, config.num_stages),
        interpret=interpret,
        name="paged_decode_attention",
    )(kv_lengths, page_tables, q, *kv_quant.planes(k_pages), *kv_quant.planes(v_pages))
    return o, m, l


def _combine_kernel(o_ref, m_ref, l_ref, gate_ref, *out_refs, group: int, num_splits: int, block_s: int,
                    gate_col: int, gate_stride: int, dtype, fp8_out: bool):
    # o_ref [B, NS, Hkv, G', D], m_ref / l_ref [B, NS, Hkv, G'] f32: the decode kernel's partials
    # gate_ref [B, P]: head h's gate at columns gate_col + h gate_stride (the qkv projection's output, read in place)
    # out_refs: out [C, B, Hq D], program (b, h) writing head h's gated output into each of the C copies of row b;
    # or with fp8_out xq [B, Hq D] float8_e4m3fn and xs [Hq D / 128, B] f32, that output's 128-groups quantized as
    # `fp8_matmul.quantize_rows` quantizes them
    b, h = pl.program_id(0), pl.program_id(1)
    kvh, g = h // group, h % group
    d = o_ref.shape[-1]
    cols = jnp.arange(d, dtype=jnp.int32)

    def stats(first):
        splits = first + jnp.arange(block_s, dtype=jnp.int32)
        live = splits < num_splits
        return (splits, live, _compat.load(m_ref.at[b, splits, kvh, g], mask=live, other=_NEG),
                _compat.load(l_ref.at[b, splits, kvh, g], mask=live, other=0.0))

    chunks = -(-num_splits // block_s)
    # the largest max first, then each chunk's weights exp(m - max), as `_combine_splits` takes them
    m_all = lax.fori_loop(0, chunks, lambda c, mx: jnp.maximum(mx, jnp.max(stats(c * block_s)[2])),
                          jnp.full((), _NEG, _F32))

    def body(c, carry):
        num, den = carry
        splits, live, m, l = stats(c * block_s)
        w = jnp.exp(m - m_all)
        o = _compat.load(o_ref.at[b, splits[:, None], kvh, g, cols[None, :]], mask=live[:, None], other=0.0)
        return num + jnp.sum(o * w[:, None], axis=0), den + jnp.sum(l * w)

    num, den = lax.fori_loop(0, chunks, body, (jnp.zeros((d,), _F32), jnp.zeros((), _F32)))
    gate = gate_ref[b, pl.ds(gate_col + h * gate_stride, d)]
    # the roundings of `_attn_gated`'s XLA ops: the output and the sigmoid each in the gate's dtype, then their product
    y = ((num / den).astype(dtype).astype(_F32) * jax.nn.sigmoid(gate.astype(_F32)).astype(dtype).astype(_F32))
    if not fp8_out:
        (out_ref,) = out_refs
        for c in range(out_ref.shape[0]):
            out_ref[c, b, pl.ds(h * d, d)] = y.astype(dtype)
        return
    xq_ref, xs_ref = out_refs
    yf = y.astype(dtype).astype(_F32)  # the rows as the out-projection would read them
    group_of = cols // FP8_GROUP
    scale = jnp.zeros((d,), _F32)
    for i in range(d // FP8_GROUP):  # a head's few groups by masks: no reshape of the row in Triton
        s_i = group_scale(jnp.where(group_of == i, yf, 0.0))  # the group's values alone: zeros add nothing
        xs_ref[h * (d // FP8_GROUP) + i, b] = s_i
        scale = jnp.where(group_of == i, s_i, scale)
    xq_ref[b, pl.ds(h * d, d)] = (yf / scale).astype(xq_ref.dtype)


def _combine_gated(o, m, l, gate_source, *, group: int, gate_col: int, gate_stride: int, copies: int, block: int,
                   fp8_out: bool, interpret):
    lanes, num_splits, hkv, _, d = o.shape
    block_s = min(pl.next_power_of_2(num_splits), block)
    width = hkv * group * d
    out_shape = ([jax.ShapeDtypeStruct((lanes, width), jnp.float8_e4m3fn),
                  jax.ShapeDtypeStruct((width // FP8_GROUP, lanes), _F32)] if fp8_out else
                 [jax.ShapeDtypeStruct((copies, lanes, width), gate_source.dtype)])
    out = pl.pallas_call(
        functools.partial(_combine_kernel, group=group, num_splits=num_splits, block_s=block_s, gate_col=gate_col,
                          gate_stride=gate_stride, dtype=gate_source.dtype, fp8_out=fp8_out),
        grid=(lanes, hkv * group),
        out_shape=out_shape,
        compiler_params=_compat.triton_params(4, 1),
        interpret=interpret,
        name="paged_decode_combine_fp8" if fp8_out else "paged_decode_combine",
    )(o, m, l, gate_source)
    return tuple(out) if fp8_out else out[0].reshape(copies * lanes, width)


def _check_pool(q, k_pages, v_pages):
    if k_pages.shape != v_pages.shape or len(k_pages.shape) != 4 or k_pages.shape[1] != PAGE:
        raise ValueError(f"K/V pools must both be [P, {PAGE}, Hkv, D], got {k_pages.shape}, {v_pages.shape}")
    hq, d = q.shape[-2], q.shape[-1]
    hkv = k_pages.shape[2]
    if k_pages.shape[3] != d or hq % hkv:
        raise ValueError(f"q heads/dim {q.shape[-2:]} do not fit the pool's {k_pages.shape[2:]}")
    if not is_pow2(d, 16):
        raise ValueError(f"head dim must be a power of 2 >= 16, got {d}")


@functools.partial(jax.jit, static_argnames=("interpret", "config"))
def paged_decode_attention(q, k_pages, v_pages, page_tables, kv_lengths, *, interpret=False, config=None):
    """One query per lane over its pages, split over the context (flash-decoding).

    Args:
      q: [B, Hq, D]; k_pages, v_pages: [P, 64, Hkv, D], plain or `kv_quant.QuantPages`;
      page_tables: [B, max_pages] int32;
      kv_lengths: [B] int32 >= 1, valid keys per lane (the query sits at kv_lengths - 1; its key is
        already written).
      interpret: run the Pallas interpreter (CPU tests). config: `DecodeConfig` (None: `default_decode_config`).
    Returns:
      [B, Hq, D] float32.
    """
    o, m, l = _partials(q, k_pages, v_pages, page_tables, kv_lengths,
                        config or default_decode_config(k_pages, v_pages), interpret)
    group = q.shape[1] // k_pages.shape[2]
    o, m, l = o[:, :, :, :group], m[:, :, :, :group], l[:, :, :, :group]  # slices fused into the combine
    return _combine_splits(o, m, l).reshape(q.shape)  # [B, Hkv, group, D] -> [B, Hq, D]


@functools.partial(jax.jit, static_argnames=("gate_col", "gate_stride", "copies", "fp8_out", "interpret", "config"))
def paged_decode_attention_gated(q, k_pages, v_pages, page_tables, kv_lengths, gate_source, *, gate_col: int,
                                 gate_stride: int, copies: int = 1, fp8_out: bool = False, interpret=False,
                                 config=None):
    """`paged_decode_attention` times sigmoid(gate), its splits merged by a kernel that applies the gate too (one
    kernel in place of XLA's three for the merge and one for the gate).

    Args:
      q, k_pages, v_pages, page_tables, kv_lengths: as `paged_decode_attention`'s.
      gate_source: [B, P] in the activations' dtype; head h's gate [D] at columns gate_col + h gate_stride (read in
        place: a slice handed to a kernel would be a copy).
      copies: each lane's row written this many times in a row block of its own ([C B, Hq D]): 2 hands a one-lane
        out-projection the two rows `qwen3_5.dot` would concatenate.
      fp8_out: the rows as an FP8 x FP8 out-projection reads them instead, quantized per token and 128-group in
        gate_source's dtype's values (D a multiple of 128, one copy).
    Returns:
      [copies B, Hq D] in gate_source's dtype; with fp8_out `fp8_matmul.quantize_rows`' pair of those rows (xq [B,
      Hq D] float8_e4m3fn, xs [Hq D / 128, B] float32).
    """
    lanes, hq, d = q.shape
    if (gate_source.ndim != 2 or gate_source.shape[0] != lanes
            or gate_col + (hq - 1) * gate_stride + d > gate_source.shape[1] or copies < 1):
        raise ValueError(f"paged_decode_attention_gated: gate_source {gate_source.shape} does not hold {hq} gates of "
                         f"{d} from column {gate_col} every {gate_stride} for {lanes} lanes (copies {copies})")
    if fp8_out and (d % FP8_GROUP or copies != 1):
        raise ValueError(f"paged_decode_attention_gated: fp8_out needs a head dim that is a multiple of {FP8_GROUP} "
                         f"and one copy, got {d} and {copies}")
    config = config or default_decode_config(k_pages, v_pages)
    o, m, l = _partials(q, k_pages, v_pages, page_tables, kv_lengths, config, interpret)
    return _combine_gated(o, m, l, gate_source, group=hq // k_pages.shape[2], gate_col=gate_col,
                          gate_stride=gate_stride, copies=copies, block=config.combine_block, fp8_out=fp8_out,
                          interpret=interpret)


def _partials(q, k_pages, v_pages, page_tables, kv_lengths, config, interpret):
    """The decode kernel's flash-decoding partials (o, m, l) after the arguments' checks."""
    _check_pool(q, k_pages, v_pages)
    if page_tables.ndim != 2 or page_tables.shape[0] != q.shape[0] or kv_lengths.shape != (q.shape[0],):
        raise ValueError(f"page_tables {page_tables.shape} / kv_lengths {kv_lengths.shape} do not match q {q.shape}")
    return _paged_decode_call(q, k_pages, v_pages, page_tables.astype(jnp.int32), kv_lengths.astype(jnp.int32),
                              config=config, interpret=interpret)


# --------------------------------------------------------------------------------------------------
# Prefill: causal flash attention of a chunk of queries over the lane's pages.
# --------------------------------------------------------------------------------------------------


def _prefill_kernel(
    base_ref,  # [1] int32: absolute position of query 0
    table_ref,  # [max_pages] int32 (whole array)
    q_ref,  # [T, Hq, D] (whole array)
    *refs,  # the K pool's planes, the V pool's (whole pools, `_Pools`), then the output
    # o [T (+1 trash row in interpret mode), Hq, D] f32 (whole array)
    pools: _Pools,
    t_len: int,
    group: int,
    block_q: int,
    pages_per_block: int,
    by_groups: tuple[bool, bool],
    asm: bool,
    scale: float,
):
    """by_groups (K, V): that quantized pool read as decode reads it (`_fetch`, `_decode`): INT8 or FP8 codes a scale
    group at a time, their scales on the scores and probabilities, NVFP4 rows as two halves in f16 (inline PTX on
    the GPU), the products in f16 (`_operand_dtype` with f16 keys and values). Else its key and value blocks are
    dequantized whole into the queries' dtype (`_load_rows`)."""
    k_refs, v_refs, (o_ref,) = pools.split(refs)
    qb, h = pl.program_id(0), pl.program_id(1)
    kvh = h // group
    d = q_ref.shape[-1]
    base = base_ref[0]
    bk = pages_per_block * PAGE
    qi = qb * block_q + jnp.arange(block_q, dtype=jnp.int32)
    q_ok = qi < t_len
    q_rows = jnp.minimum(qi, t_len - 1)
    q_pos = base + qi
    kv_len = base + t_len
    n_pages = (kv_len + PAGE - 1) // PAGE
    # Key blocks wholly at or before the block's first query need no mask; the rest reach its last one.
    max_pages = table_ref.shape[0]

    def page_of(logical):
        return table_ref[jnp.minimum(logical, max_pages - 1)]

    n_full = (base + qb * block_q + 1) // bk
    n_total = (base + jnp.minimum(qb * block_q + block_q, t_len) + bk - 1) // bk
    k_by_groups, v_by_groups = by_groups

    def read_as(fmt, refs, side, grouped):  # a side's operand dtype and column groups
        if not grouped:
            return pools.compute_dtype(k_refs, q_ref.dtype), [(0, d)]
        return _operand_dtype(fmt, q_ref.dtype, refs[0].dtype, side, True, True), _column_groups(fmt, d)

    k_dtype, k_groups = read_as(pools.k_fmt, k_refs, "k", k_by_groups)
    v_dtype, v_groups = read_as(pools.v_fmt, v_refs, "v", v_by_groups)
    v_shift = v_by_groups and not pools.v_fmt.packed and v_dtype == jnp.float16
    qs = []
    for first_col, width in k_groups:
        cols = first_col + jnp.arange(width, dtype=jnp.int32)
        q = _compat.load(q_ref.at[q_rows[:, None], h, cols[None, :]], mask=q_ok[:, None], other=0)
        qs.append((q.astype(_F32) * scale).astype(k_dtype))

    def blocks(j, mask_keys):
        """Key block j as [(K values, K scales or None)] and [(V values, V scales or None)] by column group, with
        its key positions and validity."""
        page, row, pos, valid = _key_block(page_of, j * pages_per_block, n_pages, kv_len, pages_per_block)

        def side(refs, fmt, grouped, groups, dtype):
            if not grouped:
                return [(_load_rows(refs, fmt, page, row, kvh, d, valid, mask_keys, dtype), None)]
            return _decode(fmt, groups, _fetch(refs, fmt, groups, page, row, kvh, valid), dtype, asm)

        return (side(k_refs, pools.k_fmt, k_by_groups, k_groups, k_dtype),
                side(v_refs, pools.v_fmt, v_by_groups, v_groups, v_dtype), pos, valid)

    def by_key(x):  # a [BK] vector against scores [block_q, BK]
        return x[None, :]

    def step(carry, ks, vs, visible):
        m, l, accs = carry
        s = _scores(qs, ks, _dot_nt, by_key)
        if visible is not None:
            s = jnp.where(visible, s, _NEG)
        m, l, alpha, p = _softmax_update(m, l, s, visible)
        new = []
        for acc, (v, v_scale) in zip(accs, vs):
            new.append(acc * alpha[:, None] + dot(_weights(p, v_scale, v_shift, by_key, v_dtype), v))
        return m, l, tuple(new)

    def unmasked(j, carry):
        ks, vs, _, _ = blocks(j, False)
        return step(carry, ks, vs, None)

    def masked(j, carry):
        ks, vs, pos, valid = blocks(j, True)
        return step(carry, ks, vs, valid[None, :] & (pos[None, :] <= q_pos[:, None]))

    carry = (jnp.full((block_q,), _NEG, _F32), jnp.zeros((block_q,), _F32),
             tuple(jnp.zeros((block_q, width), _F32) for _, width in v_groups))
    carry = lax.fori_loop(0, n_full, unmasked, carry)
    _, l, accs = lax.fori_loop(n_full, n_total, masked, carry)
    denom = jnp.where(l > 0, l, 1.0)[:, None]
    rows = jnp.where(q_ok, qi, t_len)  # masked lanes never store; interpret mode has a trash row
    for (first_col, width), acc in zip(v_groups, accs):
        cols = first_col + jnp.arange(width, dtype=jnp.int32)
        out = _unshifted(acc / denom, v_shift)
        _compat.store(o_ref.at[rows[:, None], h, cols[None, :]], out, mask=q_ok[:, None])


@dataclasses.dataclass(frozen=True)
class PrefillConfig:
    """Tuning knobs of paged prefill attention (hashable: a static argument)."""

    # "pallas", or "cudnn": gathered pages through cuDNN flash attention (GPU only)
    impl: str = "pallas"
    # 128 queries on 8 warps: the fastest tile of the H200 sweep (docs/benchmarks/kernels.md), also in the engine's
    # prefill (docs/kernels_notes.md)
    block_q: int = 128
    pages_per_block: int = 1  # pages per key block (64 keys each)
    num_warps: int = 8
    num_stages: int = 2
    cudnn_segment_pages: int = 128  # impl "cudnn": prefix keys gathered per cuDNN call (8192 keys)
    # which quantized pools are read as decode reads them (`_prefill_kernel`): "packed" (4-bit: NVFP4, K8V4's V),
    # "all" or "none". Whole-block dequantization decodes e2m1 by integer arithmetic: an NVFP4 prefix took 5.5x
    # the by-group time, while INT8 and FP8 run 1.45-1.6x faster whole (docs/benchmarks/kernels.md)
    by_groups: str = "packed"

    def __post_init__(self):
        if self.impl not in ("pallas", "cudnn"):
            raise ValueError(f"PrefillConfig.impl must be 'pallas' or 'cudnn', got {self.impl!r}")
        for name in ("block_q", "pages_per_block", "num_warps", "cudnn_segment_pages"):
            x = getattr(self, name)
            if not is_pow2(x):
                raise ValueError(f"PrefillConfig.{name} must be a power of 2, got {x}")
        if self.block_q < _MIN_ROWS:
            raise ValueError(f"PrefillConfig.block_q must be >= {_MIN_ROWS}, got {self.block_q}")
        if self.num_stages < 1:
            raise ValueError("PrefillConfig.num_stages must be >= 1")
        if self.by_groups not in ("packed", "all", "none"):
            raise ValueError(f"PrefillConfig.by_groups must be 'packed', 'all' or 'none', got {self.by_groups!r}")

    def reads_by_groups(self, fmt: kv_quant.Format | None) -> bool:
        """Whether a pool of this format is read by scale group (a plain pool never is)."""
        return fmt is not None and (self.by_groups == "all" or self.by_groups == "packed" and fmt.packed)


def _paged_prefill_call(q, k_pages, v_pages, page_table, base, *, config, interpret):
    t_len, hq, d = q.shape
    hkv = k_pages.shape[2]
    block_q = min(config.block_q, max(_MIN_ROWS, pl.next_power_of_2(t_len)))
    pools = _Pools.of(k_pages, v_pages)
    full = _compat.full_spec()
    o = pl.pallas_call(
        functools.partial(
            _prefill_kernel,
            pools=pools,
            t_len=t_len,
            group=hq // hkv,
            block_q=block_q,
            pages_per_block=config.pages_per_block,
            by_groups=(config.reads_by_groups(pools.k_fmt), config.reads_by_groups(pools.v_fmt)),
            asm=not interpret,
            scale=d**-0.5,
        ),
        grid=(pl.cdiv(t_len, block_q), hq),
        # base, page table, q, the pools' planes: whole arrays; query rows and pages gathered in-kernel
        in_specs=[full] * (3 + pools.num_planes),
        out_specs=full,  # rows of the query block, masked to [0, T)
        out_shape=jax.ShapeDtypeStruct((t_len + 1 if interpret else t_len, hq, d), _F32),
        compiler_params=_compat.triton_params(config.num_warps, config.num_stages),
        interpret=interpret,
        name="paged_prefill_attention",
    )(base.reshape(1), page_table, q, *kv_quant.planes(k_pages), *kv_quant.planes(v_pages))
    return o[:t_len] if interpret else o


def _flash_attention(q, k, v, causal, implementation, kv_len=None):
    """jax.nn's attention ("cudnn" or "xla") of q [1, T, Hq, D] over k, v [1, S, Hkv, D], the first kv_len keys
    if given -> (o [1, T, Hq, D] f32, log-sum-exp [1, T, Hq] f32)."""
    lengths = {} if kv_len is None else dict(
        query_seq_lengths=jnp.full((1,), q.shape[1], jnp.int32), key_value_seq_lengths=kv_len.reshape(1))
    o, lse = jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=implementation,
                                          return_residual=True, **lengths)
    return o.astype(_F32), lse.astype(_F32)


def _merge(a, b):
    """Two partial attentions (o, lse) over disjoint key sets -> the attention over their union."""
    (oa, la), (ob, lb) = a, b
    m = jnp.maximum(la, lb)
    wa, wb = jnp.exp(la - m), jnp.exp(lb - m)
    return (oa * wa[..., None] + ob * wb[..., None]) / (wa + wb)[..., None], m + jnp.log(wa + wb)


def _paged_prefill_gathered(q, k_pages, v_pages, page_table, base, segment_pages, implementation):
    """jax.nn flash attention (cuDNN on the GPU) on gathered keys: the chunk's own rows (causal), then the prefix
    [0, base) in segments of `segment_pages` pages (no mask; the last one cut by its length), merged by
    log-sum-exp. Only the segments the prefix reaches are gathered, so the cost follows the lane's length, not
    its page table's; gathered rows past the prefix are zeroed, so stale pool rows never reach the products. A
    quantized pool's gathered rows are dequantized to the queries' dtype, a segment at a time."""
    t_len, hq, d = q.shape
    hkv = k_pages.shape[2]
    qb = q.astype(q.dtype if isinstance(k_pages, kv_quant.QuantPages) else k_pages.dtype)[None]
    pos = base + jnp.arange(t_len, dtype=jnp.int32)
    rows = (page_table[jnp.minimum(pos // PAGE, page_table.shape[0] - 1)], pos % PAGE)

    def take(pool, index):
        return kv_quant.take(pool, index, qb.dtype)

    acc = _flash_attention(qb, take(k_pages, rows)[None], take(v_pages, rows)[None], True, implementation)
    seg = segment_pages * PAGE
    table = jnp.pad(page_table, (0, -page_table.shape[0] % segment_pages))

    def prefix_segment(i, acc):
        pages = lax.dynamic_slice_in_dim(table, i * segment_pages, segment_pages)
        n = jnp.minimum(base - i * seg, seg)
        keep = (jnp.arange(seg) < n)[None, :, None, None]
        k = jnp.where(keep, take(k_pages, pages).reshape(1, seg, hkv, d), 0)
        v = jnp.where(keep, take(v_pages, pages).reshape(1, seg, hkv, d), 0)
        return _merge(acc, _flash_attention(qb, k, v, False, implementation, n))

    o, _ = lax.fori_loop(0, (base + seg - 1) // seg, prefix_segment, acc)
    return o[0]


@functools.partial(jax.jit, static_argnames=("interpret", "config"))
def paged_prefill_attention(q, k_pages, v_pages, page_table, base, *, interpret=False, config=None):
    """Queries at absolute positions [base, base + T) attend causally over the lane's pages.

    Args:
      q: [T, Hq, D]; k_pages, v_pages: [P, 64, Hkv, D] (plain or `kv_quant.QuantPages`) with the chunk's own
      keys already written;
      page_table: [max_pages] int32 (entries past the lane's length may be any valid page id);
      base: int32 scalar >= 0.
      interpret: run the Pallas interpreter (CPU tests); impl "cudnn" then runs XLA's attention instead.
      config: `PrefillConfig` (None: defaults).
    Returns:
      [T, Hq, D] float32. Query i sees key j iff j <= base + i.
    """
    config = config or PrefillConfig()
    _check_pool(q, k_pages, v_pages)
    if page_table.ndim != 1:
        raise ValueError(f"page_table must be [max_pages], got {page_table.shape}")
    base = jnp.asarray(base, jnp.int32)
    page_table = page_table.astype(jnp.int32)
    if config.impl == "cudnn":
        return _paged_prefill_gathered(q, k_pages, v_pages, page_table, base, config.cudnn_segment_pages,
                                       "xla" if interpret else "cudnn")
    return _paged_prefill_call(q, k_pages, v_pages, page_table, base, config=config, interpret=interpret)
