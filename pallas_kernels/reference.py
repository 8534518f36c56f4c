"""Plain-jnp references for every kernel in this package, in one place.

These are the functions the Pallas kernels must match, and what the model runs when kernels are off
(`KernelConfig(backend="reference")`). They favour clarity over speed, compute in float32 whatever the
input dtype, and are themselves checked against HF transformers' Qwen3.5 through the model parity tests.

Conventions (shared with the kernels):
  T: tokens in a call; Hk: GDN key heads; Hv: GDN value heads (a multiple of Hk; value head j reads key
  head j // (Hv // Hk)); Dk, Dv: GDN head dims; Hq, Hkv: attention query / key-value heads; D: head dim;
  P: pages in a pool; PAGE = 64 tokens per page.

  Gated delta rule, per value head h, for t = 0..T-1 (state S: [Dk, Dv], float32):
      S <- exp(g_t) * S
      S <- S + beta_t * k_t (v_t - S^T k_t)^T
      o_t = S^T q_t
  q and k arrive already L2-normalised and q already scaled by Dk**-0.5 (the model does both, in
  float32, before calling); g is the log decay (<= 0) and beta the write strength in [0, 1].
  Identity tokens (k = v = g = beta = 0) leave S bit-for-bit unchanged: exp(0) = 1 and the update is
  0 * (...) = 0. Padding and phase alignment rely on that.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels import kv_quant

PAGE = 64


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x / sqrt(sum(x^2) + eps) over the last axis, in float32 (HF and fla use the same eps)."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def rms_norm(x, w, eps):
    """Zero-centred RMSNorm over the last axis: the (1 + w) form of Qwen3.5, normalised in float32, returned in x's
    dtype. The model's norm, and what the add + norm kernel computes on each row."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * (1.0 + w.astype(jnp.float32))).astype(x.dtype)


def gated_rms_norm(o, z, norm_w, eps):
    """The GDN output's gated RMSNorm over the last axis (plain weight, times silu(z)) with HF's roundings: the
    normalised o back to its dtype before the weight, the weighted product in the weight's and o's common dtype, the
    result in o's. Each rounding is a cast, which XLA and Triton both keep (a multiply in bf16 XLA may compute in
    float32 without rounding: on CPU one bf16 bit apart). The model's, the decode layer's and the FP8 norm's."""
    act = o.dtype
    of = o.astype(jnp.float32)
    normed = (of * jax.lax.rsqrt(jnp.mean(of * of, axis=-1, keepdims=True) + eps)).astype(act).astype(jnp.float32)
    weighted = (norm_w.astype(jnp.float32) * normed).astype(jnp.promote_types(norm_w.dtype, act))
    return (weighted.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))).astype(act)


def swiglu(gate, up):
    """silu(gate) * up in gate's dtype with torch's roundings (HF's MLP): the SiLU in float32 rounded once, the
    product rounded once. The model's MLP and the FP8 rows kernel's."""
    act = gate.dtype
    silu = jax.nn.silu(gate.astype(jnp.float32)).astype(act)
    return (silu.astype(jnp.float32) * up.astype(jnp.float32)).astype(act)


