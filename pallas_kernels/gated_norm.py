"""The GDN mixer's gated RMSNorm, written quantized for an FP8 x FP8 out-projection, as one kernel.

Per token and value head (Dv = 128 channels: one of the FP8 GEMM's activation groups):

    y  = (w * rms_norm(core)) rounded to the activations' dtype, times silu(z), rounded again
         (`reference.gated_rms_norm`, the model's)
    xs = max(|y|, 1e-12) / 448;   xq = y / xs in float8_e4m3fn          (`fp8_matmul.quantize_rows` of y)

XLA composes the two as fusions that each recompute the norm for their own output: 29.6 ms of a 35B-A3B 32k FP8
pass, against 8.7 for the bf16 pass's norm alone (docs/benchmarks/fp8/fp8_moe.md). One program per (block of
`block_t` tokens, value head) reads core and z once and writes xq and xs, the layout `fp8_gemm.fp8_gemm_rows`
takes.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _compat
from pallas_kernels._blocks import is_pow2
from pallas_kernels.fp8_matmul import BLOCK, FP8_MAX, quantize_rows
from pallas_kernels.reference import gated_rms_norm

_F32 = jnp.float32


def _kernel(core_ref, z_ref, w_ref, xq_ref, xs_ref, *, eps: float, block_t: int):
    # core, z [T, Hv, Dv]; w [Dv]; xq [T, Hv Dv] float8_e4m3fn; xs [Hv, T] float32
    tb, head = pl.program_id(0), pl.program_id(1)
    rows = pl.ds(tb * block_t, block_t)
    dv = core_ref.shape[2]
    y = gated_rms_norm(core_ref[rows, head, :].astype(z_ref.dtype), z_ref[rows, head, :], w_ref[...], eps)
    y = y.astype(_F32)
    scale = jnp.maximum(jnp.max(jnp.abs(y), axis=1), 1e-12) / FP8_MAX
    xq_ref[rows, pl.ds(head * dv, dv)] = (y / scale[:, None]).astype(xq_ref.dtype)
    xs_ref[head, rows] = scale


@dataclasses.dataclass(frozen=True)
class GatedNormConfig:
    """Tuning knobs (hashable: a static argument)."""

    block_t: int = 32  # tokens per program
    num_warps: int = 4

    def __post_init__(self):
        if not is_pow2(self.block_t, 16):
            raise ValueError(f"GatedNormConfig.block_t must be a power of two >= 16, got {self.block_t}")


DEFAULT_CONFIG = GatedNormConfig()


def supported(value_head_dim: int) -> bool:
    """A value head must be one quantization group."""
    return value_head_dim == BLOCK


@functools.partial(jax.jit, static_argnames=("eps", "interpret", "config"))
def gated_rms_norm_fp8(core, z, w, *, eps: float, interpret: bool = False, config: GatedNormConfig = DEFAULT_CONFIG):
    """The gated norm of core [T, Hv, Dv] (any float dtype, rounded to z's first) with z [T, Hv, Dv] and w [Dv],
    quantized per token and value head: (xq [T, Hv Dv] float8_e4m3fn, xs [Hv, T] float32), as `reference` computes
    it."""
    t, hv, dv = z.shape
    if core.shape != z.shape or w.shape != (dv,) or not supported(dv):
        raise ValueError(f"gated_rms_norm_fp8: core {core.shape} and z {z.shape} must be [T, Hv, {BLOCK}], "
                         f"w {w.shape} [{BLOCK}]")
    block_t = min(config.block_t, max(16, pl.next_power_of_2(t)))
    rows = pl.cdiv(t, block_t) * block_t
    if rows != t:  # the engine's buckets are multiples of 64: no copy there
        core, z = (jnp.pad(a, ((0, rows - t), (0, 0), (0, 0))) for a in (core, z))
    xq, xs = pl.pallas_call(
        functools.partial(_kernel, eps=eps, block_t=block_t),
        grid=(rows // block_t, hv),
        out_shape=[jax.ShapeDtypeStruct((rows, hv * dv), jnp.float8_e4m3fn),
                   jax.ShapeDtypeStruct((hv, rows), _F32)],
        in_specs=[_compat.full_spec()] * 3,
        out_specs=[_compat.full_spec()] * 2,
        compiler_params=_compat.triton_params(config.num_warps, 1),
        interpret=interpret,
        name="gated_rms_norm_fp8",
    )(core, z, w)
    return (xq[:t], xs[:, :t]) if rows != t else (xq, xs)


def reference(core, z, w, eps: float):
    """What the kernel computes, composed in jnp: the model's gated norm, then `quantize_rows`."""
    y = gated_rms_norm(core.astype(z.dtype), z, w, eps)
    return quantize_rows(y.reshape(y.shape[0], -1))
