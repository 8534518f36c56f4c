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
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _compat
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


def _kernel(positions_ref, tables_ref, active_ref, proj_ref, q_norm_ref, k_norm_ref, inv_freq_ref, k_in_ref, v_in_ref,
            q_ref, k_ref, v_ref, *, num_heads: int, num_kv_heads: int, rotary_dim: int, eps: float):
    # positions_ref, active_ref: [B] int32; tables_ref: [B, max_pages] int32; proj_ref: [B, Hq 2D + 2 Hkv D];
    # q_norm_ref, k_norm_ref: [D]; inv_freq_ref: [rotary_dim / 2] f32; k_in_ref / v_in_ref: the pools [P, 64, Hkv, D]
    # (aliased with k_ref / v_ref); q_ref (out): [B, Hq, D]
    del k_in_ref, v_in_ref  # the same buffers as k_ref, v_ref
    b, h = pl.program_id(0), pl.program_id(1)
    d = q_ref.shape[2]
    act = proj_ref.dtype
    half = rotary_dim // 2
    pos = positions_ref[b]
    freqs = pos.astype(_F32) * inv_freq_ref[...]
    cos, sin = (f.astype(act).astype(_F32) for f in (jnp.cos(freqs), jnp.sin(freqs)))
    rest = _pieces(rotary_dim, d)

    def normed_and_rotated(offset, norm_ref):
        """The head at proj columns [offset, offset + D): {piece offset: values in the activations' dtype}."""
        spans = [(0, half), (half, half)] + rest
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
        values, spans = normed_and_rotated(num_heads * 2 * d + j * d, k_norm_ref)
        for o, n in spans:
            k_ref[page, row, j, pl.ds(o, n)] = values[o].astype(k_ref.dtype)
        v0 = num_heads * 2 * d + num_kv_heads * d + j * d
        for o, n in _pieces(0, d):
            v_ref[page, row, j, pl.ds(o, n)] = proj_ref[b, pl.ds(v0 + o, n)].astype(v_ref.dtype)


def supported(head_dim: int, rotary_dim: int) -> bool:
    """Whether the kernel takes these head shapes: the rotated halves a power of two (each is one block)."""
    half = rotary_dim // 2
    return rotary_dim % 2 == 0 and is_pow2(half) and rotary_dim <= head_dim


@functools.partial(jax.jit, static_argnames=("num_heads", "num_kv_heads", "rotary_dim", "eps", "interpret"))
def attn_decode_qkv(proj, q_norm, k_norm, inv_freq, positions, page_tables, active, k_pages, v_pages, *,
                    num_heads: int, num_kv_heads: int, rotary_dim: int, eps: float, interpret: bool = False):
    """Normalised, rotated queries [B, Hq, D] in proj's dtype, and the pools with each active lane's new key and value
    written at its position (page_tables[b, position // 64], row position % 64).

    Args:
      proj: [B, Hq 2D + 2 Hkv D], the qkv projection's output whole (slicing it first would cost a copy each: XLA
        copies a custom call's sliced operand).
      q_norm, k_norm: [D] zero-centred norm weights. inv_freq: [rotary_dim / 2] float32 RoPE frequencies.
      positions: [B] int32; page_tables: [B, max_pages] int32; active: [B] bool.
      k_pages, v_pages: [P, 64, Hkv, D] (updated in place; donate them).
    """
    lanes = proj.shape[0]
    d = k_pages.shape[3]
    if (proj.shape[1] != num_heads * 2 * d + 2 * num_kv_heads * d or k_pages.shape != v_pages.shape
            or k_pages.shape[1:3] != (PAGE, num_kv_heads) or q_norm.shape != (d,) or k_norm.shape != (d,)
            or inv_freq.shape != (rotary_dim // 2,) or not supported(d, rotary_dim)):
        raise ValueError(f"attn_decode_qkv: proj {proj.shape}, pools {k_pages.shape}, norms {q_norm.shape} / "
                         f"{k_norm.shape}, inv_freq {inv_freq.shape} do not hold {num_heads} query heads and "
                         f"{num_kv_heads} KV heads of {d} with a rotary dim {rotary_dim} of power-of-two halves")
    if (positions.shape != (lanes,) or active.shape != (lanes,) or page_tables.ndim != 2
            or page_tables.shape[0] != lanes):
        raise ValueError(f"attn_decode_qkv: positions {positions.shape}, active {active.shape}, page_tables "
                         f"{page_tables.shape} must be per lane ({lanes})")
    q, k_pages, v_pages = pl.pallas_call(
        functools.partial(_kernel, num_heads=num_heads, num_kv_heads=num_kv_heads, rotary_dim=rotary_dim, eps=eps),
        grid=(lanes, num_heads + num_kv_heads),
        in_specs=[_compat.full_spec()] * 9,
        out_specs=[_compat.full_spec()] * 3,
        out_shape=[jax.ShapeDtypeStruct((lanes, num_heads, d), proj.dtype),
                   jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
                   jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype)],
        input_output_aliases={7: 1, 8: 2},
        compiler_params=_compat.triton_params(2, 1),
        interpret=interpret,
        name="attn_decode_qkv",
    )(positions.astype(jnp.int32), page_tables.astype(jnp.int32), active.astype(jnp.int32), proj, q_norm, k_norm,
      inv_freq.astype(_F32), k_pages, v_pages)
    return q, k_pages, v_pages
