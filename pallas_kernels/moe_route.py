"""The MoE router after its logits, for a few rows, as one kernel: softmax, top-k and renormalisation.

Computes `reference.moe_route_logits_ref`, what the router does after its logits matmul:
    p = softmax(logits);   ids = the K largest p (ties: the lower expert first, as lax.top_k);
    weights = p[ids] / sum(p[ids])
XLA runs this as a softmax kernel, a sort for `lax.top_k` (4 us per layer on the H200 at 256 experts) and the
renormalisation, a few kernels per MoE layer of a decode round. One program per row does it all: K rounds of
max, first index of the max, and masking it out, over the row's E probabilities in registers. E must be a power
of two (Triton's block shapes); `ops.moe_route` keeps the reference otherwise.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _compat

_F32 = jnp.float32


def _kernel(logits_ref, ids_ref, weights_ref, *, top_k: int):
    # logits_ref: [T, E] f32; ids_ref (out): [T, K] int32; weights_ref (out): [T, K] f32; program t handles row t
    t = pl.program_id(0)
    num_experts = logits_ref.shape[1]
    p = jax.nn.softmax(logits_ref[t, :])
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
    ids_ref[t, :] = ids
    weights_ref[t, :] = chosen / jnp.sum(chosen)


def supported(logits: jax.Array, top_k: int) -> bool:
    """Whether `route` takes logits [T, E] and K: E and K powers of two, K <= E."""
    e = logits.shape[-1]
    return logits.ndim == 2 and e & (e - 1) == 0 and top_k & (top_k - 1) == 0 and 0 < top_k <= e


@functools.partial(jax.jit, static_argnames=("top_k", "interpret"))
def route(logits, *, top_k: int, interpret: bool = False):
    """(expert ids [T, K] int32, renormalised weights [T, K] float32) from router logits [T, E] (float32)."""
    if not supported(logits, top_k):
        raise ValueError(f"moe_route: logits {logits.shape} need a power-of-two expert count and top_k {top_k} a "
                         f"power of two no larger")
    rows = logits.shape[0]
    return tuple(pl.pallas_call(
        functools.partial(_kernel, top_k=top_k),
        grid=(rows,),
        out_shape=[jax.ShapeDtypeStruct((rows, top_k), jnp.int32), jax.ShapeDtypeStruct((rows, top_k), _F32)],
        compiler_params=_compat.triton_params(4, 1),
        interpret=interpret,
        name="moe_route",
    )(logits.astype(_F32)))
