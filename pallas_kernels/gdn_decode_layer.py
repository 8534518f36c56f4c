"""The GDN mixer's decode step between its two projections as one kernel: conv, activations, gated delta rule
and output norm for one token of each of B lanes (`gdn_decode_layer`), or for T tokens of each in order (a
speculative verify round and its commit: `gdn_rows_layer`).

Computes what `ninfer_jax.model.qwen3_5.gdn_decode_mixer` otherwise composes from about a dozen XLA kernels around
`gdn_decode` (that composition is the reference: tests/model/test_gdn_decode_layer.py). With C = 2 Hk Dk + Hv Dv
pre-conv channels, K conv taps and the lane's state slot s:

    window = [conv history of slot s (K-1 rows) ; qkv]                  [K, C]
    c      = silu(sum_j window[j] * conv_w[j]) in float32, rounded to the activations' dtype
    q, k   = each key head's channels of c, L2-normalised (q times Dk^-0.5);  v = the value head's channels
    g      = -exp(a_log) softplus(a + dt_bias);  beta = sigmoid(b)
    S <- exp(g) S;  S <- S + k (beta (v - S^T k))^T;  o = S^T q
    y      = (norm_w * rmsnorm(o)) * silu(z)                             (the gated RMSNorm)

The state slot is updated in place (a verify round only reads it: which of its rows stand is known after the
logits; its commit runs the kernel again over the kept rows, which costs one more read of the state and no copy of
T states). The new conv history (window[1:], or the old one for an inactive lane) is written into the
history pool in place where one program runs all the value heads of a key head on whole heads (`history_in_place`):
that program alone reads and writes the key head's q and k history and its heads' v history. Elsewhere the value
heads that share a key head all read that key head's history, so one of them writing it in place would race with
the others' reads: the kernel returns the new histories and the wrapper scatters them (one small XLA kernel). An
inactive lane computes with zero q, k, v, g and beta, which leaves its state as it was.

One program per (lane, value head, block of Dv columns), or per (lane, several value heads of one key head, block)
run in turn (`heads_per_program`: wide rounds). With the whole [Dk, Dv] state of a head in one program
the gated norm over Dv stays inside it; one lane has only Hv such programs, too few to keep the GPU busy
(gdn_decode.program_blocks narrows the blocks as it does for the unfused kernel), and then the kernel writes o
and the norm runs after it as one XLA fusion. The key head's conv is recomputed by each of its programs (2 x Dk
channels x K taps, small); the first of them writes that key head's history rows.

Checked on the H200 (tests/model/test_gdn_decode_layer.py); it makes a one-lane decode round shorter than the
unfused path (docs/kernels_notes.md), so the engine runs it with the Pallas kernels (`KernelConfig.fuse_gdn_decode`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _compat
from pallas_kernels.fp8_matmul import BLOCK, group_scale, quantize_rows
from pallas_kernels.gdn_decode import delta_rule_step, program_blocks
from pallas_kernels.reference import gated_rms_norm, l2_normalize

_F32 = jnp.float32


def _layer_kernel(
    slots_ref,  # [B] int32
    rows_ref,  # [B] int32: the lane's rows that count (0: an inactive lane)
    proj_ref,  # [B, T, C + Hv Dv (+ 2 Hv)] the in-projection's output: qkv (pre-conv channels), z (, b, a)
    gates_ref,  # b then a from column gates_col on: proj_ref itself, or [B, T, 2 Hv] of their own
    hist_ref,  # [S, K-1, C] conv history pool (read only unless in_place: then the same buffer as tail_ref)
    conv_w_ref,  # [K, C]
    a_log_ref,  # [Hv] float32
    dt_bias_ref,  # [Hv] float32
    norm_w_ref,  # [Dv]
    ssm_ref,  # [S, Hv, Dk, Dv] float32 (aliased with ssm_out_ref when the state is written)
    y_ref,  # out [B, T, Hv, Dv] activations' dtype: the gated norm's output, or o (a program has part of Dv, or norm
    #         is off); with fp8_out the norm's output as FP8 codes, a head's Dv = 128 values one group
    tail_ref,  # out [B, K-1, C] activations' dtype: the lane's conv history after its rows; in_place: the pool
    *outs,  # out ssm [S, Hv, Dk, Dv] float32, the same buffer as ssm_ref (absent when the state is only read); then
    #         with fp8_out the groups' scales [Hv, B T] float32 (`fp8_matmul.quantize_rows`' layout)
    num_key_heads: int,
    group: int,
    taps: int,
    eps: float,
    block_v: int,
    heads_per_program: int,
    gates_col: int,
    norm: bool,
    fp8_out: bool,
    in_place: bool,
):
    lane, hg, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    h0 = hg * heads_per_program  # the program's first value head; all of its heads share key head kh
    kh = h0 // group
    t = proj_ref.shape[1]
    dk, dv = ssm_ref.shape[2], ssm_ref.shape[3]
    vcols = pl.ds(vb * block_v, block_v)
    key_dim = num_key_heads * dk
    z0, b0 = hist_ref.shape[2], gates_col  # z's and b's first columns
    a0 = b0 + ssm_ref.shape[1]
    act = proj_ref.dtype
    ssm_out, xs_ref = (outs[:-1], outs[-1]) if fp8_out else (outs, None)
    slot = slots_ref[lane]
    n = rows_ref[lane]
    state = ssm_ref[slot, h0, :, vcols]  # [Dk, block_v]: the largest read, issued before the conv's work

    def conv(c0, width, write_tail):
        """silu(conv) of channels [c0, c0 + width) for each of the T rows, rounded to the activations' dtype;
        writes their history after the lane's n rows (the window moved n rows on)."""
        cols = pl.ds(c0, width)
        window = [hist_ref[slot, j, cols].astype(act) for j in range(taps - 1)]
        window += [proj_ref[lane, r, cols] for r in range(t)]
        out = []
        for r in range(t):
            acc = window[r].astype(_F32) * conv_w_ref[0, cols].astype(_F32)
            for j in range(1, taps):
                acc = acc + window[r + j].astype(_F32) * conv_w_ref[j, cols].astype(_F32)
            out.append(jax.nn.silu(acc).astype(act))

        def write():
            for j in range(taps - 1):
                row = window[j]
                for m in range(1, t + 1):
                    row = jnp.where(n == m, window[j + m], row)
                tail_ref[slot if in_place else lane, j, cols] = row.astype(tail_ref.dtype)

        if write_tail is True:
            write()
        else:
            pl.when(write_tail)(write)
        return out

    first_of_key_head = (h0 % group == 0) & (vb == 0)
    qs = conv(kh * dk, dk, first_of_key_head)
    ks = conv(key_dim + kh * dk, dk, first_of_key_head)
    masks = [(r < n).astype(_F32) for r in range(t)]
    qs = [l2_normalize(qs[r]) * (dk**-0.5) * masks[r] for r in range(t)]
    ks = [l2_normalize(ks[r]) * masks[r] for r in range(t)]
    for i in range(heads_per_program):
        h = h0 + i
        if i:  # the next head's state: after the previous head's is written
            state = ssm_ref[slot, h, :, vcols]
        vs = conv(2 * key_dim + h * dv + vb * block_v, block_v, True)
        a_log, dt_bias = a_log_ref[h].astype(_F32), dt_bias_ref[h].astype(_F32)
        for r in range(t):  # each row from the state the earlier rows left; rows at or past n change nothing
            v = vs[r].astype(_F32) * masks[r]
            g = -jnp.exp(a_log) * jax.nn.softplus(gates_ref[lane, r, a0 + h].astype(_F32) + dt_bias) * masks[r]
            beta = jax.nn.sigmoid(gates_ref[lane, r, b0 + h].astype(_F32)) * masks[r]
            o, state = delta_rule_step(state, qs[r], ks[r], v, g, beta)  # [block_v]
            if block_v < dv or not norm:  # the norm needs all of Dv: the caller's, or the out-projection's
                y_ref[lane, r, h, vcols] = o.astype(act)
            else:
                y = gated_rms_norm(o.astype(act), proj_ref[lane, r, pl.ds(z0 + h * dv, dv)], norm_w_ref[...], eps)
                if fp8_out:  # quantized as `quantize_rows` quantizes the rounded rows
                    y = y.astype(_F32)
                    scale = group_scale(y)
                    y_ref[lane, r, h, :] = (y / scale).astype(y_ref.dtype)
                    xs_ref[h, lane * t + r] = scale
                else:
                    y_ref[lane, r, h, :] = y
        if ssm_out:
            ssm_out[0][slot, h, :, vcols] = state


