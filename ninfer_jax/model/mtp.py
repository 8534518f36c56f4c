"""Qwen3.5's multi-token-prediction (MTP) layer as a pure function, over a whole sequence without a cache.

For target position i, with h_i the target model's final-normed hidden state there (what `qwen3_5.prefill` and
`forward` compute before `logits`) and t_{i+1} the token after it:
  x_i = fc([pre_fc_norm_embedding(embed(t_{i+1})) | pre_fc_norm_hidden(h_i)])    (fc: [2H] -> [H])
then one decoder layer of full-attention type (its own q/k/v/o, q/k norms and output gate; an MLP or MoE block as
the model's layers) at RoPE position i, then `mtp.norm`; the shared lm_head turns that into logits for t_{i+2}.
The embedding table and the lm_head are the target model's. Conventions checked against vLLM's Qwen3.5 MTP model
and proposer (the token shifted by one, the position not) and against transformers' Qwen3.5 modules by
tests/model/test_mtp.py.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from ninfer_jax.config import ModelConfig
from ninfer_jax.model import ops
from ninfer_jax.model.ops import KernelConfig
from ninfer_jax.model.params import Params
from ninfer_jax.model.qwen3_5 import _attn_decode, _attn_prefill, _run_layers, dot, logits
from ninfer_jax.model.state import PAGE, DeviceState, init_device_state
from pallas_kernels.reference import rms_norm


def _one_layer(cfg: ModelConfig) -> ModelConfig:
    """The config the MTP layer runs under: the target's, with one full-attention layer."""
    return dataclasses.replace(cfg, layer_types=("full_attention",))


def mtp_layer(params: Params, cfg: ModelConfig, kc: KernelConfig, hidden, tokens, k_pages, v_pages, attn, ctx):
    """The MTP layer over rows of (target hidden [R, H], following token [R]) -> (its final-normed hidden [R, H],
    k_pages, v_pages). attn(p, one, h, kp, vp, ctx) is its attention over its own pages (prefill or decode form),
    `one` the one-layer config it runs under, ctx the arrays it reads (`qwen3_5._run_layers`)."""
    mtp, eps = params.mtp, cfg.rms_norm_eps
    embedded = rms_norm(params.embed[tokens], mtp.pre_fc_norm_embedding, eps)
    x = dot(kc, jnp.concatenate([embedded, rms_norm(hidden, mtp.pre_fc_norm_hidden, eps)], axis=-1), mtp.fc)
    # The layer runs as a one-layer model through the target's layer loop.
    one = _one_layer(cfg)
    pools = DeviceState((k_pages,), (v_pages,), (), ())
    hidden, pools = _run_layers(params.replace(layers=(mtp.layer,), final_norm=mtp.norm), one, kc, x, pools, None,
                                lambda p, h, kp, vp, c, ctx: attn(p, c, h, kp, vp, ctx), ctx)
    return hidden, pools.k_pages[0], pools.v_pages[0]


