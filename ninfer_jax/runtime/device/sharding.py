"""Tensor and expert parallelism the GSPMD way: a Mesh over the first N devices (axis "tp") and a PartitionSpec per
param leaf and per pool. The arrays carry their NamedShardings into the jitted steps, and XLA partitions the steps
and inserts the collectives; the step functions are the single-device ones.

What is split (a mixer whose head counts the mesh size does not all divide stays replicated whole, weights and
pools, as does any other axis it does not divide; vLLM likewise replicates KV heads past their count):
  embed [V, H] rows and lm_head [H, V] columns      the vocabulary
  attention qkv_proj columns, o_proj rows           fused [q+gate | k | v] columns cut in N contiguous pieces (not
                                                    head-aligned: XLA moves what a head's slice needs); o_proj rows
                                                    by query head; both when N divides the query and KV heads
  GDN in_proj columns, conv_w channels              fused [qkv | z | b | a] cut in N contiguous pieces, likewise
  GDN out_proj rows, A_log and dt_bias              by value head; all when N divides the key and value heads
  MLP and shared-expert gate_up columns, down rows  the intermediate axis
  MoE gate_up [E, H, 2I], down [E, I, H]            the expert axis with expert parallel, else each expert's
                                                    intermediate axis
  KV pages [P, 64, Hkv, D] (every plane)            by KV head, as the attention's weights
  ssm [S, Hv, Dk, Dv] and conv [S, K-1, conv_dim]   by value head, by channel, as the GDN's weights
Norms, the router, the shared-expert gate and block-FP8 weights (their scales' block grid) stay replicated.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ninfer_jax.config import ModelConfig
from ninfer_jax.model.params import (AttnParams, ConcatWeight, GDNParams, LayerParams, MLPParams, MoEParams,
                                     MTPParams, Params, QuantizedWeight)
from ninfer_jax.model.state import DeviceState

AXIS = "tp"
REPLICATED = PartitionSpec()


def _is_spec(x) -> bool:
    return isinstance(x, PartitionSpec)


def attention_heads(cfg: ModelConfig) -> int:
    """A count the mesh size divides exactly when it divides both the query and the KV heads."""
    return math.gcd(cfg.num_attention_heads, cfg.num_key_value_heads)


def gdn_heads(cfg: ModelConfig) -> int:
    """A count the mesh size divides exactly when it divides both the GDN key and value heads."""
    return math.gcd(cfg.linear_num_key_heads, cfg.linear_num_value_heads)


@dataclasses.dataclass(frozen=True)
class ParallelLayout:
    """The mesh and the rules that place one model's params and pools on it. Invariant: every spec names AXIS at
    most once, on an axis the mesh size divides."""

    mesh: Mesh
    expert_parallel: bool = False

    @classmethod
    def over(cls, size: int, expert_parallel: bool = False) -> ParallelLayout:
        """A layout over the first `size` devices."""
        return cls(Mesh(np.array(jax.devices()[:size]), (AXIS,)), expert_parallel)

    @property
    def size(self) -> int:
        return self.mesh.size

    def split(self, shape: tuple[int, ...], axis: int, units: int | None = None) -> PartitionSpec:
        """`axis` split over the mesh when the mesh divides both it and its `units` (the heads it holds: a split
        never cuts a head), else replicated."""
        units = shape[axis] if units is None else units
        if units % self.size or shape[axis] % self.size:
            return REPLICATED
        return PartitionSpec(*(None,) * axis, AXIS)  # no trailing Nones: the form jit gives its outputs

    def sharding(self, spec: PartitionSpec, memory_kind: str | None = None) -> NamedSharding:
        return NamedSharding(self.mesh, spec, memory_kind=memory_kind)

    def shardings(self, specs):
        """A pytree of PartitionSpecs -> the same pytree of NamedShardings on the mesh."""
        return jax.tree.map(self.sharding, specs, is_leaf=_is_spec)

    # --- params ----------------------------------------------------------------------------------
    def _weight(self, w, axis: int, units: int | None = None):
        """A projection weight's spec: a plain array split on `axis`; a block-FP8 one replicated (its scales'
        block grid would need the split to fall on 128-blocks)."""
        if isinstance(w, (QuantizedWeight, ConcatWeight)):
            return jax.tree.map(lambda _: REPLICATED, w)
        return self.split(w.shape, axis, units)

    def _mlp(self, p: MLPParams) -> MLPParams:
        return MLPParams(gate_up=self._weight(p.gate_up, 1), down=self._weight(p.down, 0))

    def _ffn(self, p):
        if isinstance(p, MLPParams):
            return self._mlp(p)
        gate_up_axis, down_axis = (0, 0) if self.expert_parallel else (2, 1)  # [E, H, 2I], [E, I, H]
        return MoEParams(router=REPLICATED, gate_up=self._weight(p.gate_up, gate_up_axis),
                         down=self._weight(p.down, down_axis), shared=self._mlp(p.shared), shared_gate=REPLICATED)

    def _mixer(self, p, cfg: ModelConfig):
        if isinstance(p, AttnParams):
            heads = attention_heads(cfg)
            return AttnParams(qkv_proj=self._weight(p.qkv_proj, 1, heads), q_norm=REPLICATED, k_norm=REPLICATED,
                              o_proj=self._weight(p.o_proj, 0, heads))
        heads = gdn_heads(cfg)
        return GDNParams(in_proj=self._weight(p.in_proj, 1, heads), conv_w=self.split(p.conv_w.shape, 1, heads),
                         a_log=self.split(p.a_log.shape, 0, heads), dt_bias=self.split(p.dt_bias.shape, 0, heads),
                         norm_w=REPLICATED, out_proj=self._weight(p.out_proj, 0, heads))

    def _layer(self, p: LayerParams, cfg: ModelConfig) -> LayerParams:
        return LayerParams(input_norm=REPLICATED, post_norm=REPLICATED, mixer=self._mixer(p.mixer, cfg),
                           ffn=self._ffn(p.ffn))

    def param_specs(self, params: Params, cfg: ModelConfig) -> Params:
        """A Params-shaped pytree of PartitionSpecs."""
        mtp = params.mtp
        if mtp is not None:
            mtp = MTPParams(fc=self._weight(mtp.fc, 1), pre_fc_norm_embedding=REPLICATED,
                            pre_fc_norm_hidden=REPLICATED, layer=self._layer(mtp.layer, cfg), norm=REPLICATED)
        lm_head = None if params.lm_head is None else self.split(params.lm_head.shape, 1)
        return Params(embed=self.split(params.embed.shape, 0), layers=tuple(self._layer(p, cfg) for p in params.layers),
                      final_norm=REPLICATED, lm_head=lm_head, mtp=mtp)

    def place_params(self, params: Params, cfg: ModelConfig) -> Params:
        """The params moved onto the mesh, each leaf with its NamedSharding."""
        return jax.device_put(params, self.shardings(self.param_specs(params, cfg)))

    # --- pools -----------------------------------------------------------------------------------
    def state_specs(self, state: DeviceState, cfg: ModelConfig) -> DeviceState:
        """A DeviceState-shaped pytree of PartitionSpecs (of arrays or their shapes): every KV plane by KV head,
        ssm by value head, conv by channel, each where its mixer's weights are split."""
        def by(axis, heads):
            return lambda a: self.split(a.shape, axis, heads)

        attn, gdn = attention_heads(cfg), gdn_heads(cfg)
        return DeviceState(k_pages=jax.tree.map(by(2, attn), state.k_pages),
                           v_pages=jax.tree.map(by(2, attn), state.v_pages),
                           ssm=jax.tree.map(by(1, gdn), state.ssm), conv=jax.tree.map(by(2, gdn), state.conv))

    def replicate(self, tree):
        """Small device arrays every shard reads (the sampler's state, the MTP carry, the media rows)."""
        return jax.device_put(tree, self.sharding(REPLICATED))

    def stats(self) -> dict:
        return {"tensor_parallel_size": self.size, "expert_parallel": self.expert_parallel,
                "devices": [str(d) for d in self.mesh.devices.flat]}
