"""A residual add and the zero-centred RMSNorm that follows it, for a few rows, as one kernel.

    x' = x + h  (rounded to x's dtype, as the model's add);   y = x' rsqrt(mean(x'^2) + eps) (1 + w)

XLA writes an RMSNorm as two kernels: the sum-of-squares reduction (with the add) and the scaling. In a one-lane
decode round each is a launch of one or two microseconds over a single row, twice per layer (79 norms a round at
35B-A3B). One program per row does the add, the reduction and the scaling. Rows are read whole, so the hidden
size must be a power of two (Triton's block shapes); `qwen3_5` keeps XLA's two kernels otherwise.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _compat
from pallas_kernels._blocks import is_pow2
from pallas_kernels.reference import rms_norm

_F32 = jnp.float32


def _kernel(*refs, eps: float, with_residual: bool):
    # refs: x [R, H], (h [R', H], R' >= R,) w [H], (x_out [R, H],) y [R, H]; program r handles row r
    if with_residual:
        x_ref, h_ref, w_ref, x_out_ref, y_ref = refs
    else:
        x_ref, w_ref, y_ref = refs
    r = pl.program_id(0)
    x = x_ref[r, :]
    if with_residual:
        x = (x.astype(_F32) + h_ref[r, :].astype(_F32)).astype(x_ref.dtype)
        x_out_ref[r, :] = x
    y_ref[r, :] = rms_norm(x, w_ref[...], eps)


@dataclasses.dataclass(frozen=True)
class AddNormConfig:
    """Tuning knobs (hashable)."""

    num_warps: int = 4


DEFAULT_CONFIG = AddNormConfig()


def supported(x: jax.Array) -> bool:
    """Whether `add_rms_norm` takes x [R, H]: H a power of two of at least 16."""
    h = x.shape[-1]
    return x.ndim == 2 and is_pow2(h, 16)


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def add_rms_norm(x, h, w, *, eps: float, interpret: bool = False):
    """(x + h, rms_norm(x + h) * (1 + w)) for x, h [R, H] (h may be None: then x itself and its norm).

    h may have more rows than x; those are not read. A one-row projection computed as a two-row matmul (see
    `qwen3_5.dot`) comes here whole: cutting its duplicate row off first would be a copy kernel, since XLA copies a
    custom call's sliced operand. The sum is rounded to x's dtype before the norm, as the model's residual add; the
    norm is computed in float32 and returned in x's dtype. w: [H] (any float dtype).
    """
    if (not supported(x) or w.shape != x.shape[1:]
            or (h is not None and (h.ndim != 2 or h.shape[1] != x.shape[1] or h.shape[0] < x.shape[0]))):
        raise ValueError(f"add_rms_norm: x {x.shape} must be [R, H] with H a power of two >= 16, h "
                         f"{None if h is None else h.shape} [R' >= R, H], w {w.shape} [H]")
    rows = x.shape[0]
    row = jax.ShapeDtypeStruct(x.shape, x.dtype)
    with_residual = h is not None
    out = pl.pallas_call(
        functools.partial(_kernel, eps=eps, with_residual=with_residual),
        grid=(rows,),
        out_shape=[row, row] if with_residual else [row],
        compiler_params=_compat.triton_params(DEFAULT_CONFIG.num_warps, 1),
        interpret=interpret,
        name="add_rms_norm",
    )(*((x, h, w) if with_residual else (x, w)))
    return tuple(out) if with_residual else (x, out[0])
