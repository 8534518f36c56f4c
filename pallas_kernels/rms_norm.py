"""A residual add and the zero-centred RMSNorm that follows it, for a few rows, as one kernel.

    x' = x + h  (rounded to x's dtype, as the model's add);   y = x' rsqrt(mean(x'^2) + eps) (1 + w)

XLA writes an RMSNorm as two kernels: the sum-of-squares reduction (with the add) and the scaling. In a one-lane
decode round each is a launch of one or two microseconds over a single row, twice per layer (79 norms a round at
35B-A3B). One program per row does the add, the reduction and the scaling; it also finishes the sum of a
producer's partial sums (`reference.PartialSums`: the MoE decode kernels' pieces) before the add, which saves that
sum's own launch. Rows are read whole, so the hidden size must be a power of two (Triton's block shapes); `qwen3_5`
keeps XLA's two kernels otherwise.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _compat
from pallas_kernels.reference import PartialSums, rms_norm

_F32 = jnp.float32


def _kernel(*refs, eps: float, with_residual: bool, partial_sums: bool):
    # refs: x [R, H], (h [R, H] or its partial sums [S, R, J, H],) w [H], (x_out [R, H],) y [R, H]; program r
    # handles row r
    if with_residual:
        x_ref, h_ref, w_ref, x_out_ref, y_ref = refs
    else:
        x_ref, w_ref, y_ref = refs
    r = pl.program_id(0)
    x = x_ref[r, :]
    if with_residual:
        if partial_sums:  # the producer's last sum, rounded to the activations' dtype as its own result would be
            pieces, per_row = h_ref.shape[0], h_ref.shape[2]
            h = functools.reduce(lambda a, b: a + b, [h_ref[s, r, j, :] for s in range(pieces) for j in range(per_row)])
            h = h.astype(x_ref.dtype)
        else:
            h = h_ref[r, :]
        x = (x.astype(_F32) + h.astype(_F32)).astype(x_ref.dtype)
        x_out_ref[r, :] = x
    y_ref[r, :] = rms_norm(x, w_ref[...], eps)


@dataclasses.dataclass(frozen=True)
class AddNormConfig:
    """Warps per program (hashable). A producer's partial sums are dozens of rows, each loaded whole: more warps
    keep their loads in flight at once (one program runs a row on one SM)."""

    num_warps: int = 4
    partial_sums_num_warps: int = 16


DEFAULT_CONFIG = AddNormConfig()


def supported(x: jax.Array) -> bool:
    """Whether `add_rms_norm` takes x [R, H]: H a power of two of at least 16."""
    h = x.shape[-1]
    return x.ndim == 2 and h >= 16 and h & (h - 1) == 0


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def add_rms_norm(x, h, w, *, eps: float, interpret: bool = False):
    """(x + h, rms_norm(x + h) * (1 + w)) for x, h [R, H] (h may be None: then x itself and its norm).

    h may also be `PartialSums` (parts [S, R, J, H] float32, from a split-K or MoE decode kernel): the kernel
    sums them and rounds the sum to x's dtype, as the producer's own result would be, so a decode round spends no
    reduce launch on them. The residual sum is rounded to x's dtype before the norm, as the model's residual add;
    the norm is computed in float32 and returned in x's dtype. w: [H] (any float dtype).
    """
    partial_sums = isinstance(h, PartialSums)
    h_rows = None if h is None else (h.parts.shape[1:4:2] if partial_sums else h.shape)
    if not supported(x) or w.shape != x.shape[1:] or (h is not None and h_rows != x.shape):
        raise ValueError(f"add_rms_norm: x {x.shape} must be [R, H] with H a power of two >= 16, h "
                         f"{None if h is None else h_rows} like x, w {w.shape} [H]")
    rows = x.shape[0]
    row = jax.ShapeDtypeStruct(x.shape, x.dtype)
    with_residual = h is not None
    if partial_sums:
        h = h.parts
    out = pl.pallas_call(
        functools.partial(_kernel, eps=eps, with_residual=with_residual, partial_sums=partial_sums),
        grid=(rows,),
        out_shape=[row, row] if with_residual else [row],
        compiler_params=_compat.triton_params(
            DEFAULT_CONFIG.partial_sums_num_warps if partial_sums else DEFAULT_CONFIG.num_warps, 1),
        interpret=interpret,
        name="add_rms_norm",
    )(*((x, h, w) if with_residual else (x, w)))
    return tuple(out) if with_residual else (x, out[0])
