"""The model's explicit SPMD blocks: on a tensor-parallel mesh an FFN runs per device under `shard_map` on its own
slice (the intermediate axis, or with expert parallel its experts) and sums the devices' partial outputs with one
f32 psum, where XLA's partitioner, left alone, moved each token's expert weights between devices. Block-FP8
weights split too where each device's slice is whole 128-blocks.

A split FFN's fused `gate_up` holds each device's gate and up columns side by side ([gate_0 | up_0 | gate_1 | ...],
`shard_gate_up`), so that a device's contiguous slice is the single-device layout at I / N."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from ninfer_jax.model.params import FP8_BLOCK, ConcatWeight, MLPParams, MoEParams, QuantizedWeight

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
        """Whether an FFN (MLPParams or MoEParams) is split: the mesh divides every big weight's split axis, into
        whole 128-blocks for a block-FP8 weight's intermediate axis (a ConcatWeight stays whole). Otherwise the FFN
        runs whole on every device."""
        if isinstance(p, MLPParams):
            return self._splits_mlp(p)
        if self.expert_parallel:  # the shared expert may stay whole (`shared_splits`)
            return all(self._divides(w, w.shape[0], False) for w in (p.gate_up, p.down))
        return self._splits_mlp(p.shared) and all(self._divides(w, p.down.shape[1], True) for w in (p.gate_up, p.down))

    def shared_splits(self, p: MoEParams) -> bool:
        """Whether a split MoE's shared expert splits too; where it does not (expert parallel with a shared
        expert narrower than a block-FP8 split allows) it runs whole on every device, weighed on the first only."""
        return self._splits_mlp(p.shared)

    def _splits_mlp(self, m: MLPParams) -> bool:
        return all(self._divides(w, m.down.shape[0], True) for w in (m.gate_up, m.down))

    def _divides(self, w, units: int, blocked: bool) -> bool:
        if isinstance(w, ConcatWeight):
            return False
        block = FP8_BLOCK if blocked and isinstance(w, QuantizedWeight) else 1
        return units % (self.size * block) == 0

    def ffn_specs(self, p):
        """The PartitionSpecs of an FFN's params (the placement's and the shard_map's)."""
        if not self.splits_ffn(p):
            return jax.tree.map(lambda _: REPLICATED, p)

        def mlp(m: MLPParams) -> MLPParams:  # [H, 2I] columns, [I, H] rows
            return MLPParams(gate_up=_split(m.gate_up, 1), down=_split(m.down, 0))

        if isinstance(p, MLPParams):
            return mlp(p)
        axes = (0, 0) if self.expert_parallel else (2, 1)  # [E, H, 2I], [E, I, H]
        shared = mlp(p.shared) if self.shared_splits(p) else jax.tree.map(lambda _: REPLICATED, p.shared)
        return MoEParams(router=REPLICATED, gate_up=_split(p.gate_up, axes[0]), down=_split(p.down, axes[1]),
                         shared=shared, shared_gate=REPLICATED)

    def ffn(self, p, x, local):
        """local(p, x, expert_offset, shared_weight) -> f32 [T, H], the FFN on one device's slice (expert_offset: its
        first expert's index with expert parallel, else None; shared_weight: None, or where the shared expert runs
        whole on every device 1 on the first and 0 elsewhere); run per device and summed. x replicated."""
        moe = isinstance(p, MoEParams)
        shared_whole = moe and not self.shared_splits(p)  # decided on the whole params: the body sees its slices

        def body(p, x):
            offset, shared_weight = None, None
            device = jax.lax.axis_index(AXIS)
            if moe and self.expert_parallel:
                offset = device * p.gate_up.shape[0]  # this device's experts
            if shared_whole:
                shared_weight = (device == 0).astype(jnp.float32)
            return jax.lax.psum(local(p, x, offset, shared_weight), AXIS)

        return jax.shard_map(body, mesh=self.mesh, in_specs=(self.ffn_specs(p), REPLICATED),
                             out_specs=REPLICATED)(p, x)


def _stored_axis(w, axis: int) -> int:
    """A weight's axis in its x @ w shape [..., K, N] -> the axis of its stored arrays (a QuantizedWeight keeps the
    checkpoint's [..., N, K], and its scales the same order)."""
    if not isinstance(w, QuantizedWeight) or axis < len(w.shape) - 2:
        return axis
    return len(w.shape) - 1 if axis == len(w.shape) - 2 else len(w.shape) - 2


def _split(w, axis: int):
    """The spec of a weight split on `axis` of its x @ w shape."""
    if isinstance(w, QuantizedWeight):
        spec = _on(_stored_axis(w, axis))
        return QuantizedWeight(values=spec, scales=spec)
    return _on(axis)


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

    def reorder(w, axis: int):  # a block-FP8 weight's values and scales alike: its halves are whole blocks
        if isinstance(w, QuantizedWeight):
            axis = _stored_axis(w, axis)
            return w.replace(values=shard_gate_up(w.values, axis, spmd.size),
                             scales=shard_gate_up(w.scales, axis, spmd.size))
        return shard_gate_up(w, axis, spmd.size)

    def mlp(m: MLPParams) -> MLPParams:
        return m.replace(gate_up=reorder(m.gate_up, 1))

    if isinstance(p, MLPParams):
        return mlp(p)
    gate_up = p.gate_up if spmd.expert_parallel else reorder(p.gate_up, 2)
    return p.replace(gate_up=gate_up, shared=mlp(p.shared) if spmd.shared_splits(p) else p.shared)


def local_experts(ids, weights, offset, count: int):
    """Expert parallel: a device's view of the routing, its own `count` experts from `offset` renumbered from 0;
    the others' slots weigh nothing here (and point at its expert 0, whose output they then add as zero)."""
    mine = (ids >= offset) & (ids < offset + count)
    return jnp.where(mine, ids - offset, 0), jnp.where(mine, weights, 0.0)
