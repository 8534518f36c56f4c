"""The GDN mixer's decode step between its two projections as one kernel: conv, activations, gated delta rule
and output norm for one token of each of B lanes.

Computes what `ninfer_jax.model.qwen3_5.gdn_decode_mixer` otherwise composes from about a dozen XLA kernels around
`gdn_decode` (that composition is the reference: tests/model/test_gdn_decode_layer.py). With C = 2 Hk Dk + Hv Dv
pre-conv channels, K conv taps and the lane's state slot s:

    window = [conv history of slot s (K-1 rows) ; qkv]                  [K, C]
    c      = silu(sum_j window[j] * conv_w[j]) in float32, rounded to the activations' dtype
    q, k   = each key head's channels of c, L2-normalised (q times Dk^-0.5);  v = the value head's channels
    g      = -exp(a_log) softplus(a + dt_bias);  beta = sigmoid(b)
    S <- exp(g) S;  S <- S + k (beta (v - S^T k))^T;  o = S^T q
    y      = (norm_w * rmsnorm(o)) * silu(z)                             (the gated RMSNorm)

The state slot is updated in place. The new conv history (window[1:], or the old one for an inactive lane) is
returned rather than written into the history pool: the value heads that share a key head all read that key
head's history, so one of them writing it in place would race with the others' reads. The caller scatters it
(one small XLA kernel). An inactive lane computes with zero q, k, v, g and beta, which leaves its state as it
was.

One program per (lane, value head, block of Dv columns). With the whole [Dk, Dv] state of a head in one program
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
from pallas_kernels.gdn_decode import delta_rule_step, program_blocks
from pallas_kernels.reference import l2_normalize

_F32 = jnp.float32


def _layer_kernel(
    slots_ref,  # [B] int32
    active_ref,  # [B] int32 (1: the lane decodes)
    proj_ref,  # [B, C + Hv Dv + 2 Hv] the in-projection's output: qkv (pre-conv channels), z, b, a
    hist_ref,  # [S, K-1, C] conv history pool (read only)
    conv_w_ref,  # [K, C]
    a_log_ref,  # [Hv] float32
    dt_bias_ref,  # [Hv] float32
    norm_w_ref,  # [Dv]
    ssm_ref,  # [S, Hv, Dk, Dv] float32 (aliased with ssm_out_ref)
    y_ref,  # out [B, Hv, Dv] activations' dtype: the gated norm's output, or o when a program has part of Dv
    ssm_out_ref,  # out [S, Hv, Dk, Dv] float32, the same buffer as ssm_ref
    tail_ref,  # out [B, K-1, C] activations' dtype: the lane's new conv history
    *,
    num_key_heads: int,
    group: int,
    taps: int,
    eps: float,
    norm_dtype,
    block_v: int,
):
    lane, h, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    kh = h // group
    dk, dv = ssm_ref.shape[2], ssm_ref.shape[3]
    vcols = pl.ds(vb * block_v, block_v)
    key_dim = num_key_heads * dk
    z0, b0 = hist_ref.shape[2], hist_ref.shape[2] + ssm_ref.shape[1] * dv  # z's and b's first columns
    a0 = b0 + ssm_ref.shape[1]
    act = proj_ref.dtype
    slot = slots_ref[lane]
    live = active_ref[lane] != 0
    mask = live.astype(_F32)
    state = ssm_ref[slot, h, :, vcols]  # [Dk, block_v]: the largest read, issued before the conv's work

    def conv(c0, width, write_tail):
        """silu(conv) of channels [c0, c0 + width), rounded to the activations' dtype; writes their new history."""
        cols = pl.ds(c0, width)
        rows = [hist_ref[slot, j, cols].astype(act) for j in range(taps - 1)] + [proj_ref[lane, cols]]
        acc = rows[0].astype(_F32) * conv_w_ref[0, cols].astype(_F32)
        for j in range(1, taps):
            acc = acc + rows[j].astype(_F32) * conv_w_ref[j, cols].astype(_F32)

        def write():
            for j in range(taps - 1):  # active: the window moves one row; inactive: the history stays
                tail_ref[lane, j, cols] = jnp.where(live, rows[j + 1], rows[j])

        if write_tail is True:
            write()
        else:
            pl.when(write_tail)(write)
        return jax.nn.silu(acc).astype(act)

    first_of_key_head = (h % group == 0) & (vb == 0)
    q = l2_normalize(conv(kh * dk, dk, first_of_key_head)) * (dk**-0.5) * mask
    k = l2_normalize(conv(key_dim + kh * dk, dk, first_of_key_head)) * mask
    v = conv(2 * key_dim + h * dv + vb * block_v, block_v, True).astype(_F32) * mask
    g = -jnp.exp(a_log_ref[h].astype(_F32)) * jax.nn.softplus(proj_ref[lane, a0 + h].astype(_F32)
                                                              + dt_bias_ref[h].astype(_F32)) * mask
    beta = jax.nn.sigmoid(proj_ref[lane, b0 + h].astype(_F32)) * mask

    o, ssm_out_ref[slot, h, :, vcols] = delta_rule_step(state, q, k, v, g, beta)  # [block_v]
    if block_v < dv:  # the norm needs all of Dv: the caller's fusion
        y_ref[lane, h, vcols] = o.astype(act)
    else:
        y_ref[lane, h, :] = _gated_norm(o.astype(act), proj_ref[lane, pl.ds(z0 + h * dv, dv)], norm_w_ref[...], eps,
                                        norm_dtype)


