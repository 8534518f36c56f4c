"""The tiled MoE layout (`moe.align_rows`, `moe.shared_tiles_layout`) as one Pallas kernel, for wide decode rounds.

XLA builds the layout from a sort, a scatter-add of the counts, cumulative sums, a gather, a scatter and a compare
(about ten kernels a MoE layer); at a 35B-A3B decode round's 512-2048 routed rows that glue is microseconds a layer
of launches and small sorts. Here one program does a counting sort instead, in three passes over chunks:
  1. counts [E] of each expert's rows (a one-hot sum per chunk of rows), their runs padded to BM, and the runs'
     padded ends (a cumulative sum);
  2. each row's slot: its expert's padded start, plus the rows of that expert in earlier chunks (a running count),
     plus those earlier in its own chunk; the row index stored there (a scatter, every slot at most once);
  3. each tile's expert (how many padded runs end at or before its first slot) and the padding slots, and the
     shared expert's tiles after the routed ones.
The stores of passes 2 and 3 land on disjoint slots, so no pass waits on another's writes. The result equals
`align_rows` (with the shared tiles, `shared_tiles_layout`) element for element.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _compat
from pallas_kernels._blocks import next_pow2

SHARED_TILE = 2**30  # a tile's expert for the shared expert's tile (`moe._tile`)


def routed_tiles(rows: int, num_experts: int, block_m: int) -> int:
    """The static bound on the routed rows' tiles: no tile straddles two experts, whatever the routing."""
    return (rows + min(num_experts, rows) * (block_m - 1)) // block_m


def _kernel(ids_ref, rows_ref, tiles_ref, *, num_experts: int, width: int, block_m: int, chunk: int,
            tile_chunk: int, routed: int, shared_tokens: int, pad: int):
    r = ids_ref.shape[0]
    experts = lax.broadcasted_iota(jnp.int32, (1, width), 1)
    lane = lax.broadcasted_iota(jnp.int32, (chunk,), 0)

    def ids_at(c):
        live = c * chunk + lane < r
        return _compat.load(ids_ref.at[c * chunk + lane], mask=live, other=-1), live  # -1: no expert's

    def count(c, counts):
        ids, _ = ids_at(c)
        return counts + jnp.sum((ids[:, None] == experts).astype(jnp.int32), axis=0)

    steps = pl.cdiv(r, chunk)
    counts = lax.fori_loop(0, steps, count, jnp.zeros((width,), jnp.int32))
    padded = (counts + block_m - 1) // block_m * block_m
    end = jnp.cumsum(padded)
    start = end - padded
    earlier = lane[None, :] < lane[:, None]  # [i, j]: j before i in the chunk

    def place(c, seen):
        ids, live = ids_at(c)
        hot = ids[:, None] == experts  # [chunk, width]
        base = jnp.sum(jnp.where(hot, (start + seen)[None, :], 0), axis=1)
        ahead = jnp.sum(((ids[:, None] == ids[None, :]) & earlier).astype(jnp.int32), axis=1)
        # a dead lane's slot past the end: masked on a GPU, dropped by interpret mode's scatter (which writes every
        # lane, a masked one its slot's old value, and would race a live lane on a shared slot)
        dest = jnp.where(live, base + ahead, rows_ref.shape[0])
        _compat.store(rows_ref.at[dest], c * chunk + lane, mask=live)
        return seen + jnp.sum(hot.astype(jnp.int32), axis=0)

    lax.fori_loop(0, steps, place, jnp.zeros((width,), jnp.int32))
    total = routed + pl.cdiv(shared_tokens, block_m)
    tile_lane = lax.broadcasted_iota(jnp.int32, (tile_chunk,), 0)
    slot = lax.broadcasted_iota(jnp.int32, (1, block_m), 1)

    def tiles(c, carry):
        m = c * tile_chunk + tile_lane
        first = m * block_m
        e = jnp.sum((end[None, :] <= first[:, None]).astype(jnp.int32), axis=1)
        used = (e < num_experts) & (m < routed)
        hot = e[:, None] == experts
        offset = first[:, None] + slot - jnp.sum(jnp.where(hot, start[None, :], 0), axis=1)[:, None]
        filled = used[:, None] & (offset < jnp.sum(jnp.where(hot, counts[None, :], 0), axis=1)[:, None])
        shared = m >= routed
        value = jnp.where(shared[:, None], r + jnp.minimum((m - routed)[:, None] * block_m + slot, shared_tokens), pad)
        live = m < total
        _compat.store(rows_ref.at[first[:, None] + slot], value, mask=live[:, None] & ~filled)
        _compat.store(tiles_ref.at[m], jnp.where(shared, SHARED_TILE, jnp.where(used, e, -1)), mask=live)
        return carry

    lax.fori_loop(0, pl.cdiv(total, tile_chunk), tiles, 0)


@functools.partial(jax.jit, static_argnames=("num_experts", "block_m", "shared_tokens", "chunk", "num_warps",
                                             "interpret"))
def tile_layout(flat_ids: jax.Array, *, num_experts: int, block_m: int, shared_tokens: int = 0, chunk: int = 64,
                num_warps: int = 8, interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """(tile_expert, sorted_rows) of the R routed rows' experts flat_ids [R]: `align_rows`' layout at block_m, then,
    with shared_tokens T > 0, the shared expert's rows R .. R + T - 1 as ceil(T / block_m) tiles of `SHARED_TILE`
    (padding R + T), as `moe.shared_tiles_layout`; without, padding R. One program (module docstring)."""
    r = flat_ids.shape[0]
    routed = routed_tiles(r, num_experts, block_m)
    total = routed + -(-shared_tokens // block_m)
    kernel = functools.partial(
        _kernel, num_experts=num_experts, width=next_pow2(num_experts), block_m=block_m,
        chunk=min(chunk, next_pow2(r)), tile_chunk=min(64, next_pow2(total)), routed=routed,
        shared_tokens=shared_tokens, pad=r + shared_tokens)
    rows, tiles = pl.pallas_call(
        kernel,
        grid=(1,),
        in_specs=[_compat.full_spec()],
        out_specs=[_compat.full_spec(), _compat.full_spec()],
        out_shape=(jax.ShapeDtypeStruct((total * block_m,), jnp.int32), jax.ShapeDtypeStruct((total,), jnp.int32)),
        compiler_params=_compat.triton_params(num_warps, 1),
        interpret=interpret,
        name="moe_tile_layout",
    )(flat_ids.astype(jnp.int32))
    return tiles, rows
