"""Block-FP8 x FP8 product for decode rounds as a Pallas Mosaic GPU (Hopper wgmma) kernel: x [M, K] @ W for a few
rows (M <= 64), W float8_e4m3fn stored [N, K] with one float32 scale per 128 x 128 block, x quantized per token and
128-group (the packs' `activation_scheme: dynamic`).

"Swap AB" on the tensor cores: W's tile is wgmma's left operand (64 W rows a compute warpgroup) and x's rows, padded
to `rows` (16 to 64), its right, so the product's 64-row minimum falls on W, which is read once, and the padding is
x's few rows. A decode round is bound by reading W; the memory warpgroup streams W's [cta_w, 128] tiles by TMA through
`stages` SMEM buffers, and each CTA takes one tile of W rows over one range of K (no persistent loop: several CTAs
share an SM, so the wave's tail and each CTA's latency overlap). Each 128-deep step is one wgmma into a fresh float32
tile added into the running one times the block's scale (W's, one scalar: 64 rows lie in one block) and x's group
scales (one per column). With k_splits > 1 the CTAs of a tile write float32 partial sums that XLA adds.

The result comes out transposed, [N, rows]; the wrapper slices x's rows and transposes (XLA fuses it into the
consumer). Mosaic GPU compiles only for a GPU: on CPU `lower` checks the kernel and `fp8_gemm.reference` its
arithmetic.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.fp8_matmul import BLOCK, quantize_rows

_W_ROWS = 64  # W rows per compute warpgroup: wgmma's left operand is 64 rows
_SCALE_COLS = 32  # x's scales per step at least: 128 bytes
MAX_ROWS = 64  # x's rows at most (the right operand's N); wider rounds run fp8_gemm


@dataclasses.dataclass(frozen=True)
class SwapConfig:
    """Tuning knobs (hashable: a static jit argument). compute_wgs: warpgroups per CTA, 64 W rows each (a CTA's
    tile of 64 or 128 rows lies in one weight block); stages: SMEM buffers the memory warpgroup keeps in flight;
    k_splits: K ranges on separate CTAs (float32 partial sums added by XLA), 0 picks them (`splits`)."""

    compute_wgs: int = 2
    stages: int = 6
    k_splits: int = 0
    step_blocks: int = 1

    def __post_init__(self):
        if self.compute_wgs not in (1, 2):
            raise ValueError(f"SwapConfig.compute_wgs must be 1 or 2, got {self.compute_wgs}")
        if self.stages < 2 or self.k_splits < 0:
            raise ValueError(f"SwapConfig: stages {self.stages} (>= 2), k_splits {self.k_splits} (>= 0)")

    @property
    def cta_w(self) -> int:
        return _W_ROWS * self.compute_wgs


DEFAULT_CONFIG = SwapConfig()


def supported(m: int, k: int, n: int, cfg: SwapConfig = DEFAULT_CONFIG) -> bool:
    """Whether x [m, K] @ a block-FP8 weight of x @ w shape [K, N] runs here: whole 128-blocks, N in whole CTA
    tiles, at most MAX_ROWS rows, and a row of K's scales one TMA box (4 to 256 blocks, in fours: 16-byte rows)."""
    return 1 <= m <= MAX_ROWS and k % (4 * BLOCK) == 0 and n % cfg.cta_w == 0 and k // BLOCK <= 256


def padded_rows(m: int) -> int:
    """x's rows as the kernel multiplies them: the power of two at or above m, at least 16 (a bf16 output row of 32
    bytes, the narrowest TMA swizzle)."""
    return max(16, pl.next_power_of_2(m))


def splits(n: int, k: int, num_sms: int, cfg: SwapConfig = DEFAULT_CONFIG) -> int:
    """K ranges per W tile: cfg.k_splits, or the fewest (dividing K's blocks, at most 8) that give every SM two
    CTAs, so a slow CTA and the last wave's tail are hidden by the others."""
    blocks, tiles = k // BLOCK, n // cfg.cta_w
    if cfg.k_splits:
        return cfg.k_splits
    s = 1
    while tiles * s < 2 * num_sms and s < 8 and blocks % (2 * s * cfg.step_blocks) == 0:
        s *= 2
    return s


