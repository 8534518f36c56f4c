"""Block-FP8 GEMM for prefill as a Pallas Mosaic GPU (Hopper wgmma) kernel: x [M, K] @ W for many rows, W
float8_e4m3fn stored [N, K] (the checkpoints' [out, in]) with one float32 scale per 128 x 128 block.

x is quantized per token and 128-group with dynamic scales (the packs' `activation_scheme: dynamic`), then

    out[m, n] = sum_kb xs[kb, m] * ws[n // 128, kb] * (xq[m, kb*128:+128] . wq[n, kb*128:+128])

DeepGEMM's scheme: every 128-deep step is one FP8 x FP8 wgmma into a fresh float32 accumulator, which the compute
warpgroup then adds into its running float32 tile times the step's scale (the row's activation scale times the
tile's weight block scale; a tile of at most 128 columns lies in one weight block, so that is one scale per row).
Promoting every 128 products keeps the tensor cores' reduced-precision FP8 accumulation to 128 terms.

W may come `fp8_matmul.blocked` ([K / 128, N, 128]): a step's W tile is then one contiguous run of bytes, not
128 bytes of each of its rows: 1.05-1.09x faster at 64-128 rows on an H100 (docs/kernels_notes.md).

Layout: a persistent kernel, one CTA per SM walking output tiles; per CTA a memory warpgroup streams x's
[cta_m, 128] and W's [cta_n, 128] FP8 tiles (K-major both, as FP8 wgmma requires) plus the step's activation
scales through `max_concurrent_steps` SMEM stages (TMA), and two compute warpgroups each own tile_m rows (`wg_split`
"m") or tile_n columns ("n") of the tile, each loading its step's weight block scale as one scalar (the checkpoint's
scales as they are: no per-call layout of them).
Shapes: K and N multiples of 128; M is padded to the CTA's rows. Mosaic GPU compiles only for a GPU; on CPU the
wrapper's blocking and scaling are checked through `reference` (same arithmetic in jnp) and `lower`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.fp8_matmul import BLOCK, quantize_rows, sum_partials, unblocked, weight_dims

_SMS = 132  # the H200's SMs: the persistent grid when no device is there to ask (lowering on CPU)


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """Tuning knobs (hashable: a static jit argument). tile_m: rows per compute warpgroup (the CTA takes two);
    tile_n: output columns per CTA (<= 128 and dividing it, so the tile has one weight scale per step); cluster:
    None, "m" (two CTAs along M share W's tile by TMA multicast) or "n" (two along N share x's tile);
    grid_minor: the tile walk's fast dimension ("m" or "n") in bands of grid_width tiles (L2 reuse); overlap: add
    step k-1's product into the running tile while step k's wgmma runs (one more register tile per thread) rather
    than after waiting for it; k_splits: K cut into this many ranges, each tile's ranges on separate CTAs writing
    float32 partial sums that XLA adds (a few rows over few column tiles, as the 27B's down projection's 40 at a wide
    decode round, leave most SMs idle otherwise); wg_split: the two compute warpgroups take a tile of 2 x tile_m rows
    ("m") or of 2 x tile_n columns ("n": a round of at most tile_m rows computes no padding rows and reads each
    column once per its own rows); tail_splits: the column tiles past the grid's last whole wave run as a second
    launch with K in this many ranges (1: in a last wave of their own, most of its SMs idle while a few stream
    whole tiles, as the 27B's gate_up's 136 tiles on 132 SMs); step_blocks: 128-blocks of K a pipeline step loads
    (2: 256 contiguous bytes of each weight row a copy, each block still its own product and promotion; SMEM then
    holds about half the stages; 1.00-1.04x at 64-256 rows on an H100, where a blocked weight gained more, so no
    auto_config takes it: docs/kernels_notes.md)."""

    tile_m: int = 64
    tile_n: int = 128
    max_concurrent_steps: int = 4
    cluster: str | None = "n"
    grid_minor: str = "n"
    grid_width: int = 8
    overlap: bool = False
    k_splits: int = 1
    wg_split: str = "m"
    tail_splits: int = 1
    step_blocks: int = 1

    def __post_init__(self):
        if self.tile_m not in (64, 128):
            raise ValueError(f"GemmConfig.tile_m must be 64 or 128 (wgmma rows), got {self.tile_m}")
        if self.tile_n not in (64, 128):
            raise ValueError(f"GemmConfig.tile_n must be 64 or 128 (one weight block), got {self.tile_n}")
        if self.cluster not in (None, "m", "n") or self.grid_minor not in ("m", "n"):
            raise ValueError(f"GemmConfig: cluster {self.cluster!r}, grid_minor {self.grid_minor!r}")
        if self.k_splits < 1:
            raise ValueError(f"GemmConfig.k_splits must be >= 1, got {self.k_splits}")
        if self.tail_splits < 1 or (self.tail_splits > 1 and self.k_splits > 1):
            raise ValueError(f"GemmConfig.tail_splits {self.tail_splits} needs k_splits 1, got {self.k_splits}")
        if self.step_blocks not in (1, 2) or (self.step_blocks > 1 and self.overlap):
            raise ValueError(f"GemmConfig.step_blocks must be 1 or 2 (2 without overlap), got {self.step_blocks}")
        if self.wg_split not in ("m", "n"):
            raise ValueError(f"GemmConfig.wg_split must be 'm' or 'n', got {self.wg_split!r}")

    @property
    def cta_m(self) -> int:
        return self.tile_m * (2 if self.wg_split == "m" else 1)

    @property
    def cta_n(self) -> int:
        return self.tile_n * (2 if self.wg_split == "n" else 1)


MAX_K_SPLITS = 4  # auto_config's K ranges at most: eight lost to the float32 partial sums' traffic
MAX_TAIL_SPLITS = 8  # a tail launch's K ranges at most: its partial sums stay a few MB
MAX_TAIL_ROWS = 256  # auto_config's tails up to a wide decode round's rows, where they were timed (not mixed steps')
MIN_RANGE_BLOCKS = 16  # K ranges shorter than this (128-blocks) take 64-column tiles: their pipelines fill less often
DEFAULT_CONFIG = GemmConfig()  # the fastest at the 27B's MLP gate_up, 2048 rows (docs/benchmarks/fp8/fp8_gemm.md)


def available() -> bool:
    """Whether the default device runs this kernel: wgmma and TMA are Hopper's (sm_90) alone."""
    device = jax.devices()[0]
    return device.platform == "gpu" and getattr(device, "compute_capability", "") == "9.0"