@dataclasses.dataclass(frozen=True)
class GdnDecodeLayerConfig:
    """Tuning knobs (hashable: a static argument)."""

    num_warps: int = 8
    num_stages: int = 1
    block_v: int = 128  # widest Dv columns per program; narrower down to min_programs (gdn_decode.program_blocks)
    min_programs: int = 128
    heads_per_program: int = 1  # value heads of one key head a program runs in turn (a divisor of the group; 0: all)
    # With into_pool and a key head's value heads whole in one program, that program writes the key head's new
    # histories into the pool itself: no scatter kernel after it
    history_in_place: bool = False


DEFAULT_CONFIG = GdnDecodeLayerConfig()
# Several rows a program, or several lanes: 8 warps spill at 8 lanes x 4 rows of whole 128-column heads (27B: 214
# against 65 us for the kernel alone on the H200, `bench_speculative.py --sweep-rows-kernel`), and a one-row round of
# 8 lanes of the 35B-A3B's heads ran its step in 15.6 against 30.2 us on an H100 (two programs a SM in place of one);
# one lane keeps 8 (docs/kernels_notes.md). Wide rounds take 4 warps too: from 2048 (lane, head) programs 4 warps run
# the step in half the time of 8 (35B-A3B heads at 64 / 256 lanes: 105 / 358 us against 208 / 796 us;
# docs/kernels_notes.md, "GDN decode at many lanes").
ROWS_CONFIG = GdnDecodeLayerConfig(num_warps=4)
WIDE_PROGRAMS = 2048
# One-row wide rounds: 4 warps as above, and all the value heads of a key head in one program, in turn (the key head's
# q, k conv and norms once: the 27B's 2048 programs at 128 lanes in place of 6144, the kernel alone 2-3% faster, the
# same outputs bit for bit; the 35B-A3B's 2 heads 194 against 198 us at 128 lanes; docs/kernels_notes.md), which
# writes the key head's histories into the pool itself: the 35B-A3B's FP8-dynamic rounds 0.990x / 0.985x at 64 / 256
# lanes on an H100 against one head a program and the scatter.
WIDE_CONFIG = GdnDecodeLayerConfig(num_warps=4, heads_per_program=0, history_in_place=True)


