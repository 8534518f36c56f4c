"""Random Params generated directly on the device, layer by layer: real-shape benchmarks without a
checkpoint on disk (a 27B bf16 model is 54 GB; writing and reading it would dominate the run). With fp8=True the
linears Qwen's FP8 packs quantize are block-FP8 `QuantizedWeight`s, as the loader makes them from a pack."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ninfer_jax.config import ModelConfig
from ninfer_jax.model.params import (
    FP8_BLOCK,
    AttnParams,
    ConcatWeight,
    GDNParams,
    LayerParams,
    MLPParams,
    MoEParams,
    MTPParams,
    Params,
    QuantizedWeight,
)
from pallas_kernels import fp8_matmul


@functools.partial(jax.jit, static_argnames=("shape", "dtype", "scale", "offset"))
def _normal(key, shape, dtype, scale, offset=0.0):
    # The offset inside the same program: added after it, XLA may fuse it into the product (one rounding) in one
    # program and not another, and weights made on a mesh (`ParallelLayout.init_params`) would differ by an ulp.
    return (jax.random.normal(key, shape, jnp.float32) * scale + offset).astype(dtype)


@functools.partial(jax.jit, static_argnames=("shape", "scale"))
def fp8_normal(key, shape, scale):
    """N(0, scale) weights [..., N, K] quantized per 128 x 128 block as the packs are (block amax -> 448)."""
    *lead, n, k = shape
    blocks = (jax.random.normal(key, shape, jnp.float32) * scale).reshape(
        *lead, n // FP8_BLOCK, FP8_BLOCK, k // FP8_BLOCK, FP8_BLOCK)
    scales = jnp.max(jnp.abs(blocks), axis=(-3, -1)) / fp8_matmul.FP8_MAX
    values = (blocks / scales[..., :, None, :, None]).astype(jnp.float8_e4m3fn).reshape(shape)
    return QuantizedWeight(values, scales)


def random_params(cfg: ModelConfig, seed: int = 0, dtype=jnp.bfloat16, fp8: bool = False) -> Params:
    """Params with every weight ~ N(0, fan_in^-1/2) (norm weights ~ N(0, 0.1)), the MTP layer included, made on the
    device; fp8: the projections and experts block-FP8 (their sides must be multiples of 128, as in the released
    models)."""
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), 64 * (cfg.num_layers + 2)))  # ample for the MTP layer too

    def w(*shape, scale=None, offset=0.0):
        return _normal(next(keys), shape, dtype, scale if scale is not None else shape[-2] ** -0.5
                       if len(shape) >= 2 else 0.1, offset)

    def lin(*shape):  # a linear the FP8 packs quantize, in x @ w shape [..., K, N]
        if not fp8:
            return w(*shape)
        *lead, k, n = shape
        return fp8_normal(next(keys), (*lead, n, k), k**-0.5)

    h = cfg.hidden_size

    def layer(kind):
        if kind == "linear_attention":
            hv = cfg.linear_num_value_heads
            mixer = GDNParams(
                # [qkv | z] quantized, [b | a] not (as in the packs)
                in_proj=ConcatWeight((lin(h, cfg.conv_dim + cfg.value_dim), w(h, 2 * hv))) if fp8
                else w(h, cfg.conv_dim + cfg.value_dim + 2 * hv),
                conv_w=w(cfg.linear_conv_kernel_dim, cfg.conv_dim, scale=0.5),
                a_log=jnp.log(jax.random.uniform(next(keys), (hv,), jnp.float32, 0.05, 2.0)),
                dt_bias=_normal(next(keys), (hv,), jnp.float32, 0.5),
                norm_w=w(cfg.linear_value_head_dim, offset=1.0),
                out_proj=lin(cfg.value_dim, h),
            )
        else:
            hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
            mixer = AttnParams(
                qkv_proj=lin(h, hq * 2 * d + 2 * hkv * d), q_norm=w(d), k_norm=w(d), o_proj=lin(hq * d, h)
            )
        if cfg.is_moe:
            e, inter, si = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
            ffn = MoEParams(
                router=w(e, h, scale=h**-0.5), gate_up=lin(e, h, 2 * inter), down=lin(e, inter, h),
                shared=MLPParams(gate_up=lin(h, 2 * si), down=lin(si, h)), shared_gate=w(h, 1),
            )
        else:
            ffn = MLPParams(gate_up=lin(h, 2 * cfg.intermediate_size), down=lin(cfg.intermediate_size, h))
        return LayerParams(input_norm=w(h), post_norm=w(h), mixer=mixer, ffn=ffn)

    layers = tuple(layer(kind) for kind in cfg.layer_types)
    embed, final_norm = w(cfg.vocab_size, h, scale=1.0), w(h)
    lm_head = None if cfg.tie_word_embeddings else w(h, cfg.vocab_size)
    # The MTP layer's keys come after every other weight's, so those are the same as without it
    mtp = MTPParams(  # fc unquantized, as the FP8 packs keep it
        fc=w(2 * h, h), pre_fc_norm_embedding=w(h), pre_fc_norm_hidden=w(h), layer=layer("full_attention"), norm=w(h)
    )
    return Params(embed=embed, layers=layers, final_norm=final_norm, lm_head=lm_head, mtp=mtp)