@functools.partial(jax.jit, static_argnames=("cfg", "kc"))
def _mtp_forward_jit(params: Params, cfg: ModelConfig, kc: KernelConfig, hidden, next_tokens):
    # Fresh pages of its own: causal attention within the sequence, positions from 0.
    t = hidden.shape[0]
    num_pages = -(-t // PAGE)
    state = init_device_state(_one_layer(cfg), num_pages, 1, hidden.dtype, hidden.dtype)
    ctx = {"base": jnp.int32(0), "valid": jnp.ones((t,), bool), "page_table": jnp.arange(num_pages, dtype=jnp.int32)}
    out, _, _ = mtp_layer(params, cfg, kc, hidden, next_tokens, state.k_pages[0], state.v_pages[0],
                          lambda p, one, h, kp, vp, ctx: _attn_prefill(p, h, one, kc, kp, vp, ctx), ctx)
    return out


def mtp_prefill_rows(params: Params, cfg: ModelConfig, kc: KernelConfig, hidden, tokens, n_valid, base, page_table,
                     carry, resumed, k_pages, v_pages, rope_positions=None):
    """The MTP rows of one lane's prefill chunk, one position behind the target's (the row of position i needs
    the token after it): positions base - 1 .. base + n_valid - 2, from the target hidden [carry; hidden[:-1]]
    and the chunk's tokens. The chunk's last position waits for the next step, which has its token. At base 0
    there is no row -1; `resumed` (the lane's first chunk after a cache hit) leaves position base - 1 to the
    cached page it lies in: carry holds nothing of that prefix, and a cached page is never written.

    Args:
      hidden: [T, H] the chunk's final-normed target hidden; tokens [T]; carry [H]: the hidden of position base - 1.
      rope_positions: None, or the chunk's MRoPE positions [3, T] (a prompt with images); each row rotates at its
        own position's (row 0's, before the chunk, as the first token's less one: exact after a text token).
    Returns:
      (k_pages, v_pages) of the MTP layer.
    """
    t = tokens.shape[0]
    first = base == 0
    hidden_in = jnp.where(first, hidden, jnp.concatenate([carry[None].astype(hidden.dtype), hidden[:-1]]))
    tokens_in = jnp.where(first, jnp.roll(tokens, -1), tokens)
    rows = jnp.arange(t)
    valid = (rows < jnp.where(first, n_valid - 1, n_valid)) & ((rows > 0) | first | ~resumed)
    ctx = {"base": jnp.where(first, 0, base - 1), "valid": valid, "page_table": page_table}
    if rope_positions is not None:
        behind = jnp.concatenate([rope_positions[:, :1] - 1, rope_positions[:, :-1]], axis=1)
        ctx["rope_positions"] = jnp.where(first, rope_positions, behind)
    _, k_pages, v_pages = mtp_layer(params, cfg, kc, hidden_in, tokens_in, k_pages, v_pages,
                                    lambda p, one, h, kp, vp, ctx: _attn_prefill(p, h, one, kc, kp, vp, ctx), ctx)
    return k_pages, v_pages


def mtp_decode_rows(params: Params, cfg: ModelConfig, kc: KernelConfig, hidden, tokens, positions, page_tables,
                    active, k_pages, v_pages, rope_shift=0):
    """R MTP rows, each a decode query over its lane's MTP pages at positions [R] (a row writes its key before
    reading, so its position alone makes it causal), rotating at positions + rope_shift (the prompt's MRoPE delta);
    inactive rows write nothing. -> (hidden [R, H], k_pages, v_pages)."""
    ctx = dict(positions=positions, page_tables=page_tables, active=active, rope_shift=rope_shift)
    return mtp_layer(params, cfg, kc, hidden, tokens, k_pages, v_pages,
                     lambda p, one, h, kp, vp, ctx: _attn_decode(p, h, one, kc, kp, vp, ctx), ctx)


def mtp_draft(params: Params, cfg: ModelConfig, kc: KernelConfig, hidden, tokens, positions, page_tables, active,
              limits, k_pages, v_pages, k: int, rope_shift=0):
    """k drafts per lane by chaining the MTP layer from each lane's last target hidden [B, H] and the token after
    it [B] at positions [B]: draft j + 1 is the argmax of the MTP logits of row j, whose inputs are row j - 1's
    MTP hidden and draft j. Rows write their keys at positions + j, up to limits [B] (the lane's mapped
    positions) -> (drafts [B, k] int32, k_pages, v_pages)."""
    drafts = []
    for j in range(k):
        live = active & (positions + j < limits)
        hidden, k_pages, v_pages = mtp_decode_rows(params, cfg, kc, hidden, tokens, positions + j, page_tables, live,
                                                   k_pages, v_pages, rope_shift)
        tokens = jnp.argmax(logits(params, hidden), axis=-1).astype(jnp.int32)
        drafts.append(tokens)
    return jnp.stack(drafts, axis=1), k_pages, v_pages


def mtp_verify_rows(params: Params, cfg: ModelConfig, kc: KernelConfig, hidden, tokens, emitted, kept, counts,
                    positions, page_tables, limits, carry, k_pages, v_pages, rope_shift=None):
    """A verify round's MTP work for B lanes of T rows fed at positions p: the rows of positions p - 1 .. p + kept - 1
    (row j: the target hidden of position p + j - 1, `carry` [B, H] for j = 0, with the token fed at p + j), then
    T - 1 drafts chained from the last kept row's hidden and the token emitted after it (`mtp_draft`).

    Args:
      hidden: [B T, H] the rows' final-normed target hidden; tokens, emitted: [B, T]; kept, counts, positions,
        limits: [B]; page_tables [B, max_pages]; rope_shift: [B] the lanes' MRoPE deltas, or None.
    Returns:
      (drafts [B, T - 1], k_pages, v_pages, the last kept row's hidden [B, H]: the next round's carry).
    """
    b, t = tokens.shape
    rope_shift = jnp.zeros(b, jnp.int32) if rope_shift is None else rope_shift
    hid = hidden.reshape(b, t, -1)
    rows = jnp.arange(t, dtype=jnp.int32)[None, :]
    hidden_in = jnp.concatenate([carry[:, None].astype(hid.dtype), hid[:, :-1]], axis=1).reshape(b * t, -1)
    active = ((rows <= kept[:, None]) & (counts[:, None] > 0)).reshape(-1)
    _, k_pages, v_pages = mtp_decode_rows(params, cfg, kc, hidden_in, tokens.reshape(-1),
                                          (positions[:, None] - 1 + rows).reshape(-1),
                                          jnp.repeat(page_tables, t, axis=0), active, k_pages, v_pages,
                                          jnp.repeat(rope_shift, t))
    lane = jnp.arange(b)
    last = hid[lane, kept]
    drafts, k_pages, v_pages = mtp_draft(params, cfg, kc, last, emitted[lane, kept], positions + kept, page_tables,
                                         counts > 0, limits, k_pages, v_pages, t - 1, rope_shift)
    return drafts, k_pages, v_pages, last


def mtp_forward(params: Params, cfg: ModelConfig, hidden, next_tokens, kernels: KernelConfig = ops.REFERENCE):
    """The MTP layer over target positions 0..T-1.

    Args:
      hidden: [T, H] the target's final-normed hidden states, in the params' dtype.
      next_tokens: [T] int32, the token after each position (t_1..t_T: the last is the target's sample).
    Returns:
      [T, H] the MTP layer's final-normed hidden states; `mtp_logits` gives the logits for t_2..t_{T+1}.
    """
    if params.mtp is None:
        raise ValueError("params have no MTP layer (the checkpoint has no mtp.* tensors)")
    next_tokens = jnp.asarray(next_tokens, jnp.int32)
    if next_tokens.ndim != 1 or next_tokens.shape[0] == 0 or hidden.shape != (next_tokens.shape[0], cfg.hidden_size):
        raise ValueError(
            f"hidden must be [T, {cfg.hidden_size}] and next_tokens [T] with T >= 1, got {hidden.shape} and "
            f"{next_tokens.shape}"
        )
    return _mtp_forward_jit(params, cfg, kernels, hidden, next_tokens)


def mtp_logits(params: Params, mtp_hidden):
    """The MTP layer's final-normed hidden [..., H] -> float32 logits [..., V] through the shared lm_head."""
    return logits(params, mtp_hidden)
