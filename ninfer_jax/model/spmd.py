"""The model's explicit SPMD blocks: on a tensor-parallel mesh an FFN runs per device under `shard_map` on its own
slice (the intermediate axis, or with expert parallel its experts) and sums the devices' partial outputs with one
f32 psum, where XLA's partitioner, left alone, moved each token's expert weights between devices.

A split FFN's fused `gate_up` holds each device's gate and up columns side by side ([gate_0 | up_0 | gate_1 | ...],
`shard_gate_up`), so that a device's contiguous slice is the single-device layout at I / N."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from ninfer_jax.model.params import MLPParams, MoEParams, QuantizedWeight, ConcatWeight

AXIS = "tp"
REPLICATED = PartitionSpec()


def _on(axis: int) -> PartitionSpec:
    return PartitionSpec(*(None,) * axis, AXIS)


@dataclasses.dataclass(frozen=True)
class Spmd:
    """The mesh the model's SPMD blocks run on (hashable: part of the static KernelConfig)."""

    mesh: Mesh
    expert_parallel: bool = False

    @property
    def size(self) -> int:
        return self.mesh.size

    def splits_ffn(self, p) -> bool:
        """Whether an FFN (MLPParams or MoEParams) is split: every one of its big weights is plain (block-FP8 ones
        stay whole: their 128-blocks) and the mesh divides the axis it splits on. Otherwise it runs whole on every
        device."""
        mlps = [p] if isinstance(p, MLPParams) else [p.shared]
        weights = [w for m in mlps for w in (m.gate_up, m.down)]
        if isinstance(p, MoEParams):
            weights += [p.gate_up, p.down]
            units = p.gate_up.shape[0] if self.expert_parallel else p.down.shape[1]
        else:
            units = p.down.shape[0]
        if any(isinstance(w, (QuantizedWeight, ConcatWeight)) for w in weights):
            return False
        return units % self.size == 0 and all(m.down.shape[0] % self.size == 0 for m in mlps)

    def ffn_specs(self, p):
        """The PartitionSpecs of an FFN's params (the placement's and the shard_map's)."""
        if not self.splits_ffn(p):
            return jax.tree.map(lambda _: REPLICATED, p)

        def mlp(m: MLPParams) -> MLPParams:  # [H, 2I] columns, [I, H] rows
            return MLPParams(gate_up=_on(1), down=_on(0))

        if isinstance(p, MLPParams):
            return mlp(p)
        experts = (_on(0), _on(0)) if self.expert_parallel else (_on(2), _on(1))  # [E, H, 2I], [E, I, H]
        return MoEParams(router=REPLICATED, gate_up=experts[0], down=experts[1], shared=mlp(p.shared),
                         shared_gate=REPLICATED)

    def ffn(self, p, x, local):
        """local(p, x, expert_offset) -> f32 [T, H], the FFN on one device's slice (expert_offset: its first
        expert's index with expert parallel, else None); run per device and summed. x replicated."""
        def body(p, x):
            offset = None
            if self.expert_parallel and isinstance(p, MoEParams):
                offset = jax.lax.axis_index(AXIS) * p.gate_up.shape[0]
            return jax.lax.psum(local(p, x, offset), AXIS)

        return jax.shard_map(body, mesh=self.mesh, in_specs=(self.ffn_specs(p), REPLICATED),
                             out_specs=REPLICATED)(p, x)


def shard_gate_up(w, axis: int, size: int):
    """[..., gate (I) | up (I)] along `axis` -> each of `size` devices' gate and up columns side by side."""
    xp = np if isinstance(w, np.ndarray) else jnp  # host weights stay on the host
    w = xp.moveaxis(w, axis, -1)
    lead, inter = w.shape[:-1], w.shape[-1] // 2
    w = w.reshape(*lead, 2, size, inter // size)
    w = xp.swapaxes(w, -3, -2).reshape(*lead, 2 * inter)
    return xp.ascontiguousarray(xp.moveaxis(w, -1, axis)) if xp is np else xp.moveaxis(w, -1, axis)


def place_ffn(spmd: Spmd, p):
    """An FFN's params in the layout `ffn_specs` splits: split gate_up weights reordered by `shard_gate_up`."""
    if not spmd.splits_ffn(p):
        return p

    def mlp(m: MLPParams) -> MLPParams:
        return m.replace(gate_up=shard_gate_up(m.gate_up, 1, spmd.size))

    if isinstance(p, MLPParams):
        return mlp(p)
    gate_up = p.gate_up if spmd.expert_parallel else shard_gate_up(p.gate_up, 2, spmd.size)
    return p.replace(gate_up=gate_up, shared=mlp(p.shared))


def local_experts(ids, weights, offset, count: int):
    """Expert parallel: a device's view of the routing, its own `count` experts from `offset` renumbered from 0;
    the others' slots weigh nothing here (and point at its expert 0, whose output they then add as zero)."""
    mine = (ids >= offset) & (ids < offset + count)
    return jnp.where(mine, ids - offset, 0), jnp.where(mine, weights, 0.0)