def _expand_key_heads(x: jax.Array, num_v_heads: int) -> jax.Array:
    """[T, Hk, D] -> [T, Hv, D]: value head j reads key head j // (Hv // Hk)."""
    return jnp.repeat(x, num_v_heads // x.shape[1], axis=1)


def gdn_recurrent_ref(q, k, v, g, beta, state):
    """Token-by-token gated delta rule.

    Args:
      q, k: [T, Hk, Dk] (normalised; q scaled). v: [T, Hv, Dv]. g, beta: [T, Hv]. state: [Hv, Dk, Dv].
    Returns:
      (o [T, Hv, Dv] float32, final state [Hv, Dk, Dv] float32).
    """
    hv = v.shape[1]
    q, k = (_expand_key_heads(x, hv).astype(jnp.float32) for x in (q, k))
    v, g, beta = (x.astype(jnp.float32) for x in (v, g, beta))

    def step(s, xs):
        q_t, k_t, v_t, g_t, b_t = xs  # [Hv, Dk], [Hv, Dk], [Hv, Dv], [Hv], [Hv]
        s = s * jnp.exp(g_t)[:, None, None]
        kv_mem = jnp.einsum("hkv,hk->hv", s, k_t)
        delta = (v_t - kv_mem) * b_t[:, None]
        s = s + k_t[:, :, None] * delta[:, None, :]
        return s, jnp.einsum("hkv,hk->hv", s, q_t)

    final, o = jax.lax.scan(step, state.astype(jnp.float32), (q, k, v, g, beta))
    return o, final


_EXACT = jax.lax.Precision.HIGHEST


def _unit_lower_inverse(a):
    """(I + a)^-1 for strictly lower-triangular a [..., C, C], C a power of two, by matmuls alone.

    Doubles inverted diagonal blocks: [[X, 0], [B, Y]]^-1 = [[X^-1, 0], [-Y^-1 B X^-1, Y^-1]]. No LAPACK
    triangular solve: on XLA:CPU two of those running at once on a two-core pool can wait on each other forever
    (jaxlib 0.10.2), and a train step's forward and backward hold several.
    """
    batch, c = a.shape[:-2], a.shape[-1]
    inverse = jnp.ones(batch + (c, 1, 1), a.dtype)  # the inverses of the 1x1 diagonal blocks
    s = 1
    while s < c:
        nb = c // (2 * s)
        pairs = inverse.reshape(batch + (nb, 2, s, s))
        upper, lower = pairs[..., 0, :, :], pairs[..., 1, :, :]
        blocks = jnp.moveaxis(jnp.diagonal(a.reshape(batch + (nb, 2 * s, nb, 2 * s)), axis1=-4, axis2=-2), -1, -3)
        corner = -jnp.matmul(jnp.matmul(lower, blocks[..., s:, :s], precision=_EXACT), upper, precision=_EXACT)
        zero = jnp.zeros_like(upper)
        inverse = jnp.concatenate([jnp.concatenate([upper, zero], -1), jnp.concatenate([corner, lower], -1)], -2)
        s *= 2
    return inverse.reshape(batch + (c, c))


def gdn_chunked_ref(q, k, v, g, beta, state, chunk: int = PAGE, phase: int = 0,
                    return_chunk_states: bool = False):
    """Chunked gated delta rule (the WY/UT form fla and HF use).

    Same arguments and results as `gdn_recurrent_ref`, plus:
      phase: the call is left-padded with `phase` identity tokens (spec §7.2), so that with
        phase = base % chunk every internal chunk boundary is an absolute multiple of `chunk`.
      return_chunk_states: also return the state after each chunk of the padded grid,
        [N, Hv, Dk, Dv]; entry i is the state after absolute position base - phase + chunk * (i + 1).
        This is what a state tap at a 64-aligned position reads.
    T is right-padded with identity tokens to a multiple of `chunk`, which leaves the state unchanged.
    """
    t, hv = v.shape[0], v.shape[1]
    pad = (-(t + phase)) % chunk
    q, k = (_expand_key_heads(x, hv).astype(jnp.float32) for x in (q, k))
    v, g, beta = (x.astype(jnp.float32) for x in (v, g, beta))
    q, k, v = (jnp.pad(x, ((phase, pad), (0, 0), (0, 0))) for x in (q, k, v))
    g, beta = (jnp.pad(x, ((phase, pad), (0, 0))) for x in (g, beta))
    n = (phase + t + pad) // chunk

    # [N, Hv, C, D] and [N, Hv, C]
    def to_chunks(x):
        return jnp.moveaxis(x.reshape(n, chunk, hv, -1), 2, 1)

    q, k, v = to_chunks(q), to_chunks(k), to_chunks(v)
    g = jnp.moveaxis(g.reshape(n, chunk, hv), 2, 1)
    beta = jnp.moveaxis(beta.reshape(n, chunk, hv), 2, 1)

    cum = jnp.cumsum(g, axis=-1)  # log decay from chunk start through position i
    causal = jnp.tril(jnp.ones((chunk, chunk), bool))
    decay = jnp.where(causal, jnp.exp(jnp.where(causal, cum[..., :, None] - cum[..., None, :], 0.0)), 0.0)
    k_beta = k * beta[..., None]
    strict = jnp.tril(jnp.ones((chunk, chunk), bool), -1)
    a = jnp.where(strict, jnp.einsum("nhik,nhjk->nhij", k_beta, k) * decay, 0.0)
    # (I + A)^-1 applied to beta*v and to beta*k*exp(cum): the UT transform
    inverse = _unit_lower_inverse(a)
    u = jnp.einsum("nhij,nhjv->nhiv", inverse, v * beta[..., None], precision=_EXACT)
    w = jnp.einsum("nhij,nhjk->nhik", inverse, k_beta * jnp.exp(cum)[..., None], precision=_EXACT)
    attn = jnp.einsum("nhik,nhjk->nhij", q, k) * decay  # causal incl. diagonal
    q_decayed = q * jnp.exp(cum)[..., None]
    k_to_end = k * jnp.exp(cum[..., -1:] - cum)[..., None]
    chunk_decay = jnp.exp(cum[..., -1])  # [N, Hv]

    def step(s, xs):
        u_c, w_c, attn_c, qd_c, ke_c, cd_c = xs
        v_new = u_c - jnp.einsum("hck,hkv->hcv", w_c, s)
        o = jnp.einsum("hck,hkv->hcv", qd_c, s) + jnp.einsum("hij,hjv->hiv", attn_c, v_new)
        s = s * cd_c[:, None, None] + jnp.einsum("hck,hcv->hkv", ke_c, v_new)
        return s, (o, s)

    final, (o, chunk_states) = jax.lax.scan(
        step, state.astype(jnp.float32), (u, w, attn, q_decayed, k_to_end, chunk_decay)
    )
    o = jnp.moveaxis(o, 1, 2).reshape(n * chunk, hv, -1)[phase : phase + t]
    if return_chunk_states:
        return o, final, chunk_states
    return o, final


def attention_ref(q, k, v, q_positions, kv_length):
    """Causal GQA softmax attention over contiguous keys.

    Args:
      q: [T, Hq, D]; k, v: [S, Hkv, D] (key j is at absolute position j);
      q_positions: [T] int absolute positions; kv_length: keys >= kv_length are ignored.
    Returns:
      [T, Hq, D] float32. Query i sees key j iff j <= q_positions[i] and j < kv_length.
    """
    hq, d = q.shape[1], q.shape[2]
    group = hq // k.shape[1]
    qf = q.astype(jnp.float32).reshape(q.shape[0], k.shape[1], group, d)
    kf, vf = k.astype(jnp.float32), v.astype(jnp.float32)
    scores = jnp.einsum("tkgd,skd->tkgs", qf, kf) * (d**-0.5)
    key_pos = jnp.arange(k.shape[0])
    visible = (key_pos[None, :] <= q_positions[:, None]) & (key_pos[None, :] < kv_length)
    scores = jnp.where(visible[:, None, None, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("tkgs,skd->tkgd", probs, vf)
    return out.reshape(q.shape[0], hq, d)


def gather_pages(pages, page_table: jax.Array) -> jax.Array:
    """[P, PAGE, Hkv, D] pool (plain, or quantized: dequantized to float32) and [n] page ids -> contiguous
    [n * PAGE, Hkv, D]."""
    g = kv_quant.take(pages, page_table)
    return g.reshape(-1, *pages.shape[2:])


def paged_attention_ref(q, k_pages, v_pages, page_table, q_positions, kv_length):
    """Causal attention of one lane's queries over its pages.

    Args:
      q: [T, Hq, D]; k_pages, v_pages: [P, PAGE, Hkv, D] (plain or quantized); page_table: [max_pages] int32 (the lane's
      page for logical block b at index b; entries past the lane's length may be anything valid);
      q_positions: [T]; kv_length: number of valid keys.
    Returns:
      [T, Hq, D] float32.
    """
    return attention_ref(
        q, gather_pages(k_pages, page_table), gather_pages(v_pages, page_table), q_positions, kv_length
    )


def paged_decode_attention_ref(q, k_pages, v_pages, page_tables, kv_lengths):
    """One query per lane: q [B, Hq, D], page_tables [B, max_pages], kv_lengths [B] -> [B, Hq, D] f32.

    The query of lane b sits at position kv_lengths[b] - 1 (its own key is already written).
    """

    def one(q_b, table, length):
        return paged_attention_ref(q_b[None], k_pages, v_pages, table, (length - 1)[None], length)[0]

    return jax.vmap(one)(q, page_tables, kv_lengths)


def moe_router_logits(x, router_w):
    """x [T, H], router_w [E, H] -> float32 logits [T, E] (the router's matmul, in float32).

    Products of bf16 values are exact in float32, so float32 accumulation of the bf16 operands computes what
    converting them first would; written as a contraction over both operands' H, so XLA reads the weights as they
    are (a converted, transposed copy of the router cost a kernel per MoE layer in a decode round)."""
    return jnp.einsum("th,eh->te", x, router_w, preferred_element_type=jnp.float32)


def shared_expert_gate(x, gate_w):
    """x [T, H], gate_w [H, 1] -> the shared expert's weight per token [T] float32: sigmoid of the gate's
    projection, rounded to x's dtype as the model's matmul output is."""
    return jax.nn.sigmoid(jnp.dot(x, gate_w, preferred_element_type=x.dtype)[:, 0].astype(jnp.float32))


def moe_route_ref(x, router_w, top_k: int):
    """Softmax router, top-k, renormalised.

    Args: x [T, H]; router_w [E, H]. Returns (expert ids [T, K] int32, weights [T, K] float32).
    """
    return moe_route_logits_ref(moe_router_logits(x, router_w), top_k)


def moe_route_logits_ref(logits, top_k: int):
    """The router after its matmul: float32 logits [T, E] -> (ids [T, K] int32, renormalised weights [T, K])."""
    weights, ids = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), top_k)
    return ids.astype(jnp.int32), weights / jnp.sum(weights, axis=-1, keepdims=True)


class SharedExpert(NamedTuple):
    """An MoE layer's shared expert, which every token takes: gate_up [H, 2I] (gate columns first), down [I, H],
    and its weight per token [T] float32 (the model's sigmoid gate)."""

    gate_up: jax.Array
    down: jax.Array
    weight: jax.Array


def moe_experts_ref(x, expert_ids, expert_weights, gate_up, down, shared: SharedExpert | None = None):
    """Routed experts: sum_k w_k * down_e(silu(gate_e x) * up_e x), e = expert_ids[:, k]; plus, when given, the
    shared expert's output times its weight.

    Args:
      x: [T, H]; expert_ids, expert_weights: [T, K]; gate_up: [E, H, 2I] (gate columns first);
      down: [E, I, H]; shared: SharedExpert or None.
    Returns:
      [T, H] float32.
    """
    inter = down.shape[1]
    xf = x.astype(jnp.float32)
    gu = jnp.einsum("th,tkhi->tki", xf, gate_up[expert_ids].astype(jnp.float32))
    act = jax.nn.silu(gu[..., :inter]) * gu[..., inter:]
    out = jnp.einsum("tki,tkih->tkh", act, down[expert_ids].astype(jnp.float32))
    out = jnp.einsum("tkh,tk->th", out, expert_weights.astype(jnp.float32))
    if shared is None:
        return out
    return out + shared_expert_ref(x, shared)


def shared_expert_ref(x, shared: SharedExpert):
    """weight_t * down(silu(gate x_t) * up x_t) for every token, float32 [T, H]."""
    inter = shared.down.shape[0]
    gu = jnp.dot(x.astype(jnp.float32), shared.gate_up.astype(jnp.float32))
    act = jax.nn.silu(gu[:, :inter]) * gu[:, inter:]
    return jnp.dot(act, shared.down.astype(jnp.float32)) * shared.weight.astype(jnp.float32)[:, None]


def gdn_naive_f64(q, k, v, g, beta, state, record_states: bool = False):
    """Float64 numpy oracle of the gated delta rule, token by token (the tests' ground truth).

    Same arguments as `gdn_recurrent_ref` (numpy or jax arrays; computed in numpy float64).
    Returns (o [T, Hv, Dv], final state [Hv, Dk, Dv]) and, with record_states, also the states
    [T + 1, Hv, Dk, Dv]: entry t is the state after tokens [0, t).
    """
    import numpy as np

    f64 = lambda x: np.asarray(x, dtype=np.float64)  # noqa: E731
    q, k, v, g, beta, s = (f64(x) for x in (q, k, v, g, beta, state))
    hv = v.shape[1]
    q, k = (np.repeat(x, hv // x.shape[1], axis=1) for x in (q, k))
    o = np.zeros(v.shape, np.float64)
    states = [s.copy()] if record_states else None
    for t in range(v.shape[0]):
        s = s * np.exp(g[t])[:, None, None]
        kv_mem = np.einsum("hkv,hk->hv", s, k[t])
        s = s + k[t][:, :, None] * ((v[t] - kv_mem) * beta[t][:, None])[:, None, :]
        o[t] = np.einsum("hkv,hk->hv", s, q[t])
        if record_states:
            states.append(s.copy())
    if record_states:
        return o, s, np.stack(states)
    return o, s
