"""The GDN mixer's prefill between its in-projection and the chunked delta rule as one kernel: the causal conv, its
SiLU, the key heads' L2 norms and the bucket padding's zeros, for one lane's chunk of T tokens.

With C = 2 Hk Dk + Hv Dv pre-conv channels (each key head's q channels, then each key head's k channels, then each
value head's v channels: the in-projection's first C columns) and K conv taps:

    window = [conv history (K-1 rows) ; qkv]                                        [T + K - 1, C]
    c_t    = silu(sum_j window[t + j] conv_w[j]) in float32, rounded to the activations' dtype
    q, k   = each key head's channels of c, L2-normalised in float32 (q times Dk^-0.5)  -> [T, Hk, Dk]
    v      = each value head's channels of c                                          -> [T, Hv, Dv]
    (all three in the activations' dtype: the delta rule's products take bf16 operands, and 2-byte q and k let its
    recurrence pipeline 3 loads deep in shared memory; docs/kernels_notes.md)
    rows t >= n_valid are zero (bucket padding: identity tokens for the delta rule)

which `ninfer_jax.model.qwen3_5._gdn_prefill` otherwise composes from XLA fusions that each recompute the conv from
the in-projection's output for their own outputs, well below the copy rate (docs/kernels_notes.md). That
composition is the reference (tests/kernels/test_gdn_conv.py).

One program per (block of `block_t` tokens, head): key heads' q, then their k, then the value heads. A program reads
its channels' K shifted row blocks straight from the in-projection's output (rows before the chunk from the
history), so the window is never written out.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _compat
from pallas_kernels._blocks import is_pow2
from pallas_kernels.reference import l2_normalize

_F32 = jnp.float32


def _kernel(
    n_valid_ref,  # [1] int32: rows at or past it are padding
    proj_ref,  # [T, >= C] the in-projection's output (its first C columns are the pre-conv channels)
    hist_ref,  # [K-1, C] the conv history: the K-1 pre-conv rows before the chunk
    conv_w_ref,  # [K, C]
    q_ref,  # out [T', Hk, Dk] activations' dtype (T' = T rounded up to block_t; the caller drops rows past T)
    k_ref,  # out [T', Hk, Dk] activations' dtype
    v_ref,  # out [T', Hv, Dv] activations' dtype
    *,
    taps: int,
    block_t: int,
):
    tb, head = pl.program_id(0), pl.program_id(1)
    t_len = proj_ref.shape[0]
    hk, dk = q_ref.shape[1], q_ref.shape[2]
    dv = v_ref.shape[2]
    act = proj_ref.dtype
    t = tb * block_t + jnp.arange(block_t, dtype=jnp.int32)
    in_chunk = t < t_len
    keep = (t < n_valid_ref[0]).astype(_F32)[:, None]

    def conv(c0, width):
        """silu(conv) of channels [c0, c0 + width) for the block's rows, rounded to the activations' dtype."""
        cols = c0 + jnp.arange(width, dtype=jnp.int32)
        acc = jnp.zeros((block_t, width), _F32)
        for j in range(taps):
            r = t + (j - (taps - 1))  # the chunk row window[t + j] holds; negative: a history row
            from_proj = _compat.load(proj_ref.at[jnp.clip(r, 0, t_len - 1)[:, None], cols[None, :]],
                                     mask=((r >= 0) & in_chunk)[:, None], other=0)
            from_hist = _compat.load(hist_ref.at[jnp.clip(r + taps - 1, 0, taps - 2)[:, None], cols[None, :]],
                                     mask=(r < 0)[:, None], other=0)
            x = jnp.where((r < 0)[:, None], from_hist.astype(act), from_proj)
            acc = acc + x.astype(_F32) * conv_w_ref[j, pl.ds(c0, width)].astype(_F32)[None, :]
        return jax.nn.silu(acc).astype(act)

    def store(ref, h, val):
        ref[pl.ds(tb * block_t, block_t), h, :] = val.astype(ref.dtype)

    @pl.when(head < hk)
    def _():
        store(q_ref, head, l2_normalize(conv(head * dk, dk)) * (dk**-0.5) * keep)

    @pl.when((head >= hk) & (head < 2 * hk))
    def _():
        store(k_ref, head - hk, l2_normalize(conv(head * dk, dk)) * keep)

    @pl.when(head >= 2 * hk)
    def _():
        h = head - 2 * hk
        store(v_ref, h, conv(2 * hk * dk + h * dv, dv).astype(_F32) * keep)


@dataclasses.dataclass(frozen=True)
class GdnConvConfig:
    """Tuning knobs (hashable: a static argument)."""

    # 32 tokens on 8 warps: the fastest tile of the sweep at the 35B-A3B's shapes, and the only one faster than
    # XLA's composition (docs/kernels_notes.md)
    block_t: int = 32  # tokens per program
    num_warps: int = 8
    num_stages: int = 1

    def __post_init__(self):
        if not is_pow2(self.block_t, 16):
            raise ValueError(f"GdnConvConfig.block_t must be a power of two >= 16, got {self.block_t}")


DEFAULT_CONFIG = GdnConvConfig()


def supported(key_head_dim: int, value_head_dim: int) -> bool:
    """Triton blocks are powers of two: one head's channels must be one block."""
    return is_pow2(key_head_dim, 16) and is_pow2(value_head_dim, 16)