def _kernel(w_gmem, x_gmem, xs_gmem, ws_gmem, out_gmem, *, cfg: SwapConfig, k_iters: int, n: int):
    # w_gmem [N, K] fp8   x_gmem [R, K] fp8 (R = padded rows)   xs_gmem [K / 128, max(R, 32)] f32 (x's group
    #   scales: a step's row of them at least 128 bytes, a TMA copy the warpgroup splits evenly)
    # ws_gmem [N / 128, K / 128] f32 (W's block scales)
    # out_gmem [k_splits * N, R]: the product transposed, bf16 (one split) or each K range's float32 partial sums
    tile, split = lax.axis_index("tile"), lax.axis_index("split")
    wg = lax.axis_index("wg")
    rows = x_gmem.shape[0]
    fp8_tiles = (plgpu.TilingTransform((8, BLOCK)), plgpu.SwizzleTransform(BLOCK))  # 128 FP8 = one 128-byte row
    out_dtype = out_gmem.dtype
    out_swizzle = plgpu.find_swizzle(rows * jnp.dtype(out_dtype).itemsize * 8)
    out_tiles = (plgpu.TilingTransform((8, out_swizzle // jnp.dtype(out_dtype).itemsize)),
                 plgpu.SwizzleTransform(out_swizzle))
    w_rows = pl.ds(tile * cfg.cta_w, cfg.cta_w)
    sb = cfg.step_blocks
    span = pl.ds(split * k_iters * sb * BLOCK, k_iters * sb * BLOCK)
    steps = pl.ds(split * k_iters * sb, k_iters * sb)
    block_row = tile * cfg.cta_w // BLOCK  # the weight block of this tile's rows
    col = plgpu.Layout.WGMMA.reduce(0)

    def step(idx, w_smem, x_smem, xs_smem, acc):
        # w_smem [cta_w, 128] fp8   x_smem [R, 128] fp8   xs_smem [1, max(R, 32)] f32
        (k,) = idx if isinstance(idx, tuple) else (idx,)
        for j in range(sb):
            cols = pl.ds(j * BLOCK, BLOCK)
            # the block's scales first: their loads overlap the wgmma
            scale = (plgpu.load(xs_smem.at[j, pl.ds(0, rows)], (), layout=col)
                     * ws_gmem[block_row, (split * k_iters + k) * sb + j])  # [R]

            def product(tmp, cols=cols):
                plgpu.wgmma(tmp, w_smem.at[pl.ds(wg * _W_ROWS, _W_ROWS), cols],
                            plgpu.transpose_ref(x_smem.at[:, cols], (1, 0)))
                return tmp[...]  # waits for this warpgroup's wgmma

            d = pl.run_scoped(product, plgpu.ACC((_W_ROWS, rows), jnp.float32))  # [64, R]
            acc = acc + d * lax.broadcast_in_dim(scale, (_W_ROWS, rows), [1])
        return acc

    def get_pipeline(compute_context):
        return plgpu.emit_pipeline_warp_specialized(
            step,
            grid=(k_iters,),
            memory_registers=40,
            in_specs=[
                plgpu.BlockSpec((cfg.cta_w, sb * BLOCK), lambda k: (0, k), transforms=fp8_tiles,
                                memory_space=plgpu.SMEM),
                plgpu.BlockSpec((rows, sb * BLOCK), lambda k: (0, k), transforms=fp8_tiles,
                                memory_space=plgpu.SMEM),
                plgpu.BlockSpec((sb, xs_gmem.shape[1]), lambda k: (k, 0), memory_space=plgpu.SMEM),
            ],
            wg_axis="wg",
            num_compute_wgs=cfg.compute_wgs,
            max_concurrent_steps=cfg.stages,
            compute_context=compute_context,
        )

    @functools.partial(
        pl.run_scoped,
        allocs=get_pipeline(lambda *_: None).get_allocations(w_gmem, x_gmem, xs_gmem),
        out_smem=plgpu.SMEM((cfg.compute_wgs, _W_ROWS, rows), out_dtype, transforms=out_tiles),
        collective_axes="wg",
    )
    def _scope(allocs, out_smem):
        def compute_context(run):  # the compute warpgroups: run from a zero tile, then store it
            acc = run(plgpu.layout_cast(jnp.full((_W_ROWS, rows), 0, jnp.float32), plgpu.Layout.WGMMA))
            out_smem[wg] = acc.astype(out_dtype)
            plgpu.commit_smem()
            first = split * n + tile * cfg.cta_w + wg * _W_ROWS
            plgpu.copy_smem_to_gmem(out_smem.at[wg], out_gmem.at[pl.ds(first, _W_ROWS)])

        get_pipeline(compute_context)(w_gmem.at[w_rows, span], x_gmem.at[:, span], xs_gmem.at[steps],
                                      allocations=allocs)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _num_sms() -> int:
    try:
        return jax.devices("gpu")[0].core_count
    except RuntimeError:  # no GPU here: lowering for the H200
        return 132


@functools.partial(jax.jit, static_argnames=("config",))
def fp8_swap_ab(x, values, scales, *, config: SwapConfig | None = None):
    """x [M, K] @ the block-FP8 weight (values [N, K] float8_e4m3fn, scales [N / 128, K / 128] float32) for
    M <= MAX_ROWS, x quantized per token and 128-group; float32 accumulation, the result in x's dtype."""
    cfg = config or DEFAULT_CONFIG
    (m, k), n = x.shape, values.shape[0]
    if not supported(m, k, n, cfg) or values.shape[1] != k or scales.shape != (n // BLOCK, k // BLOCK):
        raise ValueError(f"fp8_swap_ab: x {x.shape}, values {values.shape}, scales {scales.shape}: K a multiple of "
                         f"{BLOCK} (at most {256 * BLOCK}), N of {cfg.cta_w}, 1..{MAX_ROWS} rows")
    if values.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"fp8_swap_ab: values must be float8_e4m3fn, got {values.dtype}")
    ks = splits(n, k, _num_sms(), cfg)
    if (k // BLOCK) % (ks * cfg.step_blocks):
        raise ValueError(f"fp8_swap_ab: k_splits {ks} x step_blocks {cfg.step_blocks} do not divide K's "
                         f"{k // BLOCK} blocks of {BLOCK}")
    r = padded_rows(m)
    xq, xs = quantize_rows(jnp.pad(x, ((0, r - m), (0, 0))) if r != m else x)
    xs = jnp.pad(xs, ((0, 0), (0, max(r, _SCALE_COLS) - r)))
    out = plgpu.kernel(
        functools.partial(_kernel, cfg=cfg, k_iters=k // BLOCK // ks // cfg.step_blocks, n=n),
        out_type=jax.ShapeDtypeStruct((ks * n, r), x.dtype if ks == 1 else jnp.float32),
        grid=(n // cfg.cta_w, ks),
        grid_names=("tile", "split"),
        num_threads=cfg.compute_wgs + 1,
        thread_name="wg",
    )(values, xq, xs, scales.astype(jnp.float32))
    if ks > 1:
        out = out.reshape(ks, n, r).sum(axis=0)
    return out[:, :m].T.astype(x.dtype)


def lower(m: int, k: int, n: int, config: SwapConfig | None = None):
    """The kernel lowered for the H200 (no GPU needed): catches unsupported shapes, layouts and primitives."""
    args = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((n, k), jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct((n // BLOCK, k // BLOCK), jnp.float32))
    return jax.jit(functools.partial(fp8_swap_ab, config=config)).trace(*args).lower(lowering_platforms=("cuda",))
