"""Tensor and expert parallelism: a Mesh over the first N devices (axis "tp") and a PartitionSpec per param leaf and
per pool. The arrays carry their NamedShardings into the jitted steps, whose model code runs each token mixer and
each FFN per device under shard_map (`model/spmd.py`: a device's heads or slice, one psum); XLA partitions the rest
(the embedding, the lm_head, sampling) and inserts its collectives.

What is split (a mixer whose heads the mesh does not split, or whose block-FP8 projections it would cut inside a
128-block, `Spmd.splits_mixer`, stays whole on every device, weights and pools):
  embed [V, H] rows and lm_head [H, V] columns      the vocabulary
  attention qkv_proj columns, o_proj rows           by head: the fused [q+gate | k | v] columns reordered so each
                                                    device's slice is its heads' [q+gate | k | v] (`spmd.place_mixer`);
                                                    on more devices than KV heads, its query heads and a copy of the
                                                    one KV head they read (vLLM's way: `spmd.qkv_order`)
  GDN in_proj columns, conv_w channels              by head likewise: [q | k | v | z | b | a], [q | k | v]
  GDN out_proj rows, A_log and dt_bias              by value head
  MLP and shared-expert gate_up columns, down rows  the intermediate axis, gate_up's columns reordered so that each
                                                    device's slice is [gate_i | up_i] (`spmd.place_ffn`)
  MoE gate_up [E, H, 2I], down [E, I, H]            the expert axis with expert parallel, else each expert's
                                                    intermediate axis, likewise; an FFN splits whole or not at all
  KV pages [P, 64, Hkv, D] (every plane)            by KV head, as the attention's weights; on more devices than
                                                    KV heads, [P, 64, N, D]: a copy of its KV head per device
                                                    (`spmd.kv_order`; the Host tier keeps the canonical heads)
  ssm [S, Hv, Dk, Dv] and conv [S, K-1, conv_dim]   by value head; conv by channel in the devices' order
                                                    (`spmd.conv_order`; the Host tier keeps the canonical order)
Norms, the router and the shared-expert gate stay replicated. Block-FP8 weights split where each device's slice is
whole 128-blocks of their scales' grid (`spmd.reorder`, `block_order`: values and scales alike; a ConcatWeight part
by part), else their block stays whole.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ninfer_jax.config import ModelConfig
from ninfer_jax.model.params import (ConcatWeight, LayerParams, MTPParams, Params,
                                     QuantizedWeight)
from ninfer_jax.model.spmd import AXIS, REPLICATED, Spmd, kv_order, place_ffn, place_mixer
from ninfer_jax.model.state import DeviceState



def _is_spec(x) -> bool:
    return isinstance(x, PartitionSpec)


def device_bytes(shapes, specs, size: int) -> int:
    """Bytes one of `size` devices holds of `shapes` (arrays or their shapes) laid out by `specs`."""
    def one(spec, leaf):
        split = size if any(a == AXIS for a in spec) else 1
        return math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize // split
    return sum(jax.tree.leaves(jax.tree.map(one, specs, shapes, is_leaf=_is_spec)))


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

    @property
    def spmd(self) -> Spmd:
        """The mesh of the model's explicit SPMD blocks (the FFNs)."""
        return Spmd(self.mesh, self.expert_parallel)

    def _mixer(self, p, cfg: ModelConfig):
        return self.spmd.mixer_specs(p, cfg)

    def _layer(self, p: LayerParams, cfg: ModelConfig) -> LayerParams:
        return LayerParams(input_norm=REPLICATED, post_norm=REPLICATED, mixer=self._mixer(p.mixer, cfg),
                           ffn=self.spmd.ffn_specs(p.ffn))

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
        """The params moved onto the mesh, each leaf with its NamedSharding and each split FFN's gate_up in the
        order its SPMD block reads (`spmd.place_ffn`), layer by layer: host (numpy) weights reach each device as
        its shards only. Params already on this mesh (`init_params`) are taken as placed."""
        if isinstance(params.embed, jax.Array) and getattr(params.embed.sharding, "mesh", None) == self.mesh:
            return params
        specs = self.shardings(self.param_specs(params, cfg))

        def layer(p: LayerParams, s: LayerParams) -> LayerParams:
            if all(isinstance(x, np.ndarray) for x in jax.tree.leaves(p)):
                return jax.device_put(self._reordered(p, cfg), s)
            return jax.jit(functools.partial(self._reordered, cfg=cfg), out_shardings=s)(p)

        mtp = params.mtp
        if mtp is not None:
            mtp = jax.device_put(mtp.replace(layer=layer(mtp.layer, specs.mtp.layer)), specs.mtp)
        layers = tuple(layer(p, s) for p, s in zip(params.layers, specs.layers))
        rest = jax.device_put(params.replace(layers=(), mtp=None), specs.replace(layers=(), mtp=None))
        return rest.replace(layers=layers, mtp=mtp)

    def init_params(self, make, cfg: ModelConfig) -> Params:
        """Params made by `make()` (traced: random weights) straight onto the mesh, in `place_params`' layout,
        so no device ever holds more than its own shards."""
        specs = self.shardings(self.param_specs(jax.eval_shape(make), cfg))

        return jax.jit(lambda: self._reordered_params(make(), cfg), out_shardings=specs)()

    def placed_shapes(self, params: Params, cfg: ModelConfig) -> Params:
        """The shapes `place_params` gives params of these shapes (a split attention's k and v columns hold a copy
        of a KV head per device that reads it)."""
        return jax.eval_shape(functools.partial(self._reordered_params, cfg=cfg), params)

    def _reordered_params(self, params: Params, cfg: ModelConfig) -> Params:
        return params.replace(layers=tuple(self._reordered(p, cfg) for p in params.layers),
                              mtp=None if params.mtp is None else params.mtp.replace(
                                  layer=self._reordered(params.mtp.layer, cfg)))

    def _reordered(self, p: LayerParams, cfg: ModelConfig) -> LayerParams:
        """A layer's fused weights in the order its SPMD blocks read (`spmd.place_mixer`, `spmd.place_ffn`)."""
        return p.replace(mixer=place_mixer(self.spmd, p.mixer, cfg), ffn=place_ffn(self.spmd, p.ffn))

    # --- pools -----------------------------------------------------------------------------------
    def state_specs(self, state: DeviceState, cfg: ModelConfig) -> DeviceState:
        """A DeviceState-shaped pytree of PartitionSpecs (of arrays or their shapes): every KV plane by its head
        axis (the KV heads, or a copy of one per device: `kv_heads`), ssm by value head, conv by channel, each where
        the mesh divides its heads (the query heads are a multiple of the KV heads)."""
        def by(axis, heads):
            return lambda a: self.split(a.shape, axis, heads)

        gdn = gdn_heads(cfg)
        return DeviceState(k_pages=jax.tree.map(by(2, None), state.k_pages),
                           v_pages=jax.tree.map(by(2, None), state.v_pages),
                           ssm=jax.tree.map(by(1, gdn), state.ssm), conv=jax.tree.map(by(2, gdn), state.conv))

    def kv_heads(self, params: Params, cfg: ModelConfig) -> int | None:
        """The KV pools' head axis on this mesh where it is not the model's KV heads (`spmd.kv_order`: a copy per
        device), else None."""
        order = kv_order(self.spmd, params, cfg)
        return None if order is None else len(order)

    def pool_shares(self, params: Params, cfg: ModelConfig) -> tuple[float, float]:
        """The fractions of a KV page (its canonical heads) and of a state slot one device holds (`state_specs`'
        splits)."""
        def held(heads: int) -> float:  # of an axis of `heads` (`split`)
            return 1.0 / self.size if heads % self.size == 0 else 1.0

        heads = self.kv_heads(params, cfg) or cfg.num_key_value_heads
        return held(heads) * heads / cfg.num_key_value_heads, held(gdn_heads(cfg))

    def device_bytes(self, params: Params, cfg: ModelConfig) -> int:
        """The weight bytes one device holds once `place_params` placed them."""
        return device_bytes(self.placed_shapes(params, cfg), self.param_specs(params, cfg), self.size)

    def replicate(self, tree):
        """Small device arrays every shard reads (the sampler's state, the MTP carry, the media rows)."""
        return jax.device_put(tree, self.sharding(REPLICATED))

    def stats(self) -> dict:
        return {"tensor_parallel_size": self.size, "expert_parallel": self.expert_parallel,
                "devices": [str(d) for d in self.mesh.devices.flat]}
