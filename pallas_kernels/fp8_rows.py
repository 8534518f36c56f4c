"""Producers that write their output as FP8 rows for the FP8 x FP8 GEMM, one kernel each: the GDN mixer's gated
RMSNorm (the out-projection's input) and the MLP's SwiGLU product (the down-projection's input).

Each computes its rows in the model's roundings (`reference.gated_rms_norm`, `reference.swiglu`), then quantizes
them per token and 128-group as `fp8_matmul.quantize_rows` does:

    xs = max(|y|, 1e-12) / 448;   xq = y / xs in float8_e4m3fn

XLA composes a producer and the quantization as fusions that each recompute the producer for their own output:
29.6 ms of a 35B-A3B 32k FP8 pass for the gated norm, against 8.7 for the bf16 pass's norm alone
(docs/benchmarks/fp8/fp8_moe.md). One program per (block of `block_t` tokens, 128-group) reads its inputs once and
writes xq and xs, the layout `fp8_gemm.fp8_gemm_rows` takes.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _compat
from pallas_kernels._blocks import is_pow2
from pallas_kernels.fp8_matmul import BLOCK, group_scale, quantize_rows
from pallas_kernels.reference import gated_rms_norm, swiglu

_F32 = jnp.float32


def _store(y, xq_ref, xs_ref, rows, group):
    """One block of rows' 128-group `group` of y, quantized into xq [T, G 128] and xs [G, T]."""
    y = y.astype(_F32)
    scale = group_scale(y)
    xq_ref[rows, pl.ds(group * BLOCK, BLOCK)] = (y / scale[:, None]).astype(xq_ref.dtype)
    xs_ref[group, rows] = scale


def _norm_kernel(core_ref, z_ref, w_ref, xq_ref, xs_ref, *, eps: float, block_t: int, z_col: int):
    # core [T, Hv, Dv]; z_ref [T, >= z_col + Hv Dv] (z's head h at columns z_col + h Dv); w [Dv]
    tb, head = pl.program_id(0), pl.program_id(1)
    rows = pl.ds(tb * block_t, block_t)
    z = z_ref[rows, pl.ds(z_col + head * BLOCK, BLOCK)]
    _store(gated_rms_norm(core_ref[rows, head, :].astype(z.dtype), z, w_ref[...], eps), xq_ref, xs_ref, rows, head)


def _swiglu_kernel(gu_ref, xq_ref, xs_ref, *, block_t: int, inter: int):
    # gu [T, 2I]: gate then up
    tb, group = pl.program_id(0), pl.program_id(1)
    rows = pl.ds(tb * block_t, block_t)
    gate, up = (gu_ref[rows, pl.ds(c + group * BLOCK, BLOCK)] for c in (0, inter))
    _store(swiglu(gate, up), xq_ref, xs_ref, rows, group)


@dataclasses.dataclass(frozen=True)
class Fp8RowsConfig:
    """Tuning knobs (hashable: a static argument)."""

    block_t: int = 32  # tokens per program
    num_warps: int = 4

    def __post_init__(self):
        if not is_pow2(self.block_t, 16):
            raise ValueError(f"Fp8RowsConfig.block_t must be a power of two >= 16, got {self.block_t}")


DEFAULT_CONFIG = Fp8RowsConfig()


def _call(kernel, name: str, t: int, groups: int, inputs, config: Fp8RowsConfig, interpret: bool, **params):
    """kernel over (blocks of tokens, groups) -> (xq [t, groups 128], xs [groups, t]); inputs' rows are padded to
    whole blocks (the engine's buckets are multiples of 64: no copy there)."""
    block_t = min(config.block_t, max(16, pl.next_power_of_2(t)))
    rows = pl.cdiv(t, block_t) * block_t
    if rows != t:
        inputs = [jnp.pad(a, ((0, rows - t),) + ((0, 0),) * (a.ndim - 1)) if a.ndim > 1 else a for a in inputs]
    xq, xs = pl.pallas_call(
        functools.partial(kernel, block_t=block_t, **params),
        grid=(rows // block_t, groups),
        out_shape=[jax.ShapeDtypeStruct((rows, groups * BLOCK), jnp.float8_e4m3fn),
                   jax.ShapeDtypeStruct((groups, rows), _F32)],
        in_specs=[_compat.full_spec()] * len(inputs),
        out_specs=[_compat.full_spec()] * 2,
        compiler_params=_compat.triton_params(config.num_warps, 1),
        interpret=interpret,
        name=name,
    )(*inputs)
    return (xq[:t], xs[:, :t]) if rows != t else (xq, xs)


def norm_supported(value_head_dim: int) -> bool:
    """A value head must be one quantization group."""
    return value_head_dim == BLOCK


@functools.partial(jax.jit, static_argnames=("eps", "z_col", "interpret", "config"))
def gated_rms_norm_fp8(core, z, w, *, eps: float, z_col: int = 0, interpret: bool = False,
                       config: Fp8RowsConfig = DEFAULT_CONFIG):
    """The gated norm of core [T, Hv, Dv] (any float dtype, rounded to z's first) with w [Dv] and z: [T, Hv, Dv], or
    [T, W] holding it from column z_col (the in-projection's output, read in place: a custom call's sliced operand
    is a copy), quantized per token and value head: (xq [T, Hv Dv] float8_e4m3fn, xs [Hv, T] float32), as
    `norm_reference` computes it."""
    t, hv, dv = core.shape
    z2 = z.reshape(t, -1) if z.ndim == 3 else z
    if (z.ndim == 3 and (z.shape != core.shape or z_col)) or z2.shape[0] != t or z2.shape[1] < z_col + hv * dv \
            or w.shape != (dv,) or not norm_supported(dv):
        raise ValueError(f"gated_rms_norm_fp8: core {core.shape} must be [T, Hv, {BLOCK}], z {z.shape} [T, Hv, "
                         f"{BLOCK}] or [T, >= z_col ({z_col}) + Hv {BLOCK}], w {w.shape} [{BLOCK}]")
    return _call(_norm_kernel, "gated_rms_norm_fp8", t, hv, [core, z2, w], config, interpret, eps=eps, z_col=z_col)


def norm_reference(core, z, w, eps: float):
    """What `gated_rms_norm_fp8` computes, composed in jnp (z [T, Hv, Dv]): the model's gated norm, then
    `quantize_rows`."""
    y = gated_rms_norm(core.astype(z.dtype), z, w, eps)
    return quantize_rows(y.reshape(y.shape[0], -1))


def swiglu_supported(inter: int) -> bool:
    """The product's width must be whole 128-groups."""
    return inter % BLOCK == 0


@functools.partial(jax.jit, static_argnames=("interpret", "config"))
def swiglu_fp8(gu, *, interpret: bool = False, config: Fp8RowsConfig = DEFAULT_CONFIG):
    """silu(gate) * up of the MLP's gate_up product gu [T, 2I] (`reference.swiglu`'s roundings), quantized per token
    and 128-group: (xq [T, I] float8_e4m3fn, xs [I / 128, T] float32), as `swiglu_reference` computes it."""
    t, width = gu.shape
    if width % 2 or not swiglu_supported(width // 2):
        raise ValueError(f"swiglu_fp8: gu {gu.shape} must be [T, 2I] with I a multiple of {BLOCK}")
    inter = width // 2
    return _call(_swiglu_kernel, "swiglu_fp8", t, inter // BLOCK, [gu], config, interpret, inter=inter)


def swiglu_reference(gu):
    """What `swiglu_fp8` computes, composed in jnp."""
    inter = gu.shape[1] // 2
    return quantize_rows(swiglu(gu[:, :inter], gu[:, inter:]))
