"""Gated delta rule decode: one token for each of B lanes, each lane's state slot updated in place.

Implements the contract of `ninfer_jax.model.ops.gdn_decode`. One program per (lane, value head, block of
Dv columns; `program_blocks` picks the block) reads its [Dk, block_v] float32 slice of the lane's state slot,
applies one step

    S <- exp(g) S;   S <- S + k (beta (v - S^T k))^T;   o = S^T q

and writes the slice back into the same slot. The work is a read and a write of the state (64 KiB per
head at Dk = Dv = 128): memory-bound, so the grid is wide (B x Hv x Dv / block_v programs) and the
arithmetic is float32 elementwise work with reductions over Dk, no matrix units. Lanes are independent,
so any B works (tested to 64).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _compat
from pallas_kernels._blocks import is_pow2
from pallas_kernels.gdn_chunk import check_gdn_inputs

_F32 = jnp.float32


def delta_rule_step(s, q, k, v, g, beta):
    """One token of the gated delta rule on a [Dk, Dv'] slice of one head's float32 state (inside a kernel):
    q, k [Dk], v [Dv'], g and beta scalars, all float32. Returns (o [Dv'], the new state slice)."""
    s = s * jnp.exp(g)
    delta = (v - jnp.sum(s * k[:, None], axis=0)) * beta
    s = s + k[:, None] * delta[None, :]
    return jnp.sum(s * q[:, None], axis=0), s


def _decode_kernel(
    slots_ref,  # [B] int32 (whole array)
    q_ref,  # [B, Hk, Dk] (whole array)
    k_ref,  # [B, Hk, Dk] (whole array)
    v_ref,  # [B, Hv, Dv] (whole array)
    g_ref,  # [B, Hv] (whole array)
    beta_ref,  # [B, Hv] (whole array)
    pool_ref,  # [S, Hv, Dk, Dv] f32 (aliased with pool_out_ref)
    o_ref,  # out [B, Hv, Dv] f32 (whole array)
    pool_out_ref,  # out [S, Hv, Dk, Dv] f32, the same buffer as pool_ref
    *,
    group: int,
    block_v: int,
):
    b, h, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    hk = h // group
    vcols = pl.ds(vb * block_v, block_v)
    slot = slots_ref[b]
    s = pool_ref[slot, h, :, vcols]  # [Dk, block_v]
    q = q_ref[b, hk, :].astype(_F32)  # [Dk]
    k = k_ref[b, hk, :].astype(_F32)
    v = v_ref[b, h, vcols].astype(_F32)  # [block_v]
    g = g_ref[b, h].astype(_F32)
    beta = beta_ref[b, h].astype(_F32)

    o_ref[b, h, vcols], pool_out_ref[slot, h, :, vcols] = delta_rule_step(s, q, k, v, g, beta)


@dataclasses.dataclass(frozen=True)
class GdnDecodeConfig:
    """Tuning knobs (hashable: a static argument)."""

    block_v: int = 128  # widest Dv columns per program: whole 512-byte rows read faster (docs/kernels_notes.md)
    # Narrower blocks until the grid has this many programs: one lane's 32 heads would leave most SMs idle
    min_programs: int = 128
    num_warps: int = 8
    num_stages: int = 1

    def __post_init__(self):
        for name in ("block_v", "num_warps"):
            x = getattr(self, name)
            if not is_pow2(x):
                raise ValueError(f"GdnDecodeConfig.{name} must be a power of 2, got {x}")
        if self.num_stages < 1 or self.min_programs < 0:
            raise ValueError("GdnDecodeConfig.num_stages must be >= 1 and min_programs >= 0")


DEFAULT_CONFIG = GdnDecodeConfig()


def program_blocks(heads: int, dv: int, block_v: int, min_programs: int) -> int:
    """Dv columns per program for `heads` (lane, value head) pairs: the widest power of two up to block_v whose
    grid has min_programs programs, down to 16 columns (the state slice stays [Dk, >= 16])."""
    block = min(block_v, dv)
    while heads * (dv // block) < min_programs and block > 16 and dv % (block // 2) == 0:
        block //= 2
    return block


def _gdn_decode_call(q, k, v, g, beta, state_pool, slots, *, config, interpret):
    lanes, hk, _ = q.shape
    hv, dv = v.shape[1], v.shape[2]
    block_v = program_blocks(lanes * hv, dv, config.block_v, config.min_programs)
    full = _compat.full_spec()
    return pl.pallas_call(
        functools.partial(_decode_kernel, group=hv // hk, block_v=block_v),
        grid=(lanes, hv, dv // block_v),
        # slots, q, k, v, g, beta, pool: whole arrays, indexed by (lane, head, column block) in-kernel
        in_specs=[full] * 7,
        out_specs=[full, full],  # o: written at [lane, head, columns]; pool: at [slot, head, :, columns]
        out_shape=[
            jax.ShapeDtypeStruct((lanes, hv, dv), _F32),
            jax.ShapeDtypeStruct(state_pool.shape, state_pool.dtype),
        ],
        input_output_aliases={6: 1},
        compiler_params=_compat.triton_params(config.num_warps, config.num_stages),
        interpret=interpret,
        name="gdn_decode",
    )(slots, q, k, v, g, beta, state_pool)


@functools.partial(jax.jit, static_argnames=("interpret", "config"))
def gdn_decode(q, k, v, g, beta, state_pool, slots, *, interpret=False, config=None):
    """One gated-delta-rule step for each of B lanes, state slots updated in place.

    Args:
      q, k: [B, Hk, Dk] (normalised; q scaled). v: [B, Hv, Dv]. g, beta: [B, Hv].
      state_pool: [S, Hv, Dk, Dv] float32 (alias it through a donated jit argument to avoid a copy).
      slots: [B] int32, distinct. Lanes with nothing to decode pass identity tokens.
      interpret: run the Pallas interpreter (CPU tests). config: `GdnDecodeConfig` (None: defaults).
    Returns:
      (o [B, Hv, Dv] float32, updated state_pool).
    """
    config = config or DEFAULT_CONFIG
    check_gdn_inputs(q, k, v, g, beta, state_pool)
    lanes = q.shape[0]
    if slots.shape != (lanes,):
        raise ValueError(f"slots must be [{lanes}], got {slots.shape}")
    return _gdn_decode_call(
        q, k, v, g, beta, state_pool, slots.astype(jnp.int32), config=config, interpret=interpret
    )
