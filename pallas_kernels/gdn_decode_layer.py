"""The GDN mixer's decode step between its two projections as one kernel: conv, activations, gated delta rule
and output norm for one token of each of B lanes.

Computes what `ninfer_jax.model.qwen3_5._gdn_decode` otherwise composes from about a dozen XLA kernels around
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

One program per (lane, value head) with the whole [Dk, Dv] state of the head, so the norm over Dv stays inside
it. The key head's conv is recomputed by each of its Hv / Hk value heads (2 x Dk channels x K taps, small);
the first of them writes that key head's history rows.

Status (session 10): built and checked on CPU (interpret mode against the unfused path, Triton lowering at the
real shapes); not yet timed on the H200, so `KernelConfig.fuse_gdn_decode` is off by default.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _compat
from pallas_kernels.gdn_decode import delta_rule_step
from pallas_kernels.reference import l2_normalize

_F32 = jnp.float32


def _layer_kernel(
    slots_ref,  # [B] int32
    active_ref,  # [B] int32 (1: the lane decodes)
    qkv_ref,  # [B, C] pre-conv channels: q of every key head, k of every key head, v of every value head
    z_ref,  # [B, Hv, Dv]
    a_ref,  # [B, Hv]
    b_ref,  # [B, Hv]
    hist_ref,  # [S, K-1, C] conv history pool (read only)
    conv_w_ref,  # [K, C]
    a_log_ref,  # [Hv] float32
    dt_bias_ref,  # [Hv] float32
    norm_w_ref,  # [Dv]
    ssm_ref,  # [S, Hv, Dk, Dv] float32 (aliased with ssm_out_ref)
    y_ref,  # out [B, Hv, Dv] activations' dtype
    ssm_out_ref,  # out [S, Hv, Dk, Dv] float32, the same buffer as ssm_ref
    tail_ref,  # out [B, K-1, C] activations' dtype: the lane's new conv history
    *,
    num_key_heads: int,
    group: int,
    taps: int,
    eps: float,
    norm_dtype,
):
    lane, h = pl.program_id(0), pl.program_id(1)
    kh = h // group
    dk, dv = ssm_ref.shape[2], ssm_ref.shape[3]
    key_dim = num_key_heads * dk
    act = qkv_ref.dtype
    slot = slots_ref[lane]
    live = active_ref[lane] != 0
    mask = live.astype(_F32)

    def conv(c0, width, write_tail):
        """silu(conv) of channels [c0, c0 + width), rounded to the activations' dtype; writes their new history."""
        cols = pl.ds(c0, width)
        rows = [hist_ref[slot, j, cols].astype(act) for j in range(taps - 1)] + [qkv_ref[lane, cols]]
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

    first_of_key_head = h % group == 0
    q = l2_normalize(conv(kh * dk, dk, first_of_key_head)) * (dk**-0.5) * mask
    k = l2_normalize(conv(key_dim + kh * dk, dk, first_of_key_head)) * mask
    v = conv(2 * key_dim + h * dv, dv, True).astype(_F32) * mask
    g = -jnp.exp(a_log_ref[h].astype(_F32)) * jax.nn.softplus(a_ref[lane, h].astype(_F32)
                                                              + dt_bias_ref[h].astype(_F32)) * mask
    beta = jax.nn.sigmoid(b_ref[lane, h].astype(_F32)) * mask

    o, ssm_out_ref[slot, h, :, :] = delta_rule_step(ssm_ref[slot, h, :, :], q, k, v, g, beta)  # o [Dv]

    # The gated RMSNorm, with the model's roundings: o to the activations' dtype, the normalised o back to it
    # before the weight, the weighted product in the weight's and activations' common dtype.
    of = o.astype(act).astype(_F32)
    normed = (of * jax.lax.rsqrt(jnp.mean(of * of) + eps)).astype(act).astype(_F32)
    weighted = (norm_w_ref[...].astype(_F32) * normed).astype(norm_dtype).astype(_F32)
    y_ref[lane, h, :] = (weighted * jax.nn.silu(z_ref[lane, h, :].astype(_F32))).astype(act)


