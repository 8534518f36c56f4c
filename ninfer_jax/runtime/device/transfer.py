"""The Host tier's transfer programs: page bundles and state images as raw uint32 words in the slab layout.

A page bundle is, for every attention layer in forward order, its K page's planes then its V page's (one plane
for a plain pool; values then scales for a quantized one, `kv_quant`), so a page moves as its bytes lie; a state
image is, for every GDN layer in forward order, its ssm row then its conv row, cut into rows of one slab. The
gathers' output is what `HostTier` copies into the slabs; the scatters take the slabs' rows back into the donated pools.
The runner jits these (`ModelRunner.enable_host_transfers`); tests and benchmarks call them directly.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import kv_quant

# Rows travel as uint32 words: byte-wise (uint8) gathers ran as slow fusions on the GPU
# (docs/benchmarks/prefix_cache.md).
WORD_BYTES = 4


def as_words(x):
    """[n, ...] of any dtype -> its raw bytes as uint32 words [n, words per row] (a bitcast, no conversion; the
    bytes in memory order, so a host view of the words as uint8 is the rows' bytes). A row's bytes must be a
    whole number of words."""
    n, itemsize = x.shape[0], jnp.dtype(x.dtype).itemsize
    flat = x.reshape(n, -1)
    if flat.shape[1] * itemsize % WORD_BYTES:
        raise ValueError(f"a row of {flat.shape[1] * itemsize} B is not a whole number of {WORD_BYTES}-byte words")
    if x.dtype == jnp.uint32:
        return flat
    if itemsize < WORD_BYTES:  # bitcast takes a trailing axis of the narrower items
        flat = flat.reshape(n, -1, WORD_BYTES // itemsize)
    return jax.lax.bitcast_convert_type(flat, jnp.uint32).reshape(n, -1)


def from_words(w, like):
    """uint32 [n, words per row] -> [n, *like.shape[1:]] of like.dtype (the inverse of as_words)."""
    shape = (w.shape[0],) + tuple(like.shape[1:])
    itemsize = jnp.dtype(like.dtype).itemsize
    if itemsize > WORD_BYTES:
        w = w.reshape(w.shape[0], -1, itemsize // WORD_BYTES)
    return jax.lax.bitcast_convert_type(w, like.dtype).reshape(shape)


def words_per_row(pool) -> int:
    """Words of one row (one page, or one slot) of a pool."""
    return math.prod(pool.shape[1:]) * jnp.dtype(pool.dtype).itemsize // WORD_BYTES


def _canonical_heads(plane, kv_order):
    """A KV plane's shape and dtype with the canonical heads on its head axis (the Host's layout; `spmd.kv_order`:
    the pool's own, one copy per device)."""
    if kv_order is None:
        return plane
    heads = int(np.max(kv_order)) + 1
    return jax.ShapeDtypeStruct((*plane.shape[:2], heads, *plane.shape[3:]), plane.dtype)


def gather_pages(k_pages, v_pages, pages, kv_order=None):
    """Page bundles of `pages` [B]: per attention layer in order, its K page's planes then its V page's, as
    words. kv_order: the pools' head axis on a mesh that copies KV heads (`spmd.kv_order`), of which each head's
    first copy is taken, as the Host keeps the canonical heads."""
    firsts = None if kv_order is None else np.unique(kv_order, return_index=True)[1]
    parts = []
    for k, v in zip(k_pages, v_pages):
        for plane in kv_quant.planes(k) + kv_quant.planes(v):
            rows = plane[pages] if firsts is None else plane[pages][:, :, firsts]
            parts.append(as_words(rows))
    return jnp.concatenate(parts, axis=1)  # [B, bundle words]


def scatter_pages(k_pages, v_pages, pages, rows, kv_order=None):
    """Host rows [B, >= bundle words] (the gather_pages layout) into `pages`; out-of-range pages are dropped.
    kv_order: as gather_pages', each canonical head written to every copy of it."""
    offset, ks, vs = 0, [], []
    for k, v in zip(k_pages, v_pages):
        for pool, out in ((k, ks), (v, vs)):
            planes = []
            for plane in kv_quant.planes(pool):
                canonical = _canonical_heads(plane, kv_order)
                width = words_per_row(canonical)
                page = from_words(rows[:, offset:offset + width], canonical)
                if kv_order is not None:
                    page = page[:, :, kv_order]
                planes.append(plane.at[pages].set(page, mode="drop"))
                offset += width
            out.append(kv_quant.with_planes(pool, planes))
    return tuple(ks), tuple(vs)


def gather_slot(ssm, conv, slot, *, rows: int, row_words: int, conv_order=None):
    """State slot `slot` as words: per GDN layer in order, its ssm row then its conv row, padded and cut into
    `rows` rows of `row_words` (the image's packed byte o lands in row o // (4 * row_words)). conv_order: the conv
    pool's channel order on a mesh (`spmd.conv_order`), put back to the canonical one, as the Host keeps it."""
    parts = []
    inverse = None if conv_order is None else np.argsort(conv_order)
    for s, c in zip(ssm, conv):
        row = c[slot] if inverse is None else c[slot][..., inverse]
        parts += [as_words(s[slot][None])[0], as_words(row[None])[0]]
    flat = jnp.concatenate(parts)
    return jnp.pad(flat, (0, rows * row_words - flat.shape[0])).reshape(rows, row_words)


def scatter_slot(ssm_pools, conv_pools, slot, rows, conv_order=None):
    """Host rows (the gather_slot layout) into state slot `slot`; an out-of-range slot is dropped. conv_order: as
    gather_slot's, the canonical channels put in the pool's order."""
    flat, offset = rows.reshape(-1), 0
    ssm, conv = [], []
    for s, c in zip(ssm_pools, conv_pools):
        for pool, out in ((s, ssm), (c, conv)):
            width = words_per_row(pool)
            row = from_words(flat[None, offset:offset + width], pool)[0]
            if pool is c and conv_order is not None:
                row = row[..., conv_order]
            out.append(pool.at[slot].set(row, mode="drop"))
            offset += width
    return tuple(ssm), tuple(conv)
