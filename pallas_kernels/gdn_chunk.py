"""Chunked gated delta rule for prefill, with phase alignment and in-kernel state taps (spec §7.2-§7.3).

Implements the contract of `ninfer_jax.model.ops.gdn_prefill` (semantics: `ops.gdn_prefill_reference`):
one lane's chunk of T tokens, the initial state read from `state_pool[slot]`, the final state written back
in place, and the state after each named 64-aligned absolute position written into a snapshot slot of the
same pool, in the same pass (the zero-split tap).

The chunk grid is absolute: padded index j holds token j - phase, phase = base % 64, so every boundary of
the 64-token grid is an absolute multiple of 64. Indices outside [0, T) are identity tokens
(k = v = g = beta = 0), produced by masked loads, never copied; their outputs are not stored. A tap is
therefore bit-identical to the final state of a separate call ending at the tap with the same phase
(invariant §10.7): both run the same chunks through the same arithmetic.

Pallas (Triton) kernels, the WY/UT form fla and HF use (per chunk of 64, per value head):
  `_solve_kernel`, all chunks in parallel, one warp per program (the substitution is row reductions):
      gc = cumsum(g);  A = strict_lower(beta k k^T * exp(gc_i - gc_j));
      T = (I + A)^-1 by forward substitution on four 16x16 diagonal blocks and an exact block merge.
  `_wu_kernel`, all chunks in parallel: w = T (beta k e^gc), u = T (beta v), and (fused variant)
      P = causal(q k^T * exp(gc_i - gc_j)).
  `_recurrent_kernel`, one program per (value head, block of Dv columns), chunks in sequence:
      v_new = u - w S;  S = e^gc_last S + (k e^(gc_last - gc))^T v_new; a tap whose position ends chunk c
      stores S into its slot. Fused variant (default, measured faster): o = (q e^gc) S + P v_new in the
      same loop. Split variant: stores S per chunk and v_new, and `_output_kernel` computes o in parallel.
Matrix products take operands in `mm_dtype` (v's dtype unless configured; bf16 in serving) and accumulate
in float32; the state stays float32 in registers for the whole call. The output is stored in v's dtype: the model
rounds it to the activations' dtype before its gated norm anyway, and fla's output is bf16 too.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _compat
from pallas_kernels._blocks import is_pow2
from pallas_kernels.reference import PAGE

CHUNK = PAGE  # the GDN chunk is the KV page: taps land on page boundaries
SUB = 16  # rows of the diagonal blocks of the triangular solve
NSUB = CHUNK // SUB
MAX_TAPS = 8
_F32 = jnp.float32


def dot(a, b):
    """a [m, k] @ b [k, n], float32 accumulation."""
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=_F32)


def _dot_nt(a, b):
    """a [m, k] @ b[n, k]^T."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=_F32)


def _token_rows(c, phase, offset, n, t_len):
    """Token indices of padded rows [64 c + offset, +n): (index clamped into [0, T), valid mask)."""
    t = c * CHUNK - phase + offset + jnp.arange(n, dtype=jnp.int32)
    valid = (t >= 0) & (t < t_len)
    return jnp.clip(t, 0, t_len - 1), valid, t


def _chunk_program(meta_ref, group):
    """(chunk c, value head h, its key head, phase, n_chunks) of a program on a (chunk, head, ...) grid."""
    c, h = pl.program_id(0), pl.program_id(1)
    return c, h, h // group, meta_ref[1], meta_ref[2]


def _load_rows(ref, rows, valid, head, dtype):
    """ref [T, H, D] -> rows of one head as [n, D] in `dtype`, zero where not valid (identity tokens)."""
    cols = jnp.arange(ref.shape[-1], dtype=jnp.int32)
    x = _compat.load(ref.at[rows[:, None], head, cols[None, :]], mask=valid[:, None], other=0)
    return x.astype(dtype)


