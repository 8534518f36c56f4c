"""The model's hot operations, dispatched to the Pallas kernels or to the jnp references by one switch.

Every function here works on the engine's preallocated device state: per-layer KV page pools
`[P, 64, Hkv, D]` and per-layer GDN state pools `[S, Hv, Dk, Dv]` (float32), indexed by page tables and
slot ids. They are pure: pools go in, updated pools come out (the jitted step donates them).

`KernelConfig` is a static argument of every jitted step: backend "reference" runs
`pallas_kernels.reference`; backend "pallas" runs the Pallas kernels (GPU, or CPU with interpret=True).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Literal

import jax
import jax.numpy as jnp
from jax import lax

from ninfer_jax.model.params import ConcatWeight, MoEParams, QuantizedWeight
from pallas_kernels import fp8_gemm, fp8_matmul
from pallas_kernels import reference as ref

if TYPE_CHECKING:  # the kernels' module is imported where a kernel runs, not by the reference path
    from pallas_kernels.paged_attention import PrefillConfig
    from ninfer_jax.model.spmd import Spmd

PAGE = ref.PAGE

# XLA's GPU compiler rewrites a vector x matrix dot into multiply + reduce (its DotStrengthReduction pass) when
# (N + 1) x K is under this many elements.
_XLA_GEMV_REWRITE_ELEMENTS = 10_000_000


def xla_rewrites_one_row(w_shape) -> bool:
    """Whether XLA would run one row x w [K, N] as multiply + reduce (the model then hands it two rows instead)."""
    return (w_shape[1] + 1) * w_shape[0] < _XLA_GEMV_REWRITE_ELEMENTS


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Which implementation runs the hot operations (hashable: a static jit argument)."""

    backend: Literal["reference", "pallas"] = "reference"
    interpret: bool = False  # Pallas interpret mode (CPU tests)
    prefill_attention: PrefillConfig | None = None  # the Pallas prefill attention's config; None: its default
    # GDN decode between the projections as one kernel (pallas_kernels/gdn_decode_layer.py); the engine turns it on
    # with the pallas backend
    fuse_gdn_decode: bool = False
    # Residual add + RMSNorm of up to `DECODE_MAX_ROWS` rows as one kernel (pallas_kernels/rms_norm.py); the engine
    # turns it on with the pallas backend
    fuse_add_norm: bool = False
    # The MoE router's softmax, top-k and renormalisation of up to `DECODE_MAX_ROWS` rows as one kernel
    # (pallas_kernels/moe_route.py), or at one or two lanes inside the experts' first kernel, with the logits from the
    # norm before (`moe_routed_experts`, `router_for`); the engine turns it on with the pallas backend
    fuse_moe_route: bool = False
    # The attention mixer's decode between its qkv projection and the attention kernel (q/k norms, RoPE, the KV
    # writes) as one kernel (pallas_kernels/attn_decode_qkv.py); the engine turns it on with the pallas backend
    fuse_attn_qkv: bool = False
    # The GDN mixer's prefill between its in-projection and the chunked delta rule (the causal conv, the key heads'
    # norms, the padding's zeros) as one kernel (pallas_kernels/gdn_conv.py); the engine turns it on with the pallas
    # backend
    fuse_gdn_conv: bool = False
    # A one-lane decode round's GDN out-projection with its gated norm inside, on bf16 or float32 weights
    # (pallas_kernels/gdn_out_proj.py: two kernels a layer in place of four); `gdn_out_fused` decides where; the engine
    # turns it on with the pallas backend
    fuse_gdn_out: bool = False
    # Attention decode's split combine and output gate as one kernel (`paged_attention.paged_decode_attention_gated`),
    # at one lane writing the out-projection's doubled row too (`attention_decode_gated`); the engine turns it on with
    # the pallas backend (docs/kernels_notes.md)
    fuse_attn_out: bool = False
    # The fused GDN decode step writing the FP8 rows of an FP8 x FP8 out-projection itself (`gdn_fp8_rows`): the
    # 35B-A3B's FP8-dynamic rounds 0.989x / 0.987x at 8 / 64 lanes on an H100 (docs/kernels_notes.md); the engine
    # turns it on with the pallas backend
    fuse_gdn_fp8_rows: bool = False
    # Attention decode's merge kernel (fuse_attn_out) writing the FP8 rows of an FP8 x FP8 out-projection itself
    # (`attention_decode_gated`): no quantization kernels between them, the 35B-A3B's FP8-dynamic rounds 0.998x /
    # 0.997x at 8 / 64 lanes on an H100 (docs/kernels_notes.md); the engine turns it on with the pallas backend
    fuse_attn_fp8_rows: bool = False
    # A block-FP8 product run in K ranges (the FP8 GEMM at a wide decode round's rows) that goes straight to the add +
    # norm kernel leaves its float32 partial sums for that kernel to add (`PartialSums`), not for a reduction kernel
    # of XLA's between them: FP8-dynamic rounds 0.993x (27B, 64 and 128 lanes) and 0.998x (35B-A3B, 64) on an H100
    # (docs/kernels_notes.md); the engine turns it on with the pallas backend
    fuse_partial_sums: bool = False
    # Block-FP8 weights: the rows quantized to FP8 per token and 128-group for an FP8 x FP8 product, a decode
    # round's 2-32 rows (pallas_kernels/fp8_matmul.py) and on a Hopper GPU a prefill chunk's (fp8_gemm.py); the
    # engine turns it on with fp8_activations "dynamic"
    fp8_activations: bool = False
    # Tensor / expert parallel: the mesh the model's explicit SPMD blocks run on (model/spmd.py); the runner sets it
    # from its layout. None: one device.
    spmd: Spmd | None = None

    def __post_init__(self):
        if self.backend not in ("reference", "pallas"):
            raise ValueError(f"KernelConfig.backend must be 'reference' or 'pallas', got {self.backend!r}")
        for flag in ("fuse_gdn_decode", "fuse_add_norm", "fuse_moe_route", "fuse_attn_qkv", "fuse_gdn_conv",
                     "fuse_gdn_out", "fuse_attn_out", "fuse_gdn_fp8_rows", "fuse_attn_fp8_rows", "fuse_partial_sums"):
            if getattr(self, flag) and self.backend != "pallas":
                raise ValueError(f"KernelConfig.{flag} needs the pallas backend (it has no reference of its own)")

    def without_host_loops(self) -> KernelConfig:
        """This config with the prefill attention in the Pallas kernel where it is cuDNN's, for a step that runs
        beside a decode round: cuDNN's form loops over the prefix's segments in an XLA while loop, whose trip count
        the GPU runtime reads back on the host before it launches the rest of the step, so the launching thread
        would wait for the device to reach every attention layer (the round's tokens read late, the device idle
        between launches: `docs/benchmarks/arrivals.md`)."""
        pa = self.prefill_attention
        if pa is None or pa.impl != "cudnn":
            return self
        return dataclasses.replace(self, prefill_attention=dataclasses.replace(pa, impl="pallas"))


