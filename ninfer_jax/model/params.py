"""The parameter pytree of a Qwen3.5 model: one flax.struct dataclass per layer kind, one array per layer.

Weights are stored `[in, out]` (x @ w) and projections that read the same input are fused at load time:
  GDN   in_proj  = [qkv | z | b | a]           [H, 2*key_dim + value_dim + value_dim + 2*Hv]
  Attn  qkv_proj = [q+gate (per head) | k | v]  [H, Hq*2*D + 2*Hkv*D]
  MLP   gate_up  = [gate | up]                  [H, 2*I]
Layers stay a tuple of per-layer pytrees, not a stacked [L, ...] array: the jitted step unrolls the layer
loop, which decodes faster than lax.scan over stacked weights (DESIGN.md).

A projection weight (`Weight`) is a plain array, or, from an FP8 checkpoint, a `QuantizedWeight` (block-FP8
values and their scales) or a `ConcatWeight` (a fused projection whose parts cannot share one block grid).
Only the model's `dot` and the MoE experts read them (docs/engine_notes.md, "FP8 checkpoints").
"""

from __future__ import annotations

import jax
from flax import struct

from pallas_kernels import fp8_matmul

# The FP8 checkpoints' weight block (quantization_config.weight_block_size [128, 128]), the kernels' own
FP8_BLOCK = fp8_matmul.BLOCK


@struct.dataclass
class QuantizedWeight:
    """A block-FP8 weight, kept in the checkpoint's own [out, in] layout: the product x @ w reads
    w[..., k, n] = values[..., n, k] * scales[..., n // 128, k // 128]. Each 128-block of a row is contiguous. A
    dimension that is not a multiple of 128 ends in a partial block. Stacked MoE experts lead with [E]. On the Pallas
    kernels the dense weights of whole blocks may be held `blocked` instead ([K / 128, N, 128]: each block of K whole
    for every row, which the kernels stream faster; `startup.BLOCK_FP8_WEIGHTS`, pallas_kernels/fp8_matmul.py)."""

    values: jax.Array  # float8_e4m3fn [..., N, K]; blocked: [K / 128, N, 128]
    scales: jax.Array  # float32 [..., ceil(N / 128), ceil(K / 128)]
    # values in `fp8_matmul.blocked`'s layout (a dense weight of whole blocks, for the Pallas kernels:
    # `ops.kernel_layout`)
    blocked: bool = struct.field(pytree_node=False, default=False)

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical x @ w shape [..., K, N], as a plain weight's."""
        if self.blocked:
            kb, n, block = self.values.shape
            return (kb * block, n)
        *lead, n, k = self.values.shape
        return (*lead, k, n)


@struct.dataclass
class ConcatWeight:
    """Weights that read one input, their products concatenated along N: a fused projection with an unquantized
    part, or with a quantized part whose N is not a multiple of 128 (its blocks would straddle the next part)."""

    parts: tuple  # each a jax.Array or a QuantizedWeight [..., K, N_i]

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.parts[0].shape[:-1], sum(p.shape[-1] for p in self.parts))


Weight = jax.Array | QuantizedWeight | ConcatWeight


@struct.dataclass
class GDNParams:
    in_proj: Weight  # [H, conv_dim + value_dim + 2*Hv]
    conv_w: jax.Array  # [K, conv_dim], tap j multiplies the input at t - (K-1) + j
    a_log: jax.Array  # [Hv] float32
    dt_bias: jax.Array  # [Hv] float32
    norm_w: jax.Array  # [Dv] plain (not zero-centred) gated RMSNorm weight
    out_proj: Weight  # [value_dim, H]


@struct.dataclass
class AttnParams:
    qkv_proj: Weight  # [H, Hq*2*D + 2*Hkv*D]
    q_norm: jax.Array  # [D] zero-centred
    k_norm: jax.Array  # [D] zero-centred
    o_proj: Weight  # [Hq*D, H]


@struct.dataclass
class MLPParams:
    gate_up: Weight  # [H, 2*I]
    down: Weight  # [I, H]


@struct.dataclass
class MoEParams:
    router: jax.Array  # [E, H]
    gate_up: Weight  # [E, H, 2*I]
    down: Weight  # [E, I, H]
    shared: MLPParams
    shared_gate: jax.Array  # [H, 1]


@struct.dataclass
class LayerParams:
    input_norm: jax.Array  # [H] zero-centred
    post_norm: jax.Array  # [H] zero-centred
    mixer: GDNParams | AttnParams
    ffn: MLPParams | MoEParams


@struct.dataclass
class MTPParams:
    """The multi-token-prediction layer (model/mtp.py): fc over [embedding | hidden], one full-attention layer."""

    fc: Weight  # [2H, H], the embedding's rows first
    pre_fc_norm_embedding: jax.Array  # [H] zero-centred
    pre_fc_norm_hidden: jax.Array  # [H] zero-centred
    layer: LayerParams  # mixer is AttnParams; ffn an MLP or MoE block, as the model's layers
    norm: jax.Array  # [H] zero-centred, before the shared lm_head


@struct.dataclass
class Params:
    embed: jax.Array  # [V, H]
    layers: tuple[LayerParams, ...]
    final_norm: jax.Array  # [H] zero-centred
    lm_head: jax.Array | None  # [H, V]; None when tied to embed
    mtp: MTPParams | None = None  # None when the checkpoint has no MTP layer