def _load_rows_t(ref, rows, valid, head, dtype):
    """ref [T, H, D] -> rows of one head transposed, [D, n] in `dtype`, zero where not valid."""
    cols = jnp.arange(ref.shape[-1], dtype=jnp.int32)
    x = _compat.load(ref.at[rows[None, :], head, cols[:, None]], mask=valid[None, :], other=0)
    return x.astype(dtype)


def _load_col(ref, rows, valid, head):
    """ref [T, H] -> [n] float32, zero where not valid."""
    return _compat.load(ref.at[rows, head], mask=valid, other=0).astype(_F32)


# --------------------------------------------------------------------------------------------------
# Kernel 1: (I + A)^-1 per chunk (parallel over chunks; few warps: the substitution is reductions).
# --------------------------------------------------------------------------------------------------


def _solve_kernel(
    meta_ref,  # [4 + 2M] int32: slot, phase, n_chunks, -, tap chunks [M], tap slots [M]
    k_ref,  # [T, Hk, Dk] (whole array)
    g_ref,  # [T, Hv] (whole array)
    beta_ref,  # [T, Hv] (whole array)
    tinv_ref,  # out [64, 64] mm_dtype: (I + A)^-1 of this chunk and value head (lower triangular)
    gc_ref,  # out [64] f32: within-chunk cumulative log decay
    *,
    t_len: int,
    group: int,
    mm_dtype,
):
    c, h, hk, phase, n_chunks = _chunk_program(meta_ref, group)

    @pl.when(c < n_chunks)
    def _():
        ks, gcs, betas = [], [], []
        g_before = jnp.zeros((), _F32)
        for b in range(NSUB):
            rows, valid, _ = _token_rows(c, phase, b * SUB, SUB, t_len)
            ks.append(_load_rows(k_ref, rows, valid, hk, mm_dtype))
            g = _load_col(g_ref, rows, valid, h)
            betas.append(_load_col(beta_ref, rows, valid, h))
            gcs.append(jnp.cumsum(g) + g_before)
            g_before = g_before + jnp.sum(g)

        row = lax.broadcasted_iota(jnp.int32, (SUB, SUB), 0)
        col = lax.broadcasted_iota(jnp.int32, (SUB, SUB), 1)
        strict = row > col

        # A blocks (i >= j): beta_i k_i k_j^T exp(gc_i - gc_j), strictly lower on the diagonal. beta scales the
        # float32 product: scaling k first held four [16, Dk] float32 tiles on one warp and took twice as long.
        a = {}
        for i in range(NSUB):
            for j in range(i + 1):
                diff = gcs[i][:, None] - gcs[j][None, :]
                if i == j:
                    dec = jnp.where(strict, jnp.exp(jnp.where(strict, diff, 0.0)), 0.0)
                else:  # every row after every column: diff <= 0
                    dec = jnp.exp(diff)
                a[i, j] = _dot_nt(ks[i], ks[j]) * (betas[i][:, None] * dec)

        # Diagonal blocks: (I + A_ii)^-1 = I + X, row r of X = -A_r - sum_k A_rk X_k (forward substitution).
        def substitute(r, xs):
            out = []
            for i, x in enumerate(xs):
                a_row = jnp.sum(jnp.where(row == r, -a[i, i], 0.0), axis=0)  # [SUB] over columns
                a_row = a_row + jnp.sum(a_row[:, None] * x, axis=0)
                out.append(jnp.where(row == r, a_row[None, :], x))
            return tuple(out)

        xs = lax.fori_loop(2, SUB, substitute, tuple(-a[i, i] for i in range(NSUB)))
        eye = (row == col).astype(_F32)
        tinv = {(i, i): xs[i] + eye for i in range(NSUB)}
        # Off-diagonal blocks: T_ij = -T_ii sum_{j <= m < i} A_im T_mj (exact block inverse).
        for d in range(1, NSUB):
            for i in range(d, NSUB):
                j = i - d
                acc = dot(a[i, j], tinv[j, j])
                for m in range(j + 1, i):
                    acc = acc + dot(a[i, m], tinv[m, j])
                tinv[i, j] = -dot(tinv[i, i], acc)

        zero = jnp.zeros((SUB, SUB), tinv_ref.dtype)
        for i in range(NSUB):
            gc_ref[pl.ds(i * SUB, SUB)] = gcs[i]
            for j in range(NSUB):
                blk = tinv[i, j].astype(tinv_ref.dtype) if j <= i else zero
                tinv_ref[pl.ds(i * SUB, SUB), pl.ds(j * SUB, SUB)] = blk