REFERENCE = KernelConfig()


def gdn_prefill(kc: KernelConfig, q, k, v, g, beta, state_pool, slot, base, tap_positions, tap_slots):
    """Chunked gated delta rule for one lane's chunk, state read from and written to `state_pool[slot]`.

    Args:
      q, k: [T, Hk, Dk] (normalised, q scaled); v: [T, Hv, Dv]; g, beta: [T, Hv]. Tokens the caller
        wants ignored (bucket padding) must be identity tokens (k = v = g = beta = 0).
      state_pool: [S, Hv, Dk, Dv] float32. slot: int32 scalar.
      base: int32 scalar, absolute position of the chunk's first token.
      tap_positions: [M] int32 absolute 64-aligned positions in (base, base + T], or -1 for none;
        tap_slots: [M] int32 snapshot slots receiving the state after each tap position.
    Returns:
      (o [T, Hv, Dv] in v's dtype, updated state_pool).
    """
    if kc.backend == "pallas":
        from pallas_kernels import gdn_chunk

        return gdn_chunk.chunk_gated_delta_rule(
            q, k, v, g, beta, state_pool, slot, base, tap_positions, tap_slots, interpret=kc.interpret
        )
    return gdn_prefill_reference(q, k, v, g, beta, state_pool, slot, base, tap_positions, tap_slots)


