"""Qwen3.5 (dense and MoE) as pure functions of a params pytree and the engine's DeviceState.

Layer layout: layer i is Gated DeltaNet ("linear_attention") or full attention per config.layer_types
(for the released models, full attention where (i + 1) % 4 == 0), each followed by a SwiGLU MLP or an MoE
block, with pre-norm residuals. Conventions, each checked against HF transformers' Qwen3_5 classes by
tests/model/test_hf_parity.py:
  * RMSNorm is zero-centred, x * rsqrt(mean(x^2) + eps) * (1 + w), computed in float32 and cast back;
    except the gated norm inside GDN: plain w, times silu(z), normalised per value head.
  * GDN: in_proj -> [qkv | z | b | a]; causal depthwise conv (kernel K = 4, no bias, SiLU) over qkv only,
    carried across calls as the K-1 previous pre-conv rows; g = -exp(A_log) * softplus(a + dt_bias),
    beta = sigmoid(b); q, k L2-normalised (eps 1e-6) and q scaled by Dk^-0.5 in float32; value head j
    reads key head j // (Hv / Hk).
  * Attention: q_proj gives [q_h | gate_h] per head; q_norm / k_norm (zero-centred, per head); NeoX RoPE
    on the first rotary_dim = head_dim * partial_rotary_factor dims (rotate-half, theta from config);
    GQA; softmax scale D^-0.5; output times sigmoid(gate) before o_proj.
  * MoE: softmax router in float32, top-k, renormalised; routed experts plus a shared expert scaled by
    sigmoid(x @ shared_gate).
  * lm_head is embed^T when tie_word_embeddings.
  * A block-FP8 projection weight (QuantizedWeight / ConcatWeight) goes through `ops.quantized_dot` in `dot`.

Entry points:
  prefill(...)  one lane's chunk of T tokens at absolute positions [base, base + T), with in-kernel state
                taps; returns final-normed hidden states [T, H] and the updated DeviceState.
  decode(...)   one token for each of B lanes.
  mixed(...)    one lane's prefill chunk and a decode round over other lanes, in one pass over the weights.
  verify(...)   T tokens for each of B lanes (speculative decoding), then `commit_verified` keeps each lane's
                accepted rows.
  logits(...)   hidden -> float32 logits.
  forward(...)  whole-sequence forward without a cache (a fresh one-lane DeviceState); `forward_hidden` is it
                before the logits, unjitted.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ninfer_jax.config import ModelConfig
from ninfer_jax.model import ops, spmd
from ninfer_jax.model.ops import KernelConfig
from ninfer_jax.model.params import ConcatWeight, GDNParams, LayerParams, MLPParams, MoEParams, Params
from ninfer_jax.model.state import PAGE, DeviceState, init_device_state
# the norms live with the kernels' references: the kernels compute them on each row
from pallas_kernels import kv_quant
from pallas_kernels.reference import SharedExpert, gated_rms_norm, l2_normalize, rms_norm, swiglu

F32 = jnp.float32


# --- small pieces ------------------------------------------------------------------------------------
def dot(kc: KernelConfig, x, w, *, to_norm: bool = False):
    """x @ w in x's dtype. to_norm: the product goes straight to `add_norm`, which may take a one-row product with
    the duplicate row of its two-row matmul still attached (its rows past x's are ignored), or a split product's
    partial sums (`ops.PartialSums`)."""
    if isinstance(x, ops.GatedRows):  # a one-lane GDN step's output, normalized by its out-projection
        return ops.gated_rows_dot(kc, x, w)
    if isinstance(x, ops.DoubledRow):  # the two rows below, written so by the kernel before
        return _two_rows_dot(x.rows, w, to_norm)
    if ops.is_quantized(w):  # an FP8 checkpoint's weight; decided while tracing, so plain weights pay nothing
        return ops.quantized_dot(kc, x, w, to_norm)
    x = ops.plain_rows(x)
    # The output in x.dtype straight from the matmul (f32 accumulation inside): an f32 result converted after
    # costs a separate pass over every output (docs/benchmarks/prefill_profile.md).
    one_row = x.ndim == 2 and x.shape[0] == 1
    if one_row and ops.xla_rewrites_one_row(w.shape):
        # XLA rewrites a one-row dot into a form that writes the [K, N] product out before reducing it, a large part
        # of a one-lane decode round (docs/kernels_notes.md). Two rows make it a matmul again; the barrier keeps the
        # simplifier from folding the copy back. The second row reads no extra weight bytes. Cutting it off is a
        # copy kernel when the product goes to a custom call (the add + norm kernel), which ignores it instead.
        return _two_rows_dot(jax.lax.optimization_barrier(jnp.concatenate([x, x])), w, to_norm)
    return jnp.dot(x, w, preferred_element_type=x.dtype)


def _two_rows_dot(two, w, to_norm: bool):
    """A one-row product run on its row twice (`dot`): both rows for add_norm, else the first."""
    out = jnp.dot(two, w, preferred_element_type=two.dtype)
    return out if to_norm else out[:1]


def add_norm(kc: KernelConfig, x, h, w, eps, fp8_rows: str | None = None, router_w=None):
    """The residual stream x plus a block's output h (None: nothing to add; rows past x's are ignored, see
    `dot`'s to_norm), and its RMSNorm: (x + h, norm). fp8_rows: `ops.fp8_rows_for` the block that reads the norm,
    for the kernel to write its FP8 rows too (the norm then comes as `ops.Fp8Rows`); router_w: `ops.router_for` it,
    for the kernel to compute the router's logits too (as `ops.RoutedRows`)."""
    fused = ops.add_rms_norm(kc, x, h, w, eps, fp8_rows, router_w)
    if fused is not None:
        return fused
    x = x if h is None else x + ops.summed(h)[: x.shape[0]]
    return x, rms_norm(x, w, eps)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """RoPE's frequencies [rotary_dim / 2] float32."""
    rot = cfg.rotary_dim
    return 1.0 / (cfg.rope_theta ** (np.arange(0, rot, 2, dtype=np.float32) / rot))


def mrope_axes(cfg: ModelConfig) -> np.ndarray:
    """Which of an MRoPE position's (time, height, width) entries each rotary frequency turns with: int [rotary_dim
    / 2] of 0, 1, 2, interleaved as transformers' Qwen3.5 text rotary embedding lays them out."""
    axes = np.zeros(cfg.rotary_dim // 2, np.int32)
    axes[1:3 * cfg.mrope_section[1]:3] = 1
    axes[2:3 * cfg.mrope_section[2]:3] = 2
    return axes


def rope(x, positions, cfg: ModelConfig):
    """NeoX rotate-half RoPE on the first rotary_dim dims of x [T, H, D] at integer positions [T], or at MRoPE
    positions [3, T] (time, height, width: equal for text tokens, where it is the same as positions [T])."""
    rot = cfg.rotary_dim
    positions = positions.astype(F32)
    # [T, 1], or [T, rot / 2] with each frequency's own axis
    at = positions[jnp.asarray(mrope_axes(cfg))].T if positions.ndim == 2 else positions[:, None]
    freqs = at * jnp.asarray(rope_inv_freq(cfg))[None, :]
    cos, sin = (f.astype(x.dtype)[:, None, :] for f in (jnp.cos(freqs), jnp.sin(freqs)))
    x1, x2, rest = x[..., : rot // 2], x[..., rot // 2 : rot], x[..., rot:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)


def _mlp_act(gu):
    inter = gu.shape[-1] // 2
    return swiglu(gu[..., :inter], gu[..., inter:])


def mlp(p: MLPParams, x, kc: KernelConfig):
    if kc.spmd is not None and kc.spmd.splits_ffn(p):  # each device's partial down-projection, summed in f32
        def partial(p, x, *_):
            act = _mlp_act(dot(kc, x, p.gate_up))
            if ops.is_quantized(p.down):
                return ops.quantized_dot(kc, act, p.down).astype(F32)
            return jnp.dot(act, p.down, preferred_element_type=F32)

        return kc.spmd.ffn(p, x, partial).astype(x.dtype)
    gu = dot(kc, x, p.gate_up)
    fused = ops.swiglu_dot(kc, gu, p.down)  # on the FP8 GEMM, the product written as its FP8 rows
    return fused if fused is not None else dot(kc, _mlp_act(gu), p.down, to_norm=True)


def moe(p: MoEParams, x, cfg: ModelConfig, kc: KernelConfig):
    """x: the norm's rows, or `ops.Fp8Rows` with them (the experts on the grouped GEMM read its FP8 rows), or
    `ops.RoutedRows` with the router's logits."""
    def experts(p, x, expert_offset=None, shared_weight=None):  # f32
        if expert_offset is None and shared_weight is None:
            out = ops.moe_routed_experts(kc, x, p.router, cfg.num_experts_per_tok, p.gate_up, p.down,
                                         SharedExpert(p.shared.gate_up, p.shared.down, None), p.shared_gate)
            if out is not None:
                return out
        x, x_fp8 = ops.plain_rows(x), x if isinstance(x, ops.Fp8Rows) else None
        ids, weights, gate = ops.moe_route(kc, x, p.router, cfg.num_experts_per_tok, p.shared_gate)
        if expert_offset is not None:
            ids, weights = spmd.local_experts(ids, weights, expert_offset, p.gate_up.shape[0])
        if shared_weight is not None:  # a shared expert whole on every device counts on one
            gate = gate * shared_weight
        # The shared expert goes to the expert kernels with its gate, so a one-lane round reads it in their two
        # kernels (docs/kernels_notes.md).
        shared = SharedExpert(p.shared.gate_up, p.shared.down, gate)
        return ops.moe_experts(kc, x, ids, weights, p.gate_up, p.down, shared, x_fp8)

    if kc.spmd is not None and kc.spmd.splits_ffn(p):
        return kc.spmd.ffn(p, x, experts).astype(x.dtype)
    return experts(p, x).astype(ops.plain_rows(x).dtype)


def ffn(p, x, cfg, kc):
    return moe(p, x, cfg, kc) if isinstance(p, MoEParams) else mlp(p, x, kc)


# --- Gated DeltaNet pieces shared by prefill and decode ----------------------------------------------
def _gdn_split(proj, cfg: ModelConfig):
    """The in-projection's output [N, conv_dim + Hv Dv + 2 Hv], or its two sides apart ([N, conv_dim + Hv Dv],
    [N, 2 Hv]: `_gdn_in_dot`) -> (pre-conv qkv [N, conv_dim], z [N, Hv, Dv], a [N, Hv], b [N, Hv])."""
    cd, vd, hv = cfg.conv_dim, cfg.value_dim, cfg.linear_num_value_heads
    proj, gates = proj if isinstance(proj, tuple) else (proj, proj[:, cd + vd :])
    qkv, z = proj[:, :cd], proj[:, cd : cd + vd]
    b, a = gates[:, :hv], gates[:, hv:]
    return qkv, z.reshape(-1, hv, cfg.linear_value_head_dim), a, b


def _gdn_in_dot(cfg: ModelConfig):
    """x @ the GDN in-projection w, as `_projected`'s in_dot: an FP8 checkpoint's products before and after b and a
    ([qkv | z] FP8, [b | a] not) stay apart (`_gdn_split` and the kernels read them so), each as
    `ops.quantized_dot` computes it, since joining them is a copy of the whole output a layer (36 ms of a 27B 32k
    FP8 pass); any other weight as `dot`."""
    def in_dot(kc: KernelConfig, x, w):
        at = cfg.conv_dim + cfg.value_dim
        ends = np.cumsum([part.shape[-1] for part in w.parts]) if isinstance(w, ConcatWeight) else ()
        if at not in ends[:-1]:
            return dot(kc, x, w)
        i = int(np.searchsorted(ends, at)) + 1
        sides = (w.parts[:i], w.parts[i:])
        return tuple(ops.quantized_dot(kc, x, side[0] if len(side) == 1 else ConcatWeight(side)) for side in sides)

    return in_dot


def _qkvz(proj):
    """The in-projection's output, or its first side when apart: the columns from qkv through z."""
    return proj[0] if isinstance(proj, tuple) else proj


def _gdn_qkv(conv_out, cfg: ModelConfig):
    """Post-conv activations -> the delta rule's q, k [N, Hk, Dk] (normalised, q scaled) and v [N, Hv, Dv]."""
    kd = cfg.key_dim
    hk, dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
    q = l2_normalize(conv_out[:, :kd].reshape(-1, hk, dk)) * (dk**-0.5)
    k = l2_normalize(conv_out[:, kd : 2 * kd].reshape(-1, hk, dk))
    v = conv_out[:, 2 * kd :].reshape(-1, cfg.linear_num_value_heads, cfg.linear_value_head_dim)
    return q, k, v


def _gdn_gb(p: GDNParams, a, b):
    """The in-projection's a, b [N, Hv] -> the delta rule's log decay g and write strength beta (float32)."""
    g = -jnp.exp(p.a_log.astype(F32)) * jax.nn.softplus(a.astype(F32) + p.dt_bias.astype(F32))
    return g, jax.nn.sigmoid(b.astype(F32))


def _gdn_qkvgb(p: GDNParams, conv_out, a, b, cfg: ModelConfig):
    """Post-conv activations -> kernel inputs q, k [N, Hk, Dk] (normalised, q scaled), v, g, beta."""
    return *_gdn_qkv(conv_out, cfg), *_gdn_gb(p, a, b)


def gdn_conv_qkv(window, conv_w, m, cfg: ModelConfig):
    """What `ops.gdn_conv_prefill` computes as one kernel: the window [T + K - 1, C] of pre-conv rows -> the delta
    rule's q, k, v (as `_gdn_qkv`, q and k rounded to the activations' dtype after their norms, as fla's l2norm
    writes them), zero in the rows whose m [T, 1] is False (bucket padding)."""
    q, k, v = _gdn_qkv(_conv(window, conv_w), cfg)
    return (q * m[..., None]).astype(v.dtype), (k * m[..., None]).astype(v.dtype), v * m[..., None].astype(v.dtype)


def _gdn_normed(p: GDNParams, core, z, cfg: ModelConfig, dtype):
    """The delta rule's output [N, Hv, Dv] -> the out-projection's input [N, Hv Dv] (the gated norm)."""
    y = gated_rms_norm(core.astype(dtype), z, p.norm_w, cfg.rms_norm_eps)
    return y.reshape(y.shape[0], -1)


def _gdn_out(p: GDNParams, core, z, cfg: ModelConfig, kc: KernelConfig, dtype, proj=None):
    """The gated norm and the out-projection (on the FP8 GEMM, the norm writing its rows quantized, reading z in
    place from the in-projection's output proj when given)."""
    fused = ops.gated_norm_dot(kc, core, z, p.norm_w, cfg.rms_norm_eps, p.out_proj,
                               z_source=None if proj is None else (proj, cfg.conv_dim))
    if fused is not None:
        return fused
    return dot(kc, _gdn_normed(p, core, z, cfg, dtype), p.out_proj, to_norm=True)


def _projected(core_fn, in_w, out_w, in_dot=None):
    """A token mixer from its core: x -> in-projection (`dot`, or in_dot) -> core_fn(proj, *pools) -> (y, *pools) ->
    out-projection of y. `mixed` runs the projections over all of a step's rows and the cores over their own rows."""
    def mixer(kc: KernelConfig, x, *pools):
        y, *pools = core_fn((in_dot or dot)(kc, x, in_w), *pools)
        return dot(kc, y, out_w, to_norm=True), *pools

    return mixer


def _conv(window, conv_w):
    """window [N + K - 1, C] of pre-conv rows -> SiLU(causal depthwise conv) [N, C]."""
    k = conv_w.shape[0]
    n = window.shape[0] - k + 1
    acc = sum(window[j : j + n].astype(F32) * conv_w[j].astype(F32) for j in range(k))
    return jax.nn.silu(acc).astype(window.dtype)


# --- prefill -----------------------------------------------------------------------------------------
def _gdn_prefill_core(p, proj, cfg, kc, ssm, conv, ctx):
    """One lane's chunk from its in-projection rows proj [T, P] (or its sides apart, `_gdn_split`) -> ((the delta
    rule's output, z) [T, Hv, Dv] each, ssm, conv)."""
    qkv, z, a, b = _gdn_split(proj, cfg)
    proj = _qkvz(proj)  # the conv kernel reads qkv, its first columns, alone
    t = proj.shape[0]
    slot, base, n_valid, valid = ctx["slot"], ctx["base"], ctx["n_valid"], ctx["valid"]
    fresh = base == 0  # a lane at position 0 starts from the zero state whatever its slot held
    history = jnp.where(fresh, 0, conv[slot]).astype(qkv.dtype)
    window = jnp.concatenate([history, qkv], axis=0)  # row r holds position base - (K-1) + r
    # Bucket padding becomes identity tokens, which leave the recurrent state bit-for-bit unchanged.
    m = valid[:, None]
    g, beta = _gdn_gb(p, a, b)
    g, beta = g * m, beta * m
    # With kc.fuse_gdn_conv the conv, the norms and the padding's zeros are one kernel reading proj
    fused = ops.gdn_conv_prefill(kc, proj, history, p.conv_w, n_valid, cfg)
    if fused is not None:
        q, k, v = fused
    else:
        q, k, v = gdn_conv_qkv(window, p.conv_w, m, cfg)
    ssm = ssm.at[slot].set(jnp.where(fresh, 0.0, ssm[slot]))
    core, ssm = ops.gdn_prefill(kc, q, k, v, g, beta, ssm, slot, base, ctx["tap_positions"], ctx["tap_slots"])
    # Conv history after the chunk: the K-1 rows before position base + n_valid.
    km1 = cfg.linear_conv_kernel_dim - 1
    conv = conv.at[slot].set(jax.lax.dynamic_slice_in_dim(window, n_valid, km1, axis=0).astype(conv.dtype))
    # Conv taps: the K-1 rows before each tap position p (spec §7.3 item 2).
    for j in range(ctx["tap_positions"].shape[0]):
        pos = ctx["tap_positions"][j]
        ok = (pos > base) & (pos <= base + n_valid)
        rows = jax.lax.dynamic_slice_in_dim(window, jnp.clip(pos - base, 0, t), km1, axis=0)
        target = jnp.where(ok, ctx["tap_slots"][j], conv.shape[0])
        conv = conv.at[target].set(rows.astype(conv.dtype), mode="drop")
    return (core, z), ssm, conv


def _gdn_prefill(p, x, cfg, kc, ssm, conv, ctx):
    proj = _gdn_in_dot(cfg)(kc, x, p.in_proj)
    (core, z), ssm, conv = _gdn_prefill_core(p, proj, cfg, kc, ssm, conv, ctx)
    return _gdn_out(p, core, z, cfg, kc, z.dtype, _qkvz(proj)), ssm, conv


def _gdn_prefill_normed(p, proj, cfg, kc, ssm, conv, ctx):
    """`_gdn_prefill_core` up to the out-projection's input [T, Hv Dv] (the gated norm), for `mixed`'s split rows."""
    (core, z), ssm, conv = _gdn_prefill_core(p, proj, cfg, kc, ssm, conv, ctx)
    return _gdn_normed(p, core, z, cfg, z.dtype), ssm, conv


def _attn_split(proj, cfg: ModelConfig):
    """The qkv projection's output [N, Hq 2D + 2 Hkv D] -> q [N, Hq, D], k, v [N, Hkv, D], gate [N, Hq D]."""
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    qg = proj[:, : hq * 2 * d].reshape(-1, hq, 2, d)
    q, gate = qg[:, :, 0], qg[:, :, 1].reshape(proj.shape[0], hq * d)
    k = proj[:, hq * 2 * d : hq * 2 * d + hkv * d].reshape(-1, hkv, d)
    v = proj[:, hq * 2 * d + hkv * d :].reshape(-1, hkv, d)
    return q, k, v, gate


def _attn_qkv(q_norm, k_norm, proj, positions, cfg: ModelConfig):
    """The qkv projection's output -> q, k normalised and rotated, v, gate (as `_attn_split`)."""
    q, k, v, gate = _attn_split(proj, cfg)
    q = rope(rms_norm(q, q_norm, cfg.rms_norm_eps), positions, cfg)
    k = rope(rms_norm(k, k_norm, cfg.rms_norm_eps), positions, cfg)
    return q, k, v, gate


def attn_decode_qkv_composed(q_norm, k_norm, proj, positions, tables, active, k_pages, v_pages, cfg: ModelConfig,
                             rope_positions=None):
    """One decode token per lane up to the attention kernel, composed (`ops.attn_decode_qkv` is it as one kernel):
    -> (q normalised and rotated to rope_positions (None: positions), the pools with each active lane's key and
    value at its position)."""
    q, k, v, _ = _attn_qkv(q_norm, k_norm, proj, positions if rope_positions is None else rope_positions, cfg)
    page_ids = jnp.where(active, tables[jnp.arange(proj.shape[0]), positions // PAGE], k_pages.shape[0])
    rows = positions % PAGE
    return q, kv_quant.write(k_pages, k, page_ids, rows), kv_quant.write(v_pages, v, page_ids, rows)


def _attn_gated(core, gate, dtype):
    """Attention's output [N, Hq, D] -> the out-projection's input [N, Hq D] (times sigmoid(gate))."""
    return core.astype(dtype).reshape(core.shape[0], -1) * jax.nn.sigmoid(gate)


def _attn_prefill_write(p, proj, cfg, k_pages, v_pages, ctx):
    """One lane's chunk from its qkv-projection rows proj [T, P] up to the attention kernel -> (q, gate, the pools
    with the chunk's keys and values written)."""
    t = proj.shape[0]
    positions = ctx["base"] + jnp.arange(t, dtype=jnp.int32)
    rotary = positions if ctx.get("rope_positions") is None else ctx["rope_positions"]  # MRoPE: image spans' 3-D
    q, k, v, gate = _attn_qkv(p.q_norm, p.k_norm, proj, rotary, cfg)
    # Padded tokens write nowhere: page id P is out of range and dropped.
    page_ids = jnp.where(ctx["valid"], ctx["page_table"][positions // PAGE], k_pages.shape[0])
    k_pages = kv_quant.write(k_pages, k, page_ids, positions % PAGE)
    v_pages = kv_quant.write(v_pages, v, page_ids, positions % PAGE)
    return q, gate, k_pages, v_pages


def _attn_prefill_read(kc, q, gate, k_pages, v_pages, ctx, dtype):
    """The chunk's attention over its lane's pages (written) -> the out-projection's input."""
    return _attn_gated(ops.attention_prefill(kc, q, k_pages, v_pages, ctx["page_table"], ctx["base"]), gate, dtype)


def _attn_prefill_core(p, proj, cfg, kc, k_pages, v_pages, ctx):
    """One lane's chunk from its qkv-projection rows proj [T, P] -> (the out-projection's input, k_pages,
    v_pages)."""
    q, gate, k_pages, v_pages = _attn_prefill_write(p, proj, cfg, k_pages, v_pages, ctx)
    return _attn_prefill_read(kc, q, gate, k_pages, v_pages, ctx, proj.dtype), k_pages, v_pages


def _attn_prefill(p, x, cfg, kc, k_pages, v_pages, ctx):
    return _projected(lambda proj, kp, vp: _attn_prefill_core(p, proj, cfg, kc, kp, vp, ctx), p.qkv_proj,
                      p.o_proj)(kc, x, k_pages, v_pages)


def _mix(kc: KernelConfig, cfg: ModelConfig, fn, p, x, *pools, ctx, extras: int = 0):
    """fn(p, x, *pools, cfg, ctx) -> (y, *pools, *extras): one token mixer, per device on its heads where the mesh
    splits it (`Spmd.mixer`, which takes ctx, the step's arrays the mixer reads, as an input)."""
    if kc.spmd is not None and kc.spmd.splits_mixer(p, cfg):
        return kc.spmd.mixer(fn, p, x, pools, cfg, ctx, extras)
    return fn(p, x, *pools, cfg, ctx)


def _run_layers(params: Params, cfg: ModelConfig, kc: KernelConfig, x, state: DeviceState, gdn_fn, attn_fn, ctx,
                gdn_sink: list | None = None):
    """The layer loop, unrolled; gdn_fn(p, x, ssm, conv, cfg, ctx) / attn_fn(p, x, k_pages, v_pages, cfg, ctx)
    apply one token mixer under the config given (a device's share of the heads on a mesh) and return its new pools;
    ctx is a pytree of the step's arrays they read (positions, page tables, slots), passed in rather than closed
    over (`Spmd.mixer`). With gdn_sink, gdn_fn returns one more output per layer, appended to it."""
    ks, vs, ssms, convs = list(state.k_pages), list(state.v_pages), list(state.ssm), list(state.conv)
    gi = ai = 0
    eps = cfg.rms_norm_eps
    h = None  # the previous layer's FFN output, added to x with the next norm
    for layer in params.layers:
        layer: LayerParams
        mixer_in = layer.mixer.in_proj if isinstance(layer.mixer, GDNParams) else layer.mixer.qkv_proj
        x, normed = add_norm(kc, x, h, layer.input_norm, eps, ops.fp8_rows_for(kc, x.shape[0], mixer_in))
        if isinstance(layer.mixer, GDNParams):
            out = _mix(kc, cfg, gdn_fn, layer.mixer, normed, ssms[gi], convs[gi], ctx=ctx,
                       extras=gdn_sink is not None)
            h, ssms[gi], convs[gi] = out[:3]
            if gdn_sink is not None:
                gdn_sink.append(out[3])
            gi += 1
        else:
            h, ks[ai], vs[ai] = _mix(kc, cfg, attn_fn, layer.mixer, normed, ks[ai], vs[ai], ctx=ctx)
            ai += 1
        ffn_in = layer.ffn.gate_up if isinstance(layer.ffn, MLPParams) else layer.ffn
        x, normed = add_norm(kc, x, h, layer.post_norm, eps,
                             ops.fp8_rows_for(kc, x.shape[0], ffn_in, cfg.num_experts_per_tok),
                             ops.router_for(kc, x.shape[0], layer.ffn, cfg.num_experts_per_tok))
        h = ffn(layer.ffn, normed, cfg, kc)
    _, x = add_norm(kc, x, h, params.final_norm, eps)
    return x, DeviceState(tuple(ks), tuple(vs), tuple(ssms), tuple(convs))


def prefill(
    params: Params,
    cfg: ModelConfig,
    kc: KernelConfig,
    tokens,
    n_valid,
    base,
    page_table,
    slot,
    state: DeviceState,
    tap_positions,
    tap_slots,
    rope_positions=None,
    inputs_embeds=None,
):
    """One lane's prefill chunk.

    Args:
      tokens: [T] int32, the first n_valid real (the rest bucket padding).
      n_valid: int32 scalar in [1, T]. base: int32 absolute position of tokens[0]; base == 0 starts the
        lane from the zero state (its slot's previous contents are ignored).
      page_table: [max_pages] int32, the lane's page for each 64-token block; blocks the chunk writes
        must be mapped.
      slot: int32 state slot of the lane.
      tap_positions / tap_slots: [M] int32; the state after each 64-aligned position in
        (base, base + n_valid] is also written to its slot (the in-kernel tap); -1 = unused.
      rope_positions: None, or int32 [3, T]: the tokens' MRoPE positions where images make them differ from
        their indices (`frontend.mrope`); keys and values still go to the pages by index.
      inputs_embeds: None, or [T, H] in place of the tokens' embeddings (images' encoder outputs at their spans).
    Returns:
      (hidden [T, H] after the final norm, updated DeviceState).
    """
    t = tokens.shape[0]
    valid = jnp.arange(t) < n_valid
    ctx = dict(
        slot=slot, base=base, n_valid=n_valid, valid=valid, page_table=page_table,
        tap_positions=tap_positions, tap_slots=tap_slots, rope_positions=rope_positions,
    )
    x = params.embed[tokens] if inputs_embeds is None else inputs_embeds
    return _run_layers(
        params, cfg, kc, x, state,
        lambda p, h, ssm, conv, c, ctx: _gdn_prefill(p, h, c, kc, ssm, conv, ctx),
        lambda p, h, kp, vp, c, ctx: _attn_prefill(p, h, c, kc, kp, vp, ctx), ctx,
    )


# --- decode ------------------------------------------------------------------------------------------


def _gdn_decode_core(p, proj, cfg, kc, ssm, conv, ctx, out_norms: bool = False, fp8_out: bool = False):
    """One token per lane from its in-projection rows proj [B, P] (or its sides apart, `_gdn_split`) -> (the
    out-projection's input, ssm, conv). out_norms (`ops.gdn_out_fused`): that input is the delta rule's output as
    `ops.GatedRows`, for the out-projection to normalize; fp8_out (`ops.gdn_fp8_rows`): the norm's FP8 rows as
    `ops.Fp8Rows`."""
    slots, active = ctx["slots"], ctx["active"]
    sides = proj
    proj, gates = proj if isinstance(proj, tuple) else (proj, None)
    if kc.fuse_gdn_decode:  # the rest of this function as one kernel
        # slots are distinct (`steps.pack_decode_inputs`)
        y, ssm, conv = ops.gdn_decode_layer(kc, proj, active, conv, p.conv_w, p.a_log, p.dt_bias, p.norm_w, ssm, slots,
                                            num_key_heads=cfg.linear_num_key_heads, eps=cfg.rms_norm_eps, gates=gates,
                                            norm=not out_norms, fp8_out=fp8_out)
        if out_norms:
            return ops.GatedRows(y, proj, p.norm_w, cfg.conv_dim, cfg.rms_norm_eps), ssm, conv
        if fp8_out:
            xq, xs = y
            return ops.Fp8Rows(None, xq.reshape(xq.shape[0], -1), xs, proj.dtype), ssm, conv
        return y.reshape(y.shape[0], -1), ssm, conv
    qkv, z, a, b = _gdn_split(sides, cfg)
    history = conv[slots].astype(qkv.dtype)  # [B, K-1, C]
    window = jnp.concatenate([history, qkv[:, None, :]], axis=1)  # [B, K, C]
    conv_out = jax.vmap(lambda w: _conv(w, p.conv_w))(window)[:, 0]
    q, k, v, g, beta = _gdn_qkvgb(p, conv_out, a, b, cfg)
    m = active[:, None]
    q, k, v = q * m[..., None], k * m[..., None], v * m[..., None].astype(v.dtype)
    core, ssm = ops.gdn_decode(kc, q, k, v, g * m, beta * m, ssm, slots)
    new_hist = jnp.where(active[:, None, None], window[:, 1:], history)
    conv = conv.at[slots].set(new_hist.astype(conv.dtype))
    return _gdn_normed(p, core, z, cfg, proj.dtype), ssm, conv


def gdn_decode_mixer(p, x, cfg, kc, ssm, conv, ctx):
    lanes = ctx["slots"].shape[0]
    out_norms = ops.gdn_out_fused(kc, lanes, cfg.linear_num_value_heads, cfg.linear_value_head_dim, p.out_proj)
    fp8_out = not out_norms and ops.gdn_fp8_rows(kc, lanes, cfg.linear_value_head_dim, p.out_proj)
    return _projected(lambda proj, s, c: _gdn_decode_core(p, proj, cfg, kc, s, c, ctx, out_norms, fp8_out), p.in_proj,
                      p.out_proj, _gdn_in_dot(cfg))(kc, x, ssm, conv)


def _attn_decode_write(p, proj, cfg, kc, k_pages, v_pages, ctx):
    """One token per lane from its qkv-projection rows proj [B, P] up to the attention kernel -> (q, gate, the pools
    with each active lane's key and value written)."""
    positions, tables, active = ctx["positions"], ctx["page_tables"], ctx["active"]
    rotary = positions + ctx.get("rope_shift", 0)  # a prompt's MRoPE delta: its images moved later tokens' positions
    # With kc.fuse_attn_qkv the norms, RoPE and the KV writes are one kernel
    fused = ops.attn_decode_qkv(kc, proj, p.q_norm, p.k_norm, rope_inv_freq(cfg), positions, tables, active,
                                k_pages, v_pages, cfg, rotary)
    if fused is None:
        fused = attn_decode_qkv_composed(p.q_norm, p.k_norm, proj, positions, tables, active, k_pages, v_pages, cfg,
                                         rotary)
    q, k_pages, v_pages = fused
    return q, _attn_split(proj, cfg)[3], k_pages, v_pages


def _attn_decode_read(kc, q, gate, k_pages, v_pages, ctx, dtype):
    """Each lane's attention over its pages (written) -> the out-projection's input."""
    core = ops.attention_decode(kc, q, k_pages, v_pages, ctx["page_tables"], ctx["positions"] + 1)
    return _attn_gated(core, gate, dtype)


def _attn_decode_core(p, proj, cfg, kc, k_pages, v_pages, ctx):
    """One token per lane from its qkv-projection rows proj [B, P] -> (the out-projection's input, k_pages,
    v_pages)."""
    q, gate, k_pages, v_pages = _attn_decode_write(p, proj, cfg, kc, k_pages, v_pages, ctx)
    fused = ops.attention_decode_gated(kc, q, k_pages, v_pages, ctx["page_tables"], ctx["positions"] + 1, proj,
                                       p.o_proj)
    if fused is not None:
        return fused, k_pages, v_pages
    return _attn_decode_read(kc, q, gate, k_pages, v_pages, ctx, proj.dtype), k_pages, v_pages


def _attn_decode(p, x, cfg, kc, k_pages, v_pages, ctx):
    return _projected(lambda proj, kp, vp: _attn_decode_core(p, proj, cfg, kc, kp, vp, ctx), p.qkv_proj,
                      p.o_proj)(kc, x, k_pages, v_pages)


def decode(params: Params, cfg: ModelConfig, kc: KernelConfig, tokens, positions, page_tables, slots, active,
           state: DeviceState, rope_shift=0):
    """One token for each of B lanes.

    Args:
      tokens, positions, slots: [B] int32; page_tables: [B, max_pages] int32; active: [B] bool. Inactive
        lanes leave their slot, conv history and pages untouched (their outputs are garbage).
      rope_shift: [B] int32 (or 0), each lane's prompt's MRoPE delta: the token rotates at position + shift.
    Returns:
      (hidden [B, H] after the final norm, updated DeviceState).
    """
    ctx = dict(positions=positions, page_tables=page_tables, slots=slots, active=active, rope_shift=rope_shift)
    x = params.embed[tokens]
    return _run_layers(
        params, cfg, kc, x, state,
        lambda p, h, ssm, conv, c, ctx: gdn_decode_mixer(p, h, c, kc, ssm, conv, ctx),
        lambda p, h, kp, vp, c, ctx: _attn_decode(p, h, c, kc, kp, vp, ctx), ctx,
    )


# --- mixed: one lane's prefill chunk and a decode round in one step ------------------------------------
def mixed(params: Params, cfg: ModelConfig, kc: KernelConfig, prefill_embeds, prefill_ctx: dict, tokens, decode_ctx,
          state: DeviceState):
    """A prefill chunk of T rows (`prefill`'s, its embeddings given) and a decode round of B rows (`decode`'s) as one
    pass over the layers: every projection, norm and FFN runs once over the T + B rows, so the round's weight reads
    carry the chunk; each mixer's core runs the chunk's rows as prefill and the round's as decode, the chunk first
    (its lane is not in the round; a padding row of the round that names the chunk's slot writes back the state
    the chunk left). The chunk's attention runs without host loops (`KernelConfig.without_host_loops`).

    prefill_ctx: `prefill`'s slot, base, n_valid, page_table, tap_positions, tap_slots, rope_positions ([3, T]).
    decode_ctx: `decode`'s positions, page_tables, slots, active, rope_shift. Returns (hidden [T + B, H], state).
    """
    t = prefill_embeds.shape[0]
    p_ctx = dict(prefill_ctx, valid=jnp.arange(t) < prefill_ctx["n_valid"])

    def split(prefill_core, decode_core, in_w, out_w, in_dot=None):
        def rows(proj, s):  # rows of the in-projection's output, or of each of its sides apart
            return tuple(side[s] for side in proj) if isinstance(proj, tuple) else proj[s]

        def core(proj, *pools):
            y_p, *pools = prefill_core(rows(proj, slice(None, t)), *pools)
            y_d, *pools = decode_core(rows(proj, slice(t, None)), *pools)
            return jnp.concatenate([y_p, y_d]), *pools

        return _projected(core, in_w, out_w, in_dot)

    def attn_core(p, proj, k_pages, v_pages, c, ctx):
        # Every write before any read: a read of a pool between two of its writes makes XLA copy the whole pool
        # (in place, the second write could overtake the read), every layer, every step.
        pc, dc = ctx
        q_d, gate_d, k_pages, v_pages = _attn_decode_write(p, proj[t:], c, kc, k_pages, v_pages, dc)
        q_p, gate_p, k_pages, v_pages = _attn_prefill_write(p, proj[:t], c, k_pages, v_pages, pc)
        y_p = _attn_prefill_read(kc.without_host_loops(), q_p, gate_p, k_pages, v_pages, pc, proj.dtype)
        y_d = _attn_decode_read(kc, q_d, gate_d, k_pages, v_pages, dc, proj.dtype)
        return jnp.concatenate([y_p, y_d]), k_pages, v_pages

    x = jnp.concatenate([prefill_embeds, params.embed[tokens]])
    return _run_layers(
        params, cfg, kc, x, state,
        lambda p, h, ssm, conv, cf, ctx: split(
            lambda proj, s, c: _gdn_prefill_normed(p, proj, cf, kc, s, c, ctx[0]),
            lambda proj, s, c: _gdn_decode_core(p, proj, cf, kc, s, c, ctx[1]), p.in_proj, p.out_proj,
            _gdn_in_dot(cf),
        )(kc, h, ssm, conv),
        lambda p, h, kp, vp, cf, ctx: _projected(lambda proj, k, v: attn_core(p, proj, k, v, cf, ctx), p.qkv_proj,
                                                 p.o_proj)(kc, h, kp, vp),
        (p_ctx, decode_ctx),
    )


# --- verify (speculative decoding) ---------------------------------------------------------------------
def _gdn_verify(p, x, cfg, kc, ssm, conv, ctx):
    """T rows per lane, each lane's rows in order from its slot's state, reading the pools only (which row a lane
    keeps is known only from the logits) -> (y, ssm, conv, the in-projection's rows [B, T, P]), from which
    `commit_verified` advances the state to the kept row."""
    slots, counts = ctx["slots"], ctx["counts"]
    b = counts.shape[0]
    rows = ops.plain_rows(x)  # the in-projection keeps them: its [b | a] side is not FP8
    t = rows.shape[0] // b
    proj = dot(kc, x, p.in_proj).reshape(b, t, -1)
    if kc.fuse_gdn_decode:  # conv, delta rule and gated norm of every row as one kernel
        y, _ = ops.gdn_rows_layer(kc, proj, counts, conv, p.conv_w, p.a_log, p.dt_bias, p.norm_w, ssm, slots,
                                  num_key_heads=cfg.linear_num_key_heads, eps=cfg.rms_norm_eps, write_state=False)
        return dot(kc, y.reshape(b * t, -1), p.out_proj, to_norm=True), ssm, conv, proj
    core, _, z, _ = gdn_rows_composed(p, proj, cfg, kc, conv, ssm[slots], slots, counts)
    return _gdn_out(p, core.reshape(b * t, *core.shape[2:]), z, cfg, kc, rows.dtype), ssm, conv, proj


def gdn_rows_composed(p: GDNParams, proj, cfg: ModelConfig, kc: KernelConfig, conv, states, slots, rows):
    """`ops.gdn_rows_layer` composed from XLA ops and the delta-rule kernel (its reference): the in-projection's
    rows proj [B, T, P] from states [B, Hv, Dk, Dv] and the slots' conv histories, the first rows[b] of lane b
    counting -> (o [B, T, Hv, Dv] before the gated norm, the states after those rows, z [B T, Hv, Dv], the conv
    histories after them [B, K-1, C])."""
    b, t = proj.shape[:2]
    qkv, z, a, b_in = _gdn_split(proj.reshape(b * t, -1), cfg)
    window = jnp.concatenate([conv[slots].astype(qkv.dtype), qkv.reshape(b, t, -1)], axis=1)  # [B, K-1+T, C]
    conv_out = jax.vmap(lambda w: _conv(w, p.conv_w))(window).reshape(b * t, -1)
    m = (jnp.arange(t)[None, :] < rows[:, None]).reshape(-1, 1)
    q, k, v, g, beta = _gdn_qkvgb(p, conv_out, a, b_in, cfg)
    q, k, v = q * m[..., None], k * m[..., None], v * m[..., None].astype(v.dtype)
    q, k, v, g, beta = (y.reshape(b, t, *y.shape[1:]) for y in (q, k, v, g * m, beta * m))
    o, states = _gdn_rows(kc, q, k, v, g, beta, states)
    km1 = conv.shape[1]
    history = jax.vmap(lambda w, n: jax.lax.dynamic_slice_in_dim(w, n, km1, axis=0))(window, rows)
    return o, states, z, history


def _gdn_rows(kc: KernelConfig, q, k, v, g, beta, states):
    """The delta rule over T rows per lane in order (q, k, v, g, beta [B, T, ...]) from states [B, Hv, Dk, Dv], one
    decode step per row (a loop, not T copies of the step, so the program stays small) -> (o [B, T, Hv, Dv], the
    states after the last row)."""
    lanes = jnp.arange(states.shape[0], dtype=jnp.int32)

    def row(local, xs):
        o, local = ops.gdn_decode(kc, *xs, local, lanes)
        return local, o

    states, o = jax.lax.scan(row, states, tuple(jnp.swapaxes(x, 0, 1) for x in (q, k, v, g, beta)))
    return jnp.swapaxes(o, 0, 1), states


def verify(params: Params, cfg: ModelConfig, kc: KernelConfig, tokens, positions, page_tables, slots, counts,
           state: DeviceState, rope_shift=0):
    """T tokens for each of B lanes in one step (a speculative round: the last token, then the drafts).

    Args:
      tokens: [B, T] int32; lane b feeds tokens[b, :counts[b]] at positions[b], positions[b] + 1, ...
      positions, slots, counts: [B] int32 (count 0: an inactive lane); page_tables: [B, max_pages] int32, mapping
        every position a lane feeds. rope_shift: [B] int32 (or 0), as `decode`'s.
    Returns:
      (hidden [B * T, H] after the final norm, lane-major; the DeviceState with every fed row's KV written and
      the GDN pools unchanged; the replay that `commit_verified` takes).
    """
    b, t = tokens.shape
    rows = jnp.arange(t, dtype=jnp.int32)
    active = (rows[None, :] < counts[:, None]).reshape(-1)
    # Every row is one decode query over its lane's pages: a row's own key and the earlier rows' are written
    # before attention reads, so its length alone makes it causal.
    attn_ctx = dict(positions=(positions[:, None] + rows[None, :]).reshape(-1), active=active,
                    page_tables=jnp.repeat(page_tables, t, axis=0),
                    rope_shift=jnp.repeat(jnp.broadcast_to(rope_shift, (b,)), t))
    gdn_ctx = dict(slots=slots, counts=counts)
    replays: list = []
    hidden, state = _run_layers(
        params, cfg, kc, params.embed[tokens.reshape(-1)], state,
        lambda p, h, ssm, conv, c, ctx: _gdn_verify(p, h, c, kc, ssm, conv, ctx[0]),
        lambda p, h, kp, vp, c, ctx: _attn_decode(p, h, c, kc, kp, vp, ctx[1]), (gdn_ctx, attn_ctx),
        gdn_sink=replays,
    )
    return hidden, state, tuple(replays)


def commit_verified(params: Params, cfg: ModelConfig, kc: KernelConfig, state: DeviceState, replay, slots, kept,
                    active) -> DeviceState:
    """Advances each active lane's GDN states and conv histories over its verify rows 0..kept[b] (`verify`'s
    replay): what a plain decode of those tokens would have left. Rows past kept[b] leave no trace."""
    ssms, convs = list(state.ssm), list(state.conv)
    rows = jnp.where(active, kept + 1, 0).astype(jnp.int32)

    def commit(p, proj, ssm, conv, c, ctx):
        rows, slots = ctx
        if kc.fuse_gdn_decode:  # the kernel's wrapper writes the histories at the (distinct) slots, as decode's
            _, conv, ssm = ops.gdn_rows_layer(
                kc, proj, rows, conv, p.conv_w, p.a_log, p.dt_bias, p.norm_w, ssm, slots,
                num_key_heads=c.linear_num_key_heads, eps=c.rms_norm_eps, write_state=True, into_pool=True)
            return ssm, conv
        _, states, _, history = gdn_rows_composed(p, proj, c, kc, conv, ssm[slots], slots, rows)
        return ssm.at[slots].set(states), conv.at[slots].set(history.astype(conv.dtype))

    for j, proj in enumerate(replay):
        p = params.layers[cfg.gdn_layers[j]].mixer
        if kc.spmd is not None and kc.spmd.splits_mixer(p, cfg):  # each device its heads' rows (`verify`'s order)
            ssms[j], convs[j] = kc.spmd.state_update(commit, p, proj, (ssms[j], convs[j]), cfg, (rows, slots))
        else:
            ssms[j], convs[j] = commit(p, proj, ssms[j], convs[j], cfg, (rows, slots))
    return DeviceState(state.k_pages, state.v_pages, tuple(ssms), tuple(convs))


def logits(params: Params, hidden):
    """Final-normed hidden [..., H] -> float32 logits [..., V]."""
    w = params.lm_head if params.lm_head is not None else params.embed.T
    return jnp.dot(hidden, w, preferred_element_type=F32)


# --- whole-sequence forward --------------------------------------------------------------------------
def forward_hidden(params, cfg, kc, token_ids, media=None):
    """The whole-sequence forward's final-normed hidden states [T, H] (a fresh one-lane DeviceState), unjitted, so
    that it composes with vmap and grad (with the reference kernels: scripts/train_tiny_mtp.py trains through it)."""
    t = token_ids.shape[0]
    num_pages = -(-t // PAGE)
    state = init_device_state(cfg, num_pages, 1, params.embed.dtype, params.embed.dtype)
    no_taps = jnp.full((1,), -1, jnp.int32)
    embeds = rope_positions = None
    if media is not None:  # each image's encoder output, in order, at the placeholder tokens
        image_embeds, spans, rope_positions = media
        rows = jnp.cumsum(spans) - 1
        embeds = jnp.where(spans[:, None], image_embeds[jnp.clip(rows, 0)].astype(params.embed.dtype),
                           params.embed[token_ids])
    hidden, _ = prefill(
        params, cfg, kc, token_ids, jnp.int32(t), jnp.int32(0), jnp.arange(num_pages, dtype=jnp.int32),
        jnp.int32(0), state, no_taps, no_taps, rope_positions, embeds,
    )
    return hidden


@functools.partial(jax.jit, static_argnames=("cfg", "kc"))
def _forward_jit(params, cfg, kc, token_ids, media=None):
    return logits(params, forward_hidden(params, cfg, kc, token_ids, media))


def forward(params: Params, config: ModelConfig, token_ids, kernels: KernelConfig = ops.REFERENCE, *,
            image_embeds=None, image_spans=None, rope_positions=None):
    """Whole-sequence forward without a cache: token_ids [T] -> float32 logits [T, vocab]. With images:
    image_embeds [N, H] (the vision tower's merged tokens, image after image), image_spans bool [T] (the N
    placeholder tokens they take, in order) and rope_positions int32 [3, T] (`frontend.mrope.mrope_positions`)."""
    token_ids = jnp.asarray(token_ids, jnp.int32)
    if token_ids.ndim != 1 or token_ids.shape[0] == 0:
        raise ValueError(f"token_ids must be a non-empty 1-D array, got shape {token_ids.shape}")
    media = None
    if image_embeds is not None:
        spans = np.asarray(image_spans, bool)
        if spans.shape != token_ids.shape or spans.sum() != image_embeds.shape[0]:
            raise ValueError(f"image_spans must mark one token of the {token_ids.shape[0]} per image embedding "
                             f"({image_embeds.shape[0]}), got {spans.sum()} of {spans.shape}")
        media = (jnp.asarray(image_embeds), jnp.asarray(spans), jnp.asarray(rope_positions, jnp.int32))
    return _forward_jit(params, config, kernels, token_ids, media)