def supported(k: int, n: int) -> bool:
    """Whether a block-FP8 weight of x @ w shape [K, N] runs through this kernel (whole 128-blocks only)."""
    return k % BLOCK == 0 and n % BLOCK == 0


def _dim(name: str):
    # plgpu.planar_snake takes the fast dimension as an index: 0 = M, 1 = N
    return 0 if name == "m" else 1


def _kernel(*refs, cfg: GemmConfig, iters: tuple[int, int, int], grouped: bool, col0: int):
    # grouped: groups_gmem [M / cta_m] int32 first, the group (expert) of each row tile, -1 for a tile to skip
    # x_gmem [M, K] fp8 (M padded to the cluster's rows)   w_gmem [N, K] or `blocked` [K / 128, N, 128] fp8
    #   (grouped: [G, N, K])
    # xs_gmem [K / 128, M] f32: activation scale of row m's group kb
    # ws_gmem [N / 128, K / 128] f32 (grouped: [G, ...]): the weight's block scales as the checkpoint stores them;
    #   a compute warpgroup loads its tile's one scalar a step straight from memory (L2 after the first tile)
    # out_gmem (out) [k_splits * M, N]: bf16, or float32 partial sums of each K range (k_splits > 1)
    # col0: W's first column this launch computes, its output's column 0 past the first (a tail launch's)
    groups_gmem, (x_gmem, w_gmem, xs_gmem, ws_gmem, out_gmem) = (refs[0], refs[1:]) if grouped else (None, refs)
    m_iters, n_iters, k_iters = iters  # k_iters: 128-deep blocks per K range
    sb = cfg.step_blocks  # 128-blocks a pipeline step
    tile_m, tile_n, cta_m, cta_n = cfg.tile_m, cfg.tile_n, cfg.cta_m, cfg.cta_n
    by_cols = cfg.wg_split == "n"
    blocked = not grouped and len(w_gmem.shape) == 3  # a step's W tile [sb, cta_n, 128], contiguous
    fp8_tiles = (plgpu.TilingTransform((8, BLOCK)), plgpu.SwizzleTransform(BLOCK))  # 128 FP8 = one 128-byte row
    out_dtype = out_gmem.dtype
    out_swizzle = plgpu.find_swizzle(tile_n * jnp.dtype(out_dtype).itemsize * 8)
    out_tiles = (plgpu.TilingTransform((8, out_swizzle // jnp.dtype(out_dtype).itemsize)),
                 plgpu.SwizzleTransform(out_swizzle))

    def get_pipeline(body, compute_context):
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(k_iters // sb,),
            memory_registers=40,
            in_specs=[
                plgpu.BlockSpec((cta_m, sb * BLOCK), lambda k: (0, k), transforms=fp8_tiles,
                                memory_space=plgpu.SMEM, collective_axes=("cluster",) if cfg.cluster == "n" else ()),
                plgpu.BlockSpec((sb, cta_n, BLOCK) if blocked else (cta_n, sb * BLOCK),
                                (lambda k: (k, 0, 0)) if blocked else (lambda k: (0, k)), transforms=fp8_tiles,
                                memory_space=plgpu.SMEM, collective_axes=("cluster",) if cfg.cluster == "m" else ()),
                plgpu.BlockSpec((sb, cta_m), lambda k: (k, 0), memory_space=plgpu.SMEM),
            ],
            wg_axis="wg",
            num_compute_wgs=2,
            max_concurrent_steps=cfg.max_concurrent_steps,
            compute_context=compute_context,
        )

    ignore = lambda *_, **__: None  # noqa: E731 (the allocations depend on the specs only)

    @functools.partial(
        pl.run_scoped,
        allocs=get_pipeline(ignore, ignore).get_allocations(x_gmem, w_gmem.at[0] if grouped else w_gmem, xs_gmem),
        out_smem=plgpu.SMEM((2, tile_m, tile_n), out_dtype, transforms=out_tiles),
        collective_axes="wg",
    )
    def _scope(allocs, out_smem):
        wg = lax.axis_index("wg")
        cta = lax.axis_index("cluster")

        @plgpu.nd_loop((cfg.k_splits * m_iters * n_iters,), collective_axes="cluster_grid")
        def _tiles(info: plgpu.NDLoopInfo):
            (lin,) = info.index
            split, lin = lin // (m_iters * n_iters), lin % (m_iters * n_iters)
            mi, ni = plgpu.planar_snake(lin, (m_iters, n_iters), _dim(cfg.grid_minor), cfg.grid_width)
            if cfg.cluster == "m":
                mi = mi * 2 + cta
            elif cfg.cluster == "n":
                ni = ni * 2 + cta
            rows = pl.ds(mi * cta_m, cta_m)
            cols = pl.ds(ni * cta_n, cta_n)
            w_cols = pl.ds(col0 + ni * cta_n, cta_n)
            steps = pl.ds(split * k_iters, k_iters)
            span = pl.ds(split * k_iters * BLOCK, k_iters * BLOCK)
            out_rows = pl.ds(split * x_gmem.shape[0] + mi * cta_m, cta_m)
            wg_rows = pl.ds(0 if by_cols else wg * tile_m, tile_m)  # within the tile
            out_tile = out_gmem.at[out_rows, cols]
            wg_out = out_tile.at[:, pl.ds(wg * tile_n, tile_n)] if by_cols else out_tile.at[wg_rows]

            row = plgpu.Layout.WGMMA.reduce(1)

            def compute_context(eval_pipeline):
                zero = plgpu.layout_cast(jnp.full((tile_m, tile_n), 0, jnp.float32), plgpu.Layout.WGMMA)
                if cfg.overlap:  # carry: the running tile, the last step's product and its row scales
                    acc, d, scale = eval_pipeline(
                        (zero, zero, plgpu.layout_cast(jnp.full((tile_m,), 0, jnp.float32), row)))
                    acc = acc + d * lax.broadcast_in_dim(scale, (tile_m, tile_n), [0])
                else:
                    acc = eval_pipeline(zero)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous tile's store has read out_smem
                out_smem[wg] = acc.astype(out_dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(out_smem.at[wg], wg_out)

            # this warpgroup's columns lie in one 128-block of the weight (tile_n <= 128 and divides it)
            w_block = (col0 + ni * cta_n + (wg * tile_n if by_cols else 0)) // BLOCK

            def step(ws, idx, x_smem, w_smem, xs_smem, carry):
                # x_smem [cta_m, sb 128] fp8   w_smem [cta_n, sb 128] (blocked: [sb, cta_n, 128]) fp8   xs_smem [sb,
                # cta_m] f32; each 128-block of the step its own product, promoted with its own scales
                wg_cols = pl.ds(wg * tile_n, tile_n)
                w_tile = w_smem.at[wg_cols] if by_cols and not blocked else w_smem
                x_tile = x_smem.at[wg_rows]
                # one block a step keeps the refs and the scale's index unsliced: the timed kernel's ops exactly
                for j in range(sb):
                    block = pl.ds(j * BLOCK, BLOCK)
                    # loaded before the wgmma: its latency hides there
                    w_scale = ws[w_block, split * k_iters + (idx[0] * sb + j if sb > 1 else idx[0])]

                    def product(tmp, block=block, j=j):
                        x_blk = x_tile.at[:, block] if sb > 1 else x_tile
                        if blocked:
                            w_blk = w_tile.at[j].at[wg_cols] if by_cols else w_tile.at[j]
                        else:
                            w_blk = w_tile.at[:, block] if sb > 1 else w_tile
                        plgpu.wgmma(tmp, x_blk, plgpu.transpose_ref(w_blk, (1, 0)))
                        if cfg.overlap:  # the FMAs run while the tensor cores do this step
                            acc, d_prev, s_prev = carry
                            acc = acc + d_prev * lax.broadcast_in_dim(s_prev, (tile_m, tile_n), [0])
                            return tmp[...], acc
                        return tmp[...], carry  # tmp[...] waits for this warpgroup's wgmma

                    d, carry = pl.run_scoped(product, plgpu.ACC((tile_m, tile_n), jnp.float32))  # [tile_m, tile_n]
                    scale = plgpu.load(xs_smem.at[j, wg_rows], (), layout=row) * w_scale  # [tile_m]
                    if cfg.overlap:
                        return carry, d, scale
                    carry = carry + d * lax.broadcast_in_dim(scale, (tile_m, tile_n), [0])
                return carry

            def run(w, ws):
                get_pipeline(functools.partial(step, ws), compute_context)(
                    x_gmem.at[rows, span], w.at[steps, w_cols] if blocked else w.at[w_cols, span],
                    xs_gmem.at[steps, rows], allocations=allocs)

            if groups_gmem is None:
                run(w_gmem, ws_gmem)
            else:  # a row tile of one group: its weight, or nothing past the used tiles (both CTAs of a pair alike)
                group = groups_gmem[mi]
                pl.when(group >= 0)(lambda: run(w_gmem.at[group], ws_gmem.at[group]))

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _gemm(xq, xs, values, scales, cfg: GemmConfig, out_dtype, num_sms: int, interpret: bool = False, groups=None,
          cols: tuple[int, int] | None = None):
    """One launch over W's columns cols = (first, count) (default all): its output N columns wide when first is 0
    (a tail launch fills the rest), else count."""
    (m, k), n = xq.shape, values.shape[-2]
    col0, count = cols or (0, n)
    cluster = 1 if cfg.cluster is None else 2
    iters = (m // cfg.cta_m // (cluster if cfg.cluster == "m" else 1),
             count // cfg.cta_n // (cluster if cfg.cluster == "n" else 1), k // BLOCK // cfg.k_splits)
    grouped = groups is not None
    return plgpu.kernel(
        functools.partial(_kernel, cfg=cfg, iters=iters, grouped=grouped, col0=col0),
        out_type=jax.ShapeDtypeStruct((cfg.k_splits * m, n if col0 == 0 else count),
                                      out_dtype if cfg.k_splits == 1 else jnp.float32),
        grid=(num_sms // cluster,),
        grid_names=("cluster_grid",),
        cluster=(cluster,),
        cluster_names=("cluster",),
        num_threads=3,
        thread_name="wg",
        interpret=interpret,
    )(*((groups,) if grouped else ()), xq, values, xs, scales.astype(jnp.float32))


def _num_sms() -> int:
    try:
        return jax.devices("gpu")[0].core_count
    except RuntimeError:  # no GPU here: lowering for the H200
        return _SMS


def _check(x, values, scales, cfg: GemmConfig):
    k, (n, vk) = x.shape[1], weight_dims(values)
    if (not supported(k, n) or vk != k or scales.shape != (n // BLOCK, k // BLOCK)
            or (values.ndim == 3 and values.shape[2] != BLOCK)):
        raise ValueError(f"fp8_gemm: x {x.shape}, values {values.shape}, scales {scales.shape}: K and N must be "
                         f"multiples of {BLOCK}, values [N, K] or [K/{BLOCK}, N, {BLOCK}] and scales "
                         f"[N/{BLOCK}, K/{BLOCK}]")
    for name, splits in (("k_splits", cfg.k_splits), ("tail_splits", cfg.tail_splits)):
        if (k // BLOCK) % (splits * cfg.step_blocks):
            raise ValueError(f"fp8_gemm: {name} {splits} ranges of {cfg.step_blocks}-block steps do not divide K's "
                             f"{k // BLOCK} blocks of {BLOCK}")
    if values.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"fp8_gemm: values must be float8_e4m3fn, got {values.dtype}")


def _padded_rows(m: int, cfg: GemmConfig) -> int:
    rows = cfg.cta_m * (2 if cfg.cluster == "m" else 1)
    return -(-m // rows) * rows


def _k_splits(tiles: int, blocks: int, num_sms: int) -> int:
    """K ranges for `tiles` output tiles: doubled while every range's CTA still has an SM of its own, up to
    MAX_K_SPLITS, each range whole 128-blocks of K."""
    splits = 1
    while splits < MAX_K_SPLITS and 2 * splits * tiles <= num_sms and blocks % (2 * splits) == 0:
        splits *= 2
    return splits


def whole_wave_columns(cfg: GemmConfig, m: int, n: int, num_sms: int) -> int:
    """W's columns whose tiles (m rows, padded, cfg fitted to n columns as a call runs it) fill whole waves of the
    persistent grid: n when all of them do or they make less than one wave; fewer, a tail launch takes the rest."""
    cfg = _fit_columns(cfg, n)
    m = _padded_rows(m, cfg)
    cluster = 1 if cfg.cluster is None else 2
    m_units = m // cfg.cta_m // (cluster if cfg.cluster == "m" else 1)
    col_unit = cfg.cta_n * (cluster if cfg.cluster == "n" else 1)
    n_units, ctas = n // col_unit, num_sms // cluster
    main = m_units * n_units // ctas * ctas // m_units
    return main * col_unit if 0 < main < n_units else n


def _with_tail(cfg: GemmConfig, m: int, n: int, k: int, num_sms: int) -> GemmConfig:
    """cfg with the tiles past its last whole wave in K ranges when they would fill at most a quarter of it (up to
    MAX_TAIL_ROWS rows): the most whole-block ranges, up to MAX_TAIL_SPLITS, whose CTAs the SMs hold at once."""
    fitted = _fit_columns(cfg, n)
    main = whole_wave_columns(cfg, m, n, num_sms)
    tail_ctas = _padded_rows(m, fitted) // fitted.cta_m * ((n - main) // fitted.cta_n)
    if cfg.k_splits > 1 or main == n or 4 * tail_ctas > num_sms or m > MAX_TAIL_ROWS:
        return cfg
    splits = max(d for d in range(1, MAX_TAIL_SPLITS + 1) if (k // BLOCK) % d == 0 and d * tail_ctas <= num_sms)
    return dataclasses.replace(cfg, tail_splits=splits)


def with_k_splits(cfg: GemmConfig, splits: int) -> GemmConfig:
    """cfg with K in `splits` ranges on the stages SMEM holds: with warpgroups side by side on columns, the float32
    output tiles of K ranges leave room for three stages only; otherwise DEFAULT_CONFIG's; two-block steps three
    on 64-column tiles, two on wider ones."""
    stages = 3 if splits > 1 and cfg.wg_split == "n" else DEFAULT_CONFIG.max_concurrent_steps
    if cfg.step_blocks > 1:  # a stage twice the bytes: three of 64-column tiles, two of wider ones
        stages = 3 if cfg.tile_n == 64 else 2
    return dataclasses.replace(cfg, k_splits=splits, max_concurrent_steps=stages)


def auto_config(m: int, n: int, k: int, num_sms: int) -> GemmConfig:
    """At most tile_m rows (a wide decode round of 64): the warpgroups side by side on columns (wg n, no padding
    rows multiplied); K in ranges when the 256-column tiles fill at most a quarter of the SMs (64-column warpgroup
    tiles, the ranges counted again, where ranges would be shorter than MIN_RANGE_BLOCKS), 64-column warpgroup
    tiles when they fill more but not all. More rows: DEFAULT_CONFIG, K in ranges while the CTAs fit the SMs.
    Either way, up to MAX_TAIL_ROWS rows, a last wave the tiles would fill at most a quarter of runs as a tail
    launch in K ranges (`_with_tail`).
    Measured at 64-256 rows on the 27B's and the 35B-A3B's projections (docs/benchmarks/fp8/fp8_sweep_wide.md,
    docs/kernels_notes.md "FP8 weights"); more than four ranges lose to the partial sums' traffic."""
    cfg, blocks = DEFAULT_CONFIG, k // BLOCK
    if m <= cfg.tile_m and n % (2 * cfg.tile_n) == 0:
        cfg, tiles = dataclasses.replace(cfg, wg_split="n"), n // (2 * cfg.tile_n)
        if 4 * tiles <= num_sms and (splits := _k_splits(tiles, blocks, num_sms)) > 1:
            if blocks // splits < MIN_RANGE_BLOCKS:
                cfg, splits = dataclasses.replace(cfg, tile_n=cfg.tile_n // 2), _k_splits(2 * tiles, blocks, num_sms)
            return with_k_splits(cfg, splits)
        if tiles < num_sms:
            cfg = dataclasses.replace(cfg, tile_n=cfg.tile_n // 2)
        return _with_tail(cfg, m, n, k, num_sms)
    tiles = -(-m // cfg.cta_m) * (n // cfg.cta_n)
    return _with_tail(with_k_splits(cfg, _k_splits(tiles, blocks, num_sms)), m, n, k, num_sms)


@functools.partial(jax.jit, static_argnames=("config", "out_dtype"))
def fp8_gemm(x, values, scales, *, config: GemmConfig | None = None, out_dtype=None):
    """x [M, K] @ the block-FP8 weight (values [N, K], or `fp8_matmul.blocked`, float8_e4m3fn, scales [N / 128,
    K / 128] float32) with x quantized per token and 128-group; float32 accumulation, the result in out_dtype
    (default x's dtype)."""
    _check(x, values, scales, config or DEFAULT_CONFIG)  # before the quantization reads x in 128-groups
    return fp8_gemm_rows(*quantize_rows(x), values, scales, config=config, out_dtype=out_dtype or x.dtype)


@functools.partial(jax.jit, static_argnames=("config", "out_dtype", "partial_sums"))
def fp8_gemm_rows(xq, xs, values, scales, *, out_dtype, config: GemmConfig | None = None, partial_sums: bool = False):
    """`fp8_gemm` of rows already quantized as `quantize_rows` writes them (xq [M, K] float8_e4m3fn, xs [K / 128, M]
    float32), for a producer that quantizes its own output (pallas_kernels/fp8_rows.py). partial_sums: where the
    config runs K in ranges, their float32 partial sums [k_splits, M, N] unadded, for a consumer that adds them
    itself as `sum_partials` does (pallas_kernels/rms_norm.py); otherwise the product as always."""
    (m, k), (n, _) = xq.shape, weight_dims(values)
    cfg = config or auto_config(m, n, k, _num_sms())
    _check(xq, values, scales, cfg)
    if xs.shape != (k // BLOCK, m) or xq.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"fp8_gemm_rows: xq {xq.shape} {xq.dtype} must be float8_e4m3fn, xs {xs.shape} "
                         f"[K/{BLOCK}, M]")
    cfg, sms = _fit_columns(cfg, n), _num_sms()
    mp = _padded_rows(m, cfg)
    if mp != m:  # padding rows multiply zeros: their outputs are cut off
        xq, xs = jnp.pad(xq, ((0, mp - m), (0, 0))), jnp.pad(xs, ((0, 0), (0, mp - m)))
    main = whole_wave_columns(cfg, mp, n, sms) if cfg.tail_splits > 1 else n
    if partial_sums and cfg.k_splits > 1:  # (K ranges and a tail exclude each other)
        parts = _gemm(xq, xs, values, scales, cfg, out_dtype, sms).reshape(cfg.k_splits, mp, n)
        return parts[:, :m] if mp != m else parts
    out = _summed(_gemm(xq, xs, values, scales, cfg, out_dtype, sms, cols=(0, main)), cfg.k_splits, out_dtype)
    if main < n:  # the tail's columns, each K range's partial sums added into the output in place
        tail = _fit_columns(with_k_splits(dataclasses.replace(cfg, tail_splits=1), cfg.tail_splits), n - main)
        part = _gemm(xq, xs, values, scales, tail, out_dtype, sms, cols=(main, n - main))
        out = lax.dynamic_update_slice(out, _summed(part, tail.k_splits, out_dtype), (0, main))
    return out[:m] if mp != m else out


def _summed(out, splits: int, dtype):
    """A launch's output [splits * M, N] as the product: its K ranges' float32 partial sums added (one range: as
    it is)."""
    return out if splits == 1 else sum_partials(out.reshape(splits, out.shape[0] // splits, -1), dtype)


def _fit_columns(cfg: GemmConfig, n: int) -> GemmConfig:
    """cfg for N columns: the warpgroups side by side on columns, and N clusters, only where the column tiles come
    in pairs."""
    if n % cfg.cta_n:
        cfg = dataclasses.replace(cfg, wg_split="m")
    if cfg.cluster == "n" and n % (2 * cfg.cta_n):
        cfg = dataclasses.replace(cfg, cluster=None)
    return cfg


def grouped_config(n: int, config: GemmConfig | None = None) -> GemmConfig:
    """The config a grouped product runs: one K range, no M clusters (a pair of row tiles may hold two groups), the
    column pairs as `_fit_columns` allows."""
    cfg = dataclasses.replace(config or DEFAULT_CONFIG, k_splits=1, tail_splits=1)
    return _fit_columns(dataclasses.replace(cfg, cluster=None) if cfg.cluster == "m" else cfg, n)


def group_rows(config: GemmConfig | None = None) -> int:
    """The row tile of a grouped product: each group's rows start on its multiples."""
    return grouped_config(2 * BLOCK, config).cta_m


@functools.partial(jax.jit, static_argnames=("config", "out_dtype"))
def grouped_gemm(xq, xs, groups, values, scales, *, config: GemmConfig | None = None, out_dtype=jnp.bfloat16):
    """Rows in runs of one group each (DeepGEMM's contiguous grouped layout, MoE experts' rows sorted by expert):
    out[m] = xq[m] @ the block-FP8 weight groups[m // rows] (`group_rows`), float32 accumulation.

    xq [M, K] float8_e4m3fn and xs [K / 128, M] float32: rows already quantized per token and 128-group
    (`fp8_matmul.quantize_rows`), M a multiple of the row tile; groups [M / rows] int32 (-1: a tile past the used
    ones, its output rows left unwritten); values [G, N, K] float8_e4m3fn, scales [G, N / 128, K / 128]."""
    cfg = grouped_config(values.shape[1], config)
    (m, k), g = xq.shape, values.shape[0]
    _check(xq, values[0], scales[0], cfg)
    if m % cfg.cta_m or groups.shape != (m // cfg.cta_m,) or scales.shape[0] != g or xs.shape != (k // BLOCK, m):
        raise ValueError(f"grouped_gemm: rows {xq.shape}, scales {xs.shape}, groups {groups.shape}: rows must come in "
                         f"tiles of {cfg.cta_m}, one group each; weights {values.shape}, scales {scales.shape}")
    return _gemm(xq, xs, values, scales, cfg, out_dtype, _num_sms(),
                 groups=groups.astype(jnp.int32))


def grouped_reference(xq, xs, groups, values, scales, *, out_dtype=jnp.bfloat16):
    """`grouped_gemm` in jnp (float32 products; skipped tiles' rows 0): each row against its tile's group's weight
    dequantized, times its activation scales."""
    m, k = xq.shape
    tiles = groups.shape[0]
    x = (xq.astype(jnp.float32).reshape(m, k // BLOCK, BLOCK) * xs.T[..., None]).reshape(tiles, m // tiles, k)

    def tile(args):  # one tile at a time: a [G, N, K] float32 copy of the weights would not fit at real shapes
        rows, g = args
        w = values[jnp.maximum(g, 0)].astype(jnp.float32) * jnp.repeat(jnp.repeat(scales[jnp.maximum(g, 0)], BLOCK,
                                                                                   axis=0), BLOCK, axis=1)
        return jnp.where(g >= 0, jnp.dot(rows, w.T, precision=lax.Precision.HIGHEST), 0)

    return lax.map(tile, (x, groups)).reshape(m, -1).astype(out_dtype)


def lower_grouped(m: int, k: int, n: int, groups: int, config: GemmConfig | None = None):
    """The grouped kernel lowered for the H200 (no GPU needed)."""
    args = (jax.ShapeDtypeStruct((m, k), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((k // BLOCK, m), jnp.float32),
            jax.ShapeDtypeStruct((m // group_rows(config),), jnp.int32),
            jax.ShapeDtypeStruct((groups, n, k), jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct((groups, n // BLOCK, k // BLOCK), jnp.float32))
    return jax.jit(functools.partial(grouped_gemm, config=config)).trace(*args).lower(lowering_platforms=("cuda",))


def lower(m: int, k: int, n: int, config: GemmConfig | None = None, blocked: bool = False):
    """The kernel lowered for the H200 (no GPU needed): catches unsupported shapes, layouts and primitives.
    blocked: the weight in `fp8_matmul.blocked`'s layout."""
    values = (k // BLOCK, n, BLOCK) if blocked else (n, k)
    args = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct(values, jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct((n // BLOCK, k // BLOCK), jnp.float32))
    return jax.jit(functools.partial(fp8_gemm, config=config)).trace(*args).lower(lowering_platforms=("cuda",))


def reference(x, values, scales):
    """The kernel's arithmetic in jnp, float32: x quantized the same way, each 128-deep block product scaled by
    its activation and weight scales, summed over blocks (the order differs, so float32 rounding does)."""
    return reference_rows(*quantize_rows(x), values, scales)


def reference_rows(xq, xs, values, scales):
    """`reference` of rows already quantized (`fp8_gemm_rows`' inputs), float32."""
    values = unblocked(values)
    (m, k), n = xq.shape, values.shape[0]
    xb = xq.astype(jnp.float32).reshape(m, k // BLOCK, BLOCK)
    wb = values.astype(jnp.float32).reshape(n, k // BLOCK, BLOCK)
    per_block = jnp.einsum("mbk,nbk->bmn", xb, wb, precision=lax.Precision.HIGHEST)  # [K/128, M, N]
    ws = jnp.repeat(scales, BLOCK, axis=0)[:n]  # [N, K/128]
    return jnp.einsum("bmn,bm,nb->mn", per_block, xs, ws, precision=lax.Precision.HIGHEST)