# --------------------------------------------------------------------------------------------------
# Kernel 2: w, u (and, for the fused recurrence, P) per chunk (parallel, full-size matrix products).
# --------------------------------------------------------------------------------------------------


def _wu_kernel(
    meta_ref,  # [4 + 2M] int32
    q_ref,  # [T, Hk, Dk] (whole array)
    k_ref,  # [T, Hk, Dk] (whole array)
    v_ref,  # [T, Hv, Dv] (whole array)
    beta_ref,  # [T, Hv] (whole array)
    tinv_ref,  # [64, 64] mm_dtype: this chunk's (I + A)^-1
    gc_ref,  # [64] f32
    w_ref,  # out [64, Dk] mm_dtype: T diag(beta e^gc) k
    u_ref,  # out [64, Dv] mm_dtype: T diag(beta) v
    *p_refs,  # out [64, 64] mm_dtype: causal(q k^T exp(gc_i - gc_j)) (only with the fused recurrence)
    t_len: int,
    group: int,
    mm_dtype,
):
    c, h, hk, phase, n_chunks = _chunk_program(meta_ref, group)

    @pl.when(c < n_chunks)
    def _():
        rows, valid, _ = _token_rows(c, phase, 0, CHUNK, t_len)
        k = _load_rows(k_ref, rows, valid, hk, mm_dtype)
        beta = _load_col(beta_ref, rows, valid, h)
        gc = gc_ref[...]
        # The row scales go on T's columns ([64, 64]), not on k's and v's rows ([64, D]): k and v reach the
        # products as loaded, with no float32 tile of either.
        tinv = tinv_ref[...].astype(_F32)
        w_ref[...] = dot((tinv * (beta * jnp.exp(gc))[None, :]).astype(mm_dtype), k).astype(w_ref.dtype)
        v = _load_rows(v_ref, rows, valid, h, mm_dtype)
        u_ref[...] = dot((tinv * beta[None, :]).astype(mm_dtype), v).astype(u_ref.dtype)
        if p_refs:
            q = _load_rows(q_ref, rows, valid, hk, mm_dtype)
            p_refs[0][...] = _intra_attention(q, k, gc, mm_dtype).astype(p_refs[0].dtype)


def _intra_attention(q, k, gc, mm_dtype):
    """causal(q k^T * exp(gc_i - gc_j)) for one chunk: [64, 64] f32."""
    row = lax.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), 0)
    col = lax.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), 1)
    causal = row >= col
    dec = jnp.where(causal, jnp.exp(jnp.where(causal, gc[:, None] - gc[None, :], 0.0)), 0.0)
    return _dot_nt(q.astype(mm_dtype), k.astype(mm_dtype)) * dec


# --------------------------------------------------------------------------------------------------
# Kernel 3: the state recurrence over chunks, with taps (parallel over heads x Dv blocks).
# --------------------------------------------------------------------------------------------------


