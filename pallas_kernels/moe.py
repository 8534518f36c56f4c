"""Routed MoE experts as Pallas kernels: a grouped matmul over one-expert row tiles, prefill and decode.

Computes exactly `reference.moe_experts_ref`: for every token t and each of its K routed experts e,
    y_tk = down_e(silu(gate_e x_t) * up_e x_t),    out_t = sum_k w_tk * y_tk    (float32 result).
Weight layout (ours, transposed from HF): gate_up [E, H, 2I] with the I gate columns first, then the I
up columns; down [E, I, H].

Names: T tokens, K experts per token, R = T*K routed rows (row r = t*K + k), E experts, H hidden,
I expert intermediate, BM/BN/BK tile sides, P padded rows (a multiple of BM).

Three paths. Prefill and wide decode run the same two kernels over row tiles of one expert each; they
differ in how rows are laid out into tiles (steps 1-4 below). Narrow decode (R <= `gemv_max_rows`, one
lane) runs two split-K matrix-vector kernels instead (step 5). On a Hopper GPU, FP8 x FP8 prefill rows with
many rows a expert take `fp8_gemm.grouped_gemm` instead of the two kernels (`_grouped_moe`).
  1. Layout. Prefill (R > `MoeConfig.decode_max_rows`), the moe_align_block_size idea of vLLM's fused_moe
     and the group offsets of megablox's gmm: `align_rows` sorts the R rows by expert (one int32 key per
     row, so XLA runs a single-operand sort) and pads each expert's run to a multiple of BM. Decode
     (1-8 lanes, R <= 64): `_rows_as_tiles` gives every routed row a 16-row tile of its own (row r, then
     padding): no sort, and each tile streams exactly its row's expert (the 15 padding rows ride along
     free on the tensor cores), an expert two rows use twice; with `MoeConfig.decode_share_tiles` the kernels
     find the rows of each tile's expert themselves (`_tile`) and one tile takes them all, so HBM traffic is
     the used experts' bytes, with no layout kernel. Results: `sorted_rows` [P]
     (the source row r of each slot, R for padding) and `tile_expert` [P / BM] (the one expert of each
     row tile, -1 past the used tiles). Prefill P has the static bound R + min(E, R) * (BM - 1), so no
     tile straddles two experts and no shape depends on the routing.
  2. `gate_up_call`: per (column block, row tile), gathers the tile's token rows of x inside the
     kernel, reads its expert's gate and up column blocks (expert id from `tile_expert`), and writes
     act = silu(gate) * up [P, I] in the weights' dtype: the SiLU gate is fused, gate/up never reach HBM.
  3. `down_call`: act tile @ down[e] times the routing weight, stored straight to the row's place in
     token order (row r of y [R + 1, H]; padding goes to the spare row R).
  4. out = y[:R].reshape(T, K, H).sum(1) in float32 (one fused XLA reduction, no scatter).
  5. Narrow decode: every routed row is a matrix-vector product over its own expert. A row's 16-row tile
     leaves too few programs (R * I / BN) in flight to keep HBM busy, and narrow column blocks read each
     weight row in 64-byte pieces. The gate_up kernel (`_gemv_call`) splits the H contraction into S
     pieces (grid column block x row x split, wide column blocks), each program writing float32 partial
     sums [S, R, 2I]; the down kernel sums them and applies silu(gate) * up as it reads act (rounded to the
     weights' dtype, as in the tiled path), splits I the same way and scales each row by its routing weight
     ([S2, R, H] partials), and one float32 reduction sums splits and each token's experts. A shared expert
     of the same I rides along as one more row per token (rows go token by token, its routed experts then
     the shared one, which reads its own weights and is scaled by its gate): one lane's round reads all
     nine experts' weights in two kernels instead of the shared expert's four matmul and glue kernels.
     Given the router's logits instead of the routing (`moe_experts_routed`), each routed program of gate_up
     chooses its token's experts itself (`moe_route.select`, a few microseconds before its weight loads) and the
     token's first program writes the ids, weights and shared gate down reads: the router kernel goes (a 35B-A3B
     one-lane round 2% shorter on an H100).
  In the tiled layouts a shared expert of the experts' I can ride along as more row tiles (`_tile`,
  `shared_tiles_layout`); elsewhere it is two plain matmuls added to the routed sum.

Pallas notes (see DESIGN.md "Pallas"): GPU lowers through Triton (no scalar prefetch), so every weight
and index ref is passed whole and indexed inside the kernel with ids loaded from an index array; block
sides are powers of two and dots are 2-D with sides >= 16. The same kernels run on CPU with
interpret=True (tests); interpret mode fills outputs with NaN before the kernels run, so an unwritten
element shows up in the result.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _compat, fp8_gemm, fp8_matmul, fp8_rows, moe_route
from pallas_kernels import reference as ref
from pallas_kernels._blocks import is_pow2
from pallas_kernels.reference import SharedExpert


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """Tuning knobs (hashable: a static jit argument). Block sides are clamped to the problem's dims.

    Narrow decode (R <= gemv_max_rows) has its own gemv_* column blocks, contraction steps, splits,
    warps and stages. Prefill: block_m rows per tile (also the per-expert padding unit), block_n columns of gate (and of
    up) per program, block_k the contraction step over H; the down projection uses down_block_n
    columns of H and down_block_k steps over I. Decode (16-row tiles, one routed row each) has its own
    decode_* column blocks, steps, warps and pipeline stages.
    """

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    down_block_n: int = 128
    down_block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3
    decode_max_rows: int = 64  # R = T*K at or below this takes the decode layout
    decode_block_n: int = 32
    decode_block_k: int = 256
    decode_down_block_n: int = 64
    decode_down_block_k: int = 256
    decode_num_warps: int = 4
    decode_num_stages: int = 4
    # Decode rows routed to one expert share its tiles (`_tile`), so a round reads each used expert once; off: every
    # row streams its expert alone (8 lanes of the 35B-A3B route 64 rows to about 57 experts)
    decode_share_tiles: bool = True
    # With shared tiles, a shared expert of the experts' I as one more tile of both kernels (one row per token) instead
    # of two matmuls and their glue: the 35B-A3B's 4- and 8-lane rounds 0.970x / 0.982x on an H100, FP8 dynamic 0.909x /
    # 0.940x (docs/kernels_notes.md)
    decode_shared_tile: bool = True
    # The tiled layout (R > decode_max_rows) with a shared expert of the experts' I and at most this many tokens: the
    # shared expert as ceil(T / block_m) more row tiles of both kernels (T rows, its gate the rows' weight) instead of
    # two matmuls and their glue (FP8 ones dequantized every round: six XLA kernels, 18 us a 35B-A3B layer at 64
    # lanes on an H100); 0: never. The 35B-A3B's FP8-dynamic rounds 0.986x / 0.986x / 0.991x at 64 / 128 / 256
    # lanes on an H100, bf16 0.997x at 64 (docs/kernels_notes.md)
    tiled_shared_max_tokens: int = 256
    gemv_max_rows: int = 16  # R at or below this takes the split-K matrix-vector path (0: never)
    # Many small programs: 16 splits on 2 warps gave the shortest 35B-A3B one-lane round of the sweep, one split per
    # kernel (fused epilogues, fewer programs) a far slower one; down's 8 splits, once it finished act from gate_up's
    # partial sums, 1-4% shorter MoE layers than 4 on an H100 (docs/kernels_notes.md)
    gemv_block_n: int = 128
    gemv_block_k: int = 64
    gemv_splits: int = 16  # pieces of the H contraction in gate_up
    gemv_down_block_n: int = 128
    gemv_down_block_k: int = 64
    gemv_down_splits: int = 8  # pieces of the I contraction in down
    gemv_num_warps: int = 2
    gemv_num_stages: int = 4
    # FP8 experts with at least this many routed rows per expert (on average) are dequantized to bf16 first
    fp8_dequantize_rows_per_expert: int = 128
    # The model's FP8 x FP8 tiles (fp8_activations, FP8_ROWS_CONFIG) up to this many routed rows per expert: a 35B-A3B
    # layer ran 1.12-1.59x the weight-only FP8 paths at 32-256 a expert, 0.97x at 384 (docs/benchmarks/fp8/fp8_moe.md)
    fp8_dynamic_rows_per_expert: int = 256
    # FP8 x FP8 prefill rows from this many routed rows per expert take the grouped wgmma GEMM on a Hopper GPU
    # (`_grouped_moe`) instead of the tiles: a 35B-A3B layer on an H100 ran 1.15x the tiles at 128 a expert, 1.34x at
    # 256 and 1.61x at 1024, and 0.79x at 64 in an earlier build (docs/benchmarks/fp8/fp8_moe.md)
    fp8_grouped_rows_per_expert: int = 128

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, int) or v < 0:  # bools are ints
                raise ValueError(f"MoeConfig.{f.name} must be a non-negative int, got {v!r}")
            if "block" in f.name and not is_pow2(v, 16):
                raise ValueError(f"MoeConfig.{f.name} must be a power of two >= 16, got {v}")
            if f.name.endswith("num_warps") and not is_pow2(v):
                raise ValueError(f"MoeConfig.{f.name} must be a power of two, got {v}")
            if f.name.endswith("splits") and not is_pow2(v):
                raise ValueError(f"MoeConfig.{f.name} must be a power of two, got {v}")
            if f.name.endswith("num_stages") and v < 1:
                raise ValueError(f"MoeConfig.{f.name} must be >= 1, got {v}")


# Tuned on the H200 at the 35B-A3B shapes (docs/benchmarks/moe.md has the sweeps).
DEFAULT_CONFIG = MoeConfig()
# Prefill with few rows per expert (R < E * 64; 512 tokens of 35B-A3B have 16 per expert): 32-row tiles
# waste less padding, and the step is bound by reading every used expert's weights once.
SPARSE_PREFILL_CONFIG = MoeConfig(block_m=32, num_warps=4, num_stages=4)
# Prefill with 64-127 rows per expert (2048 tokens of 35B-A3B route 64 to each): 128-row tiles would be about
# half padding; 64-row tiles on 4 warps are faster there (docs/benchmarks/moe.md).
MID_PREFILL_CONFIG = MoeConfig(block_m=64, num_warps=4, num_stages=4)
# FP8 x FP8 tiles at any prefill row count: 32 rows and 128-deep steps (one scale group) on 4 warps. Wider row
# tiles ran slower on gathered rows (at 8192 tokens of the 35B-A3B 128-row tiles on 8 warps took 2.7 ms against
# 1.8; docs/benchmarks/fp8/fp8_moe.md), and neither rows put in tile order first nor one accumulator a tile made them
# win (docs/kernels_notes.md).
FP8_ROWS_CONFIG = MoeConfig(block_m=32, block_k=128, down_block_k=128, num_warps=4, num_stages=4)
# The same at up to FP8_NARROW_ROWS_PER_EXPERT routed rows a expert (a wide decode round: 64-256 lanes of the 35B-A3B
# route 2-8 to each): 16-row tiles multiply half the padding rows of 32. On an H100 the 35B-A3B's FP8 rounds ran
# 2.2% / 2.0% / 1.1% shorter at 64 / 128 / 256 lanes, one layer 4.5% / 3% at 64 / 128 tokens (docs/kernels_notes.md).
FP8_NARROW_ROWS_CONFIG = dataclasses.replace(FP8_ROWS_CONFIG, block_m=16)
FP8_NARROW_ROWS_PER_EXPERT = 8
# Decode with more than 16 routed rows (2-8 lanes): wider column blocks, already enough programs.
WIDE_DECODE_CONFIG = MoeConfig(decode_block_n=64, decode_block_k=128, decode_down_block_n=128,
                               decode_down_block_k=128)
# The grouped GEMM's down product (K = I, four 128-deep steps a tile) walks row tiles fastest: 4-7% shorter than the
# column-fast default on an H100 at 8192-32768 tokens of the 35B-A3B, where gate_up ran 1-9% slower so
# (docs/kernels_notes.md)
GROUPED_DOWN_CONFIG = dataclasses.replace(fp8_gemm.DEFAULT_CONFIG, grid_minor="m")
_DECODE_BLOCK_M = 16  # the smallest side of a Pallas dot


def default_config(rows: int, num_experts: int, fp8_rows: bool = False) -> MoeConfig:
    """The tuned config for R routed rows over E experts (what `moe_experts` takes when given None); fp8_rows:
    for its FP8 x FP8 tiles (quantize_activations)."""
    if rows <= DEFAULT_CONFIG.decode_max_rows:
        return WIDE_DECODE_CONFIG if rows > 16 else DEFAULT_CONFIG
    if fp8_rows:
        return FP8_NARROW_ROWS_CONFIG if rows <= num_experts * FP8_NARROW_ROWS_PER_EXPERT else FP8_ROWS_CONFIG
    if rows < num_experts * 64:
        return SPARSE_PREFILL_CONFIG
    if rows < num_experts * 128:
        return MID_PREFILL_CONFIG
    return DEFAULT_CONFIG


def dot(a, b):
    # float32 operands: IEEE products (Triton's default for them is TF32 under jax >= 0.11).
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jnp.dot(a, b, precision=precision, preferred_element_type=jnp.float32)


@dataclasses.dataclass(frozen=True)
class _Weight:
    """One weight operand inside a kernel: a plain ref [(E,) K, N], or a block-FP8 one, its values ref
    [(E,) N, K] and scales ref [(E,) N / 128, K / 128]. A tile never straddles two 128-blocks (its sides divide
    128 and start on their multiples), so its scale is one number, applied to the tile's product."""

    ref: object
    scales: object = None

    @staticmethod
    def take(refs, fp8: bool):
        """The first weight of `refs` and the refs after it."""
        n = 2 if fp8 else 1
        return _Weight(*refs[:n]), refs[n:]

    def dot(self, xt, e, k0, c0, block_k: int, block_n: int, row_scale=None):
        """xt [BM, BK] @ the [BK, BN] tile at rows k0, columns c0 of expert e, float32, times row_scale [BM, 1]
        when given (FP8 rows' scales); e None for a weight without an expert axis (the shared expert's)."""
        lead = () if e is None else (e,)
        if self.scales is None:
            d = dot(xt, self.ref[(*lead, pl.ds(k0, block_k), pl.ds(c0, block_n))])
            return d if row_scale is None else d * row_scale
        w = self.ref[(*lead, pl.ds(c0, block_n), pl.ds(k0, block_k))].astype(xt.dtype)  # [BN, BK]
        precision = lax.Precision.HIGHEST if xt.dtype == jnp.float32 else None
        d = lax.dot_general(xt, w, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32)
        scale = self.scales[(*lead, c0 // fp8_matmul.BLOCK, k0 // fp8_matmul.BLOCK)]
        # Both scales folded into one [BM, 1] vector first: a tile's product then takes one multiply per element,
        # which the caller's accumulation can contract into an FMA (scaling by each in turn cost 11% at 8192
        # tokens of the 35B-A3B).
        return d * (scale if row_scale is None else row_scale * scale)

    def vec(self, xv, e, k0, c0, block_k: int, block_n: int):
        """xv [BK] float32 against the tile at rows k0, columns c0 ([BN] float32); e None for a weight without
        an expert axis (the shared expert's)."""
        lead = () if e is None else (e,)
        if self.scales is None:
            tile = self.ref[(*lead, pl.ds(k0, block_k), pl.ds(c0, block_n))].astype(jnp.float32)
            return jnp.sum(xv[:, None] * tile, axis=0)
        tile = self.ref[(*lead, pl.ds(c0, block_n), pl.ds(k0, block_k))].astype(jnp.float32)  # [BN, BK]
        scale = self.scales[(*lead, c0 // fp8_matmul.BLOCK, k0 // fp8_matmul.BLOCK)]
        return jnp.sum(tile * xv[None, :], axis=1) * scale


def _operands(w) -> tuple:
    """A weight's arrays as kernel inputs: (array,) or (FP8 values, scales)."""
    return tuple(w) if isinstance(w, fp8_matmul.BlockFp8) else (w,)


# ----------------------------------------------------------------------------------------------------
# Kernels: grouped matmul over row tiles of one expert each.


def _gate_up_kernel(*refs, fp8: bool, fp8_rows: bool, top_k: int, num_rows: int, block_m: int, block_n: int,
                    block_k: int, share_tiles: bool, shared_rows: int):
    # the layout refs (`_tile`), then x_ref: [T, H]; refs: with fp8_rows x's scales [H / 128, T] f32 first; the gate_up
    #   weight [E, H, 2I] (see _Weight), with shared_rows the shared expert's [H, 2I]; then act_ref, and with fp8_rows
    #   act_scale_ref. Rows: R routed (row r = t K + k), then shared_rows shared ones (row R + t), num_rows in all
    # act_ref (out): [P, I], this program writes [BM, BN] at (tile m, column block n); with fp8_rows FP8, each
    #   row's BN columns over its scale act_scale_ref[P, I / BN] (largest magnitude at 448)
    n, m = pl.program_id(0), pl.program_id(1)
    e, rows, (x_ref, *refs) = _tile(refs, m, block_m, num_rows, share_tiles, shared_rows)
    x_scale_ref, refs = (refs[0], refs[1:]) if fp8_rows else (None, refs)
    gate_up, refs = _Weight.take(refs, fp8)
    shared, (act_ref, *act_scale_ref) = _Weight.take(refs, fp8) if shared_rows else (None, refs)
    hidden, inter = x_ref.shape[1], act_ref.shape[1]
    routed = num_rows - shared_rows

    def tile(gate_up, e):
        # padding rows read token 0
        tokens = jnp.where(rows < routed, lax.div(rows, top_k), jnp.where(rows < num_rows, rows - routed, 0))

        def body(i, acc):
            acc_g, acc_u = acc
            k0 = pl.multiple_of(i * block_k, block_k)
            xt = x_ref[tokens, pl.ds(k0, block_k)]
            if x_scale_ref is None:
                xt, x_scale = xt.astype(act_ref.dtype), None
            else:  # FP8 rows as they are; their scales [BM, 1] (BK lies in one 128-group of a row)
                x_scale = x_scale_ref[k0 // fp8_matmul.BLOCK, tokens][:, None]
            return (acc_g + gate_up.dot(xt, e, k0, n * block_n, block_k, block_n, x_scale),
                    acc_u + gate_up.dot(xt, e, k0, inter + n * block_n, block_k, block_n, x_scale))

        zero = jnp.zeros((block_m, block_n), jnp.float32)
        g, u = lax.fori_loop(0, hidden // block_k, body, (zero, zero))
        act = g * jax.nn.sigmoid(g) * u
        out = (pl.ds(m * block_m, block_m), pl.ds(n * block_n, block_n))
        if fp8_rows:
            scale = fp8_matmul.group_scale(act)
            act_ref[out] = (act / scale[:, None]).astype(act_ref.dtype)
            act_scale_ref[0][pl.ds(m * block_m, block_m), n] = scale
        else:
            act_ref[out] = act.astype(act_ref.dtype)

    _routed_or_shared_tile(e, tile, gate_up, shared)


def _num_tiles(layout, shared) -> int:
    """The row tiles a layout gives the two kernels: one a routed row with the expert ids (`_tile`), and the shared
    expert's one past them; (tile_expert, sorted_rows) counts its own, any shared tiles included."""
    return layout[0].shape[0] + (shared is not None and len(layout) == 1)


def gate_up_call(layout, x, gate_up, *, act_dtype, top_k, num_rows, inter, block_m, block_n, block_k, num_warps,
                 num_stages, interpret, x_scales=None, shared=None):
    """act [P, I] in act_dtype; with x_scales (x FP8 [T, H], its scales [H / 128, T]) FP8 x FP8 products and
    (act FP8 [P, I], its scales [P, I / block_n]). layout: (tile_expert, sorted_rows), or (expert ids,) (`_tile`);
    shared: the shared expert's gate_up for T rows past num_rows: with the expert ids one more tile (`_tile`), with
    (tile_expert, sorted_rows) the tiles `shared_tiles_layout` appended."""
    shared_rows = 0 if shared is None else x.shape[0]
    num_tiles = _num_tiles(layout, shared)
    fp8_rows = x_scales is not None
    kernel = functools.partial(_gate_up_kernel, fp8=isinstance(gate_up, fp8_matmul.BlockFp8), fp8_rows=fp8_rows,
                               top_k=top_k, num_rows=num_rows + shared_rows, block_m=block_m, block_n=block_n,
                               block_k=block_k, share_tiles=len(layout) == 1, shared_rows=shared_rows)
    act = jax.ShapeDtypeStruct((num_tiles * block_m, inter), jnp.float8_e4m3fn if fp8_rows else act_dtype)
    scales = [jax.ShapeDtypeStruct((num_tiles * block_m, inter // block_n), jnp.float32)] if fp8_rows else []
    # Grid (column block n, row tile m): n varies fastest, so the programs sharing a row tile's x rows
    # run together, and neighbouring row tiles of one expert re-read its weights from L2.
    # No BlockSpecs: every ref is the whole array; the kernel indexes it with the ids it loads.
    return pl.pallas_call(
        kernel,
        grid=(inter // block_n, num_tiles),
        out_shape=[act, *scales] if fp8_rows else act,
        compiler_params=_compat.triton_params(num_warps, num_stages),
        interpret=interpret,
        name="moe_gate_up_fp8_rows" if fp8_rows else "moe_gate_up",
    )(*layout, x, *([x_scales] if fp8_rows else []), *_operands(gate_up),
      *(() if shared is None else _operands(shared)))


def _down_kernel(*refs, fp8: bool, fp8_rows: bool, num_rows: int, block_m: int, block_n: int, block_k: int,
                 share_tiles: bool, shared_rows: int):
    # the layout refs (`_tile`), then row_weight_ref: [N + 1] f32 (0 at N = num_rows, the rows as in _gate_up_kernel)
    # act_ref: [P, I] (FP8 with fp8_rows) refs: with fp8_rows act's scales [P, I / G] first (G a multiple of BK);
    #   the down weight [E, I, H] (see _Weight), with shared_rows the shared expert's [I, H], then y_ref
    # y_ref (out): [N + 1, H], this program writes its tile's BM rows (scattered to rows r) x BN columns
    n, m = pl.program_id(0), pl.program_id(1)
    e, rows, (row_weight_ref, act_ref, *refs) = _tile(refs, m, block_m, num_rows, share_tiles, shared_rows)
    act_scale_ref, refs = (refs[0], refs[1:]) if fp8_rows else (None, refs)
    down, refs = _Weight.take(refs, fp8)
    shared, (y_ref,) = _Weight.take(refs, fp8) if shared_rows else (None, refs)
    inter = act_ref.shape[1]

    def tile(down, e):
        def body(i, acc):
            k0 = pl.multiple_of(i * block_k, block_k)
            at = act_ref[pl.ds(m * block_m, block_m), pl.ds(k0, block_k)]  # [BM, BK]
            act_scale = None
            if fp8_rows:  # BK lies in one scale group of act's row
                group = act_ref.shape[1] // act_scale_ref.shape[1]
                act_scale = act_scale_ref[pl.ds(m * block_m, block_m), k0 // group][:, None]
            return acc + down.dot(at, e, k0, n * block_n, block_k, block_n, act_scale)

        acc = lax.fori_loop(0, inter // block_k, body, jnp.zeros((block_m, block_n), jnp.float32))
        weight = row_weight_ref[rows]  # [BM]
        # Padding rows all land on the spare row N (never read back); real rows are unique.
        y_ref[rows, pl.ds(n * block_n, block_n)] = (acc * weight[:, None]).astype(y_ref.dtype)

    _routed_or_shared_tile(e, tile, down, shared)


def down_call(layout, row_weight, act, down, *, hidden, block_m, block_n, block_k, num_warps, num_stages, interpret,
              act_scales=None, out_dtype=None, shared=None, shared_rows=0):
    """y [N + 1, H] in act's dtype (out_dtype with act_scales: act FP8 [P, I], its scales [P, I / G]); layout as
    `gate_up_call`'s; shared: its shared expert's down, for the last shared_rows of the N rows row_weight weighs."""
    num_tiles = _num_tiles(layout, shared)
    num_rows = row_weight.shape[0] - 1
    fp8_rows = act_scales is not None
    kernel = functools.partial(_down_kernel, fp8=isinstance(down, fp8_matmul.BlockFp8), fp8_rows=fp8_rows,
                               num_rows=num_rows, block_m=block_m, block_n=block_n, block_k=block_k,
                               share_tiles=len(layout) == 1, shared_rows=shared_rows)
    # Grid (column block n of H, row tile m), n fastest as in `gate_up_call`.
    # No BlockSpecs: whole-array refs indexed in the kernel (expert id, scattered output rows).
    return pl.pallas_call(
        kernel,
        grid=(hidden // block_n, num_tiles),
        out_shape=jax.ShapeDtypeStruct((num_rows + 1, hidden), out_dtype if fp8_rows else act.dtype),
        compiler_params=_compat.triton_params(num_warps, num_stages),
        interpret=interpret,
        name="moe_down_fp8_rows" if fp8_rows else "moe_down",
    )(*layout, row_weight, act, *([act_scales] if fp8_rows else []), *_operands(down),
      *(() if shared is None else _operands(shared)))


def _gemv_gate_up_kernel(route_ref, x_ref, *refs, fp8: bool, with_shared: bool, top_k: int, block_n: int,
                         block_k: int, steps: int, routes: bool = False):
    # route_ref: [T K] int32 the rows' experts; with `routes` the router's float32 logits [T, E] instead: each routed
    # program chooses its token's experts itself (`moe_route.select`), so the router needs no kernel of its own
    # x_ref: [T, H]
    # refs: the gate_up weight [E, H, 2I], the shared expert's [H, 2I] when it rides along (see _Weight), with `routes`
    # and a shared expert its gate [H]; part_ref; with `routes` ids_ref [T, K] int32, weights_ref [T, K] f32 (and the
    # shared expert's weight [T, 1] f32), written by the token's first program for the down kernel
    # part_ref (out): [S, T J, 2I] f32, this program writes the gate and the up columns of its block n for row r
    # (token r // J's expert r % J, see _row), summed over its split s of H (steps * block_k rows of the weights)
    gate_up, refs = _Weight.take(refs, fp8)
    shared, refs = _Weight.take(refs, fp8) if with_shared else (None, refs)
    gate_w_ref, refs = (refs[0], refs[1:]) if routes and with_shared else (None, refs)
    part_ref, *route_out = refs
    n, r, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    t, j, routed_id = _row(r, top_k, with_shared)
    inter = part_ref.shape[2] // 2
    cdt = x_ref.dtype if fp8 else gate_up.ref.dtype

    def accumulate(weight, e):
        def body(i, acc):
            acc_g, acc_u = acc
            k0 = pl.multiple_of((s * steps + i) * block_k, block_k)
            xv = x_ref[t, pl.ds(k0, block_k)].astype(cdt).astype(jnp.float32)  # [BK]
            return (acc_g + weight.vec(xv, e, k0, n * block_n, block_k, block_n),
                    acc_u + weight.vec(xv, e, k0, inter + n * block_n, block_k, block_n))

        zero = jnp.zeros((block_n,), jnp.float32)
        g, u = lax.fori_loop(0, steps, body, (zero, zero))
        part_ref[s, r, pl.ds(n * block_n, block_n)] = g
        part_ref[s, r, pl.ds(inter + n * block_n, block_n)] = u

    def routed():
        if not routes:
            accumulate(gate_up, route_ref[routed_id])
            return
        ids, weights = moe_route.select(route_ref[t, :], top_k)
        accumulate(gate_up, jnp.sum(jnp.where(lax.broadcasted_iota(jnp.int32, (top_k,), 0) == j, ids, 0)))

        @pl.when((n == 0) & (s == 0) & (j == 0))
        def _():
            ids_ref, weights_ref, *shared_ref = route_out
            ids_ref[t, :], weights_ref[t, :] = ids, weights
            if with_shared:
                shared_ref[0][t, :] = moe_route.shared_gate(x_ref[t, :], gate_w_ref[...])

    _routed_or_shared(j, top_k, with_shared, routed, lambda: accumulate(shared, None))


def _gemv_down_kernel(expert_ids_ref, route_w_ref, gu_ref, *refs, fp8: bool, with_shared: bool, top_k: int,
                      block_n: int, block_k: int, steps: int, act_dtype):
    # expert_ids_ref, route_w_ref: [T K] int32 / f32    gu_ref: [S, T J, 2I] f32, the gate_up kernel's partial sums
    # refs: the down weight [E, I, H], with the shared expert its down [I, H] (see _Weight) and shared_w_ref [T]
    # f32, then part_ref (out): [S2, T J, H] f32, this program writes row r's column block n summed over split s
    # of I, times the row's weight (its routing weight, or the shared expert's gate)
    # Each step finishes its act columns from the partial sums (L2-resident, re-read by every column block):
    # cheaper than the XLA kernel that did so between the two.
    down, refs = _Weight.take(refs, fp8)
    shared, refs = _Weight.take(refs, fp8) if with_shared else (None, refs)
    *shared_w_ref, part_ref = refs
    n, r, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    t, j, routed_id = _row(r, top_k, with_shared)
    inter = gu_ref.shape[2] // 2

    def accumulate(weight, e, row_weight):
        def body(i, acc):
            k0 = pl.multiple_of((s * steps + i) * block_k, block_k)
            g = jnp.sum(gu_ref[:, r, pl.ds(k0, block_k)], axis=0)  # [BK]
            u = jnp.sum(gu_ref[:, r, pl.ds(inter + k0, block_k)], axis=0)
            av = (g * jax.nn.sigmoid(g) * u).astype(act_dtype).astype(jnp.float32)  # act rounded as the tiles'
            return acc + weight.vec(av, e, k0, n * block_n, block_k, block_n)

        acc = lax.fori_loop(0, steps, body, jnp.zeros((block_n,), jnp.float32))
        part_ref[s, r, pl.ds(n * block_n, block_n)] = acc * row_weight

    _routed_or_shared(j, top_k, with_shared,
                      lambda: accumulate(down, expert_ids_ref[routed_id], route_w_ref[routed_id]),
                      lambda: accumulate(shared, None, shared_w_ref[0][t]))


def _row(r, top_k: int, with_shared: bool):
    """Row r of the matrix-vector kernels -> (token t, its expert j, the routed row t K + j). Rows go token by
    token, J = K (+ 1 with the shared expert, last) each, so row r's partial sums reshape to [T, J] for free."""
    per_token = top_k + 1 if with_shared else top_k
    t, j = lax.div(r, per_token), lax.rem(r, per_token)
    return t, j, t * top_k + j


def _routed_or_shared(j, top_k: int, with_shared: bool, routed, shared):
    """Run a matrix-vector program for its token's expert j: `routed()` for the K routed experts, `shared()` for
    the shared expert past them (only when it rides along)."""
    if not with_shared:
        routed()
        return
    pl.when(j < top_k)(routed)
    pl.when(j >= top_k)(shared)


def _gemv_call(kernel, name, inputs, *, fp8, with_shared, rows, contraction, out_cols, width, block_n, block_k,
               splits, num_warps, num_stages, interpret, extra_out=(), **kw):
    """One split-K matrix-vector kernel over weights of `contraction` rows: grid (column block of `out_cols`, row,
    split), whole-array refs, f32 partial sums [splits, rows, width] (then `extra_out`'s arrays, when given). `inputs`
    are the kernel's refs in order."""
    if contraction % block_k:
        raise ValueError(f"moe_experts: {name}: contraction {contraction} is not a multiple of block_k {block_k}")
    total = contraction // block_k
    splits = min(splits, total)  # small shapes: fewer, whole pieces, a power of two (a block side of the partials)
    while total % splits or splits & (splits - 1):
        splits -= 1
    steps = total // splits
    kernel = functools.partial(kernel, fp8=fp8, with_shared=with_shared, block_n=block_n, block_k=block_k,
                               steps=steps, **kw)
    part = jax.ShapeDtypeStruct((splits, rows, width), jnp.float32)
    return pl.pallas_call(
        kernel,
        grid=(out_cols // block_n, rows, splits),
        out_shape=(part, *extra_out) if extra_out else part,
        compiler_params=_compat.triton_params(num_warps, num_stages),
        interpret=interpret,
        name=name,
    )(*inputs)


def align_rows(flat_ids: jax.Array, num_experts: int, block_m: int, pad: int | None = None):
    """Sort the R routed rows by expert and pad each expert's run to a multiple of block_m.

    Args:
      flat_ids: [R] int32 expert of each routed row (row r = t*K + k).
      pad: the padding slots' row (default R).
    Returns:
      sorted_rows [P] int32: source row of each padded slot (pad), grouped by expert in
        ascending order, rows of one expert in ascending r;
      tile_expert [P / block_m] int32: the expert of each row tile, -1 for tiles past the last used one.
    P = block_m * ((R + min(E, R) * (block_m - 1)) // block_m), a static bound on the padded rows.
    """
    r = flat_ids.shape[0]
    num_tiles = (r + min(num_experts, r) * (block_m - 1)) // block_m
    iota = jnp.arange(r, dtype=jnp.int32)
    if num_experts * r < 2**31:
        # One int32 key per row (expert major, row minor): a single-operand sort (XLA GPU may hand it to
        # a library radix sort), and unique keys make it stable for free.
        keys = lax.sort(flat_ids * r + iota)
        s_expert, s_row = keys // r, keys % r
    else:
        s_expert, s_row = lax.sort((flat_ids, iota), num_keys=1, is_stable=True)
    counts = jnp.zeros((num_experts,), jnp.int32).at[flat_ids].add(1)
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = jnp.cumsum(padded)
    start = jnp.cumsum(counts) - counts
    dest = (padded_end - padded)[s_expert] + iota - start[s_expert]  # padded slot of sorted row j
    sorted_rows = jnp.full((num_tiles * block_m,), r if pad is None else pad, jnp.int32).at[dest].set(
        s_row, unique_indices=True)
    tile_start = jnp.arange(num_tiles, dtype=jnp.int32) * block_m
    # Expert of a tile = how many padded runs end at or before its first row (compare-all: E is small,
    # and it avoids the device loop of a binary search).
    tile_expert = jnp.sum(padded_end[None, :] <= tile_start[:, None], axis=1, dtype=jnp.int32)
    tile_expert = jnp.where(tile_expert < num_experts, tile_expert, -1)
    return sorted_rows, tile_expert


_SHARED_TILE = 2**30  # `_tile`'s expert for the shared expert's tile


def _tile(refs, m, block_m: int, num_rows: int, share_tiles: bool, shared_rows: int = 0):
    """Row tile m's expert (-1: the tile holds no rows; `_SHARED_TILE`: the shared expert's), its BM source rows
    (num_rows marks padding) and the refs after the layout's. The layout refs: (tile_expert, sorted_rows) as
    `align_rows` or `_rows_as_tiles` give them; with share_tiles the decode rows' experts [R] alone (R a power of two):
    tile m < R holds row m and the next BM - 1 rows of its expert, in row order, where m's rank among that expert's
    rows is a multiple of BM, and none otherwise; with shared_rows (<= BM) tile R holds the shared expert's rows R,
    R + 1, ... Every row then lies in exactly one tile, and each used expert is read once per BM of its rows."""
    if not share_tiles:
        tile_expert_ref, sorted_rows_ref, *rest = refs
        return tile_expert_ref[m], sorted_rows_ref[pl.ds(m * block_m, block_m)], rest
    ids_ref, *rest = refs
    routed = ids_ref.shape[0]
    e = ids_ref[jnp.minimum(m, routed - 1)]
    same = (ids_ref[...] == e).astype(jnp.int32)  # [R]
    rank = jnp.cumsum(same) - 1  # each of e's rows' rank among them
    row = lax.broadcasted_iota(jnp.int32, (routed,), 0)
    first = jnp.sum(jnp.where(row == m, rank, 0))
    wanted = lax.broadcasted_iota(jnp.int32, (block_m, routed), 0) + first  # [BM, R]
    hit = (same[None, :] == 1) & (rank[None, :] == wanted)
    rows = jnp.min(jnp.where(hit, row[None, :], num_rows), axis=1)
    e = jnp.where(first % block_m == 0, e, -1)
    if shared_rows:
        slot = lax.broadcasted_iota(jnp.int32, (block_m,), 0)
        rows = jnp.where(m == routed, jnp.where(slot < shared_rows, routed + slot, num_rows), rows)
        e = jnp.where(m == routed, _SHARED_TILE, e)
    return e, rows, rest


def _routed_or_shared_tile(e, tile, weight, shared):
    """Run a tile program: tile(weight, e) for a routed expert's tile, tile(shared, None) for the shared expert's
    (`_tile`), nothing for an empty one."""
    pl.when((e >= 0) & (e < _SHARED_TILE))(lambda: tile(weight, e))
    if shared is not None:
        pl.when(e == _SHARED_TILE)(lambda: tile(shared, None))


def shared_tiles_layout(flat_ids: jax.Array, num_experts: int, block_m: int, tokens: int):
    """(tile_expert, sorted_rows): `align_rows`' tiles of the R routed rows, then the shared expert's rows R ..
    R + tokens - 1 as ceil(tokens / block_m) tiles of `_SHARED_TILE`; every padding slot holds R + tokens (the
    kernels' spare row), so no padding lands on a shared row."""
    routed = flat_ids.shape[0]
    sorted_rows, tile_expert = align_rows(flat_ids, num_experts, block_m, pad=routed + tokens)
    n = -(-tokens // block_m)
    slot = jnp.arange(n * block_m, dtype=jnp.int32)
    rows = jnp.concatenate([sorted_rows, routed + jnp.minimum(slot, tokens)])
    return jnp.concatenate([tile_expert, jnp.full((n,), _SHARED_TILE, jnp.int32)]), rows


def _rows_as_tiles(flat_ids: jax.Array, block_m: int):
    """Decode layout: routed row r alone in tile r (slot r * block_m), the tile's other slots padding.

    Returns sorted_rows [R * block_m] int32 (r or R) and tile_expert [R] int32 (= flat_ids).
    """
    r = flat_ids.shape[0]
    slot = jnp.arange(r * block_m, dtype=jnp.int32)
    sorted_rows = jnp.where(slot % block_m == 0, slot // block_m, r)
    return sorted_rows, flat_ids


# ----------------------------------------------------------------------------------------------------
# Public entry point.


def _block(want: int, dim: int, name: str) -> int:
    b = min(want, dim)
    if dim % b:
        raise ValueError(f"moe_experts: {name}={dim} is not a multiple of its block {b}")
    return b


def _shape(w) -> tuple[int, ...]:
    """A weight's x @ w shape [..., K, N] (a BlockFp8 stores [..., N, K])."""
    if isinstance(w, fp8_matmul.BlockFp8):
        *lead, n, k = w.values.shape
        return (*lead, k, n)
    return w.shape


@functools.partial(jax.jit, static_argnames=("config", "quantize_activations", "interpret"))
def moe_experts(x: jax.Array, expert_ids: jax.Array, expert_weights: jax.Array, gate_up, down,
                shared: SharedExpert | None = None, *, config: MoeConfig | None = None,
                quantize_activations: bool = False, x_fp8: tuple | None = None, interpret: bool = False) -> jax.Array:
    """Routed experts of an MoE layer, plus its shared expert when given.

    Args:
      x: [T, H] bfloat16 or float32 (cast to the weights' dtype for the matrix products; FP8 weights multiply in
        x's dtype).
      expert_ids: [T, K] int32 in [0, E).
      expert_weights: [T, K] float32 routing weights (already renormalised by the router).
      gate_up: [E, H, 2I] (gate columns first, then up); down: [E, I, H]; same dtype (bf16 or f32), or both
        `fp8_matmul.BlockFp8` (values [E, 2I, H] and [E, H, I], 128-block scales; H and I multiples of 128).
      shared: the shared expert (`reference.SharedExpert`: gate_up [H, 2Is], down [Is, H], weight [T], of the
        experts' kind) or None. Narrow decode runs it as T more rows of its two kernels (one lane's round then
        reads its weights in the same kernels as the routed experts'; Is must equal I), the tiled decode with
        `MoeConfig.decode_shared_tile` as one more tile of its two (T <= 16, Is = I), the tiled layout up to
        `MoeConfig.tiled_shared_max_tokens` as more row tiles of its two (Is = I; with quantize_activations FP8 x
        FP8 as the routed rows); the other paths add it as two matmuls.
      config: tuning knobs; None takes `default_config(T * K, E, quantize_activations)`.
      quantize_activations: FP8 experts in the prefill layout (R > decode_max_rows) multiply FP8 x FP8: x quantized
        per token and 128-group, act per row and block_n columns in the gate_up kernel (the packs' dynamic
        activation scheme), each tile's product times both scales; decode stays weight-only.
      x_fp8: x quantized per token and 128-group by its producer (xq [T, H] float8_e4m3fn, xs [H / 128, T]:
        `fp8_matmul.quantize_rows`' layout), read by the FP8 x FP8 paths (`reads_fp8_rows`: the tiles past the
        decode layout, the grouped GEMM) instead of quantizing x; the other paths read x.
      interpret: run the Pallas kernels in interpret mode (CPU tests).
    Returns:
      [T, H] float32, sum_k w_tk * down_e(silu(gate_e x_t) * up_e x_t) with e = expert_ids[t, k], plus
      shared.weight_t * down_s(silu(gate_s x_t) * up_s x_t). Products accumulate in float32; with bf16
      weights the activation act and each weighted expert output are rounded to bf16 once (relative error
      ~1e-3 against the float32 reference); the narrow decode path keeps the expert outputs in float32.
    """
    t, h = x.shape
    fp8 = isinstance(gate_up, fp8_matmul.BlockFp8)
    num_experts, inter = _check_weights(h, gate_up, down, shared)
    k = expert_ids.shape[1] if expert_ids.ndim == 2 else -1
    if expert_ids.shape != (t, k) or expert_weights.shape != (t, k):
        raise ValueError(f"moe_experts: expert_ids {expert_ids.shape} and expert_weights "
                         f"{expert_weights.shape} must both be [T={t}, K]")
    if quantize_activations and not fp8:
        raise ValueError("moe_experts: quantize_activations multiplies FP8 x FP8 and needs block-FP8 experts")
    if not jnp.issubdtype(expert_ids.dtype, jnp.integer):
        raise ValueError(f"moe_experts: expert_ids must be integers, got {expert_ids.dtype}")
    if shared is not None and shared.weight.shape != (t,):
        raise ValueError(f"moe_experts: the shared expert's weight {shared.weight.shape} must be [T={t}]")

    rows = t * k
    cfg = default_config(rows, num_experts, fp8_rows=quantize_activations) if config is None else config
    flat_ids = expert_ids.reshape(rows).astype(jnp.int32)
    flat_w = expert_weights.reshape(rows).astype(jnp.float32)
    dtype = x.dtype if fp8 else gate_up.dtype  # what the products multiply in, and act's

    fp8_rows = quantize_activations and rows > cfg.decode_max_rows
    if fp8 and not fp8_rows and rows >= num_experts * cfg.fp8_dequantize_rows_per_expert:
        # A long prefill: every expert's bf16 tiles beat converting FP8 tiles in the kernels (a 35B-A3B layer at 8192
        # tokens: 0.57x of bf16 weights converting in-kernel; docs/kernels_notes.md, "FP8 weights"), and the one
        # pass that dequantizes the experts is small beside the pass's matmuls. The barrier ties the weights to x:
        # a dequantization reads weights only, and XLA otherwise starts every layer's early and holds them all (a
        # 35B-A3B pass of 32768 tokens asked 24 GiB more and ran out of memory on the H200). Straight to `dtype`:
        # no float32 copy of the experts.
        (gate_up, down), x = lax.optimization_barrier(((gate_up, down), x))
        gate_up, down = (jnp.swapaxes(fp8_matmul.dequantize_rows(w, dtype), -1, -2) for w in (gate_up, down))
    if fp8_rows and _grouped(rows, num_experts, h, inter, cfg, interpret):
        out = _grouped_moe(x, flat_ids, flat_w, gate_up, down, t=t, k=k, num_experts=num_experts, inter=inter,
                           dtype=dtype, x_fp8=x_fp8)
        return out if shared is None else out + _shared_dense(x, shared, dtype)
    if rows <= cfg.gemv_max_rows and (shared is None or _shape(shared.down) == _shape(down)[1:]):
        return _gemv_moe(x, flat_ids, flat_w, gate_up, down, shared, t=t, k=k, inter=inter, dtype=dtype, cfg=cfg,
                         interpret=interpret)
    return _tiled_moe(x, flat_ids, flat_w, gate_up, down, shared, t=t, k=k, num_experts=num_experts, inter=inter,
                      dtype=dtype, cfg=cfg, fp8_rows=fp8_rows, interpret=interpret, x_fp8=x_fp8)


def _check_weights(h: int, gate_up, down, shared: SharedExpert | None) -> tuple[int, int]:
    """Raise unless the experts' (and the shared expert's) weights fit rows of H values; (E, I)."""
    fp8 = isinstance(gate_up, fp8_matmul.BlockFp8)
    (num_experts, inter), gate_up_shape = _shape(down)[:2], _shape(gate_up)
    if gate_up_shape != (num_experts, h, 2 * inter) or _shape(down) != (num_experts, inter, h):
        raise ValueError(f"moe_experts: gate_up {gate_up_shape} must be [E, H, 2I] and down {_shape(down)} "
                         f"[E, I, H] with H={h}")
    if fp8 != isinstance(down, fp8_matmul.BlockFp8) or (not fp8 and (
            gate_up.dtype != down.dtype or gate_up.dtype not in (jnp.bfloat16, jnp.float32))):
        raise ValueError("moe_experts: gate_up and down must both be block-FP8, or share dtype bf16 or f32")
    if fp8 and (h % fp8_matmul.BLOCK or inter % fp8_matmul.BLOCK):
        raise ValueError(f"moe_experts: FP8 experts need H={h} and I={inter} to be multiples of {fp8_matmul.BLOCK}")
    if h % 16 or inter % 16:
        raise ValueError(f"moe_experts: H={h} and I={inter} must be multiples of 16")
    if shared is not None:
        si = _shape(shared.down)[0]
        if _shape(shared.gate_up) != (h, 2 * si) or _shape(shared.down) != (si, h):
            raise ValueError(f"moe_experts: shared gate_up {_shape(shared.gate_up)} and down {_shape(shared.down)} "
                             f"must be [H, 2Is] and [Is, H] with H={h}")
        kinds = {type(w) for w in (gate_up, shared.gate_up, shared.down)}
        if len(kinds) != 1 or (not fp8 and {shared.gate_up.dtype, shared.down.dtype} != {gate_up.dtype}):
            raise ValueError("moe_experts: the shared expert's weights must be of the experts' kind and dtype")
    return num_experts, inter


def routes_in_gemv(tokens: int, num_experts: int, top_k: int, hidden: int, inter: int, shared_inter: int | None,
                   config: MoeConfig | None = None) -> bool:
    """Whether `moe_experts_routed` takes a layer: the matrix-vector path's rows (T K <= gemv_max_rows), a shared
    expert of the experts' I or none, and what `moe_route` needs (E and K powers of two, with a shared gate H too)."""
    cfg = DEFAULT_CONFIG if config is None else config
    return (tokens * top_k <= cfg.gemv_max_rows and shared_inter in (None, inter) and is_pow2(num_experts)
            and is_pow2(top_k) and top_k <= num_experts and (shared_inter is None or is_pow2(hidden, 16)))


@functools.partial(jax.jit, static_argnames=("top_k", "config", "interpret"))
def moe_experts_routed(x: jax.Array, logits: jax.Array, gate_up, down, shared: SharedExpert | None = None,
                       shared_gate_w: jax.Array | None = None, *, top_k: int, config: MoeConfig | None = None,
                       interpret: bool = False):
    """A narrow decode round's MoE layer from its router's float32 logits [T, E]: what `moe_route.route` and then
    `moe_experts` compute, in the matrix-vector path's two kernels, the first choosing each token's experts itself
    (one kernel fewer a layer). shared: the shared expert's gate_up and down (its `weight` unused), shared_gate_w its
    gate [H, 1]. Only where `routes_in_gemv`. Returns (out [T, H] float32, expert ids [T, K] int32, weights
    [T, K] float32)."""
    t, h = x.shape
    num_experts, inter = _check_weights(h, gate_up, down, shared)
    shared_inter = None if shared is None else _shape(shared.down)[0]
    cfg = DEFAULT_CONFIG if config is None else config
    if logits.shape != (t, num_experts) or logits.dtype != jnp.float32:
        raise ValueError(f"moe_experts_routed: logits {logits.shape} {logits.dtype} must be float32 [T={t}, "
                         f"E={num_experts}]")
    if (shared is None) != (shared_gate_w is None) or (shared_gate_w is not None and shared_gate_w.size != h):
        raise ValueError("moe_experts_routed: a shared expert comes with its gate [H, 1], and only then")
    if not routes_in_gemv(t, num_experts, top_k, h, inter, shared_inter, cfg):
        raise ValueError(f"moe_experts_routed: {t} tokens x top_k {top_k} over {num_experts} experts (H {h}, I "
                         f"{inter}, shared I {shared_inter}) do not take the matrix-vector path with routing")
    dtype = x.dtype if isinstance(gate_up, fp8_matmul.BlockFp8) else gate_up.dtype
    return _gemv_moe(x, logits, None, gate_up, down, shared, t=t, k=top_k, inter=inter, dtype=dtype, cfg=cfg,
                     interpret=interpret, shared_gate_w=shared_gate_w)


def _blocks(fp8: bool, *sides: int) -> tuple[int, ...]:
    """Block sides as configured, at most one 128-block for FP8 weights (a tile reads one scale)."""
    return tuple(min(b, fp8_matmul.BLOCK) if fp8 else b for b in sides)


def _tiled_moe(x, flat_ids, flat_w, gate_up, down, shared, *, t, k, num_experts, inter, dtype, cfg, interpret,
               fp8_rows=False, x_fp8=None):
    """Prefill and wide decode (steps 1-4 of the module docstring): the two kernels over one-expert row tiles, the
    shared expert (when given) more tiles of them (`MoeConfig.decode_shared_tile`, `tiled_shared_max_tokens`) or two
    matmuls added; fp8_rows (prefill, FP8 experts): FP8 x FP8 products (`moe_experts`' quantize_activations)."""
    h = x.shape[1]
    rows = t * k
    fp8 = isinstance(gate_up, fp8_matmul.BlockFp8)
    in_tiles = None
    # a shared expert in the kernels' tiles needs the experts' I (their blocks) and kind (FP8 or not)
    fits = (shared is not None and _shape(shared.down) == _shape(down)[1:]
            and isinstance(shared.down, fp8_matmul.BlockFp8) == fp8)
    if rows <= cfg.decode_max_rows:
        block_m = _DECODE_BLOCK_M
        share = cfg.decode_share_tiles and is_pow2(rows)
        layout = (flat_ids,) if share else _rows_as_tiles(flat_ids, block_m)[::-1]
        if fits and share and cfg.decode_shared_tile and t <= block_m:
            in_tiles, shared = shared, None
        bn, bk, dbn, dbk = _blocks(fp8, cfg.decode_block_n, cfg.decode_block_k, cfg.decode_down_block_n,
                                   cfg.decode_down_block_k)
        warps, stages = cfg.decode_num_warps, cfg.decode_num_stages
    else:
        block_m = cfg.block_m
        if fits and t <= cfg.tiled_shared_max_tokens:
            layout = shared_tiles_layout(flat_ids, num_experts, block_m, t)
            in_tiles, shared = shared, None
        else:
            layout = align_rows(flat_ids, num_experts, block_m)[::-1]
        bn, bk, dbn, dbk = _blocks(fp8, cfg.block_n, cfg.block_k, cfg.down_block_n, cfg.down_block_k)
        warps, stages = cfg.num_warps, cfg.num_stages
    bn = _block(bn, inter, "I")
    x_rows, x_scales, act_scales = x, None, None  # x stays for the shared expert's matmuls
    if fp8_rows:  # x's FP8 rows from its producer (the norm before the layer), or quantized here
        x_rows, x_scales = fp8_matmul.quantize_rows(x) if x_fp8 is None else x_fp8
        dbk = min(dbk, bn)  # a step of down's contraction within one of act's scale groups (bn columns)
    act = gate_up_call(
        layout, x_rows, gate_up, act_dtype=dtype, top_k=k, num_rows=rows, inter=inter,
        block_m=block_m, block_n=bn, block_k=_block(bk, h, "H"), num_warps=warps,
        num_stages=stages, interpret=interpret, x_scales=x_scales,
        shared=None if in_tiles is None else in_tiles.gate_up)
    if fp8_rows:
        act, act_scales = act
    weights = [flat_w] if in_tiles is None else [flat_w, in_tiles.weight.astype(jnp.float32)]
    row_weight = jnp.concatenate([*weights, jnp.zeros((1,), jnp.float32)])  # the spare row weighs 0
    y = down_call(
        layout, row_weight, act, down, hidden=h, block_m=block_m,
        block_n=_block(dbn, h, "H"), block_k=_block(dbk, inter, "I"), num_warps=warps, num_stages=stages,
        interpret=interpret, act_scales=act_scales, out_dtype=dtype,
        shared=None if in_tiles is None else in_tiles.down, shared_rows=0 if in_tiles is None else t)
    out = y[:rows].astype(jnp.float32).reshape(t, k, h).sum(axis=1)
    if in_tiles is not None:
        out = out + y[rows:rows + t].astype(jnp.float32)
    return out if shared is None else out + _shared_dense(x, shared, dtype)


def _grouped(rows: int, num_experts: int, hidden: int, inter: int, cfg: MoeConfig, interpret: bool) -> bool:
    return rows >= num_experts * cfg.fp8_grouped_rows_per_expert and grouped_available(hidden, inter, interpret)


def takes_grouped(rows: int, num_experts: int, hidden: int, inter: int, interpret: bool = False) -> bool:
    """Whether `rows` routed rows of FP8 x FP8 experts (quantize_activations) take the grouped GEMM, which reads
    x's FP8 rows whole (a producer may hand them over: moe_experts' x_fp8)."""
    cfg = default_config(rows, num_experts, fp8_rows=True)
    return rows > cfg.decode_max_rows and _grouped(rows, num_experts, hidden, inter, cfg, interpret)


def takes_dynamic(rows: int, num_experts: int, hidden: int, inter: int, interpret: bool = False) -> bool:
    """Whether `rows` routed rows of block-FP8 experts multiply FP8 x FP8 (quantize_activations) in the model: within
    `fp8_dynamic_rows_per_expert` (the tiles), or where the grouped GEMM takes them."""
    return (rows <= num_experts * DEFAULT_CONFIG.fp8_dynamic_rows_per_expert
            or takes_grouped(rows, num_experts, hidden, inter, interpret))


def reads_fp8_rows(rows: int, num_experts: int, hidden: int, inter: int, interpret: bool = False) -> bool:
    """Whether `rows` routed rows of block-FP8 experts in the model (`takes_dynamic`) read x's FP8 rows whole, so
    that a producer may hand them over (moe_experts' x_fp8): past the decode layout, on the tiles or the grouped
    GEMM."""
    return (rows > default_config(rows, num_experts, fp8_rows=True).decode_max_rows
            and takes_dynamic(rows, num_experts, hidden, inter, interpret))


def grouped_available(hidden: int, inter: int, interpret: bool = False) -> bool:
    """Whether FP8 x FP8 prefill rows can take `_grouped_moe` here: a Hopper GPU, whole 128-blocks."""
    return (not interpret and fp8_gemm.supported(hidden, 2 * inter) and fp8_gemm.supported(inter, hidden)
            and fp8_gemm.available())


def _grouped_moe(x, flat_ids, flat_w, gate_up, down, *, t, k, num_experts, inter, dtype, x_fp8=None):
    """FP8 x FP8 prefill rows on the wgmma GEMM (`fp8_gemm.grouped_gemm`): the rows sorted by expert and each
    expert's run padded to the GEMM's row tile (`align_rows`), x's quantized rows gathered into that order (the
    tiles' TMA loads read whole rows), gate_up, silu(gate) * up written as FP8 rows by `fp8_rows.swiglu_fp8` (the
    model's roundings in `dtype`, one pass) with the row's routing weight folded into its scales, down, then each
    token's rows gathered back and summed."""
    rows, h = t * k, x.shape[1]
    sorted_rows, tile_expert, x_rows, x_scales = grouped_rows(x, flat_ids, k, num_experts, x_fp8)
    real = sorted_rows < rows
    gu = fp8_gemm.grouped_gemm(x_rows, x_scales, tile_expert, *gate_up, out_dtype=dtype)
    aq, a_scales = fp8_rows.swiglu_fp8(gu)
    weight = jnp.concatenate([flat_w, jnp.zeros((1,), jnp.float32)])[sorted_rows]  # padding slots (R) weigh 0
    y = fp8_gemm.grouped_gemm(aq, a_scales * weight, tile_expert, *down, config=GROUPED_DOWN_CONFIG, out_dtype=dtype)
    padded = jnp.arange(sorted_rows.shape[0], dtype=jnp.int32)
    # each real row's slot; padding slots aim past the end, each at its own index (unique, dropped)
    slot = jnp.zeros((rows,), jnp.int32).at[jnp.where(real, sorted_rows, rows + padded)].set(
        padded, mode="drop", unique_indices=True)
    return y[slot].astype(jnp.float32).reshape(t, k, h).sum(axis=1)


def grouped_rows(x, flat_ids, top_k: int, num_experts: int, x_fp8=None):
    """The grouped GEMM's input from x [T, H] (or its FP8 rows x_fp8, (xq, xs) as `quantize_rows` writes them) and
    the routed rows' experts flat_ids [R]: (sorted_rows [P] and tile_expert as `align_rows` at the GEMM's row tile,
    x quantized per token and 128-group with its rows in that order [P, H], their scales [H / 128, P]; padding
    slots read token 0)."""
    sorted_rows, tile_expert = align_rows(flat_ids, num_experts, fp8_gemm.group_rows())
    tokens = jnp.where(sorted_rows < flat_ids.shape[0], sorted_rows // top_k, 0)
    xq, xs = x_fp8 or fp8_matmul.quantize_rows(x)
    return sorted_rows, tile_expert, _take_rows(xq, tokens), xs[:, tokens]


def _take_rows(a, rows):
    """a[rows] for a [T, H] of one-byte elements, gathered as 32-bit words (XLA's gather moved FP8 rows byte by
    byte: a 35B-A3B layer's 32768 tokens took 0.77 ms on an H100)."""
    t, h = a.shape
    words = lax.bitcast_convert_type(a.reshape(t, h // 4, 4), jnp.uint32)
    return lax.bitcast_convert_type(words[rows], a.dtype).reshape(rows.shape[0], h)


def _gemv_moe(x, flat_ids, flat_w, gate_up, down, shared, *, t, k, inter, dtype, cfg, interpret, shared_gate_w=None):
    """Narrow decode (step 5 of the module docstring): two split-K matrix-vector kernels, the shared expert (when
    given) as one more row per token in the same two kernels. flat_ids [T K] the rows' experts and flat_w their
    weights; or flat_ids the router's logits [T, E] and flat_w None: the first kernel routes, the shared expert's
    weight from shared_gate_w, and the result is (out, ids [T, K], weights [T, K])."""
    h = x.shape[1]
    fp8 = isinstance(gate_up, fp8_matmul.BlockFp8)
    routes = flat_w is None
    per_token = k + (1 if shared is not None else 0)
    rows = t * per_token
    common = dict(fp8=fp8, with_shared=shared is not None, rows=rows, top_k=k, num_warps=cfg.gemv_num_warps,
                  num_stages=cfg.gemv_num_stages, interpret=interpret)
    bn, bk, dbn, dbk = _blocks(fp8, cfg.gemv_block_n, cfg.gemv_block_k, cfg.gemv_down_block_n, cfg.gemv_down_block_k)
    shared_gate_up = () if shared is None else _operands(shared.gate_up)
    gate_up_kw = dict(contraction=h, out_cols=inter, width=2 * inter, block_n=_block(bn, inter, "I"),
                      block_k=_block(bk, h, "H"), splits=cfg.gemv_splits, **common)
    shared_w = None if shared is None else shared.weight
    if not routes:
        gu = _gemv_call(_gemv_gate_up_kernel, "moe_gemv_gate_up", (flat_ids, x, *_operands(gate_up), *shared_gate_up),
                        **gate_up_kw)  # [S, rows, 2I] partial sums
    else:
        extra = (jax.ShapeDtypeStruct((t, k), jnp.int32), jax.ShapeDtypeStruct((t, k), jnp.float32),
                 *([jax.ShapeDtypeStruct((t, 1), jnp.float32)] if shared is not None else []))
        gate = () if shared is None else (shared_gate_w.reshape(-1),)  # a reshape, not a slice: no copy
        gu, ids, weights, *gates = _gemv_call(
            _gemv_gate_up_kernel, "moe_gemv_route_gate_up", (flat_ids, x, *_operands(gate_up), *shared_gate_up, *gate),
            extra_out=extra, routes=True, **gate_up_kw)
        flat_ids, flat_w = ids.reshape(t * k), weights.reshape(t * k)
        shared_w = gates[0].reshape(t) if gates else None
    shared_down = () if shared is None else (*_operands(shared.down), shared_w.astype(jnp.float32))
    part = _gemv_call(_gemv_down_kernel, "moe_gemv_down", (flat_ids, flat_w, gu, *_operands(down), *shared_down),
                      contraction=inter, out_cols=h, width=h, block_n=_block(dbn, h, "H"),
                      block_k=_block(dbk, inter, "I"), splits=cfg.gemv_down_splits, act_dtype=dtype, **common)
    # the weighted rows' pieces [S2, T, J, H]: one reduction over splits and each token's experts
    out = part.reshape(part.shape[0], t, per_token, h).sum(axis=(0, 2))
    return (out, ids, weights) if routes else out


def _shared_dense(x, shared: SharedExpert, dtype):
    """The shared expert as plain matmuls (the paths whose kernels have no rows for it): float32 products,
    act rounded to `dtype` as the routed rows' is (FP8 weights dequantized to it first: on the FP8 x FP8 GEMM, with
    its rows' quantization passes, a 35B-A3B layer's shared expert took 1.8x as long at 32768 tokens, and on
    `fp8_matmul`'s weight-only kernels the 35B-A3B's 16- and 64-lane decode rounds ran 0.6-0.7% longer;
    docs/kernels_notes.md)."""
    def plain(w):
        return fp8_matmul.dequantize(w).astype(dtype) if isinstance(w, fp8_matmul.BlockFp8) else w

    gate_up, down = plain(shared.gate_up), plain(shared.down)
    inter = down.shape[0]
    gu = dot(x.astype(dtype), gate_up)  # float32 rows in IEEE products, as the kernels' (a GPU's default is TF32)
    act = (jax.nn.silu(gu[:, :inter]) * gu[:, inter:]).astype(dtype)
    return dot(act, down) * shared.weight[:, None]


# The plain-jnp reference these kernels match lives with the others in `reference.py`.
moe_experts_ref = ref.moe_experts_ref