@functools.partial(jax.jit, static_argnames=("num_key_heads", "eps", "interpret", "config", "norm", "fp8_out",
                                             "into_pool"))
def gdn_decode_layer(proj, active, hist_pool, conv_w, a_log, dt_bias, norm_w, ssm_pool, slots, *,
                     num_key_heads: int, eps: float, interpret: bool = False,
                     config: GdnDecodeLayerConfig | None = None, gates=None, norm: bool = True, fp8_out: bool = False,
                     into_pool: bool = False):
    """One GDN decode step for each of B lanes, from the in-projection's output to the gated norm's (norm False:
    to the delta rule's output o, for an out-projection that normalizes it, `gdn_out_proj`).

    Args:
      proj: [B, C + Hv Dv + 2 Hv], the in-projection's output whole: the pre-conv channels qkv (C = 2 Hk Dk +
        Hv Dv), then z [Hv Dv], b [Hv] and a [Hv]. Slicing them apart first would cost a copy each (XLA makes a
        custom call's sliced operand a memcpy).
      gates: None, or b and a [B, 2 Hv] apart (an FP8 checkpoint's in-projection is two products: joining them is a
        copy kernel a layer), proj then [B, C + Hv Dv].
      active: [B] bool. hist_pool: [S, K-1, C] conv histories; conv_w: [K, C].
      a_log, dt_bias: [Hv]; norm_w: [Dv]. ssm_pool: [S, Hv, Dk, Dv] float32 (alias it through a donated jit
      argument to avoid a copy). slots: [B] int32, distinct.
      num_key_heads: Hk. eps: the gated norm's epsilon.
      fp8_out: y as the FP8 rows of an FP8 x FP8 out-projection (Dv = 128, norm on), as `gdn_rows_layer`'s.
      into_pool: return the history pool with the lanes' new histories written, as `gdn_rows_layer`'s.
    Returns:
      (y [B, Hv, Dv] in proj's dtype (o when not norm; with fp8_out (codes, scales [Hv, B])), updated ssm_pool, new
      conv histories [B, K-1, C] in proj's dtype, or with into_pool the updated hist_pool).
    """
    y, tail, ssm_pool = gdn_rows_layer(proj[:, None], active.astype(jnp.int32), hist_pool, conv_w, a_log, dt_bias,
                                       norm_w, ssm_pool, slots, num_key_heads=num_key_heads, eps=eps,
                                       write_state=True, interpret=interpret, config=config,
                                       gates=None if gates is None else gates[:, None], norm=norm, fp8_out=fp8_out,
                                       into_pool=into_pool)
    return (y[0][:, 0], y[1]) if fp8_out else y[:, 0], ssm_pool, tail