def _recurrent_kernel(
    meta_ref,  # [4 + 2M] int32: slot, phase, n_chunks, -, tap chunks [M] (-1: none), tap slots [M]
    q_ref,  # [T, Hk, Dk] (whole array)
    k_ref,  # [T, Hk, Dk] (whole array)
    w_ref,  # [Hv, NP, Dk] mm_dtype (whole array; NP = 64 * max chunks)
    u_ref,  # [Hv, NP, Dv] mm_dtype
    gc_ref,  # [Hv, NP] f32
    *rest,
    t_len: int,
    group: int,
    block_v: int,
    n_taps: int,
    mm_dtype,
    fuse_output: bool,
):
    # fused:  rest = p_ref [Hv, NP, 64], pool_ref [S, Hv, Dk, Dv], | o_ref [T (+1), Hv, Dv] v's dtype, pool_out_ref
    # split:  rest = pool_ref, | h_ref [Hv, N, Dk, Dv] mm_dtype (state before each chunk),
    #                            vn_ref [Hv, NP, Dv] mm_dtype (v_new), pool_out_ref
    if fuse_output:
        p_ref, pool_ref, o_ref, pool_out_ref = rest
    else:
        pool_ref, h_ref, vn_ref, pool_out_ref = rest
    h, vb = pl.program_id(0), pl.program_id(1)
    hk = h // group
    v0 = vb * block_v
    vcols = pl.ds(v0, block_v)
    slot, phase, n_chunks = meta_ref[0], meta_ref[1], meta_ref[2]
    tap_chunk = [meta_ref[4 + j] for j in range(n_taps)]
    tap_slot = [meta_ref[4 + n_taps + j] for j in range(n_taps)]
    out_cols = v0 + jnp.arange(block_v, dtype=jnp.int32)

    def step(c, s):  # s: [Dk, block_v] f32, the state before chunk c
        rows = pl.ds(c * CHUNK, CHUNK)
        tok, valid, t = _token_rows(c, phase, 0, CHUNK, t_len)
        k_t = _load_rows_t(k_ref, tok, valid, hk, mm_dtype)  # [Dk, 64]: loaded transposed, no register transpose
        w = w_ref[h, rows, :]
        u = u_ref[h, rows, vcols].astype(_F32)
        gc = gc_ref[h, rows]
        g_last = gc_ref[h, c * CHUNK + CHUNK - 1]

        s_mm = s.astype(mm_dtype)
        v_new = u - dot(w, s_mm)
        v_mm = v_new.astype(mm_dtype)
        # Decays scale the products' float32 rows (o's by exp(gc), the state update's v_new by
        # exp(g_last - gc)), so q and k reach the products as loaded, with no float32 [64, Dk] tile.
        if fuse_output:
            q = _load_rows(q_ref, tok, valid, hk, mm_dtype)
            o = dot(q, s_mm) * jnp.exp(gc)[:, None] + dot(p_ref[h, rows, :], v_mm)
            trash = jnp.where(valid, t, t_len)  # masked lanes never store; interpret mode has a trash row
            _compat.store(o_ref.at[trash[:, None], h, out_cols[None, :]], o.astype(o_ref.dtype),
                          mask=valid[:, None])
        else:
            h_ref[h, c, :, vcols] = s_mm
            vn_ref[h, rows, vcols] = v_mm

        v_dec = (v_new * jnp.exp(g_last - gc)[:, None]).astype(mm_dtype)
        s = s * jnp.exp(g_last) + dot(k_t, v_dec)
        if n_taps:  # one predicated store per chunk, whatever M: the slot of the tap ending chunk c
            target = jnp.int32(-1)
            for j in range(n_taps):
                target = jnp.where(c == tap_chunk[j], tap_slot[j], target)

            @pl.when(target >= 0)
            def _():
                pool_out_ref[target, h, :, vcols] = s

        return s

    s = lax.fori_loop(0, n_chunks, step, pool_ref[slot, h, :, vcols])
    pool_out_ref[slot, h, :, vcols] = s


# --------------------------------------------------------------------------------------------------
# Kernel 4 (split variant only): the output, parallel over chunks.
# --------------------------------------------------------------------------------------------------


