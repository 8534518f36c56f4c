"""The parameter pytree of a Qwen3.5 model: one flax.struct dataclass per layer kind, one array per layer.

Weights are stored `[in, out]` (x @ w) and projections that read the same input are fused at load time:
  GDN   in_proj  = [qkv | z | b | a]           [H, 2*key_dim + value_dim + value_dim + 2*Hv]
  Attn  qkv_proj = [q+gate (per head) | k | v]  [H, Hq*2*D + 2*Hkv*D]
  MLP   gate_up  = [gate | up]                  [H, 2*I]
Layers stay a tuple of per-layer pytrees, not a stacked [L, ...] array: the jitted step unrolls the layer
loop, which decodes faster than lax.scan over stacked weights (DESIGN.md).
"""

from __future__ import annotations

from typing import Any

import jax
from flax import struct


@struct.dataclass
class GDNParams:
    in_proj: jax.Array  # [H, conv_dim + value_dim + 2*Hv]
    conv_w: jax.Array  # [K, conv_dim], tap j multiplies the input at t - (K-1) + j
    a_log: jax.Array  # [Hv] float32
    dt_bias: jax.Array  # [Hv] float32
    norm_w: jax.Array  # [Dv] plain (not zero-centred) gated RMSNorm weight
    out_proj: jax.Array  # [value_dim, H]


@struct.dataclass
class AttnParams:
    qkv_proj: jax.Array  # [H, Hq*2*D + 2*Hkv*D]
    q_norm: jax.Array  # [D] zero-centred
    k_norm: jax.Array  # [D] zero-centred
    o_proj: jax.Array  # [Hq*D, H]


@struct.dataclass
class MLPParams:
    gate_up: jax.Array  # [H, 2*I]
    down: jax.Array  # [I, H]


@struct.dataclass
class MoEParams:
    router: jax.Array  # [E, H]
    gate_up: jax.Array  # [E, H, 2*I]
    down: jax.Array  # [E, I, H]
    shared: MLPParams
    shared_gate: jax.Array  # [H, 1]


@struct.dataclass
class LayerParams:
    input_norm: jax.Array  # [H] zero-centred
    post_norm: jax.Array  # [H] zero-centred
    mixer: GDNParams | AttnParams
    ffn: MLPParams | MoEParams


@struct.dataclass
class Params:
    embed: jax.Array  # [V, H]
    layers: tuple[LayerParams, ...]
    final_norm: jax.Array  # [H] zero-centred
    lm_head: jax.Array | None  # [H, V]; None when tied to embed
    mtp: dict[str, Any] | None = None  # raw multi-token-prediction weights, when the checkpoint has them
