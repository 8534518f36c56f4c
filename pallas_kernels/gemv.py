"""A split-K matrix-vector product for the one-lane decode projections: y = x @ w for x [R, K] with R <= 8.

    parts[s, r, :] = sum over k in split s of x[r, k] w[k, :]   (float32),    y = sum_s parts[s]   (x's dtype)

Why: XLA hands a one-row bf16 projection to cuBLAS, which at M = 1 reads a [4096, 2048] weight at about 59% of
the H200's copy bandwidth, and below ~10M weight elements XLA's own vector-matrix rewrite (multiply + reduce)
writes the whole [K, N] product out first. A decode round is a chain of such reads, so their bandwidth is its
speed. Here the contraction is cut into S splits: grid (column block n, row r, split s), each program streams a
[K / S, block_n] slab of w in [block_k, block_n] tiles, so even a narrow N gives every SM several programs.
With `partial=True` the float32 partial sums [S, R, N] are the result, so that the consumer (the residual add +
RMSNorm kernel) can sum them as it reads them instead of a separate reduction launch; otherwise XLA sums them
(or, with one split, the kernel writes y itself).

Products are float32 (x rounded to w's dtype first, as the MoE kernels do); tiles are loaded whole, so block
sides are powers of two, N is a multiple of the column block and K of splits x block_k. Every ref is the whole
array, indexed inside the kernel (Triton has no scalar prefetch; see moe.py). The same kernel runs on CPU with
interpret=True (tests).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _compat

_F32 = jnp.float32
_MIN_BLOCK = 16  # the smallest block side Triton takes here
_MAX_ROWS = 8  # each row re-reads the weights (rows are separate programs): beyond a few, a matmul is better


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    """Tuning knobs (hashable: a static jit argument).

    block_n columns per program (halved until it divides N), block_k contraction rows per loop step, splits
    pieces of the contraction (clamped to K // block_k), num_warps and num_stages for Triton.
    """

    # the fastest of bench_gemv.py's sweep at the 35B-A3B's out_proj ([4096, 2048], gemv.md)
    block_n: int = 64
    block_k: int = 64
    splits: int = 16
    num_warps: int = 4
    num_stages: int = 4

    def __post_init__(self):
        for name in ("block_n", "block_k"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < _MIN_BLOCK or not _is_pow2(v):
                raise ValueError(f"GemvConfig.{name} must be a power of two >= {_MIN_BLOCK}, got {v!r}")
        if not isinstance(self.splits, int) or self.splits < 1:
            raise ValueError(f"GemvConfig.splits must be an int >= 1, got {self.splits!r}")
        if not isinstance(self.num_warps, int) or not _is_pow2(self.num_warps):
            raise ValueError(f"GemvConfig.num_warps must be a power of two, got {self.num_warps!r}")
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"GemvConfig.num_stages must be an int >= 1, got {self.num_stages!r}")


DEFAULT_CONFIG = GemvConfig()


@dataclasses.dataclass(frozen=True)
class _Plan:
    block_n: int
    block_k: int
    splits: int
    steps: int  # block_k steps per split


def _plan(k: int, n: int, config: GemvConfig) -> _Plan:
    """The blocks and splits `gemv` runs for a [K, N] weight, or a ValueError saying why it cannot."""
    block_n = config.block_n
    while block_n > _MIN_BLOCK and (block_n > n or n % block_n):
        block_n //= 2
    if n % block_n:
        raise ValueError(f"gemv: N={n} is not a multiple of any column block from {config.block_n} down to "
                         f"{_MIN_BLOCK}")
    block_k = config.block_k
    while block_k > _MIN_BLOCK and block_k > k:  # a short contraction: one smaller step
        block_k //= 2
    splits = max(1, min(config.splits, k // block_k))  # small K: fewer, whole pieces
    if k % (splits * block_k):
        raise ValueError(f"gemv: K={k} is not a multiple of splits {splits} x block_k {block_k}")
    return _Plan(block_n, block_k, splits, k // (splits * block_k))


def supported(x: jax.Array, w: jax.Array, config: GemvConfig | None = None) -> bool:
    """Whether `gemv` takes x [R, K], w [K, N] (R <= 8, K and N multiples of 16) with this config (None: the
    default one)."""
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0] or not 1 <= x.shape[0] <= _MAX_ROWS:
        return False
    k, n = w.shape
    if k % 16 or n % 16:
        return False
    try:
        _plan(k, n, DEFAULT_CONFIG if config is None else config)
    except ValueError:
        return False
    return True


def _kernel(x_ref, w_ref, out_ref, *, block_n: int, block_k: int, steps: int, partial: bool):
    # x_ref: [R, K]    w_ref: [K, N]
    # out_ref: partial: [S, R, N] f32, this program writes row r's column block n summed over its split s of K
    #          (steps * block_k rows of w); else [R, N] in x's dtype (one split: the whole sum)
    n, r, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    cdt = w_ref.dtype

    def body(i, acc):
        k0 = pl.multiple_of((s * steps + i) * block_k, block_k)
        xv = x_ref[r, pl.ds(k0, block_k)].astype(cdt).astype(_F32)[:, None]  # [BK, 1]
        tile = w_ref[pl.ds(k0, block_k), pl.ds(n * block_n, block_n)].astype(_F32)  # [BK, BN]
        return acc + jnp.sum(xv * tile, axis=0)

    acc = lax.fori_loop(0, steps, body, jnp.zeros((block_n,), _F32))
    if partial:
        out_ref[s, r, pl.ds(n * block_n, block_n)] = acc
    else:
        out_ref[r, pl.ds(n * block_n, block_n)] = acc.astype(out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("config", "partial", "interpret"))
def gemv(x: jax.Array, w: jax.Array, *, config: GemvConfig | None = None, partial: bool = False,
         interpret: bool = False) -> jax.Array:
    """x @ w for a few rows, as one split-K Pallas kernel.

    Args:
      x: [R, K] bfloat16 or float32, R small (1..8: each row's programs read all of w).
      w: [K, N] bfloat16 or float32; x is rounded to w's dtype for the products, which accumulate in float32.
      config: tuning knobs; None takes `DEFAULT_CONFIG`.
      partial: return the float32 partial sums [S, R, N] (S = the splits after clamping); the caller sums
        axis 0.
      interpret: run the kernel in Pallas interpret mode (CPU tests).
    Returns:
      partial: [S, R, N] float32; else [R, N] in x's dtype (one split: rounded in the kernel; more: XLA sums
      the partials in float32, then rounds).
    """
    if x.ndim != 2 or w.ndim != 2:
        raise ValueError(f"gemv: x {x.shape} must be [R, K] and w {w.shape} [K, N]")
    if x.shape[1] != w.shape[0]:
        raise ValueError(f"gemv: x {x.shape} and w {w.shape} disagree on K")
    for name, a in (("x", x), ("w", w)):
        if a.dtype not in (jnp.bfloat16, jnp.float32):
            raise ValueError(f"gemv: {name} must be bfloat16 or float32, got {a.dtype}")
    rows, (k, n) = x.shape[0], w.shape
    cfg = DEFAULT_CONFIG if config is None else config
    plan = _plan(k, n, cfg)
    write_parts = partial or plan.splits > 1
    out_shape = (jax.ShapeDtypeStruct((plan.splits, rows, n), _F32) if write_parts
                 else jax.ShapeDtypeStruct((rows, n), x.dtype))
    kernel = functools.partial(_kernel, block_n=plan.block_n, block_k=plan.block_k, steps=plan.steps,
                               partial=write_parts)
    # Grid (column block n, row r, split s), n fastest: the programs in flight share a split, so each streams
    # its own columns of the same K rows. No BlockSpecs: whole-array refs indexed in the kernel.
    out = pl.pallas_call(
        kernel,
        grid=(n // plan.block_n, rows, plan.splits),
        out_shape=out_shape,
        compiler_params=_compat.triton_params(cfg.num_warps, cfg.num_stages),
        interpret=interpret,
        name="gemv",
    )(x, w)
    if partial or not write_parts:
        return out
    return out.sum(axis=0).astype(x.dtype)