def _output_kernel(
    meta_ref,  # [4 + 2M] int32
    q_ref,  # [T, Hk, Dk] (whole array)
    k_ref,  # [T, Hk, Dk] (whole array)
    gc_ref,  # [64] f32 (this chunk and head)
    h_ref,  # [Dk, block_v] mm_dtype: state before this chunk
    vn_ref,  # [64, block_v] mm_dtype: v_new of this chunk
    o_ref,  # out [T (+1 trash row in interpret mode), Hv, Dv] v's dtype (whole array)
    *,
    t_len: int,
    group: int,
    block_v: int,
    mm_dtype,
):
    c, h, hk, phase, n_chunks = _chunk_program(meta_ref, group)
    vb = pl.program_id(2)

    @pl.when(c < n_chunks)
    def _():
        tok, valid, t = _token_rows(c, phase, 0, CHUNK, t_len)
        q = _load_rows(q_ref, tok, valid, hk, mm_dtype)
        k = _load_rows(k_ref, tok, valid, hk, mm_dtype)
        gc = gc_ref[...]
        p = _intra_attention(q, k, gc, mm_dtype).astype(mm_dtype)
        o = dot(q, h_ref[...]) * jnp.exp(gc)[:, None] + dot(p, vn_ref[...])
        out_cols = vb * block_v + jnp.arange(block_v, dtype=jnp.int32)
        trash = jnp.where(valid, t, t_len)
        _compat.store(o_ref.at[trash[:, None], h, out_cols[None, :]], o.astype(o_ref.dtype), mask=valid[:, None])