@functools.partial(jax.jit, static_argnames=("num_key_heads", "eps", "write_state", "interpret", "config", "norm",
                                             "fp8_out", "into_pool"))
def gdn_rows_layer(proj, rows, hist_pool, conv_w, a_log, dt_bias, norm_w, ssm_pool, slots, *, num_key_heads: int,
                   eps: float, write_state: bool, interpret: bool = False, config: GdnDecodeLayerConfig | None = None,
                   gates=None, norm: bool = True, fp8_out: bool = False, into_pool: bool = False):
    """T tokens of each of B lanes in order from its state slot (a speculative verify round, or its commit), from
    the in-projection's output to the gated norm's.

    Args:
      proj: [B, T, C + Hv Dv + 2 Hv] (as `gdn_decode_layer`'s, T rows a lane; with gates [B, T, 2 Hv] apart,
        [B, T, C + Hv Dv]). rows: [B] int32 in [0, T], the
        lane's first rows that count: later rows are fed zero q, k, v, g and beta (their outputs are garbage, the
        state they leave is that of row rows - 1); 0 leaves the lane as it was.
      write_state: static; True writes the state after the lane's rows into its slot (ssm_pool aliased), False
        only reads the pool (a verify round, whose kept rows are known only from its logits).
      fp8_out: static; y as `fp8_matmul.quantize_rows` quantizes the norm's rows (a value head, Dv = 128, one
        group): (codes [B, T, Hv, Dv] float8_e4m3fn, scales [Hv, B T] float32), written by the kernel where a
        program holds a whole head, else quantized after the norm.
      into_pool: static (write_state on); in place of the histories, hist_pool with each lane's written at its slot
        (alias it through a donated jit argument to avoid a copy): by the kernel where the config says so
        (history_in_place) and a program runs a key head's value heads whole, else scattered after it.
      The rest as `gdn_decode_layer`'s.
    Returns:
      (y [B, T, Hv, Dv] in proj's dtype (or fp8_out's pair), the conv histories after each lane's rows [B, K-1, C]
      (or the updated hist_pool), and the updated ssm_pool when write_state).
    """
    lanes, t = proj.shape[:2]
    if config is None:
        wide = t == 1 and lanes * ssm_pool.shape[1] >= WIDE_PROGRAMS
        config = DEFAULT_CONFIG if lanes * t == 1 else WIDE_CONFIG if wide else ROWS_CONFIG
    taps, channels = conv_w.shape
    hv, dk, dv = ssm_pool.shape[1:]
    width = channels + hv * dv + (0 if gates is not None else 2 * hv)
    if channels != 2 * num_key_heads * dk + hv * dv or proj.shape != (lanes, t, width):
        raise ValueError(f"gdn_rows_layer: proj {proj.shape} / conv_w {conv_w.shape} do not hold 2 x {num_key_heads}"
                         f" key heads of {dk} and {hv} value heads of {dv}" + (" (b and a apart)" if gates is not None
                                                                               else ""))
    if gates is not None and (gates.shape != (lanes, t, 2 * hv) or gates.dtype != proj.dtype):
        raise ValueError(f"gdn_rows_layer: gates {gates.shape} {gates.dtype} must be [{lanes}, {t}, {2 * hv}] "
                         f"{proj.dtype}")
    if hist_pool.shape[1:] != (taps - 1, channels) or norm_w.shape != (dv,):
        raise ValueError(f"gdn_rows_layer: conv pool {hist_pool.shape} / norm_w {norm_w.shape} do not fit the layer")
    if slots.shape != (lanes,) or rows.shape != (lanes,):
        raise ValueError(f"gdn_rows_layer: slots {slots.shape}, rows {rows.shape} must be [{lanes}]")
    if hv % num_key_heads or ssm_pool.dtype != _F32:
        raise ValueError("gdn_rows_layer: value heads must be a multiple of key heads, the state float32")
    if into_pool and not write_state:
        raise ValueError("gdn_rows_layer: into_pool writes the histories of rows that stand: needs write_state")
    if fp8_out and not (norm and dv == BLOCK):
        raise ValueError(f"gdn_rows_layer: fp8_out quantizes the norm's rows a value head a group: needs norm and "
                         f"Dv = {BLOCK}")
    full = _compat.full_spec()
    block_v = program_blocks(lanes * hv, dv, config.block_v, config.min_programs)
    group = hv // num_key_heads
    hp = config.heads_per_program or group
    hp = hp if group % hp == 0 else 1
    in_kernel = fp8_out and block_v == dv  # a program holds a head's whole row: it quantizes the row itself
    in_place = into_pool and config.history_in_place and hp == group and block_v == dv  # one reader and writer
    out_shape = [jax.ShapeDtypeStruct((lanes, t, hv, dv), jnp.float8_e4m3fn if in_kernel else proj.dtype),
                 jax.ShapeDtypeStruct(hist_pool.shape, hist_pool.dtype) if in_place
                 else jax.ShapeDtypeStruct((lanes, taps - 1, channels), proj.dtype)]
    if write_state:
        out_shape.append(jax.ShapeDtypeStruct(ssm_pool.shape, ssm_pool.dtype))
    if in_kernel:
        out_shape.append(jax.ShapeDtypeStruct((hv, lanes * t), _F32))
    out = pl.pallas_call(
        functools.partial(_layer_kernel, num_key_heads=num_key_heads, group=group, taps=taps, eps=eps,
                          block_v=block_v, heads_per_program=hp,
                          gates_col=0 if gates is not None else channels + hv * dv, norm=norm, fp8_out=in_kernel,
                          in_place=in_place),
        grid=(lanes, hv // hp, dv // block_v),
        in_specs=[full] * 10,
        out_specs=[full] * len(out_shape),
        out_shape=out_shape,
        input_output_aliases={**({9: 2} if write_state else {}), **({4: 1} if in_place else {})},
        compiler_params=_compat.triton_params(config.num_warps, config.num_stages),
        interpret=interpret,
        name="gdn_rows_layer" if t > 1 else "gdn_decode_layer",
    )(slots.astype(jnp.int32), rows.astype(jnp.int32), proj, proj if gates is None else gates, hist_pool, conv_w,
      a_log, dt_bias, norm_w, ssm_pool)
    y, rest = out[0], out[1:]
    if in_kernel:
        y, rest = (y, rest[-1]), rest[:-1]
    elif block_v < dv and norm:  # y holds o
        z = proj[:, :, channels:channels + hv * dv].reshape(lanes, t, hv, dv)
        y = gated_rms_norm(y, z, norm_w, eps)
        if fp8_out:
            xq, xs = quantize_rows(y.reshape(lanes * t, hv * dv))
            y = (xq.reshape(lanes, t, hv, dv), xs)
    if into_pool and not in_place:
        # slots are distinct, and saying so makes XLA's bf16 row scatter 4.5x faster: 7.4 against 33.5 us a layer at
        # 128 lanes of the 27B (7.9 MB of rows), 1.25 ms of a 31.6 ms round
        rest = (hist_pool.at[slots].set(rest[0].astype(hist_pool.dtype), unique_indices=True), *rest[1:])
    return (y, *rest)