@functools.partial(jax.jit, static_argnames=("num_key_heads", "key_head_dim", "num_value_heads", "value_head_dim",
                                             "interpret", "config"))
def gdn_conv_prefill(proj, history, conv_w, n_valid, *, num_key_heads: int, key_head_dim: int, num_value_heads: int,
                     value_head_dim: int, interpret: bool = False, config: GdnConvConfig = DEFAULT_CONFIG):
    """The conv, SiLU, L2 norms and padding zeros of one lane's prefill chunk (module docstring).

    Args:
      proj: [T, P] the in-projection's output, P >= C = 2 Hk Dk + Hv Dv (the rest of its columns are not read).
      history: [K-1, C] the pre-conv rows before the chunk (zeros for a lane at position 0); any float dtype.
      conv_w: [K, C] the depthwise conv's weights.
      n_valid: int32 scalar, the chunk's real tokens (the rest is bucket padding).
    Returns:
      q [T, Hk, Dk] (normalised, times Dk^-0.5), k [T, Hk, Dk] (normalised), v [T, Hv, Dv], all in proj's dtype;
      rows at or past n_valid are zero.
    """
    t_len = proj.shape[0]
    hk, dk, hv, dv = num_key_heads, key_head_dim, num_value_heads, value_head_dim
    channels = 2 * hk * dk + hv * dv
    taps = conv_w.shape[0]
    if conv_w.shape != (taps, channels) or history.shape != (taps - 1, channels) or proj.shape[1] < channels:
        raise ValueError(f"gdn_conv_prefill: conv_w {conv_w.shape} must be [K, C={channels}], history {history.shape} "
                         f"[K-1, C] and proj {proj.shape} [T, >= C]")
    if taps < 2 or not supported(dk, dv):
        raise ValueError(f"gdn_conv_prefill: needs K >= 2 taps (got {taps}) and power-of-two head dims >= 16 "
                         f"(got {dk}, {dv})")
    block_t = min(config.block_t, max(16, pl.next_power_of_2(t_len)))
    kernel = functools.partial(_kernel, taps=taps, block_t=block_t)
    # Whole blocks of rows are stored (the engine's buckets are multiples of 64: nothing to drop there)
    rows = pl.cdiv(t_len, block_t) * block_t
    q, k, v = pl.pallas_call(
        kernel,
        grid=(rows // block_t, 2 * hk + hv),
        out_shape=[jax.ShapeDtypeStruct((rows, hk, dk), proj.dtype)] * 2
        + [jax.ShapeDtypeStruct((rows, hv, dv), proj.dtype)],
        in_specs=[_compat.full_spec()] * 4,
        out_specs=[_compat.full_spec()] * 3,
        compiler_params=_compat.triton_params(config.num_warps, config.num_stages),
        interpret=interpret,
        name="gdn_conv_prefill",
    )(jnp.reshape(n_valid, (1,)).astype(jnp.int32), proj, history, conv_w)
    return q[:t_len], k[:t_len], v[:t_len]