def gdn_prefill_reference(q, k, v, g, beta, state_pool, slot, base, tap_positions, tap_slots):
    t = v.shape[0]
    # Phase alignment (spec §7.2) with a traced base: place the tokens at offset phase = base % 64 in a
    # buffer of 63 + T identity tokens, so padded index j holds absolute position base - phase + j and
    # every chunk boundary of the grid is an absolute multiple of 64. Identity tokens leave the state
    # bit-for-bit unchanged.
    phase = jnp.mod(base, PAGE)

    def place(x):
        padded = jnp.zeros((PAGE - 1 + t,) + x.shape[1:], x.dtype)
        return jax.lax.dynamic_update_slice_in_dim(padded, x, phase, axis=0)

    o, final, chunk_states = ref.gdn_chunked_ref(
        *(place(x) for x in (q, k, v, g, beta)), state_pool[slot], return_chunk_states=True
    )
    o = jax.lax.dynamic_slice_in_dim(o, phase, t, axis=0).astype(v.dtype)
    state_pool = state_pool.at[slot].set(final)
    # Chunk i of the grid ends after absolute position base - phase + 64 (i + 1) (exclusive).
    chunk_end = base - phase + PAGE * (jnp.arange(chunk_states.shape[0]) + 1)
    for j in range(tap_positions.shape[0]):
        p = tap_positions[j]
        idx = jnp.clip((p - (base - phase)) // PAGE - 1, 0, chunk_states.shape[0] - 1)
        valid = (p > base) & (p <= base + t) & (chunk_end[idx] == p)
        target = jnp.where(valid, tap_slots[j], state_pool.shape[0])  # out of range: dropped
        state_pool = state_pool.at[target].set(chunk_states[idx], mode="drop")
    return o, state_pool


def gdn_decode(kc: KernelConfig, q, k, v, g, beta, state_pool, slots):
    """One token for each of B lanes: q, k [B, Hk, Dk]; v [B, Hv, Dv]; g, beta [B, Hv]; slots [B].

    Lanes with nothing to decode pass identity tokens. Slots must be distinct.
    Returns (o [B, Hv, Dv] float32, updated state_pool).
    """
    if kc.backend == "pallas":
        from pallas_kernels import gdn_decode as kernel

        return kernel.gdn_decode(q, k, v, g, beta, state_pool, slots, interpret=kc.interpret)
    states = state_pool[slots]

    def one(q_b, k_b, v_b, g_b, b_b, s_b):
        o, s = ref.gdn_recurrent_ref(q_b[None], k_b[None], v_b[None], g_b[None], b_b[None], s_b)
        return o[0], s

    o, states = jax.vmap(one)(q, k, v, g, beta, states)
    return o, state_pool.at[slots].set(states)


def gdn_decode_layer(kc: KernelConfig, proj, active, hist_pool, conv_w, a_log, dt_bias, norm_w, state_pool, slots, *,
                     num_key_heads: int, eps: float, gates=None, norm: bool = True, fp8_out: bool = False):
    """The fused GDN decode step (kc.fuse_gdn_decode): the in-projection's output [B, C + Hv Dv + 2 Hv] (qkv, z, b,
    a; or b and a apart in gates [B, 2 Hv]) -> gated-norm outputs [B, Hv, Dv] (norm False: the delta rule's, before
    the norm; fp8_out: as FP8 rows and their scales, `gdn_fp8_rows`), the state pool and the history pool with the
    lanes' new conv histories, both updated in place (slots distinct)."""
    from pallas_kernels import gdn_decode_layer as kernel

    return kernel.gdn_decode_layer(proj, active, hist_pool, conv_w, a_log, dt_bias, norm_w, state_pool, slots,
                                   num_key_heads=num_key_heads, eps=eps, interpret=kc.interpret, gates=gates,
                                   norm=norm, fp8_out=fp8_out, into_pool=True)


def gdn_fp8_rows(kc: KernelConfig, lanes: int, value_head_dim: int, out_proj) -> bool:
    """Whether a decode round's fused GDN step writes its output as the FP8 rows the out-projection multiplies
    (kc.fuse_gdn_fp8_rows; `takes_fp8_rows`; a value head of 128 one quantization group): no quantization kernels
    between them. Not on a mesh (its blocks run per device on bf16 rows)."""
    return (kc.fuse_gdn_fp8_rows and kc.fuse_gdn_decode and kc.spmd is None and value_head_dim == fp8_matmul.BLOCK
            and takes_fp8_rows(kc, lanes, out_proj))


def gdn_rows_layer(kc: KernelConfig, proj, rows, hist_pool, conv_w, a_log, dt_bias, norm_w, state_pool, slots, *,
                   num_key_heads: int, eps: float, write_state: bool, into_pool: bool = False):
    """`gdn_decode_layer` over T rows a lane in order (proj [B, T, P]; the first rows[b] count): y [B, T, Hv, Dv],
    the conv histories after those rows (into_pool, with write_state: the history pool with them written at the
    distinct slots), and with write_state the state pool with their updates."""
    from pallas_kernels import gdn_decode_layer as kernel

    return kernel.gdn_rows_layer(proj, rows, hist_pool, conv_w, a_log, dt_bias, norm_w, state_pool, slots,
                                 num_key_heads=num_key_heads, eps=eps, write_state=write_state,
                                 interpret=kc.interpret, into_pool=into_pool)


def attn_decode_qkv(kc: KernelConfig, proj, q_norm, k_norm, inv_freq, positions, page_tables, active, k_pages,
                    v_pages, cfg, rope_positions=None):
    """The fused attention decode step up to the attention kernel (kc.fuse_attn_qkv): the qkv projection's output
    [B, Hq 2D + 2 Hkv D] -> (normalised, rotated q [B, Hq, D], the pools with each active lane's new key and value
    written, quantized for a quantized pool); None when the rows exceed DECODE_MAX_ROWS or the kernel does not take
    the head shapes."""
    if not kc.fuse_attn_qkv or proj.shape[0] > DECODE_MAX_ROWS:
        return None
    from pallas_kernels import attn_decode_qkv as kernel

    if not kernel.supported(cfg.head_dim, cfg.rotary_dim, k_pages):
        return None
    return kernel.attn_decode_qkv(proj, q_norm, k_norm, jnp.asarray(inv_freq), positions, page_tables, active,
                                  k_pages, v_pages, rope_positions, num_heads=cfg.num_attention_heads,
                                  num_kv_heads=cfg.num_key_value_heads, rotary_dim=cfg.rotary_dim,
                                  eps=cfg.rms_norm_eps, interpret=kc.interpret)


def gdn_conv_prefill(kc: KernelConfig, proj, history, conv_w, n_valid, cfg):
    """The fused GDN prefill step up to the delta rule (kc.fuse_gdn_conv): the in-projection's output [T, P] and the
    conv history [K-1, C] -> (q, k [T, Hk, Dk] normalised, v [T, Hv, Dv], in proj's dtype), rows at or past n_valid
    zero; None when off or the kernel does not take the head shapes."""
    if not kc.fuse_gdn_conv:
        return None
    from pallas_kernels import gdn_conv as kernel

    if not kernel.supported(cfg.linear_key_head_dim, cfg.linear_value_head_dim):
        return None
    return kernel.gdn_conv_prefill(proj, history, conv_w, n_valid, num_key_heads=cfg.linear_num_key_heads,
                                   key_head_dim=cfg.linear_key_head_dim, num_value_heads=cfg.linear_num_value_heads,
                                   value_head_dim=cfg.linear_value_head_dim, interpret=kc.interpret)


# The small-row kernels (add + norm, router) take up to this many rows: decode rounds. A prefill chunk's rows stay
# XLA's (bandwidth-bound there, no launch to save).
DECODE_MAX_ROWS = 64


@functools.partial(jax.tree_util.register_dataclass, data_fields=["rows", "xq", "xs"], meta_fields=["dtype"])
@dataclasses.dataclass(frozen=True)
class Fp8Rows:
    """A norm's rows with their FP8 quantization (`fp8_matmul.quantize_rows`' layout), written by one kernel for
    the FP8 x FP8 products that read them (`add_rms_norm`'s fp8_rows). rows: the rows in the activations' dtype,
    None where nothing reads them. `quantized_dot` and `moe_experts` take either form."""

    rows: jax.Array | None
    xq: jax.Array
    xs: jax.Array
    dtype: jnp.dtype  # the activations' (the products' output)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["parts"], meta_fields=["dtype"])
@dataclasses.dataclass(frozen=True)
class PartialSums:
    """A product's K ranges' float32 partial sums [S, R, N] (`fp8_gemm.fp8_gemm_rows`' partial_sums), on their way
    to the add + norm kernel, which adds them itself (`add_rms_norm`); `summed` is the product."""

    parts: jax.Array
    dtype: jnp.dtype  # the product's

    def summed(self):
        return fp8_matmul.sum_partials(self.parts, self.dtype)


def summed(h):
    """A block's output as an array: `PartialSums` added, anything else as it is."""
    return h.summed() if isinstance(h, PartialSums) else h


@functools.partial(jax.tree_util.register_dataclass, data_fields=["rows", "logits"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class RoutedRows:
    """A norm's rows with the MoE router's float32 logits [R, E] against them, written by one kernel
    (`router_for`); `moe_routed_experts` takes them instead of computing the logits."""

    rows: jax.Array
    logits: jax.Array


@functools.partial(jax.tree_util.register_dataclass, data_fields=["o", "z_source", "norm_w"],
                   meta_fields=["z_col", "eps"])
@dataclasses.dataclass(frozen=True)
class GatedRows:
    """The GDN's delta-rule output o [R, Hv, Dv] before its gated norm, with what the norm reads (z at column z_col
    of the in-projection's output z_source, norm_w, eps), for an out-projection that normalizes it itself
    (`gdn_out_fused`, `gated_rows_dot`)."""

    o: jax.Array
    z_source: jax.Array
    norm_w: jax.Array
    z_col: int
    eps: float


def gdn_out_fused(kc: KernelConfig, rows: int, hv: int, dv: int, w) -> bool:
    """Whether a decode round's GDN step of `rows` rows (the fused decode kernel's) hands its out-projection w the
    un-normed `GatedRows`: with kc.fuse_gdn_out, one row (more re-read w per row: XLA's matmul is better), a plain
    weight the kernel holds, and one XLA would run as the doubled-row matmul (a 35B-A3B one-lane round 1.4% shorter
    on an H100; against the 27B's one-row cuBLAS call the kernel made the round 0.7% longer: docs/kernels_notes.md).
    A mixed step's decode rows share the out-projection with its chunk's: never."""
    if not (kc.fuse_gdn_out and kc.fuse_gdn_decode and rows == 1 and kc.spmd is None and isinstance(w, jax.Array)
            and xla_rewrites_one_row(w.shape)):
        return False
    from pallas_kernels import gdn_out_proj

    return gdn_out_proj.supported((rows, hv, dv), w.shape)


def gated_rows_dot(kc: KernelConfig, x: GatedRows, w):
    """x's gated norm @ w as one kernel (pallas_kernels/gdn_out_proj.py), in o's dtype."""
    from pallas_kernels import gdn_out_proj

    return gdn_out_proj.gdn_out_proj(x.o, x.z_source, x.norm_w, w, z_col=x.z_col, eps=x.eps,
                                     interpret=kc.interpret)


def add_rms_norm(kc: KernelConfig, x, h, w, eps: float, fp8_rows: str | None = None, router_w=None):
    """The residual add and RMSNorm as one kernel when kc.fuse_add_norm, x [R, H] has R <= DECODE_MAX_ROWS and the
    kernel holds H (`rms_norm.supported`); None otherwise (the caller composes them). Returns (x + h, its norm) (h
    None: x, its norm). fp8_rows (`fp8_rows_for`, any row count): the kernel writes the norm's FP8 rows too and the
    norm comes as `Fp8Rows`, with its bf16 rows ("with_rows") or without them ("only"). router_w (`router_for`):
    the kernel computes the router's logits too and the norm comes as `RoutedRows`."""
    if not kc.fuse_add_norm:
        return None
    from pallas_kernels import rms_norm as kernel

    h = h.parts if isinstance(h, PartialSums) else h  # each kernel adds them itself

    if router_w is not None and fp8_rows is None and kernel.router_supported(x, router_w):
        x, rows, logits = kernel.add_rms_norm_router(x, h, w, router_w, eps=eps, interpret=kc.interpret)
        return x, RoutedRows(rows, logits)
    if fp8_rows is not None and kernel.fp8_supported(x):
        x, rows, xq, xs = kernel.add_rms_norm_fp8(x, h, w, eps=eps, with_rows=fp8_rows == "with_rows",
                                                  interpret=kc.interpret)
        return x, Fp8Rows(rows, xq, xs, x.dtype)
    if x.shape[0] > DECODE_MAX_ROWS:
        return None
    return kernel.add_rms_norm(x, h, w, eps=eps, interpret=kc.interpret) if kernel.supported(x) else None


def fp8_rows_for(kc: KernelConfig, rows: int, consumer, top_k: int = 0) -> str | None:
    """What a norm of `rows` rows writes for the block that reads it first, `consumer`: a projection's weight, or an
    MoE layer's params (top_k its experts a token). "only": FP8 rows (a block-FP8 weight whose product takes them,
    `takes_fp8_rows`); "with_rows": FP8 rows and the bf16 ones (an in-projection with an unquantized part, the GDN's
    [b | a]; an MoE layer whose experts read FP8 rows, `moe.reads_fp8_rows`, its router bf16); None:
    the bf16 rows alone. Not on a mesh (its blocks run per device on the bf16 rows)."""
    if not kc.fuse_add_norm or kc.spmd is not None:
        return None
    if isinstance(consumer, MoEParams):
        experts = consumer.gate_up
        if not (isinstance(experts, QuantizedWeight) and kc.backend == "pallas" and kc.fp8_activations):
            return None
        from pallas_kernels import moe

        num_experts, hidden, inter = experts.values.shape[0], experts.values.shape[2], experts.values.shape[1] // 2
        return "with_rows" if moe.reads_fp8_rows(rows * top_k, num_experts, hidden, inter, kc.interpret) else None
    first = consumer.parts[0] if isinstance(consumer, ConcatWeight) else consumer
    if not takes_fp8_rows(kc, rows, first):
        return None
    return "only" if isinstance(consumer, QuantizedWeight) else "with_rows"


def plain_rows(x):
    """x's bf16 rows, whether x is an array, `Fp8Rows` that kept them or `RoutedRows`."""
    return x.rows if isinstance(x, (Fp8Rows, RoutedRows)) else x


def router_for(kc: KernelConfig, rows: int, consumer, top_k: int = 0):
    """The router weight [E, H] a norm of `rows` rows computes the logits of, for the block that reads it: an MoE
    layer that `moe_routed_experts` takes (a one-lane round's); None otherwise, and on a mesh."""
    if not (kc.fuse_add_norm and kc.spmd is None and isinstance(consumer, MoEParams)
            and _routes_in_gemv(kc, rows, consumer.router, top_k, consumer.down, consumer.shared.down)):
        return None
    return consumer.router


def _routes_in_gemv(kc: KernelConfig, tokens: int, router_w, top_k: int, down, shared_down) -> bool:
    """Whether an MoE layer of `tokens` rows runs as `moe.moe_experts_routed` (logical [E, I, H] / [I, H] shapes of
    down, plain or FP8)."""
    if not (kc.fuse_moe_route and kc.backend == "pallas"):
        return False
    from pallas_kernels import moe

    num_experts, hidden = router_w.shape
    return moe.routes_in_gemv(tokens, num_experts, top_k, hidden, down.shape[-2],
                              None if shared_down is None else shared_down.shape[0])


def moe_route(kc: KernelConfig, x, router_w, top_k: int, shared_gate_w=None):
    """The MoE router and the shared expert's gate: x [T, H], router_w [E, H], shared_gate_w [H, 1] or None ->
    (expert ids [T, K] int32, weights [T, K] float32 renormalised, the shared expert's weight [T] float32 or None).
    With kc.fuse_moe_route, up to DECODE_MAX_ROWS rows and power-of-two E, K and H, everything after the logits
    matmul is one kernel."""
    logits = ref.moe_router_logits(x, router_w)
    if kc.fuse_moe_route and x.shape[0] <= DECODE_MAX_ROWS:
        from pallas_kernels import moe_route as kernel

        if kernel.supported(logits, top_k, None if shared_gate_w is None else x):
            out = kernel.route(logits, x, shared_gate_w, top_k=top_k, interpret=kc.interpret)
            return out if shared_gate_w is not None else (*out, None)
    gate = None if shared_gate_w is None else ref.shared_expert_gate(x, shared_gate_w)
    return (*ref.moe_route_logits_ref(logits, top_k), gate)


def attention_prefill(kc: KernelConfig, q, k_pages, v_pages, page_table, base):
    """Queries at absolute positions [base, base + T) attend causally over the lane's pages.

    The chunk's own keys are already written into the pages. q: [T, Hq, D]; page_table [max_pages].
    Returns [T, Hq, D] float32.
    """
    if kc.backend == "pallas":
        from pallas_kernels import paged_attention

        return paged_attention.paged_prefill_attention(
            q, k_pages, v_pages, page_table, base, interpret=kc.interpret, config=kc.prefill_attention
        )
    t = q.shape[0]
    positions = base + jnp.arange(t, dtype=jnp.int32)
    return ref.paged_attention_ref(q, k_pages, v_pages, page_table, positions, base + t)


def attention_decode(kc: KernelConfig, q, k_pages, v_pages, page_tables, kv_lengths):
    """One query per lane (at position kv_lengths - 1) over its pages. Returns [B, Hq, D] float32."""
    if kc.backend == "pallas":
        from pallas_kernels import paged_attention

        return paged_attention.paged_decode_attention(
            q, k_pages, v_pages, page_tables, kv_lengths, interpret=kc.interpret
        )
    return ref.paged_decode_attention_ref(q, k_pages, v_pages, page_tables, kv_lengths)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["rows"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class DoubledRow:
    """One lane's out-projection input written twice by its kernel [2, K]: `qwen3_5.dot`'s two-row matmul for a
    weight XLA would run one row of as multiply + reduce, without the concatenate that doubles it."""

    rows: jax.Array


def attention_decode_gated(kc: KernelConfig, q, k_pages, v_pages, page_tables, kv_lengths, proj, out_w):
    """With kc.fuse_attn_out, each lane's attention times sigmoid(gate) [B, Hq D] in proj's dtype as one kernel after
    the attention's, the gate read in place from the qkv projection's output proj (head h's query then its gate, D
    columns each, `qwen3_5._attn_split`); one lane whose out-projection out_w XLA would run as multiply + reduce gets
    it as `DoubledRow`; with kc.fuse_attn_fp8_rows an out_w that multiplies FP8 rows (`takes_fp8_rows`) gets them as
    `Fp8Rows`. None otherwise (and on a mesh)."""
    if not (kc.fuse_attn_out and kc.spmd is None):
        return None
    from pallas_kernels import paged_attention

    lanes, _, d = q.shape
    doubled = lanes == 1 and isinstance(out_w, jax.Array) and xla_rewrites_one_row(out_w.shape)
    fp8_out = kc.fuse_attn_fp8_rows and d % fp8_matmul.BLOCK == 0 and takes_fp8_rows(kc, lanes, out_w)
    y = paged_attention.paged_decode_attention_gated(q, k_pages, v_pages, page_tables, kv_lengths, proj, gate_col=d,
                                                     gate_stride=2 * d, copies=2 if doubled else 1, fp8_out=fp8_out,
                                                     interpret=kc.interpret)
    if fp8_out:
        return Fp8Rows(None, *y, proj.dtype)
    return DoubledRow(y) if doubled else y


def is_quantized(w) -> bool:
    """Whether a weight is an FP8 checkpoint's kind (read through `quantized_dot` / `dequantize`)."""
    return isinstance(w, (QuantizedWeight, ConcatWeight))


def dequantize(w):
    """A weight of any kind -> a plain float32 array [..., K, N] (x @ w layout)."""
    if isinstance(w, ConcatWeight):
        return jnp.concatenate([dequantize(p) for p in w.parts], axis=-1)
    if not isinstance(w, QuantizedWeight):
        return w.astype(jnp.float32)
    return fp8_matmul.dequantize(block_fp8(w))


def block_fp8(w: QuantizedWeight) -> fp8_matmul.BlockFp8:
    """A QuantizedWeight as [..., N, K] values and their scales (a blocked weight's values laid back)."""
    return fp8_matmul.BlockFp8(fp8_matmul.unblocked(w.values) if w.blocked else w.values, w.scales)


def kernel_layout(params, blocked: bool = True):
    """params with each dense block-FP8 weight of whole blocks `blocked` (`fp8_matmul.blocked`: the Pallas kernels
    stream it 1.05-1.15x faster, docs/kernels_notes.md), or with blocked False laid back [N, K]; each converted in
    place of the old one (donated). MoE layers stay as they are: their kernels read experts and the shared expert
    [N, K]."""
    layout = jax.jit(fp8_matmul.blocked if blocked else fp8_matmul.unblocked, donate_argnums=0)

    def convert(node):
        if (isinstance(node, QuantizedWeight) and node.blocked != blocked and (node.blocked or node.values.ndim == 2)
                and fp8_matmul.supported(*node.shape)):
            return node.replace(values=layout(node.values), blocked=blocked)
        return node

    return jax.tree.map(convert, params, is_leaf=lambda n: isinstance(n, (QuantizedWeight, MoEParams)))


def quantized_dot(kc: KernelConfig, x, w, to_norm: bool = False):
    """x [R, K] @ w for a QuantizedWeight or ConcatWeight, in x's dtype with float32 accumulation; x may be
    `Fp8Rows`, whose FP8 rows an FP8 x FP8 product reads. to_norm: the product goes straight to `add_rms_norm`
    (`qwen3_5.dot`'s), so it may come as `PartialSums`.

    The reference dequantizes to float32. The pallas backend reads the FP8 weight directly for a decode round's rows
    (pallas_kernels/fp8_matmul.py: up to 128 weight-only, 32 FP8 x FP8). More rows, with fp8_activations on a Hopper
    GPU: the FP8 x FP8 wgmma GEMM (pallas_kernels/fp8_gemm.py, 1.3-1.7x the dequantized matmul at 2048-8192 rows,
    at the activations' quantization error); otherwise the weight dequantized to x's dtype for XLA's matmul
    (docs/kernels_notes.md, "FP8 weights")."""
    if isinstance(w, ConcatWeight):  # the model keeps the GDN in-projection's sides apart (`qwen3_5._gdn_in_dot`)
        return jnp.concatenate([quantized_dot(kc, x, p) for p in w.parts], axis=-1)
    rows = x.xq.shape[0] if isinstance(x, Fp8Rows) else x.shape[0]
    if takes_fp8_rows(kc, rows, w):  # x's rows in FP8: as their producer wrote them (`Fp8Rows`), or quantized here
        fp8 = x if isinstance(x, Fp8Rows) else Fp8Rows(None, *fp8_matmul.quantize_rows(x), x.dtype)
        if rows <= fp8_matmul.DEFAULT_CONFIG.rows_limit(True):
            return fp8_matmul.fp8_matmul_rows(fp8.xq, fp8.xs, w.values, w.scales, out_dtype=fp8.dtype,
                                              interpret=kc.interpret)
        return _gemm_rows(kc, fp8.xq, fp8.xs, w, fp8.dtype, to_norm)
    x = plain_rows(x)
    if not isinstance(w, QuantizedWeight):  # an unquantized part, multiplied as the model's `dot` does
        return jnp.dot(x, w, preferred_element_type=x.dtype)
    if kc.backend != "pallas":
        return jnp.dot(x.astype(jnp.float32), dequantize(w), preferred_element_type=jnp.float32).astype(x.dtype)
    k, n = w.shape
    if x.shape[0] <= fp8_matmul.DEFAULT_CONFIG.rows_limit(kc.fp8_activations) and fp8_matmul.supported(k, n):
        return fp8_matmul.fp8_matmul(x, w.values, w.scales, interpret=kc.interpret)  # weight-only
    return dequantized_dot(x, w)


def takes_fp8_rows(kc: KernelConfig, rows: int, w) -> bool:
    """Whether `quantized_dot` multiplies rows of x @ w in FP8 x FP8, quantizing x per token and 128-group: the
    swap-AB kernels' 2-32 decode rows, or the wgmma GEMM's."""
    if not isinstance(w, QuantizedWeight) or kc.backend != "pallas" or not kc.fp8_activations:
        return False
    k, n = w.shape
    cfg = fp8_matmul.DEFAULT_CONFIG
    if rows <= cfg.rows_limit(True) and fp8_matmul.supported(k, n):
        return rows > cfg.cuda_core_max_rows
    return _takes_gemm(kc, rows, w)


def _takes_gemm(kc: KernelConfig, rows: int, w) -> bool:
    """Whether rows of x @ w run on the FP8 x FP8 wgmma GEMM: more rows than the decode kernels take,
    fp8_activations, a Hopper GPU."""
    if not isinstance(w, QuantizedWeight) or kc.backend != "pallas" or not kc.fp8_activations:
        return False
    k, n = w.shape
    return (rows > fp8_matmul.DEFAULT_CONFIG.rows_limit(True) or not fp8_matmul.supported(k, n)) and (
        fp8_gemm.supported(k, n) and fp8_gemm.available())


def gated_norm_dot(kc: KernelConfig, core, z, norm_w, eps: float, w, z_source=None):
    """The GDN out-projection of its gated norm (core, z [T, Hv, Dv]) with the norm writing its rows quantized
    straight for the FP8 GEMM (pallas_kernels/fp8_rows.py) when w takes the GEMM and a value head is one
    quantization group; None otherwise (the caller composes the norm and `quantized_dot`). z_source: (the array z
    was sliced from, z's first column), for the kernel to read z in place rather than a copy of it."""
    from pallas_kernels import fp8_rows

    if not _takes_gemm(kc, z.shape[0], w) or not fp8_rows.norm_supported(z.shape[-1]):
        return None
    zz, col = z_source or (z, 0)
    xq, xs = fp8_rows.gated_rms_norm_fp8(core, zz, norm_w, eps=eps, z_col=col)
    return _gemm_rows(kc, xq, xs, w, z.dtype, to_norm=True)


def swiglu_dot(kc: KernelConfig, gu, w):
    """The MLP's down-projection of silu(gate) * up (gu [T, 2I]) with the product written as FP8 rows straight for
    the FP8 GEMM (pallas_kernels/fp8_rows.py) when w takes the GEMM; None otherwise (the caller composes). The
    product goes to the add + norm (`_gemm_rows`' to_norm)."""
    from pallas_kernels import fp8_rows

    if not _takes_gemm(kc, gu.shape[0], w) or not fp8_rows.swiglu_supported(gu.shape[1] // 2):
        return None
    xq, xs = fp8_rows.swiglu_fp8(gu)
    return _gemm_rows(kc, xq, xs, w, gu.dtype, to_norm=True)


def _gemm_rows(kc: KernelConfig, xq, xs, w: QuantizedWeight, dtype, to_norm: bool):
    """The FP8 GEMM of quantized rows; a product for the add + norm kernel (to_norm) as `PartialSums` where it runs
    K in ranges and kc.fuse_partial_sums (not on a mesh: there the products are summed over devices first)."""
    partial = to_norm and kc.fuse_partial_sums and kc.fuse_add_norm and kc.spmd is None
    out = fp8_gemm.fp8_gemm_rows(xq, xs, w.values, w.scales, out_dtype=dtype, partial_sums=partial)
    return PartialSums(out, dtype) if out.ndim == 3 else out


def dequantized_dot(x, w: QuantizedWeight):
    """x [R, K] @ w with the weight dequantized to x's dtype for XLA's matmul (many weight-only rows)."""
    # tied to x, so XLA cannot start every layer's dequantization early and hold them all (pallas_kernels/moe.py)
    w, x = lax.optimization_barrier((w, x))
    rows = fp8_matmul.dequantize_rows(block_fp8(w), x.dtype)
    return lax.dot_general(x, rows, (((1,), (1,)), ((), ())), preferred_element_type=x.dtype)


def _expert_weights(kc: KernelConfig, gate_up, down, shared: ref.SharedExpert | None):
    """The experts' weights as the kernels take them: FP8 ones as `fp8_matmul.BlockFp8` (Pallas) or dequantized
    (the reference)."""
    weights = (gate_up, down) if shared is None else (gate_up, down, shared.gate_up, shared.down)
    if not any(is_quantized(w) for w in weights):
        return gate_up, down, shared
    if kc.backend == "pallas" and not all(isinstance(w, QuantizedWeight) for w in weights):
        raise ValueError("FP8 MoE experts run on the Pallas kernels only when every expert and shared-expert "
                         "projection is one block-FP8 weight (H and I multiples of 128); this checkpoint's are "
                         "not: run it with kernels='reference'")
    convert = block_fp8 if kc.backend == "pallas" else dequantize
    if shared is not None:
        shared = shared._replace(gate_up=convert(shared.gate_up), down=convert(shared.down))
    return convert(gate_up), convert(down), shared


def moe_routed_experts(kc: KernelConfig, x, router_w, top_k: int, gate_up, down, shared: ref.SharedExpert | None,
                       shared_gate_w=None):
    """A narrow decode round's MoE layer, x [T, H] (or `RoutedRows` with the router's logits) -> [T, H] float32, with
    the routing inside the experts' first kernel (`moe.moe_experts_routed`: one kernel fewer a layer than
    `moe_route` and `moe_experts`, the same values) when kc.fuse_moe_route and the matrix-vector path takes the
    layer; None otherwise. shared: the shared expert (its weight unused), shared_gate_w its gate [H, 1]."""
    rows = plain_rows(x)
    if not _routes_in_gemv(kc, rows.shape[0], router_w, top_k, down, None if shared is None else shared.down):
        return None
    from pallas_kernels import moe

    logits = x.logits if isinstance(x, RoutedRows) else ref.moe_router_logits(rows, router_w)
    gate_up, down, shared = _expert_weights(kc, gate_up, down, shared)
    return moe.moe_experts_routed(rows, logits, gate_up, down, shared, shared_gate_w, top_k=top_k,
                                  interpret=kc.interpret)[0]


def moe_experts(kc: KernelConfig, x, expert_ids, expert_weights, gate_up, down,
                shared: ref.SharedExpert | None = None, x_fp8: Fp8Rows | None = None):
    """Routed experts of an MoE layer, plus its shared expert when given: x [T, H], ids/weights [T, K],
    gate_up [E, H, 2I], down [E, I, H] (plain, or block-FP8: the Pallas kernels read FP8 tiles, the reference
    dequantizes). x_fp8: x's FP8 rows from its norm, which FP8 x FP8 experts read (`fp8_rows_for`). Returns
    [T, H] float32."""
    gate_up, down, shared = _expert_weights(kc, gate_up, down, shared)
    if kc.backend == "pallas":
        from pallas_kernels import moe

        # FP8 x FP8 products (the packs' dynamic activation scheme) where they measured faster than converting the
        # FP8 tiles: the tiles at a wide decode round's or a short pass's few rows per expert, on a Hopper GPU the
        # grouped wgmma GEMM at many
        dynamic = kc.fp8_activations and isinstance(gate_up, fp8_matmul.BlockFp8) and moe.takes_dynamic(
            expert_ids.size, gate_up.values.shape[0], x.shape[1], down.values.shape[-1], kc.interpret)
        return moe.moe_experts(x, expert_ids, expert_weights, gate_up, down, shared, quantize_activations=dynamic,
                               x_fp8=None if x_fp8 is None else (x_fp8.xq, x_fp8.xs), interpret=kc.interpret)
    return ref.moe_experts_ref(x, expert_ids, expert_weights, gate_up, down, shared)