# --------------------------------------------------------------------------------------------------
# Wrapper and public function.
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GdnChunkConfig:
    """Tuning knobs of the chunked kernels (hashable: a static argument)."""

    # The fused output beats the split variant's per-chunk state traffic; the w/u kernel, its k and v in bf16 and
    # the scales on T's columns, is fastest on 4 warps (docs/kernels_notes.md, docs/benchmarks/kernels.md).
    fuse_output: bool = True  # output inside the recurrence (no per-chunk states in HBM) or a 4th kernel
    # Dv columns per recurrent program (grid Hv x Dv / block_v) and its load pipelining; None: by the call's shapes
    # (`recurrent_tiles`)
    block_v: int | None = None
    num_warps: int = 4  # recurrent kernel
    num_stages: int | None = None
    solve_num_warps: int = 1  # (I + A)^-1 kernel: row reductions stay inside one warp
    wu_num_warps: int = 4
    out_block_v: int = 64  # output kernel (split variant)
    out_num_warps: int = 4
    mm_dtype: str | None = None  # matmul operand dtype; None: v's dtype

    def __post_init__(self):
        for name in ("block_v", "num_warps", "solve_num_warps", "wu_num_warps", "out_block_v", "out_num_warps"):
            x = getattr(self, name)
            if x is not None and not is_pow2(x):
                raise ValueError(f"GdnChunkConfig.{name} must be a power of 2, got {x}")
        if (self.block_v is not None and self.block_v < 16) or self.out_block_v < 16:
            raise ValueError("GdnChunkConfig block_v and out_block_v must be >= 16 (Triton dots)")
        if self.num_stages is not None and self.num_stages < 1:
            raise ValueError("GdnChunkConfig.num_stages must be >= 1")
        if self.mm_dtype not in (None, "bfloat16", "float16", "float32"):
            raise ValueError(f"GdnChunkConfig.mm_dtype must be None or a float dtype name, got {self.mm_dtype}")

    def recurrent_tiles(self, hv: int, dv: int, qk_dtype) -> tuple[int, int]:
        """(block_v, num_stages) of the recurrent kernel. With 2-byte q and k each step's loads fit 3 stages in the
        H200's shared memory (4-byte ones do not: 234,504 of 232,448 bytes at block_v 32), and the fastest block_v
        is the widest that still gives 96+ programs for its 132 SMs: 64 at the 27B's 48 value heads, 32 at the
        35B-A3B's 32 (docs/kernels_notes.md, "Tuning at the engine's shapes")."""
        narrow = jnp.dtype(qk_dtype).itemsize <= 2
        block_v = self.block_v or (64 if narrow and hv * dv // 64 >= 96 else 32)
        return min(block_v, dv), self.num_stages or (3 if narrow else 2)


def _tap_meta(base, phase, t_len, tap_positions, tap_slots):
    """Chunk index of each tap on the padded grid (-1 if the tap does not end a chunk of this call)."""
    p = tap_positions.astype(jnp.int32)
    idx = (p - (base - phase)) // CHUNK - 1
    valid = (p > base) & (p <= base + t_len) & (p % CHUNK == 0)
    return jnp.where(valid, idx, -1), jnp.where(valid, tap_slots.astype(jnp.int32), -1)


def _dims(q, v, config):
    t_len, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    max_chunks = pl.cdiv(t_len + CHUNK - 1, CHUNK)
    mm_dtype = jnp.dtype(config.mm_dtype) if config.mm_dtype else v.dtype
    return t_len, hk, hv, dk, dv, hv // hk, max_chunks, max_chunks * CHUNK, mm_dtype


def _by_chunk(*tail):
    """BlockSpec over [Hv, NP, *tail] arrays on a (chunk, head) grid: chunk c of value head h."""
    return pl.BlockSpec((None, CHUNK) + tail, lambda c, h: (h, c) + (0,) * len(tail))


def _solve_call(meta, q, k, v, g, beta, *, config, interpret):
    t_len, _, hv, _, _, group, max_chunks, npad, mm_dtype = _dims(q, v, config)
    full = _compat.full_spec()
    return pl.pallas_call(
        functools.partial(_solve_kernel, t_len=t_len, group=group, mm_dtype=mm_dtype),
        grid=(max_chunks, hv),
        in_specs=[full] * 4,  # meta, k, g, beta: whole arrays, rows gathered by phase in-kernel
        out_specs=[_by_chunk(CHUNK), _by_chunk()],  # (I + A)^-1 and gc of chunk c, value head h
        out_shape=[jax.ShapeDtypeStruct((hv, npad, CHUNK), mm_dtype), jax.ShapeDtypeStruct((hv, npad), _F32)],
        compiler_params=_compat.triton_params(config.solve_num_warps, 1),
        interpret=interpret,
        name="gdn_chunk_solve",
    )(meta, k, g, beta)


def _wu_call(meta, q, k, v, beta, tinv, gc, *, config, interpret):
    t_len, _, hv, dk, dv, group, max_chunks, npad, mm_dtype = _dims(q, v, config)
    full = _compat.full_spec()
    out = [jax.ShapeDtypeStruct((hv, npad, dk), mm_dtype), jax.ShapeDtypeStruct((hv, npad, dv), mm_dtype)]
    specs = [_by_chunk(dk), _by_chunk(dv)]  # w, u of chunk c, value head h
    if config.fuse_output:
        out.append(jax.ShapeDtypeStruct((hv, npad, CHUNK), mm_dtype))
        specs.append(_by_chunk(CHUNK))  # P of chunk c, value head h
    return pl.pallas_call(
        functools.partial(_wu_kernel, t_len=t_len, group=group, mm_dtype=mm_dtype),
        grid=(max_chunks, hv),
        # meta, q, k, v, beta: whole arrays (rows gathered by phase); (I + A)^-1, gc: chunk c of head h
        in_specs=[full] * 5 + [_by_chunk(CHUNK), _by_chunk()],
        out_specs=specs,
        out_shape=out,
        compiler_params=_compat.triton_params(config.wu_num_warps, 1),
        interpret=interpret,
        name="gdn_chunk_wu",
    )(meta, q, k, v, beta, tinv, gc)


def _recurrent_call(meta, q, k, v, wu, gc, state_pool, *, n_taps, config, interpret):
    """Fused: (o, pool). Split: (per-chunk states, v_new, pool)."""
    t_len, _, hv, dk, dv, group, max_chunks, npad, mm_dtype = _dims(q, v, config)
    block_v, num_stages = config.recurrent_tiles(hv, dv, q.dtype)
    full = _compat.full_spec()
    kernel = functools.partial(
        _recurrent_kernel, t_len=t_len, group=group, block_v=block_v, n_taps=n_taps, mm_dtype=mm_dtype,
        fuse_output=config.fuse_output,
    )
    pool_shape = jax.ShapeDtypeStruct(state_pool.shape, state_pool.dtype)
    params = _compat.triton_params(config.num_warps, num_stages)
    # All operands whole arrays: each program walks its head's chunks in order, reads/writes its
    # [Dk, block_v] column block of the state slots, and scatters output rows (fused) or writes the
    # per-chunk states and v_new (split).
    if config.fuse_output:
        o_rows = t_len + 1 if interpret else t_len  # interpret mode's masked scatter needs a trash row
        return pl.pallas_call(
            kernel, grid=(hv, dv // block_v), in_specs=[full] * 8, out_specs=[full, full],
            out_shape=[jax.ShapeDtypeStruct((o_rows, hv, dv), v.dtype), pool_shape],
            input_output_aliases={7: 1}, compiler_params=params, interpret=interpret,
            name="gdn_chunk_recurrent_fused",
        )(meta, q, k, wu[0], wu[1], gc, wu[2], state_pool)
    return pl.pallas_call(
        kernel, grid=(hv, dv // block_v), in_specs=[full] * 7, out_specs=[full] * 3,
        out_shape=[jax.ShapeDtypeStruct((hv, max_chunks, dk, dv), mm_dtype),
                   jax.ShapeDtypeStruct((hv, npad, dv), mm_dtype), pool_shape],
        input_output_aliases={6: 2}, compiler_params=params, interpret=interpret,
        name="gdn_chunk_recurrent",
    )(meta, q, k, wu[0], wu[1], gc, state_pool)


def _output_call(meta, q, k, v, gc, h_states, v_new, *, config, interpret):
    t_len, _, hv, dk, dv, group, max_chunks, _, mm_dtype = _dims(q, v, config)
    ob = min(config.out_block_v, dv)
    full = _compat.full_spec()
    o_rows = t_len + 1 if interpret else t_len  # interpret mode's masked scatter needs a trash row
    return pl.pallas_call(
        functools.partial(_output_kernel, t_len=t_len, group=group, block_v=ob, mm_dtype=mm_dtype),
        grid=(max_chunks, hv, dv // ob),
        in_specs=[
            full, full, full,  # meta, q, k: whole arrays, rows gathered by phase in-kernel
            pl.BlockSpec((None, CHUNK), lambda c, h, j: (h, c)),  # gc of chunk c, head h
            pl.BlockSpec((None, None, dk, ob), lambda c, h, j: (h, c, 0, j)),  # state before chunk c
            pl.BlockSpec((None, CHUNK, ob), lambda c, h, j: (h, c, j)),  # v_new of chunk c
        ],
        out_specs=full,  # rows scattered, masked to [0, T)
        out_shape=jax.ShapeDtypeStruct((o_rows, hv, dv), v.dtype),
        compiler_params=_compat.triton_params(config.out_num_warps, 1),
        interpret=interpret,
        name="gdn_chunk_output",
    )(meta, q, k, gc, h_states, v_new)


def _gdn_chunk_call(q, k, v, g, beta, state_pool, meta, *, n_taps, config, interpret):
    t_len = q.shape[0]
    tinv, gc = _solve_call(meta, q, k, v, g, beta, config=config, interpret=interpret)
    wu = _wu_call(meta, q, k, v, beta, tinv, gc, config=config, interpret=interpret)
    rec = _recurrent_call(meta, q, k, v, wu, gc, state_pool, n_taps=n_taps, config=config, interpret=interpret)
    if config.fuse_output:
        o, state_pool = rec
    else:
        h_states, v_new, state_pool = rec
        o = _output_call(meta, q, k, v, gc, h_states, v_new, config=config, interpret=interpret)
    return (o[:t_len] if interpret else o), state_pool


def check_gdn_inputs(q, k, v, g, beta, state_pool):
    """Validate the shared GDN operand shapes: q, k [N, Hk, Dk]; v [N, Hv, Dv]; g, beta [N, Hv];
    state_pool float32 [S, Hv, Dk, Dv]; Hv a multiple of Hk; head dims powers of 2 >= 16."""
    n, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    if k.shape != q.shape or v.shape[0] != n or g.shape != (n, hv) or beta.shape != (n, hv):
        raise ValueError(f"shape mismatch: q{q.shape} k{k.shape} v{v.shape} g{g.shape} beta{beta.shape}")
    if hv % hk:
        raise ValueError(f"value heads ({hv}) must be a multiple of key heads ({hk})")
    for name, d in (("Dk", dk), ("Dv", dv)):
        if not is_pow2(d, 16):
            raise ValueError(f"{name} must be a power of 2 >= 16, got {d}")
    if state_pool.shape[1:] != (hv, dk, dv) or state_pool.dtype != jnp.float32:
        raise ValueError(f"state_pool must be float32 [S, {hv}, {dk}, {dv}], got {state_pool.dtype}{state_pool.shape}")


def make_meta(slot, base, t_len, tap_positions, tap_slots):
    """The kernels' int32 scalar block: [slot, phase, n_chunks, 0, tap chunks [M], tap slots [M]]."""
    base = jnp.asarray(base, jnp.int32)
    phase = jnp.mod(base, CHUNK)
    n_chunks = (phase + t_len + CHUNK - 1) // CHUNK
    tap_chunk, tap_slot = _tap_meta(base, phase, t_len, tap_positions, tap_slots)
    head = jnp.stack([jnp.asarray(slot, jnp.int32), phase, n_chunks, jnp.int32(0)])
    return jnp.concatenate([head, tap_chunk, tap_slot])


@functools.partial(jax.jit, static_argnames=("interpret", "config"))
def chunk_gated_delta_rule(
    q, k, v, g, beta, state_pool, slot, base, tap_positions, tap_slots, *, interpret=False, config=None
):
    """Chunked gated delta rule over one lane's chunk, with in-kernel state taps.

    Args:
      q, k: [T, Hk, Dk] (L2-normalised; q scaled by Dk**-0.5), bf16 or f32.
      v: [T, Hv, Dv]; g (log decay, <= 0), beta: [T, Hv]. Hv is a multiple of Hk; value head j reads
        key head j // (Hv // Hk). Tokens the caller wants ignored must be identity tokens.
      state_pool: [S, Hv, Dk, Dv] float32; read at `slot`, written back at `slot` in place (alias it
        through a donated jit argument to avoid a copy).
      slot: int32 scalar. base: int32 scalar >= 0, absolute position of the first token.
      tap_positions: [M] int32 (M <= 8, static), absolute positions; a position p that is a multiple of
        64 in (base, base + T] stores the state after tokens [0, p) into `state_pool[tap_slots[j]]`;
        any other value (-1) stores nothing. Tap slots must differ from `slot` and from each other.
      tap_slots: [M] int32.
      interpret: run the Pallas interpreter (CPU tests).
      config: `GdnChunkConfig` (None: defaults).
    Returns:
      (o [T, Hv, Dv] in v's dtype, updated state_pool).
    """
    config = config or GdnChunkConfig()
    check_gdn_inputs(q, k, v, g, beta, state_pool)
    t_len = q.shape[0]
    n_taps = tap_positions.shape[0]
    if tap_positions.ndim != 1 or tap_slots.shape != tap_positions.shape or n_taps > MAX_TAPS:
        raise ValueError(f"tap_positions and tap_slots must be [M <= {MAX_TAPS}], "
                         f"got {tap_positions.shape}, {tap_slots.shape}")
    meta = make_meta(slot, base, t_len, tap_positions, tap_slots)
    return _gdn_chunk_call(q, k, v, g, beta, state_pool, meta, n_taps=n_taps, config=config, interpret=interpret)