@dataclasses.dataclass(frozen=True)
class GdnDecodeLayerConfig:
    """Tuning knobs (hashable: a static argument)."""

    num_warps: int = 8
    num_stages: int = 1


@functools.partial(jax.jit, static_argnames=("num_key_heads", "eps", "interpret", "config"))
def gdn_decode_layer(qkv, z, a, b, active, hist_pool, conv_w, a_log, dt_bias, norm_w, ssm_pool, slots, *,
                     num_key_heads: int, eps: float, interpret: bool = False,
                     config: GdnDecodeLayerConfig | None = None):
    """One GDN decode step for each of B lanes, from the in-projection's outputs to the gated norm's.

    Args:
      qkv: [B, C] pre-conv channels (C = 2 Hk Dk + Hv Dv); z: [B, Hv, Dv]; a, b: [B, Hv]; all one dtype.
      active: [B] bool. hist_pool: [S, K-1, C] conv histories; conv_w: [K, C].
      a_log, dt_bias: [Hv]; norm_w: [Dv]. ssm_pool: [S, Hv, Dk, Dv] float32 (alias it through a donated jit
      argument to avoid a copy). slots: [B] int32, distinct.
      num_key_heads: Hk. eps: the gated norm's epsilon.
    Returns:
      (y [B, Hv, Dv] in qkv's dtype, updated ssm_pool, new conv histories [B, K-1, C] in qkv's dtype).
    """
    config = config or GdnDecodeLayerConfig()
    lanes, channels = qkv.shape
    hv, dv = z.shape[1], z.shape[2]
    taps = conv_w.shape[0]
    dk = ssm_pool.shape[2]
    if channels != 2 * num_key_heads * dk + hv * dv or conv_w.shape != (taps, channels):
        raise ValueError(f"gdn_decode_layer: qkv {qkv.shape} / conv_w {conv_w.shape} do not hold 2 x {num_key_heads}"
                         f" key heads of {dk} and {hv} value heads of {dv}")
    if hist_pool.shape[1:] != (taps - 1, channels) or ssm_pool.shape[1:] != (hv, dk, dv):
        raise ValueError(f"gdn_decode_layer: pools {hist_pool.shape}, {ssm_pool.shape} do not fit the layer")
    if a.shape != (lanes, hv) or b.shape != (lanes, hv) or slots.shape != (lanes,) or active.shape != (lanes,):
        raise ValueError(f"gdn_decode_layer: a {a.shape}, b {b.shape}, slots {slots.shape}, active {active.shape}")
    if hv % num_key_heads or ssm_pool.dtype != _F32:
        raise ValueError("gdn_decode_layer: value heads must be a multiple of key heads, the state float32")
    full = _compat.full_spec()
    return pl.pallas_call(
        functools.partial(_layer_kernel, num_key_heads=num_key_heads, group=hv // num_key_heads, taps=taps,
                          eps=eps, norm_dtype=jnp.promote_types(norm_w.dtype, qkv.dtype)),
        grid=(lanes, hv),
        in_specs=[full] * 12,
        out_specs=[full] * 3,
        out_shape=[
            jax.ShapeDtypeStruct((lanes, hv, dv), qkv.dtype),
            jax.ShapeDtypeStruct(ssm_pool.shape, ssm_pool.dtype),
            jax.ShapeDtypeStruct((lanes, taps - 1, channels), qkv.dtype),
        ],
        input_output_aliases={11: 1},
        compiler_params=_compat.triton_params(config.num_warps, config.num_stages),
        interpret=interpret,
        name="gdn_decode_layer",
    )(slots.astype(jnp.int32), active.astype(jnp.int32), qkv, z, a, b, hist_pool, conv_w, a_log, dt_bias, norm_w,
      ssm_pool)
