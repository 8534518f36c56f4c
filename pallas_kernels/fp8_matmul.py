"""Block-FP8 weight-only matmul for decode as Pallas kernels: x [M, K] @ W for a few rows, W float8_e4m3fn stored
[N, K] (the checkpoints' [out, in]) or `blocked` [K / 128, N, 128], with one float32 scale per 128 x 128 block:
    (x @ W)[m, n] = sum_k x[m, k] * values[n, k] * scales[n // 128, k // 128].

A decode round reads every weight once for a few rows, so the kernels are bound by reading W: FP8 halves the bytes
of bf16. Each program streams 128-wide column blocks of the contraction for a block of W's rows (output columns)
over one split of K; each 128-block's product is scaled by the block's scale (one scalar: the tile lies in one
block). With several splits XLA sums their float32 partials; with one the kernel writes the result. Kernels:
  * `cuda_core` (M <= `Fp8Config.cuda_core_max_rows`, one row): each thread keeps its share of a [block_n, 128]
    float32 product tile, one FMA a weight with the block scale folded into x's 128 values, and the tile is
    reduced once after the loop. At one row the tensor cores' 16-row minimum would multiply 15 padding rows.
  * `tensor_core` (up to `Fp8Config.max_rows`; `dynamic_max_rows` for FP8 x FP8): "swap AB", W's tile is the
    matmul's left operand and x's rows (16, or the power of two at or above M up to 128; the rows past M loaded as
    zeros) its right, so the 16-row minimum falls on x, not on W's rows. bf16 rows go in as float16, each row over
    a power of two (exact within 2**29 of its largest): FP8 -> float16 is one packed conversion a pair, FP8 -> bf16
    three, and the conversion is what bounds this kernel.
  * With quantize_activations (2 rows and more): x quantized per token and 128-group with dynamic scales (the
    packs' `activation_scheme: dynamic`, as vLLM and SGLang serve them), then the same swap-AB product in FP8 x FP8,
    no conversion in the loop, at the activations' quantization error (about 2.6% relative per product).
Larger M (prefill, the widest decode rounds) is not here: weight-only dequantizes to bf16 for XLA's matmul; with
quantized activations on Hopper, fp8_gemm.py (Mosaic GPU wgmma) runs it (docs/kernels_notes.md, "FP8 weights"). K
and N must be multiples of 128 (`supported`).
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
MAX_ROWS = 128  # the widest right operand of the swap-AB product: x's rows beside one W tile


class BlockFp8(NamedTuple):
    """A block-FP8 weight as the kernels take it (the model's QuantizedWeight, without the model package):
    values [..., N, K] float8_e4m3fn and scales [..., N / 128, K / 128] float32, for x @ W with W [..., K, N]."""

    values: jax.Array
    scales: jax.Array


def blocked(values: jax.Array) -> jax.Array:
    """A weight's values [N, K] (K a multiple of 128) in the blocked layout [K / 128, N, 128]: each 128-deep block
    of K stored whole for every row, so a kernel step's tile of rows (one block deep) is one contiguous run of bytes
    rather than 128 bytes from each of its rows (the [N, K] tile's: 1.05-1.15x slower to stream on an H100,
    docs/kernels_notes.md). The dense kernels here and in fp8_gemm.py take either layout, to the same bits."""
    n, k = values.shape
    return values.reshape(n, k // BLOCK, BLOCK).transpose(1, 0, 2)


def unblocked(values: jax.Array) -> jax.Array:
    """`blocked`'s inverse: [K / 128, N, 128] -> [N, K]; a 2-D array as it is."""
    if values.ndim == 2:
        return values
    kb, n, _ = values.shape
    return values.transpose(1, 0, 2).reshape(n, kb * BLOCK)


def weight_dims(values: jax.Array) -> tuple[int, int]:
    """(N, K) of a dense weight's values, [N, K] or blocked [K / 128, N, 128]."""
    return (values.shape[1], values.shape[0] * BLOCK) if values.ndim == 3 else values.shape


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
    (docs/kernels_notes.md, "FP8 weights"). block_n: W rows per program (<= 128, so a tile has one scale); block_k:
    contraction per loop step (128-blocks, each with its own scale); splits: at most this many programs share one block
    of rows' K (a divisor of the steps), fewer where min_programs are reached with fewer (0: the most;
    cuda_core_min_programs is the one-row kernel's: at 264-1024 the 27B's FP8 one-lane round ran 1.12-1.20x longer on an
    H100, kernels_notes.md); with one split the kernel writes the result itself,
    otherwise XLA adds the splits' float32 partials. tc_mode: the weight-only tensor-core product's operands for bf16
    rows, "f16" or "bf16". dynamic_*: the FP8 x FP8 product's. max_rows / dynamic_max_rows: the most rows the
    weight-only / FP8 x FP8 kernels take (the model's dispatch reads them; past them it dequantizes or runs the wgmma
    GEMM). At the 27B's projections on the H200 the swap-AB kernels beat dequantize + bf16 2-3x at 32-128 rows, and the
    FP8 x FP8 kernel beats the wgmma GEMM 1.0-2.0x at 32 rows but not at 64-128 (docs/benchmarks/fp8/fp8_sweep.md).
    wide_tiles: the weight-only tiles past 16 rows, (most rows, block_n, num_warps) in rising rows (block_n / num_warps
    below and past them): every program reads all of x's rows from L2 for its block_n weight rows, so wider rounds take
    wider blocks (at the 27B's projections 1.31x at 32 rows with 64, 1.11x at 64 rows with 128 and 8 warps,
    fp8_sweep.md)."""

    cuda_core_max_rows: int = 1
    max_rows: int = 128
    dynamic_max_rows: int = 32
    cuda_core_splits: int = 16
    cuda_core_min_programs: int = 0
    cuda_core_block_n: int = 32
    cuda_core_block_k: int = 256
    cuda_core_warps: int = 4
    cuda_core_stages: int = 3
    splits: int = 8
    block_n: int = 32
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4
    min_programs: int = 512
    tc_mode: str = "f16"
    dynamic_block_n: int = 64
    dynamic_min_programs: int = 512
    wide_tiles: tuple[tuple[int, int, int], ...] = ((32, 64, 4), (MAX_ROWS, 128, 8))

    def __post_init__(self):
        for name in ("block_n", "cuda_core_block_n", "dynamic_block_n", "block_k", "cuda_core_block_k",
                     "num_warps", "cuda_core_warps"):
            if not is_pow2(getattr(self, name)):
                raise ValueError(f"Fp8Config.{name} must be a power of two, got {getattr(self, name)}")
        if not all(16 <= b <= BLOCK for b in (self.block_n, self.cuda_core_block_n, self.dynamic_block_n)):
            raise ValueError(f"Fp8Config block_n must be in 16..{BLOCK}")
        rows = [r for r, _, _ in self.wide_tiles]
        if rows != sorted(set(rows)) or not all(16 <= n <= BLOCK and is_pow2(n) and is_pow2(w)
                                                for _, n, w in self.wide_tiles):
            raise ValueError(f"Fp8Config.wide_tiles must rise in rows, block_n powers of two in 16..{BLOCK}, warps "
                             f"powers of two: {self.wide_tiles}")
        if self.block_k < BLOCK or self.cuda_core_block_k < BLOCK:
            raise ValueError(f"Fp8Config block_k must be a multiple of {BLOCK}")
        if self.tc_mode not in ("f16", "bf16"):
            raise ValueError(f"Fp8Config.tc_mode must be f16 or bf16, got {self.tc_mode}")
        if not 0 <= self.cuda_core_max_rows <= min(self.max_rows, self.dynamic_max_rows):
            raise ValueError("Fp8Config needs cuda_core_max_rows <= max_rows and dynamic_max_rows")
        if max(self.max_rows, self.dynamic_max_rows) > MAX_ROWS:
            raise ValueError(f"Fp8Config needs max_rows and dynamic_max_rows <= {MAX_ROWS}")

    def rows_limit(self, quantize_activations: bool) -> int:
        """The most rows these kernels take for weight-only (False) or FP8 x FP8 (True) products."""
        return self.dynamic_max_rows if quantize_activations else self.max_rows

    def tile(self, rows: int, quantize_activations: bool) -> tuple[int, int]:
        """(block_n, num_warps) of the tensor-core kernel for x of `rows` rows."""
        if quantize_activations:
            return self.dynamic_block_n, self.num_warps
        wide = (t for t in self.wide_tiles if _TC_ROWS < rows <= t[0])
        return next(((n, w) for _, n, w in wide), (self.block_n, self.num_warps))


DEFAULT_CONFIG = Fp8Config()


def supported(k: int, n: int) -> bool:
    """Whether a block-FP8 weight of x @ w shape [K, N] runs through these kernels (whole 128-blocks only)."""
    return k % BLOCK == 0 and n % BLOCK == 0


def _weight_fits(k: int, values, scales) -> bool:
    """Whether values ([N, K] or `blocked`) and scales [N / 128, K / 128] are a whole-block FP8 weight for rows of
    K values."""
    n, vk = weight_dims(values)
    layout_ok = values.ndim == 2 or values.shape[2] == BLOCK
    return supported(k, n) and vk == k and layout_ok and scales.shape == (n // BLOCK, k // BLOCK)


def fp8_matmul(x, values, scales, *, config: Fp8Config | None = None, quantize_activations: bool = False,
               interpret: bool = False):
    """x [M, K] @ the block-FP8 weight (values [N, K], or `blocked`, float8_e4m3fn, scales [N / 128, K / 128]
    float32) for M <= config.rows_limit(quantize_activations), in x's dtype with float32 accumulation;
    quantize_activations: x in FP8 too (see above)."""
    cfg = config or DEFAULT_CONFIG
    m, k = x.shape
    if not _weight_fits(k, values, scales):
        raise ValueError(f"fp8_matmul: x {x.shape}, values {values.shape}, scales {scales.shape}: K and N must be "
                         f"multiples of {BLOCK}, values [N, K] and scales [N/{BLOCK}, K/{BLOCK}]")
    if m > cfg.rows_limit(quantize_activations):
        raise ValueError(f"fp8_matmul: {m} rows exceed Fp8Config's limit of {cfg.rows_limit(quantize_activations)} "
                         f"(max_rows / dynamic_max_rows; dequantize or run the GEMM instead)")
    if quantize_activations and m > 1:
        return fp8_matmul_rows(*quantize_rows(x), values, scales, out_dtype=x.dtype, config=cfg, interpret=interpret)
    if m <= cfg.cuda_core_max_rows:
        return _cuda_core(x, values, scales, cfg, interpret)
    return _tensor_core(x, values, scales, cfg, interpret)


def _grid(k: int, n: int, block_n: int, block_k: int, splits: int, min_programs: int):
    """(128-blocks per step, splits of K, steps per split): the most splits <= `splits` that divide the steps, or
    the fewest that still give min_programs programs (fewer partial sums to write and add)."""
    sub, k_blocks = block_k // BLOCK, k // BLOCK
    while k_blocks % sub:
        sub //= 2
    steps = k_blocks // sub
    fits = [d for d in range(1, min(splits, steps) + 1) if steps % d == 0]
    enough = [d for d in fits if n // block_n * d >= min_programs]
    chosen = min(enough) if min_programs and enough else max(fits)
    return sub, chosen, steps // chosen


def _w_tile(w_ref, n, block_n: int, kb):
    if len(w_ref.shape) == 3:  # `blocked`
        return w_ref[kb, pl.ds(n * block_n, block_n), :]
    return w_ref[pl.ds(n * block_n, block_n), pl.ds(pl.multiple_of(kb * BLOCK, BLOCK), BLOCK)]


def _cuda_core_kernel(x_ref, w_ref, s_ref, out_ref, *, steps: int, sub: int, block_n: int):
    # x_ref [M, K]   w_ref [N, K] fp8 (or `blocked`)   s_ref [N / 128, K / 128] f32
    # out_ref [S, M, N] f32 (several splits: program (n, s) writes W rows n*block_n.. summed over split s of K)
    #   or [M, N] in x's dtype (one split)
    # Each thread keeps its share of a [block_n, 128] float32 product tile per row of x and reduces it once at the
    # end: one FMA a weight (the block's scale rides on x's 128 values), no cross-thread sum in the loop.
    n, s = pl.program_id(0), pl.program_id(1)
    rows = x_ref.shape[0]
    srow = n // (BLOCK // block_n)

    def body(i, accs):
        accs = list(accs)
        for j in range(sub):
            kb = (s * steps + i) * sub + j
            k0 = pl.multiple_of(kb * BLOCK, BLOCK)
            w = _w_tile(w_ref, n, block_n, kb).astype(jnp.float32)
            scale = s_ref[srow, kb]
            for r in range(rows):
                accs[r] = accs[r] + w * (x_ref[r, pl.ds(k0, BLOCK)].astype(jnp.float32) * scale)[None, :]
        return tuple(accs)

    accs = lax.fori_loop(0, steps, body, tuple(jnp.zeros((block_n, BLOCK), jnp.float32) for _ in range(rows)))
    for r, acc in enumerate(accs):
        total = jnp.sum(acc, axis=1)
        if len(out_ref.shape) == 3:
            out_ref[s, r, pl.ds(n * block_n, block_n)] = total
        else:
            out_ref[r, pl.ds(n * block_n, block_n)] = total.astype(out_ref.dtype)


def _cuda_core(x, values, scales, cfg: Fp8Config, interpret: bool):
    (m, k), (n, _) = x.shape, weight_dims(values)
    bn = cfg.cuda_core_block_n
    sub, splits, steps = _grid(k, n, bn, cfg.cuda_core_block_k, cfg.cuda_core_splits, cfg.cuda_core_min_programs)
    out = pl.pallas_call(
        functools.partial(_cuda_core_kernel, steps=steps, sub=sub, block_n=bn),
        grid=(n // bn, splits),
        out_shape=jax.ShapeDtypeStruct((splits, m, n) if splits > 1 else (m, n),
                                       jnp.float32 if splits > 1 else x.dtype),
        compiler_params=_compat.triton_params(cfg.cuda_core_warps, cfg.cuda_core_stages),
        interpret=interpret,
        name="fp8_gemv",
    )(x, values, scales)
    return out.sum(0).astype(x.dtype) if splits > 1 else out


def _tensor_core_kernel(x_ref, *refs, steps: int, sub: int, block_n: int, mode: str, tile_rows: int):
    # x_ref [M, K]: FP8 in mode "fp8", then side[0] [K / 128, M] f32 its group scales; float16 in mode "f16", each
    #   row over a power of two in side[0] [M] f32; rows M..tile_rows-1 of the product load as zeros
    # w_ref [N, K] fp8 (or `blocked`)   s_ref [N / 128, K / 128] f32
    # out_ref [S, M, N] f32 (several splits: program (n, s) writes W rows n*block_n.. for split s of K)
    #   or [M, N] in the output's dtype (one split)
    *side, w_ref, s_ref, out_ref = refs
    n, s = pl.program_id(0), pl.program_id(1)
    m = x_ref.shape[0]
    srow = n // (BLOCK // block_n)
    rows = jnp.arange(tile_rows, dtype=jnp.int32)
    live = rows < m
    cols = jnp.arange(BLOCK, dtype=jnp.int32)

    def body(i, acc):
        for j in range(sub):
            kb = (s * steps + i) * sub + j
            k0 = pl.multiple_of(kb * BLOCK, BLOCK)
            xt = _compat.load(x_ref.at[rows[:, None], (k0 + cols)[None, :]], mask=live[:, None], other=0.0)
            wt = _w_tile(w_ref, n, block_n, kb)
            if mode != "fp8":
                wt = wt.astype(xt.dtype)
            d = lax.dot_general(wt, xt, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)  # [bn, rows]
            scale = s_ref[srow, kb]
            if mode == "fp8":
                scale = scale * _compat.load(side[0].at[kb, rows], mask=live, other=0.0)[None, :]
            acc = acc + d * scale
        return acc

    acc = lax.fori_loop(0, steps, body, jnp.zeros((block_n, tile_rows), jnp.float32))
    if mode == "f16":
        acc = acc * _compat.load(side[0].at[rows], mask=live, other=0.0)[None, :]
    cols_n = n * block_n + jnp.arange(block_n, dtype=jnp.int32)
    if len(out_ref.shape) == 3:
        _compat.store(out_ref.at[s, rows[:, None], cols_n[None, :]], acc.T, mask=live[:, None])
    else:
        _compat.store(out_ref.at[rows[:, None], cols_n[None, :]], acc.T.astype(out_ref.dtype), mask=live[:, None])


def fp8_matmul_rows(xq, xs, values, scales, *, out_dtype, config: Fp8Config | None = None, interpret: bool = False):
    """`fp8_matmul` with quantize_activations, of rows already quantized as `quantize_rows` writes them (xq [M, K]
    float8_e4m3fn, xs [K / 128, M] float32; 2 <= M <= dynamic_max_rows), for a producer that quantizes its own
    output (the add + norm kernel, pallas_kernels/rms_norm.py)."""
    cfg = config or DEFAULT_CONFIG
    m, k = xq.shape
    if (not _weight_fits(k, values, scales) or xq.dtype != jnp.float8_e4m3fn or xs.shape != (k // BLOCK, m)
            or not 2 <= m <= cfg.dynamic_max_rows):
        raise ValueError(f"fp8_matmul_rows: xq {xq.shape} {xq.dtype}, xs {xs.shape}, values {values.shape}, scales "
                         f"{scales.shape}: xq float8_e4m3fn [M, K] with 2 <= M <= {cfg.dynamic_max_rows}, xs "
                         f"[K/{BLOCK}, M], K and N multiples of {BLOCK}")
    return _swap_ab((xq, xs), m, out_dtype, values, scales, cfg, interpret, "fp8")


def _tensor_core(x, values, scales, cfg: Fp8Config, interpret: bool):
    """The weight-only swap-AB product of bf16 or float32 rows."""
    mode = cfg.tc_mode if x.dtype == jnp.bfloat16 else "plain"
    if mode == "f16":
        # bf16 rows into float16 (8 of float16's 11 mantissa bits), each row over a power of two that puts its
        # largest magnitude at or under 2**15: exact for values within 2**29 of it, smaller ones round in float16's
        # subnormals, far below the float32 accumulation's error. FP8 -> float16 is one packed conversion a pair,
        # -> bf16 three
        amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=1)
        row_scale = jnp.exp2(jnp.ceil(jnp.log2(jnp.maximum(amax, 1e-30))) - 15)
        inputs = ((x.astype(jnp.float32) / row_scale[:, None]).astype(jnp.float16), row_scale)
    else:
        inputs = (x,)
    return _swap_ab(inputs, x.shape[0], x.dtype, values, scales, cfg, interpret, mode)


def _swap_ab(inputs, m: int, out_dtype, values, scales, cfg: Fp8Config, interpret: bool, mode: str):
    """The swap-AB kernel over x's rows as `mode` takes them (`_tensor_core_kernel`), the result in out_dtype."""
    n, k = weight_dims(values)
    fp8_rows = mode == "fp8"
    bn, warps = cfg.tile(m, fp8_rows)
    min_programs = cfg.dynamic_min_programs if fp8_rows else cfg.min_programs
    sub, splits, steps = _grid(k, n, bn, cfg.block_k, cfg.splits, min_programs)
    out = pl.pallas_call(
        functools.partial(_tensor_core_kernel, steps=steps, sub=sub, block_n=bn, mode=mode,
                          tile_rows=max(_TC_ROWS, pl.next_power_of_2(m))),
        grid=(n // bn, splits),
        out_shape=jax.ShapeDtypeStruct((splits, m, n) if splits > 1 else (m, n),
                                       jnp.float32 if splits > 1 else out_dtype),
        compiler_params=_compat.triton_params(warps, cfg.num_stages),
        interpret=interpret,
        name="fp8_fp8_swap_ab" if fp8_rows else "fp8_swap_ab",
    )(*inputs, values, scales)
    return out.sum(0).astype(out_dtype) if splits > 1 else out


def sum_partials(parts, dtype):
    """K ranges' float32 partial sums [S, ...] added in order, ((p0 + p1) + p2) ..., in `dtype`: the one order of
    every split product here and of the kernels that add a product's partial sums themselves
    (pallas_kernels/rms_norm.py), so either way gives the same bits."""
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total.astype(dtype)


def group_scale(groups):
    """The FP8 scale of each group along the last axis (float32): its largest magnitude maps to 448, the largest
    finite e4m3 (a zero group gets 1e-12 / 448). The one rule of every per-token 128-group quantization here, in XLA
    and inside the kernels."""
    return jnp.maximum(jnp.max(jnp.abs(groups), axis=-1), 1e-12) / FP8_MAX


def quantize_rows(x):
    """x [M, K] -> (float8_e4m3fn [M, K], float32 scales [K / 128, M]): each token's 128-wide group scaled so its
    largest magnitude maps to 448, the largest finite e4m3 (a zero group keeps scale 1e-12 / 448 and zeros)."""
    m, k = x.shape
    groups = x.astype(jnp.float32).reshape(m, k // BLOCK, BLOCK)
    scale = group_scale(groups)
    return (groups / scale[..., None]).astype(jnp.float8_e4m3fn).reshape(m, k), scale.T
