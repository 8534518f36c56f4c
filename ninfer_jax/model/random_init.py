"""Random Params generated directly on the device, layer by layer: real-shape benchmarks without a
checkpoint on disk (a 27B bf16 model is 54 GB; writing and reading it would dominate the run)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ninfer_jax.config import ModelConfig
from ninfer_jax.model.params import AttnParams, GDNParams, LayerParams, MLPParams, MoEParams, Params


@functools.partial(jax.jit, static_argnames=("shape", "dtype", "scale"))
def _normal(key, shape, dtype, scale):
    return (jax.random.normal(key, shape, jnp.float32) * scale).astype(dtype)


def random_params(cfg: ModelConfig, seed: int = 0, dtype=jnp.bfloat16) -> Params:
    """Params with every weight ~ N(0, fan_in^-1/2) (norm weights ~ N(0, 0.1)), made on the device."""
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), 64 * (cfg.num_layers + 2)))

    def w(*shape, scale=None):
        return _normal(next(keys), shape, dtype, scale if scale is not None else shape[-2] ** -0.5
                       if len(shape) >= 2 else 0.1)

    h = cfg.hidden_size
    layers = []
    for kind in cfg.layer_types:
        if kind == "linear_attention":
            hv = cfg.linear_num_value_heads
            mixer = GDNParams(
                in_proj=w(h, cfg.conv_dim + cfg.value_dim + 2 * hv),
                conv_w=w(cfg.linear_conv_kernel_dim, cfg.conv_dim, scale=0.5),
                a_log=jnp.log(jax.random.uniform(next(keys), (hv,), jnp.float32, 0.05, 2.0)),
                dt_bias=_normal(next(keys), (hv,), jnp.float32, 0.5),
                norm_w=1.0 + w(cfg.linear_value_head_dim),
                out_proj=w(cfg.value_dim, h),
            )
        else:
            hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
            mixer = AttnParams(
                qkv_proj=w(h, hq * 2 * d + 2 * hkv * d), q_norm=w(d), k_norm=w(d), o_proj=w(hq * d, h)
            )
        if cfg.is_moe:
            e, inter, si = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
            ffn = MoEParams(
                router=w(e, h, scale=h**-0.5), gate_up=w(e, h, 2 * inter), down=w(e, inter, h),
                shared=MLPParams(gate_up=w(h, 2 * si), down=w(si, h)), shared_gate=w(h, 1),
            )
        else:
            ffn = MLPParams(gate_up=w(h, 2 * cfg.intermediate_size), down=w(cfg.intermediate_size, h))
        layers.append(LayerParams(input_norm=w(h), post_norm=w(h), mixer=mixer, ffn=ffn))
    return Params(
        embed=w(cfg.vocab_size, h, scale=1.0),
        layers=tuple(layers),
        final_norm=w(h),
        lm_head=None if cfg.tie_word_embeddings else w(h, cfg.vocab_size),
    )