def _gated_norm(o, z, norm_w, eps, norm_dtype):
    """The gated RMSNorm over the last axis with the model's roundings (o arrives in the activations' dtype): the
    normalised o back to that dtype before the weight, the weighted product in the weight's and activations'
    common dtype. Runs inside the kernel on one head's [Dv] and in XLA on [B, Hv, Dv].

    Not `qwen3_5.gated_rms_norm` itself: that one writes the weighted product as a multiply in the common dtype,
    whose rounding XLA may skip (excess precision: on CPU its result differs in the last bf16 bit from this form);
    here each rounding is a cast, which XLA and Triton both take."""
    act = o.dtype
    of = o.astype(_F32)
    normed = (of * jax.lax.rsqrt(jnp.mean(of * of, axis=-1, keepdims=True) + eps)).astype(act).astype(_F32)
    weighted = (norm_w.astype(_F32) * normed).astype(norm_dtype).astype(_F32)
    return (weighted * jax.nn.silu(z.astype(_F32))).astype(act)


@dataclasses.dataclass(frozen=True)
class GdnDecodeLayerConfig:
    """Tuning knobs (hashable: a static argument)."""

    num_warps: int = 8
    num_stages: int = 1
    block_v: int = 128  # widest Dv columns per program; narrower down to min_programs (gdn_decode.program_blocks)
    min_programs: int = 128


DEFAULT_CONFIG = GdnDecodeLayerConfig()


@functools.partial(jax.jit, static_argnames=("num_key_heads", "eps", "interpret", "config"))
def gdn_decode_layer(proj, active, hist_pool, conv_w, a_log, dt_bias, norm_w, ssm_pool, slots, *,
                     num_key_heads: int, eps: float, interpret: bool = False,
                     config: GdnDecodeLayerConfig | None = None):
    """One GDN decode step for each of B lanes, from the in-projection's output to the gated norm's.

    Args:
      proj: [B, C + Hv Dv + 2 Hv], the in-projection's output whole: the pre-conv channels qkv (C = 2 Hk Dk +
        Hv Dv), then z [Hv Dv], b [Hv] and a [Hv]. Slicing them apart first would cost a copy each (XLA makes a
        custom call's sliced operand a memcpy).
      active: [B] bool. hist_pool: [S, K-1, C] conv histories; conv_w: [K, C].
      a_log, dt_bias: [Hv]; norm_w: [Dv]. ssm_pool: [S, Hv, Dk, Dv] float32 (alias it through a donated jit
      argument to avoid a copy). slots: [B] int32, distinct.
      num_key_heads: Hk. eps: the gated norm's epsilon.
    Returns:
      (y [B, Hv, Dv] in proj's dtype, updated ssm_pool, new conv histories [B, K-1, C] in proj's dtype).
    """
    config = config or DEFAULT_CONFIG
    lanes = proj.shape[0]
    taps, channels = conv_w.shape
    hv, dk, dv = ssm_pool.shape[1:]
    if channels != 2 * num_key_heads * dk + hv * dv or proj.shape != (lanes, channels + hv * dv + 2 * hv):
        raise ValueError(f"gdn_decode_layer: proj {proj.shape} / conv_w {conv_w.shape} do not hold 2 x {num_key_heads}"
                         f" key heads of {dk} and {hv} value heads of {dv}")
    if hist_pool.shape[1:] != (taps - 1, channels) or norm_w.shape != (dv,):
        raise ValueError(f"gdn_decode_layer: conv pool {hist_pool.shape} / norm_w {norm_w.shape} do not fit the layer")
    if slots.shape != (lanes,) or active.shape != (lanes,):
        raise ValueError(f"gdn_decode_layer: slots {slots.shape}, active {active.shape} must be [{lanes}]")
    if hv % num_key_heads or ssm_pool.dtype != _F32:
        raise ValueError("gdn_decode_layer: value heads must be a multiple of key heads, the state float32")
    full = _compat.full_spec()
    block_v = program_blocks(lanes * hv, dv, config.block_v, config.min_programs)
    norm_dtype = jnp.promote_types(norm_w.dtype, proj.dtype)
    y, ssm_pool, tail = pl.pallas_call(
        functools.partial(_layer_kernel, num_key_heads=num_key_heads, group=hv // num_key_heads, taps=taps,
                          eps=eps, norm_dtype=norm_dtype, block_v=block_v),
        grid=(lanes, hv, dv // block_v),
        in_specs=[full] * 9,
        out_specs=[full] * 3,
        out_shape=[
            jax.ShapeDtypeStruct((lanes, hv, dv), proj.dtype),
            jax.ShapeDtypeStruct(ssm_pool.shape, ssm_pool.dtype),
            jax.ShapeDtypeStruct((lanes, taps - 1, channels), proj.dtype),
        ],
        input_output_aliases={8: 1},
        compiler_params=_compat.triton_params(config.num_warps, config.num_stages),
        interpret=interpret,
        name="gdn_decode_layer",
    )(slots.astype(jnp.int32), active.astype(jnp.int32), proj, hist_pool, conv_w, a_log, dt_bias, norm_w, ssm_pool)
    if block_v < dv:  # y holds o
        y = _gated_norm(y, proj[:, channels : channels + hv * dv].reshape(lanes, hv, dv), norm_w, eps, norm_dtype)
    return y, ssm_pool, tail
