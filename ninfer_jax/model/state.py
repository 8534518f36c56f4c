"""DeviceState: the preallocated KV page pools and GDN state slots one model reads and writes.

One array per layer (tuples in layer order of their kind):
  k_pages[i], v_pages[i]: [P, 64, Hkv, D]       full-attention layer i's K and V pages (spec §5.4): plain, or a
                                                `kv_quant.QuantPages` of value and scale planes (a KV profile)
  ssm[j]:                 [S, Hv, Dk, Dv] f32   GDN layer j's recurrent state, one row per state slot
  conv[j]:                [S, K-1, conv_dim]    GDN layer j's conv history: pre-conv inputs of the
                                                K-1 positions before the slot's frontier
Slots 0..C-1 are the lanes' active slots and C..C+D-1 the snapshot slots (the engine decides). Jitted
steps take a DeviceState, donate it, and return the updated one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from ninfer_jax.config import ModelConfig
from pallas_kernels import kv_quant

PAGE = 64


@struct.dataclass
class DeviceState:
    k_pages: tuple[jax.Array, ...]
    v_pages: tuple[jax.Array, ...]
    ssm: tuple[jax.Array, ...]
    conv: tuple[jax.Array, ...]

    @property
    def num_pages(self) -> int:
        return self.k_pages[0].shape[0] if self.k_pages else 0  # a QuantPages' shape is its logical one

    @property
    def num_slots(self) -> int:
        return self.ssm[0].shape[0] if self.ssm else 0

    @property
    def mtp_pages(self):
        """(K, V) pools of the MTP layer: the last pair, in a state made with `init_device_state(..., mtp=True)`."""
        return self.k_pages[-1], self.v_pages[-1]

    def with_mtp_pages(self, k_pages, v_pages) -> "DeviceState":
        return self.replace(k_pages=self.k_pages[:-1] + (k_pages,), v_pages=self.v_pages[:-1] + (v_pages,))


def page_bytes(cfg: ModelConfig, kv_dtype, kv_profile: str = "auto", mtp: bool = False) -> int:
    """Bytes of one 64-token page bundle across all full-attention layers (K and V, values and scales) in a KV
    profile ("auto": plain, of kv_dtype); with `mtp` the MTP layer's pages too (spec §3.1: one layer more)."""
    per_head = kv_quant.bytes_per_token_head(kv_profile, cfg.head_dim, kv_dtype)
    return PAGE * cfg.num_key_value_heads * per_head * (len(cfg.attn_layers) + mtp)


def slot_bytes(cfg: ModelConfig, conv_dtype) -> int:
    """Bytes of one state slot (the StateImage of spec §3.2) across all GDN layers."""
    ssm = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    conv = (cfg.linear_conv_kernel_dim - 1) * cfg.conv_dim * jnp.dtype(conv_dtype).itemsize
    return (ssm + conv) * len(cfg.gdn_layers)


def prefill_activation_bytes(cfg: ModelConfig, tokens: int, act_dtype) -> int:
    """A generous bound on a prefill pass's live activations: twice the larger of one layer's mixer and FFN
    temporaries, plus the residual stream, per token. It sizes the memory "auto" KV capacity leaves to the
    longest compiled pass."""
    act = jnp.dtype(act_dtype).itemsize
    gdn = ((2 * cfg.key_dim + 2 * cfg.value_dim + 2 * cfg.linear_num_value_heads) * act  # in-projection
           + 2 * cfg.key_dim * 4 + cfg.value_dim * act  # the conv's q, k (counted at 4 bytes) and v
           + cfg.linear_num_value_heads * (cfg.linear_key_head_dim + cfg.linear_value_head_dim + 64) * act  # w, u, P
           + cfg.value_dim * 4)  # the output (counted at 4 bytes)
    attn = (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads + cfg.num_attention_heads) * cfg.head_dim * act
    if cfg.is_moe:  # routed rows' act and f32 outputs, router logits, the shared expert
        ffn = (cfg.num_experts_per_tok * (cfg.moe_intermediate_size * act + cfg.hidden_size * 4)
               + cfg.num_experts * 4 + 3 * cfg.shared_expert_intermediate_size * act)
    else:
        ffn = 3 * cfg.intermediate_size * act
    return tokens * (2 * max(gdn, attn, ffn) + 3 * cfg.hidden_size * 4)


def init_device_state(cfg: ModelConfig, num_pages: int, num_slots: int, kv_dtype, conv_dtype,
                      kv_profile: str = "auto", mtp: bool = False, kv_heads: int | None = None) -> DeviceState:
    """Zero-filled pools, the KV ones in `kv_profile`'s layout (plain ones of kv_dtype); with `mtp` the last K and
    V pools are the MTP layer's (the model's layers never index them). kv_heads: the KV pools' head axis where it
    is not the model's KV heads (a mesh's copies of them, `spmd.kv_order`). Zeros are only a start value: every reader
    masks what it has not written."""
    kv_quant.check_profile(kv_profile, cfg.head_dim)
    k_fmt, v_fmt = kv_quant.PROFILES[kv_profile]
    plain = kv_quant.plain_dtype(kv_profile, kv_dtype)
    kv_shape = (num_pages, PAGE, kv_heads or cfg.num_key_value_heads, cfg.head_dim)
    ssm_shape = (num_slots, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
    conv_shape = (num_slots, cfg.linear_conv_kernel_dim - 1, cfg.conv_dim)
    n_attn, n_gdn = len(cfg.attn_layers) + mtp, len(cfg.gdn_layers)
    return DeviceState(
        k_pages=tuple(kv_quant.empty_pool(k_fmt, kv_shape, plain) for _ in range(n_attn)),
        v_pages=tuple(kv_quant.empty_pool(v_fmt, kv_shape, plain) for _ in range(n_attn)),
        ssm=tuple(jnp.zeros(ssm_shape, jnp.float32) for _ in range(n_gdn)),
        conv=tuple(jnp.zeros(conv_shape, conv_dtype) for _ in range(n_gdn)),
    )
