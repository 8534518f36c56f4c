"""The attention mixer's decode step from its qkv projection to the attention kernel's inputs, as one kernel.

For one token of each of B lanes, from the projection's output proj [B, Hq 2D + 2 Hkv D] (each query head's q then
its output gate, then the keys, then the values):

    q_h = rope(rms_norm(q_h) (1 + q_norm))           for each query head h      -> q [B, Hq, D]
    k_j = rope(rms_norm(k_j) (1 + k_norm)), v_j      for each KV head j         -> written into the page pools at
                                                                                    the lane's position

which `ninfer_jax.model.qwen3_5._attn_decode` otherwise composes from about nine XLA kernels per attention layer of a
decode round (the norms' reductions, RoPE's concatenates, the two scatters into the pools): that composition is the
reference (tests/kernels/test_attn_decode_qkv.py). RoPE is NeoX rotate-half on the first `rotary_dim` dims, at
frequencies `inv_freq` and the lane's integer position, with cos and sin rounded to the activations' dtype as the
model rounds them; norms are computed in float32 and rounded to the activations' dtype.

One program per (lane, head): query heads first, then KV heads. A head's D values are read in power-of-two pieces
(the rotated halves, then the rest) since Triton's blocks are powers of two. The pools are updated in place (alias
them through a donated jit argument, as the engine's decode step does); an inactive lane writes nothing. The output
gate stays in proj for the caller. The engine runs it with the Pallas kernels (`KernelConfig.fuse_attn_qkv`): it
makes a one-lane decode round shorter, in fewer kernels (docs/kernels_notes.md).

A quantized pool (`kv_quant.QuantPages`) is written as `kv_quant.quantize` writes it, from the same scale and code
functions: each group's largest magnitude by masked reductions over the pieces, its scale, the codes piece by
piece, and the scales as one small vector. An NVFP4 row is read in mirrored pieces (those of [0, D/2), then the
same ones shifted by D/2), so each byte's two codes sit at one position of two pieces.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _compat, kv_quant
from pallas_kernels._blocks import is_pow2
from pallas_kernels.reference import PAGE

_F32 = jnp.float32


def _pieces(start: int, stop: int) -> list[tuple[int, int]]:
    """[start, stop) as (offset, size) pieces of power-of-two sizes, largest first."""
    out, offset = [], start
    while offset < stop:
        size = 1 << ((stop - offset).bit_length() - 1)
        out.append((offset, size))
        offset += size
    return out


def _mirrored(pieces: list[tuple[int, int]], d: int) -> list[tuple[int, int]]:
    """Pieces of [0, D/2), then the same shifted by D/2: an NVFP4 byte's two codes at one position of two pieces."""
    return pieces + [(o + d // 2, n) for o, n in pieces]


def _write_row(refs, fmt, page, row, j, xs: dict, spans, d: int):
    """One token's row of one KV head, xs {piece offset: f32 values}, into a pool's planes: as they are (plain), or
    quantized as `kv_quant.quantize` does it."""
    if fmt is None:
        for o, n in spans:
            refs[0][page, row, j, pl.ds(o, n)] = xs[o].astype(refs[0].dtype)
        return
    g = fmt.group_of(d)
    groups = range(d // g)

    def overlaps(gi, o, n):
        return o < (gi + 1) * g and o + n > gi * g

    def in_group(gi, o, n):
        cols = o + jnp.arange(n, dtype=jnp.int32)
        return (cols >= gi * g) & (cols < (gi + 1) * g)

    scales = []
    for gi in groups:
        parts = [jnp.max(jnp.where(in_group(gi, o, n), jnp.abs(xs[o]), 0.0)) for o, n in spans if overlaps(gi, o, n)]
        scales.append(kv_quant.scale_for(fmt, functools.reduce(jnp.maximum, parts)).astype(_F32))
    codes = {}
    for o, n in spans:
        per_col = sum(jnp.where(in_group(gi, o, n), scales[gi], 0.0) for gi in groups if overlaps(gi, o, n))
        codes[o] = kv_quant.encode(fmt, kv_quant.divide(xs[o], per_col))
    for o, n in spans:
        if not fmt.packed:
            refs[0][page, row, j, pl.ds(o, n)] = codes[o]
        elif o < d // 2:
            refs[0][page, row, j, pl.ds(o, n)] = codes[o] | (codes[o + d // 2] << 4)
    ids = jnp.arange(len(groups), dtype=jnp.int32)
    refs[1][page, row, j, pl.ds(0, len(groups))] = sum(jnp.where(ids == gi, scales[gi], 0.0)
                                                      for gi in groups).astype(fmt.scale_dtype)


def _kernel(positions_ref, rope_ref, tables_ref, active_ref, proj_ref, q_norm_ref, k_norm_ref, inv_freq_ref, *refs,
            num_heads: int, num_kv_heads: int, rotary_dim: int, eps: float, k_fmt, v_fmt):
    # positions_ref, rope_ref, active_ref: [B] int32 (where the key goes, where it rotates to); tables_ref:
    # [B, max_pages] int32; proj_ref: [B, Hq 2D + 2 Hkv D];
    # q_norm_ref, k_norm_ref: [D]; inv_freq_ref: [rotary_dim / 2] f32; refs: the K pool's planes and the V pool's
    # [P, 64, Hkv, *] (aliased with the outputs after q), q (out) [B, Hq, D], then the K and V planes (out)
    n_k, n_v = (1 if f is None else 2 for f in (k_fmt, v_fmt))
    q_ref = refs[n_k + n_v]
    k_refs, v_refs = refs[n_k + n_v + 1:][:n_k], refs[n_k + n_v + 1:][n_k:]
    b, h = pl.program_id(0), pl.program_id(1)
    d = q_ref.shape[2]
    act = proj_ref.dtype
    half = rotary_dim // 2
    pos = positions_ref[b]
    freqs = rope_ref[b].astype(_F32) * inv_freq_ref[...]
    cos, sin = (f.astype(act).astype(_F32) for f in (jnp.cos(freqs), jnp.sin(freqs)))

    def normed_and_rotated(offset, norm_ref, packed=False):
        """The head at proj columns [offset, offset + D): {piece offset: values in the activations' dtype}, and the
        pieces (mirrored halves if packed)."""
        spans = [(0, half), (half, half)]
        spans = _mirrored(spans + _pieces(rotary_dim, d // 2), d) if packed else spans + _pieces(rotary_dim, d)
        rest = spans[2:]
        xs = {o: proj_ref[b, pl.ds(offset + o, n)].astype(_F32) for o, n in spans}
        inv = jax.lax.rsqrt(sum(jnp.sum(x * x) for x in xs.values()) / d + eps)
        ys = {o: (xs[o] * inv * (1.0 + norm_ref[pl.ds(o, n)].astype(_F32))).astype(act).astype(_F32) for o, n in spans}
        x1, x2 = ys[0], ys[half]
        out = {0: x1 * cos - x2 * sin, half: x2 * cos + x1 * sin} | {o: ys[o] for o, _ in rest}
        return {o: v.astype(act) for o, v in out.items()}, spans

    @pl.when(h < num_heads)
    def _():
        values, spans = normed_and_rotated(h * 2 * d, q_norm_ref)
        for o, n in spans:
            q_ref[b, h, pl.ds(o, n)] = values[o]

    @pl.when((h >= num_heads) & (active_ref[b] != 0))
    def _():
        j = h - num_heads
        page, row = tables_ref[b, pos // PAGE], pos % PAGE
        values, spans = normed_and_rotated(num_heads * 2 * d + j * d, k_norm_ref, k_fmt is not None and k_fmt.packed)
        _write_row(k_refs, k_fmt, page, row, j, {o: v.astype(_F32) for o, v in values.items()}, spans, d)
        v0 = num_heads * 2 * d + num_kv_heads * d + j * d
        spans = _mirrored(_pieces(0, d // 2), d) if v_fmt is not None and v_fmt.packed else _pieces(0, d)
        xs = {o: proj_ref[b, pl.ds(v0 + o, n)].astype(_F32) for o, n in spans}
        _write_row(v_refs, v_fmt, page, row, j, xs, spans, d)


def supported(head_dim: int, rotary_dim: int, k_pages=None) -> bool:
    """Whether the kernel takes these head shapes: the rotated halves a power of two (each is one block), within
    the row's first half for an NVFP4 K pool (its pieces mirror that half)."""
    half = rotary_dim // 2
    packed = kv_quant.format_of(k_pages) is not None and kv_quant.format_of(k_pages).packed
    return rotary_dim % 2 == 0 and is_pow2(half) and rotary_dim <= (head_dim // 2 if packed else head_dim)


@functools.partial(jax.jit, static_argnames=("num_heads", "num_kv_heads", "rotary_dim", "eps", "interpret"))
def attn_decode_qkv(proj, q_norm, k_norm, inv_freq, positions, page_tables, active, k_pages, v_pages,
                    rope_positions=None, *, num_heads: int, num_kv_heads: int, rotary_dim: int, eps: float,
                    interpret: bool = False):
    """Normalised, rotated queries [B, Hq, D] in proj's dtype, and the pools with each active lane's new key and value
    written at its position (page_tables[b, position // 64], row position % 64).

    Args:
      proj: [B, Hq 2D + 2 Hkv D], the qkv projection's output whole (slicing it first would cost a copy each: XLA
        copies a custom call's sliced operand).
      q_norm, k_norm: [D] zero-centred norm weights. inv_freq: [rotary_dim / 2] float32 RoPE frequencies.
      positions: [B] int32; page_tables: [B, max_pages] int32; active: [B] bool.
      k_pages, v_pages: [P, 64, Hkv, D], plain or `kv_quant.QuantPages` (updated in place; donate them).
      rope_positions: [B] int32, the positions q and k rotate to (None: `positions`); after an image they run
        ahead of the KV positions by the prompt's MRoPE delta.
    """
    lanes = proj.shape[0]
    d = k_pages.shape[3]
    if (proj.shape[1] != num_heads * 2 * d + 2 * num_kv_heads * d or k_pages.shape != v_pages.shape
            or k_pages.shape[1:3] != (PAGE, num_kv_heads) or q_norm.shape != (d,) or k_norm.shape != (d,)
            or inv_freq.shape != (rotary_dim // 2,) or not supported(d, rotary_dim, k_pages)):
        raise ValueError(f"attn_decode_qkv: proj {proj.shape}, pools {k_pages.shape}, norms {q_norm.shape} / "
                         f"{k_norm.shape}, inv_freq {inv_freq.shape} do not hold {num_heads} query heads and "
                         f"{num_kv_heads} KV heads of {d} with a rotary dim {rotary_dim} of power-of-two halves")
    if (positions.shape != (lanes,) or active.shape != (lanes,) or page_tables.ndim != 2
            or page_tables.shape[0] != lanes):
        raise ValueError(f"attn_decode_qkv: positions {positions.shape}, active {active.shape}, page_tables "
                         f"{page_tables.shape} must be per lane ({lanes})")
    rope_positions = positions if rope_positions is None else rope_positions
    planes = kv_quant.planes(k_pages) + kv_quant.planes(v_pages)
    n_k = len(kv_quant.planes(k_pages))
    q, *planes = pl.pallas_call(
        functools.partial(_kernel, num_heads=num_heads, num_kv_heads=num_kv_heads, rotary_dim=rotary_dim, eps=eps,
                          k_fmt=kv_quant.format_of(k_pages), v_fmt=kv_quant.format_of(v_pages)),
        grid=(lanes, num_heads + num_kv_heads),
        in_specs=[_compat.full_spec()] * (8 + len(planes)),
        out_specs=[_compat.full_spec()] * (1 + len(planes)),
        out_shape=[jax.ShapeDtypeStruct((lanes, num_heads, d), proj.dtype)]
                  + [jax.ShapeDtypeStruct(p.shape, p.dtype) for p in planes],
        input_output_aliases={8 + i: 1 + i for i in range(len(planes))},
        compiler_params=_compat.triton_params(2, 1),
        interpret=interpret,
        name="attn_decode_qkv",
    )(positions.astype(jnp.int32), rope_positions.astype(jnp.int32), page_tables.astype(jnp.int32),
      active.astype(jnp.int32), proj, q_norm, k_norm,
      inv_freq.astype(_F32), *planes)
    return q, kv_quant.with_planes(k_pages, planes[:n_k]), kv_quant.with_planes(v_pages, planes[n_k:])
