"""The model's explicit SPMD blocks: on a tensor-parallel mesh each token mixer runs per device under `shard_map` on
its own heads (the single-device code under a config of its share), and each FFN on its own slice (the
intermediate axis, or with expert parallel its experts); one psum sums the devices' partial outputs. Left alone,
XLA's partitioner moved what the single-device code touched: each token's expert weights, and each head's columns
of the fused projections. Block-FP8 weights split too where each device's slice is whole 128-blocks
(`block_order`); a block that would be cut keeps its FFN or mixer whole.

A split block's fused weights hold each device's pieces side by side (`shard_sections`: [gate_0 | up_0 | gate_1 |
...], [q+gate_0 | k_0 | v_0 | q+gate_1 | ...]), so that a device's contiguous slice is the single-device layout of
its share. The conv pool's channels follow the same order on the device (`conv_order`). An attention split over
more devices than KV heads gives each device its query heads and a copy of the one KV head they read (vLLM's
way): its k and v columns and its KV pools' head axis hold one entry per device (`kv_head_order`, `kv_order`)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from ninfer_jax.config import ModelConfig
from ninfer_jax.model.params import (FP8_BLOCK, AttnParams, ConcatWeight, GDNParams, MLPParams, MoEParams,
                                     QuantizedWeight)

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

    # --- mixers ----------------------------------------------------------------------------------
    def splits_mixer(self, p, cfg: ModelConfig) -> bool:
        """Whether a token mixer is split by head: the mesh divides its query heads and its KV heads or their count
        divides the mesh (then devices share a KV head, each holding a copy: `kv_head_order`), or it divides the
        GDN's key and value heads; and each device's piece of a block-FP8 projection is whole 128-blocks (of each
        part of a ConcatWeight; its out-projection's rows likewise, and not a ConcatWeight there). Otherwise it runs
        whole on every device."""
        n = self.size
        if isinstance(p, AttnParams):
            hkv, out = cfg.num_key_value_heads, p.o_proj
            heads = cfg.num_attention_heads % n == 0 and (hkv % n == 0 or n % hkv == 0)
        else:
            out = p.out_proj
            heads = cfg.linear_num_key_heads % n == 0 and cfg.linear_num_value_heads % n == 0
        return heads and self._divides(out, out.shape[0], True) and all(
            splits_by(getattr(p, name), axis, order, n) for name, (axis, order) in mixer_orders(p, cfg, n).items())

    def local_config(self, p, cfg: ModelConfig) -> ModelConfig:
        """The config one device runs a split mixer under: its share of the heads (of the KV heads, at least one)."""
        n = self.size
        if isinstance(p, AttnParams):
            return dataclasses.replace(cfg, num_attention_heads=cfg.num_attention_heads // n,
                                       num_key_value_heads=max(cfg.num_key_value_heads // n, 1))
        return dataclasses.replace(cfg, linear_num_key_heads=cfg.linear_num_key_heads // n,
                                   linear_num_value_heads=cfg.linear_num_value_heads // n)

    def mixer_specs(self, p, cfg: ModelConfig):
        """The PartitionSpecs of a mixer's params: by head where it splits (fused projections in `place_mixer`'s
        order), else whole."""
        if not self.splits_mixer(p, cfg):
            return jax.tree.map(lambda _: REPLICATED, p)
        if isinstance(p, AttnParams):
            return AttnParams(qkv_proj=_split(p.qkv_proj, 1), q_norm=REPLICATED, k_norm=REPLICATED,
                              o_proj=_split(p.o_proj, 0))
        return GDNParams(in_proj=_split(p.in_proj, 1), conv_w=_on(1), a_log=_on(0), dt_bias=_on(0),
                         norm_w=REPLICATED, out_proj=_split(p.out_proj, 0))

    @staticmethod
    def pool_specs(p, pools):
        """A split mixer's pools by head: every KV plane [P, 64, Hkv, ...] on its axis 2; ssm [S, Hv, Dk, Dv] on 1;
        conv [S, K-1, channels] on 2 (channels in `conv_order`)."""
        if isinstance(p, AttnParams):
            return tuple(jax.tree.map(lambda _: _on(2), pool) for pool in pools)
        return _on(1), _on(2)

    def mixer(self, fn, p, x, pools, cfg: ModelConfig, ctx, extras: int = 0):
        """fn(p, x, *pools, cfg, ctx) -> (out-projection output, *pools, *extras), run per device on its heads with
        its local config, the outputs summed. x and ctx (the step's arrays the mixer reads) replicated; the caller
        checked `splits_mixer`. ctx is an input, not a closure: an array the step computed from an SPMD block's
        output carries the mesh in its type, which a closure cannot bring into another block. Each extra output (a
        verify round's in-projection rows) stays split on its last axis: its columns in the devices' order, which
        `state_update` takes back."""
        local = self.local_config(p, cfg)
        pool_specs = self.pool_specs(p, pools)

        def body(p, x, ctx, *pools):
            y, *rest = fn(p, x, *pools, local, ctx)
            return (jax.lax.psum(y, AXIS), *rest)

        extra_specs = (PartitionSpec(None, None, AXIS),) * extras  # [B, T, columns]
        return jax.shard_map(body, mesh=self.mesh,
                             in_specs=(self.mixer_specs(p, cfg), REPLICATED, REPLICATED, *pool_specs),
                             out_specs=(REPLICATED, *pool_specs, *extra_specs))(p, x, ctx, *pools)

    def state_update(self, fn, p, rows, pools, cfg: ModelConfig, ctx):
        """fn(p, rows, *pools, cfg, ctx) -> pools, per device on its heads: a split GDN mixer's state advanced over
        its in-projection rows [B, T, columns] (`mixer`'s extra output); ctx replicated, an input as in `mixer`."""
        local = self.local_config(p, cfg)
        pool_specs = self.pool_specs(p, pools)
        return jax.shard_map(lambda p, rows, ctx, *pools: tuple(fn(p, rows, *pools, local, ctx)), mesh=self.mesh,
                             in_specs=(self.mixer_specs(p, cfg), PartitionSpec(None, None, AXIS), REPLICATED,
                                       *pool_specs),
                             out_specs=tuple(pool_specs))(p, rows, ctx, *pools)

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
    """The spec of a weight split on `axis` of its x @ w shape (each part's, for a ConcatWeight)."""
    if isinstance(w, ConcatWeight):
        return ConcatWeight(parts=tuple(_split(part, axis) for part in w.parts))
    if isinstance(w, QuantizedWeight):
        spec = _on(_stored_axis(w, axis))
        return QuantizedWeight(values=spec, scales=spec)
    return _on(axis)


def shard_sections(w, axis: int, sections: tuple[int, ...], size: int):
    """[s_0 | s_1 | ...] along `axis` (sections of those widths, each split in `size` pieces) -> each device's pieces
    side by side: [s_0 piece 0 | s_1 piece 0 | ... | s_0 piece 1 | ...]; a device's contiguous slice is then the
    single-device layout of its share."""
    xp = np if isinstance(w, np.ndarray) else jnp  # host weights stay on the host
    w = xp.moveaxis(w, axis, -1)
    lead, starts = w.shape[:-1], np.cumsum((0,) + tuple(sections))
    parts = [w[..., a:b].reshape(*lead, size, (b - a) // size) for a, b in zip(starts[:-1], starts[1:])]
    w = xp.concatenate(parts, axis=-1).reshape(*lead, w.shape[-1])
    w = xp.moveaxis(w, -1, axis)
    return xp.ascontiguousarray(w) if xp is np else w


def sections_order(sections: tuple[int, ...], size: int) -> np.ndarray:
    """`shard_sections`' permutation as indices: position i of the reordered axis holds canonical index order[i]."""
    return shard_sections(np.arange(sum(sections)), 0, sections, size)


def block_order(order: np.ndarray, size: int) -> np.ndarray | None:
    """A column order split over `size` devices as one of whole 128-blocks (a block-FP8 weight's scales follow
    its values by block): the canonical block at each block position; None where a device's piece, or a run of
    its columns, would cut a block."""
    if len(order) % (size * FP8_BLOCK):
        return None
    runs = order.reshape(-1, FP8_BLOCK)
    if (runs[:, 0] % FP8_BLOCK).any() or (runs != runs[:, :1] + np.arange(FP8_BLOCK)).any():
        return None
    return runs[:, 0] // FP8_BLOCK


def part_orders(order: np.ndarray, widths, size: int) -> list[np.ndarray] | None:
    """A fused column order over a ConcatWeight's parts (of those widths): each part's own order, every device's
    columns of it side by side; None where the devices' shares of a part differ in width."""
    rows, starts, out = order.reshape(size, -1), np.cumsum((0, *widths)), []
    for a, b in zip(starts[:-1], starts[1:]):
        pieces = [row[(row >= a) & (row < b)] - a for row in rows]
        if len({len(piece) for piece in pieces}) > 1:
            return None
        out.append(np.concatenate(pieces))
    return out


def splits_by(w, axis: int, order: np.ndarray, size: int) -> bool:
    """Whether `reorder` splits w in `order` over `size` devices: a block-FP8 weight's pieces are whole blocks
    (`block_order`), a ConcatWeight's parts each."""
    if isinstance(w, ConcatWeight):
        orders = part_orders(order, [part.shape[axis] for part in w.parts], size)
        return orders is not None and all(splits_by(part, axis, o, size) for part, o in zip(w.parts, orders))
    return not isinstance(w, QuantizedWeight) or block_order(order, size) is not None


def reorder(w, axis: int, order: np.ndarray, size: int):
    """w's `axis` (of its x @ w shape) in `order` (the canonical index at each position), for `size` devices: a
    block-FP8 weight's values and its scales' blocks alike, a ConcatWeight's parts each by its share; the caller
    checked `splits_by`."""
    if isinstance(w, ConcatWeight):
        orders = part_orders(order, [part.shape[axis] for part in w.parts], size)
        return w.replace(parts=tuple(reorder(part, axis, o, size) for part, o in zip(w.parts, orders)))
    if isinstance(w, QuantizedWeight):
        stored = _stored_axis(w, axis)
        blocks = block_order(order, size)
        return w.replace(values=_take(w.values, order, stored), scales=_take(w.scales, blocks, stored))
    return _take(w, order, axis)


def place_ffn(spmd: Spmd, p):
    """An FFN's params in the layout `ffn_specs` splits: split gate_up weights in each device's [gate_i | up_i]
    order (`reorder`; a block-FP8 one's halves are whole blocks per device, `splits_ffn`)."""
    if not spmd.splits_ffn(p):
        return p

    def reordered(w, axis: int):
        half = w.shape[axis] // 2
        return reorder(w, axis, sections_order((half, half), spmd.size), spmd.size)

    def mlp(m: MLPParams) -> MLPParams:
        return m.replace(gate_up=reordered(m.gate_up, 1))

    if isinstance(p, MLPParams):
        return mlp(p)
    gate_up = p.gate_up if spmd.expert_parallel else reordered(p.gate_up, 2)
    return p.replace(gate_up=gate_up, shared=mlp(p.shared) if spmd.shared_splits(p) else p.shared)


def kv_head_order(kv_heads: int, size: int) -> np.ndarray:
    """The canonical KV head at each position of a split attention's KV head axis on `size` devices (its pools'
    and its k and v columns'), each device's run contiguous: the heads themselves where the mesh divides them, else
    one entry per device, a copy of the head its query heads read (GQA: query head h reads KV head
    h // (Hq / Hkv), so device d's reads KV head d // (size / Hkv))."""
    width = max(kv_heads, size)
    return np.arange(width) * kv_heads // width


def qkv_order(cfg: ModelConfig, size: int) -> np.ndarray:
    """The fused [q+gate (per head) | k | v] columns of a split attention as canonical column indices: each device's
    [q+gate | k | v] of its heads side by side, a KV head shared by devices repeated in each (`kv_head_order`)."""
    d, hq, hkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    q = np.arange(2 * hq * d).reshape(size, -1)
    k = (kv_head_order(hkv, size)[:, None] * d + np.arange(d)).reshape(size, -1) + 2 * hq * d
    return np.concatenate([q, k, k + hkv * d], axis=1).reshape(-1)


def gdn_sections(cfg: ModelConfig) -> dict:
    """A GDN mixer's fused weights, by field: (axis, sections) that `shard_sections` reorders by head."""
    kd, vd, hv = cfg.key_dim, cfg.value_dim, cfg.linear_num_value_heads
    return {"in_proj": (1, (kd, kd, vd, vd, hv, hv)),  # [q | k | v | z | b | a]
            "conv_w": (1, (kd, kd, vd))}


def mixer_orders(p, cfg: ModelConfig, size: int) -> dict:
    """A split mixer's fused weights, by field: (axis, the canonical index at each position of that axis); the
    caller checked that the mesh splits its heads."""
    if isinstance(p, AttnParams):
        return {"qkv_proj": (1, qkv_order(cfg, size))}
    return {name: (axis, sections_order(sections, size)) for name, (axis, sections) in gdn_sections(cfg).items()}


def _first_mixer(params, kind):
    """The first layer's mixer of `kind` (every mixer of a kind splits alike), or None."""
    return next((layer.mixer for layer in params.layers if isinstance(layer.mixer, kind)), None)


def conv_order(spmd: Spmd | None, params, cfg: ModelConfig) -> np.ndarray | None:
    """The conv pool's channel order where the GDN mixers split (`splits_mixer`, decided as for the mixers
    themselves: one whose block-FP8 in_proj cannot split runs whole and reads the canonical order): position i
    holds canonical channel order[i]; None where it is the canonical order. The Host tier stores the canonical
    order."""
    gdn = _first_mixer(params, GDNParams)
    if spmd is None or gdn is None or not spmd.splits_mixer(gdn, cfg):
        return None
    return sections_order(gdn_sections(cfg)["conv_w"][1], spmd.size)


def kv_order(spmd: Spmd | None, params, cfg: ModelConfig) -> np.ndarray | None:
    """The KV pools' head axis where the attention mixers split over more devices than KV heads (decided as for the
    mixers: one whose block-FP8 projections cannot split runs whole on the canonical heads): position i holds a copy
    of canonical KV head order[i] (`kv_head_order`); None where the axis is the canonical heads. The Host tier stores
    the canonical heads: a write to it takes each head's first copy, a restore writes every copy."""
    attention = _first_mixer(params, AttnParams)
    if spmd is None or attention is None or cfg.num_key_value_heads >= spmd.size \
            or not spmd.splits_mixer(attention, cfg):
        return None
    return kv_head_order(cfg.num_key_value_heads, spmd.size)


def _take(w, order: np.ndarray, axis: int):
    """w's `axis` as `order` indexes it (host weights stay on the host)."""
    return np.take(w, order, axis=axis) if isinstance(w, np.ndarray) else jnp.take(w, order, axis=axis)


def place_mixer(spmd: Spmd, p, cfg: ModelConfig):
    """A mixer's params in the layout `mixer_specs` splits: fused weights reordered by head (`mixer_orders`)."""
    if not spmd.splits_mixer(p, cfg):
        return p
    return p.replace(**{name: reorder(getattr(p, name), axis, order, spmd.size)
                        for name, (axis, order) in mixer_orders(p, cfg, spmd.size).items()})


def local_experts(ids, weights, offset, count: int):
    """Expert parallel: a device's view of the routing, its own `count` experts from `offset` renumbered from 0;
    the others' slots weigh nothing here (and point at its expert 0, whose output they then add as zero)."""
    mine = (ids >= offset) & (ids < offset + count)
    return jnp.where(mine, ids - offset, 0), jnp.where(mine, weights, 0.0)
