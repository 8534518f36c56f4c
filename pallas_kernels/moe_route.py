"""The MoE router after its logits, for a few rows, as one kernel: softmax, top-k and renormalisation.

Computes `reference.moe_route_logits_ref`, what the router does after its logits matmul:
    p = softmax(logits);   ids = the K largest p (ties: the lower expert first, as lax.top_k);
    weights = p[ids] / sum(p[ids])
XLA runs this as a softmax kernel, a sort for `lax.top_k` (the slowest of them at 256 experts) and the
renormalisation, a few kernels per MoE layer of a decode round. One program per row does it all: K rounds of
max, first index of the max, and masking it out, over the row's E probabilities in registers. Given the row and
the shared expert's gate, it also computes that gate (a dot product over H and a sigmoid, two more XLA kernels
otherwise). E and H must be powers of two (Triton's block shapes); `ops.moe_route` keeps the reference otherwise.
The one-lane experts' first kernel routes by the same functions (`select`, `shared_gate`; `moe.moe_experts_routed`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _compat
from pallas_kernels._blocks import is_pow2

_F32 = jnp.float32


def select(logits, top_k: int):
    """One row's routing from its float32 logits [E]: (ids [K] int32, renormalised weights [K] float32). K rounds of
    max, first index of the max and masking it out over the row's probabilities (ties to the lower expert)."""
    num_experts = logits.shape[0]
    p = jax.nn.softmax(logits)
    experts = lax.broadcasted_iota(jnp.int32, (num_experts,), 0)
    slots = lax.broadcasted_iota(jnp.int32, (top_k,), 0)
    ids = jnp.zeros((top_k,), jnp.int32)
    chosen = jnp.zeros((top_k,), _F32)
    for k in range(top_k):  # K is small (8): unrolled
        best = jnp.max(p)
        idx = jnp.min(jnp.where(p == best, experts, num_experts))
        ids = jnp.where(slots == k, idx, ids)
        chosen = jnp.where(slots == k, best, chosen)
        p = jnp.where(experts == idx, -1.0, p)  # probabilities are >= 0: taken experts never win again
    return ids, chosen / jnp.sum(chosen)


def shared_gate(x, gate_w):
    """The shared expert's weight for one row x [H] and its gate gate_w [H]: [1] float32, the dot product rounded to
    x's dtype as the model's matmul, then sigmoid (`reference.shared_expert_gate`)."""
    dot = jnp.sum(x.astype(_F32) * gate_w.astype(_F32), keepdims=True)
    return jax.nn.sigmoid(dot.astype(x.dtype).astype(_F32))


def _kernel(logits_ref, *refs, top_k: int):
    # logits_ref: [T, E] f32; refs: (x_ref [T, H], gate_w_ref [H],) ids_ref (out) [T, K] int32, weights_ref (out)
    # [T, K] f32, (shared_ref (out) [T, 1] f32: the shared expert's gate). Program t handles row t
    with_shared = len(refs) == 5
    if with_shared:
        x_ref, gate_w_ref, ids_ref, weights_ref, shared_ref = refs
    else:
        ids_ref, weights_ref = refs
    t = pl.program_id(0)
    ids_ref[t, :], weights_ref[t, :] = select(logits_ref[t, :], top_k)
    if with_shared:
        shared_ref[t, :] = shared_gate(x_ref[t, :], gate_w_ref[...])


@dataclasses.dataclass(frozen=True)
class RouteConfig:
    """Tuning knobs (hashable)."""

    num_warps: int = 4


DEFAULT_CONFIG = RouteConfig()


def supported(logits: jax.Array, top_k: int, x: jax.Array | None = None) -> bool:
    """Whether `route` takes logits [T, E] and K (E and K powers of two, K <= E), and with a shared gate x [T, H]
    (H a power of two: the row is read whole)."""
    e = logits.shape[-1]
    ok = logits.ndim == 2 and is_pow2(e) and is_pow2(top_k) and top_k <= e
    if x is not None:
        h = x.shape[-1]
        ok = ok and x.shape[0] == logits.shape[0] and is_pow2(h, 16)
    return ok


@functools.partial(jax.jit, static_argnames=("top_k", "interpret"))
def route(logits, x=None, shared_gate_w=None, *, top_k: int, interpret: bool = False):
    """(expert ids [T, K] int32, renormalised weights [T, K] float32) from router logits [T, E] (float32); with x
    [T, H] and the shared expert's gate shared_gate_w [H, 1] also its weight per token [T] float32
    (`reference.shared_expert_gate`), which saves that small projection its own kernels."""
    with_shared = shared_gate_w is not None
    if not supported(logits, top_k, x if with_shared else None) or (
            with_shared and shared_gate_w.size != x.shape[1]):
        raise ValueError(f"moe_route: logits {logits.shape} need a power-of-two expert count and top_k {top_k} a "
                         f"power of two no larger; a shared gate x {None if x is None else x.shape} a power-of-two H "
                         f"and a gate of H values")
    rows = logits.shape[0]
    out_shape = [jax.ShapeDtypeStruct((rows, top_k), jnp.int32), jax.ShapeDtypeStruct((rows, top_k), _F32)]
    inputs = (logits.astype(_F32),)
    if with_shared:  # the gate [H, 1] as [H]: a reshape, not a slice (a sliced operand would be copied first)
        out_shape.append(jax.ShapeDtypeStruct((rows, 1), _F32))
        inputs += (x, shared_gate_w.reshape(-1))
    out = pl.pallas_call(
        functools.partial(_kernel, top_k=top_k),
        grid=(rows,),
        out_shape=out_shape,
        compiler_params=_compat.triton_params(DEFAULT_CONFIG.num_warps, 1),
        interpret=interpret,
        name="moe_route",
    )(*inputs)
    return (out[0], out[1], out[2].reshape(rows)) if with_shared else (out[0], out[1])
