"""A decode lane's GDN out-projection with the gated RMSNorm before it as the kernel's prologue:

    y[r] = gated_rms_norm(o[r], z[r], norm_w) @ w      o [R, Hv, Dv], z [R, Hv Dv], w [Hv Dv, N] (bf16 or f32)

Why: at one lane XLA runs the norm after the fused decode kernel, a copy doubling its row (below ~10M weight
elements XLA rewrites a one-row dot into multiply + reduce, which writes the [K, N] product out; two rows keep it a
matmul: `qwen3_5.dot`) and a split-K GEMM with its reduction, four kernels a layer. The norm is per value head, and
a value head is Dv rows of w's contraction, so a split-K matrix-vector kernel whose splits hold whole heads can
normalize its own heads before it reads their rows of w: grid (column block n, row r, split s), split s covers heads
[s Hs, (s + 1) Hs), and step i normalizes head h = s Hs + i (`reference.gated_rms_norm`, HF's roundings, the result
in o's dtype as the composed norm writes it) and adds its [Dv, block_n] tile of products to a float32 tile that is
summed once at the end (one FMA a weight, as `fp8_matmul`'s one-row kernel). XLA sums the splits' float32 pieces:
two kernels a layer.

z is read in place from the in-projection's output (`z_col`, its first column): a slice handed to a custom call
would be a copy kernel. Every ref is whole and indexed inside the kernel (Triton has no scalar prefetch; moe.py).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _compat
from pallas_kernels.reference import gated_rms_norm

_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class GdnOutConfig:
    """Tuning knobs (hashable: a static jit argument): block_n output columns a program, splits of the value heads
    (the largest power of two up to it that divides Hv), Triton's warps and stages."""

    block_n: int = 64
    splits: int = 16
    num_warps: int = 4
    num_stages: int = 4


DEFAULT_CONFIG = GdnOutConfig()


def _splits(heads: int, cfg: GdnOutConfig) -> int:
    s = cfg.splits
    while heads % s:
        s //= 2
    return s


def supported(o_shape, w_shape, cfg: GdnOutConfig = DEFAULT_CONFIG) -> bool:
    """Whether the kernel takes o [R, Hv, Dv] against w [Hv Dv, N]: Dv a power of two >= 16 (a tile side), N a
    multiple of the column block."""
    _, hv, dv = o_shape
    return (len(w_shape) == 2 and w_shape[0] == hv * dv and dv >= 16 and dv & (dv - 1) == 0
            and w_shape[1] % cfg.block_n == 0)


def _kernel(o_ref, z_ref, norm_w_ref, w_ref, out_ref, *, z_col: int, heads: int, eps: float, block_n: int):
    # o_ref [R, Hv, Dv]   z_ref [R, P] (z at columns z_col..)   norm_w_ref [Dv]   w_ref [Hv Dv, N]
    # out_ref [S, R, N] float32: program (n, r, s) writes row r's columns n*block_n.. summed over split s's heads
    n, r, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    dv = o_ref.shape[2]
    cols = pl.ds(n * block_n, block_n)

    def body(i, acc):
        h = s * heads + i
        z = z_ref[r, pl.ds(z_col + h * dv, dv)]
        x = gated_rms_norm(o_ref[r, h, :], z, norm_w_ref[...], eps).astype(w_ref.dtype).astype(_F32)
        tile = w_ref[pl.ds(pl.multiple_of(h * dv, dv), dv), cols].astype(_F32)  # [Dv, block_n]
        return acc + x[:, None] * tile

    acc = lax.fori_loop(0, heads, body, jnp.zeros((dv, block_n), _F32))
    out_ref[s, r, cols] = jnp.sum(acc, axis=0)


@functools.partial(jax.jit, static_argnames=("z_col", "eps", "config", "interpret"))
def gdn_out_proj(o, z_source, norm_w, w, *, z_col: int, eps: float, config: GdnOutConfig | None = None,
                 interpret: bool = False):
    """gated_rms_norm(o, z, norm_w, eps) @ w for a few rows (each row's programs read all of w).

    Args:
      o: [R, Hv, Dv], the delta rule's output in the activations' dtype.
      z_source: [R, P], the in-projection's output; z is its columns [z_col, z_col + Hv Dv).
      norm_w: [Dv]. w: [Hv Dv, N], bf16 or float32; the normed rows are rounded to w's dtype for the products,
        which accumulate in float32.
    Returns:
      [R, N] in o's dtype (the splits' float32 pieces summed by XLA, then rounded once).
    """
    cfg = config or DEFAULT_CONFIG
    rows, hv, dv = o.shape
    if not supported(o.shape, w.shape, cfg):
        raise ValueError(f"gdn_out_proj: o {o.shape} against w {w.shape}: w must be [Hv Dv, N] with Dv a power of "
                         f"two >= 16 and N a multiple of {cfg.block_n}")
    if z_source.shape[0] != rows or z_source.shape[1] < z_col + hv * dv or norm_w.shape != (dv,):
        raise ValueError(f"gdn_out_proj: z_source {z_source.shape} from column {z_col} / norm_w {norm_w.shape} do "
                         f"not hold z [{rows}, {hv * dv}] / [{dv}]")
    n = w.shape[1]
    splits = _splits(hv, cfg)
    parts = pl.pallas_call(
        functools.partial(_kernel, z_col=z_col, heads=hv // splits, eps=eps, block_n=cfg.block_n),
        grid=(n // cfg.block_n, rows, splits),
        out_shape=jax.ShapeDtypeStruct((splits, rows, n), _F32),
        compiler_params=_compat.triton_params(cfg.num_warps, cfg.num_stages),
        interpret=interpret,
        name="gdn_out_proj",
    )(o, z_source, norm_w, w)
    return parts.sum(axis=0).astype(o.dtype)
