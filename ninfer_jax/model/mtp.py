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
from ninfer_jax.model.qwen3_5 import _attn_prefill, _run_layers, dot, logits
from ninfer_jax.model.state import PAGE, init_device_state
from pallas_kernels.reference import rms_norm


@functools.partial(jax.jit, static_argnames=("cfg", "kc"))
def _mtp_forward_jit(params: Params, cfg: ModelConfig, kc: KernelConfig, hidden, next_tokens):
    mtp, eps = params.mtp, cfg.rms_norm_eps
    embedded = rms_norm(params.embed[next_tokens], mtp.pre_fc_norm_embedding, eps)
    x = dot(kc, jnp.concatenate([embedded, rms_norm(hidden, mtp.pre_fc_norm_hidden, eps)], axis=-1), mtp.fc)
    # The layer runs as a one-layer model through the target's layer loop and attention prefill, over fresh pages
    # of its own: causal attention within the sequence, positions from 0.
    one = dataclasses.replace(cfg, layer_types=("full_attention",))
    t = x.shape[0]
    num_pages = -(-t // PAGE)
    state = init_device_state(one, num_pages, 1, x.dtype, x.dtype)
    ctx = {"base": jnp.int32(0), "valid": jnp.ones((t,), bool), "page_table": jnp.arange(num_pages, dtype=jnp.int32)}
    hidden, _ = _run_layers(
        params.replace(layers=(mtp.layer,), final_norm=mtp.norm), one, kc, x, state, None,
        lambda p, h, kp, vp: _attn_prefill(p, h, one, kc, kp, vp, ctx),
    )
    return hidden


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
