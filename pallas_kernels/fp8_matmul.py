"""Block-FP8 weight-only matmul for decode as Pallas kernels: x [M, K] @ W for a few rows, W float8_e4m3fn stored
[N, K] (the checkpoints' [out, in]) with one float32 scale per 128 x 128 block:
    (x @ W)[m, n] = sum_k x[m, k] * values[n, k] * scales[n // 128, k // 128].

A decode round reads every weight once for a few rows, so the kernels are bound by reading W: FP8 halves the bytes
of bf16. Each program streams 128-wide column blocks of the contraction for a block of W's rows (output columns)
over one split of K, multiplies each [rows, 128] FP8 tile's product by the tile's block scale (one scalar: the tile
lies in one block) and adds it to a float32 accumulator; XLA sums the splits' float32 partials. Two kernels:
  * `cuda_core` (M <= `Fp8Config.cuda_core_max_rows`): the tile converted to float32 and reduced against each row
    of x on the CUDA cores. At one row the tensor cores' 16-row minimum would multiply 15 padding rows.
  * `tensor_core` (up to `Fp8Config.max_rows`): "swap AB", W's tile is the matmul's left operand and x's rows
    (padded to 16) its right, so the 16-row minimum falls on x, not on W's 128 rows.
  * With quantize_activations (2 rows and more): x quantized per token and 128-group with dynamic scales (the
    packs' `activation_scheme: dynamic`, as vLLM and SGLang serve them), then the same swap-AB product in FP8 x FP8:
    no FP8-to-bf16 conversion, which is what bounds the weight-only tensor-core kernel (1.4x its speed at 8 rows),
    at the activations' quantization error (about 2.6% relative per product).
Larger M (prefill) is not here: weight-only dequantizes to bf16 for XLA's matmul; with quantized activations on
Hopper, fp8_gemm.py (Mosaic GPU wgmma) runs it (docs/kernels_notes.md, "FP8 weights"). K and N must be multiples of
128 (`supported`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _compat
from pallas_kernels._blocks import is_pow2

BLOCK = 128  # the checkpoints' weight block, and each kernel's contraction step
FP8_MAX = 448.0  # the largest finite float8_e4m3fn: a block's or group's amax maps here
_TC_ROWS = 16  # the smallest side of a tensor-core product


class BlockFp8(NamedTuple):
    """A block-FP8 weight as the kernels take it (the model's QuantizedWeight, without the model package):
    values [..., N, K] float8_e4m3fn and scales [..., N / 128, K / 128] float32, for x @ W with W [..., K, N]."""

    values: jax.Array
    scales: jax.Array


def dequantize_rows(w: BlockFp8, dtype=jnp.float32) -> jax.Array:
    """The weight in its own [..., N, K] layout, in `dtype`: each FP8 value times its block's scale (a partial
    block at the end of a side reads its block's scale too)."""
    n, k = w.values.shape[-2:]
    scales = jnp.repeat(jnp.repeat(w.scales, BLOCK, axis=-2)[..., :n, :], BLOCK, axis=-1)[..., :k]
    return (w.values.astype(jnp.float32) * scales).astype(dtype)


def dequantize(w: BlockFp8) -> jax.Array:
    """W [..., K, N] float32, the x @ W layout."""
    return jnp.swapaxes(dequantize_rows(w), -1, -2)


@dataclasses.dataclass(frozen=True)
class Fp8Config:
    """Tuning knobs (hashable: a static jit argument); tuned on the H200 at the 27B's projections
    (docs/benchmarks/fp8.md). block_n: W rows per tensor-core program (<= 128, so a tile has one scale)."""

    cuda_core_max_rows: int = 2
    max_rows: int = 16
    cuda_core_splits: int = 16
    splits: int = 8
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 4

    def __post_init__(self):
        for name in ("cuda_core_splits", "splits", "block_n", "num_warps"):
            if not is_pow2(getattr(self, name)):
                raise ValueError(f"Fp8Config.{name} must be a power of two, got {getattr(self, name)}")
        if not 16 <= self.block_n <= BLOCK:
            raise ValueError(f"Fp8Config.block_n must be in 16..{BLOCK}, got {self.block_n}")
        if not 0 <= self.cuda_core_max_rows <= self.max_rows <= _TC_ROWS:
            raise ValueError(f"Fp8Config needs 0 <= cuda_core_max_rows <= max_rows <= {_TC_ROWS}")


DEFAULT_CONFIG = Fp8Config()


def supported(k: int, n: int) -> bool:
    """Whether a block-FP8 weight of x @ w shape [K, N] runs through these kernels (whole 128-blocks only)."""
    return k % BLOCK == 0 and n % BLOCK == 0


def fp8_matmul(x, values, scales, *, config: Fp8Config | None = None, quantize_activations: bool = False,
               interpret: bool = False):
    """x [M, K] @ the block-FP8 weight (values [N, K] float8_e4m3fn, scales [N / 128, K / 128] float32) for
    M <= config.max_rows, in x's dtype with float32 accumulation; quantize_activations: x in FP8 too (see above)."""
    cfg = config or DEFAULT_CONFIG
    (m, k), n = x.shape, values.shape[0]
    if not supported(k, n) or values.shape[1] != k or scales.shape != (n // BLOCK, k // BLOCK):
        raise ValueError(f"fp8_matmul: x {x.shape}, values {values.shape}, scales {scales.shape}: K and N must be "
                         f"multiples of {BLOCK}, values [N, K] and scales [N/{BLOCK}, K/{BLOCK}]")
    if m > cfg.max_rows:
        raise ValueError(f"fp8_matmul: {m} rows exceed Fp8Config.max_rows {cfg.max_rows} (dequantize instead)")
    if m <= cfg.cuda_core_max_rows and not (quantize_activations and m > 1):
        return _cuda_core(x, values, scales, cfg, interpret)
    return _tensor_core(x, values, scales, cfg, interpret, quantize_activations)


def _splits(k_blocks: int, wanted: int) -> int:
    """The largest power of two <= wanted that divides the K blocks evenly."""
    splits = max(1, min(wanted, k_blocks))
    while k_blocks % splits:
        splits //= 2
    return splits


def _cuda_core_kernel(x_ref, w_ref, s_ref, part_ref, *, steps: int):
    # x_ref [M, K]   w_ref [N, K] fp8   s_ref [N / 128, K / 128] f32
    # part_ref (out) [S, M, N] f32: program (n, s) writes W rows n*128.. summed over split s of K, for every row of x
    n, s = pl.program_id(0), pl.program_id(1)
    rows = x_ref.shape[0]

    def body(i, accs):
        kb = s * steps + i
        k0 = pl.multiple_of(kb * BLOCK, BLOCK)
        wt = w_ref[pl.ds(n * BLOCK, BLOCK), pl.ds(k0, BLOCK)].astype(jnp.float32) * s_ref[n, kb]  # [128 n, 128 k]
        return tuple(acc + jnp.sum(wt * x_ref[r, pl.ds(k0, BLOCK)].astype(jnp.float32)[None, :], axis=1)
                     for r, acc in enumerate(accs))

    accs = lax.fori_loop(0, steps, body, tuple(jnp.zeros((BLOCK,), jnp.float32) for _ in range(rows)))
    for r, acc in enumerate(accs):
        part_ref[s, r, pl.ds(n * BLOCK, BLOCK)] = acc


def _cuda_core(x, values, scales, cfg: Fp8Config, interpret: bool):
    (m, k), n = x.shape, values.shape[0]
    splits = _splits(k // BLOCK, cfg.cuda_core_splits)
    parts = pl.pallas_call(
        functools.partial(_cuda_core_kernel, steps=k // BLOCK // splits),
        grid=(n // BLOCK, splits),
        out_shape=jax.ShapeDtypeStruct((splits, m, n), jnp.float32),
        compiler_params=_compat.triton_params(cfg.num_warps, cfg.num_stages),
        interpret=interpret,
        name="fp8_gemv",
    )(x, values, scales)
    return parts.sum(0).astype(x.dtype)


def _tensor_core_kernel(x_ref, *refs, steps: int, block_n: int, fp8_rows: bool):
    # x_ref [16, K] (zero past M; FP8 with fp8_rows, then xs_ref [K / 128, 16] f32 its group scales)
    # w_ref [N, K] fp8   s_ref [N / 128, K / 128] f32
    # part_ref (out) [S, N, 16] f32: program (n, s) writes W rows n*block_n.. (x @ W transposed), split s of K
    *xs_ref, w_ref, s_ref, part_ref = refs
    n, s = pl.program_id(0), pl.program_id(1)
    per_block = BLOCK // block_n

    def body(i, acc):
        kb = s * steps + i
        k0 = pl.multiple_of(kb * BLOCK, BLOCK)
        xt = x_ref[:, pl.ds(k0, BLOCK)]
        wt = w_ref[pl.ds(n * block_n, block_n), pl.ds(k0, BLOCK)]
        if not fp8_rows:
            wt = wt.astype(xt.dtype)
        d = lax.dot_general(wt, xt, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)  # [block_n, 16]
        scale = s_ref[n // per_block, kb]
        return acc + (d * (scale * xs_ref[0][kb, :])[None, :] if fp8_rows else d * scale)

    part_ref[s, pl.ds(n * block_n, block_n), :] = lax.fori_loop(
        0, steps, body, jnp.zeros((block_n, x_ref.shape[0]), jnp.float32))


def _tensor_core(x, values, scales, cfg: Fp8Config, interpret: bool, fp8_rows: bool):
    (m, k), n = x.shape, values.shape[0]
    xp = jnp.pad(x, ((0, _TC_ROWS - m), (0, 0))) if m < _TC_ROWS else x
    inputs = quantize_rows(xp) if fp8_rows else (xp,)
    splits = _splits(k // BLOCK, cfg.splits)
    parts = pl.pallas_call(
        functools.partial(_tensor_core_kernel, steps=k // BLOCK // splits, block_n=cfg.block_n, fp8_rows=fp8_rows),
        grid=(n // cfg.block_n, splits),
        out_shape=jax.ShapeDtypeStruct((splits, n, _TC_ROWS), jnp.float32),
        compiler_params=_compat.triton_params(cfg.num_warps, cfg.num_stages),
        interpret=interpret,
        name="fp8_fp8_swap_ab" if fp8_rows else "fp8_swap_ab",
    )(*inputs, values, scales)
    return parts.sum(0)[:, :m].T.astype(x.dtype)


def quantize_rows(x):
    """x [M, K] -> (float8_e4m3fn [M, K], float32 scales [K / 128, M]): each token's 128-wide group scaled so its
    largest magnitude maps to 448, the largest finite e4m3 (a zero group keeps scale 1e-12 / 448 and zeros)."""
    m, k = x.shape
    groups = x.astype(jnp.float32).reshape(m, k // BLOCK, BLOCK)
    scale = jnp.maximum(jnp.max(jnp.abs(groups), axis=-1), 1e-12) / FP8_MAX
    return (groups / scale[..., None]).astype(jnp.float8_e4m3fn).reshape(m, k), scale.T
