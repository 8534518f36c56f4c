"""Load an HF Qwen3.5 checkpoint directory (config.json + *.safetensors) into a Params pytree.

Accepts the VLM layout (`model.language_model.*`, vision tower `model.visual.*` skipped) and the plain
text layout (`model.*`), one file or many (with `model.safetensors.index.json`), MoE experts fused
(`experts.gate_up_proj [E, 2I, H]`, `experts.down_proj [E, H, I]`) or per expert
(`experts.{e}.gate_proj.weight`, ...), bf16 or fp32 on disk. Every tensor is checked for presence and
shape; a problem raises CheckpointError naming the tensor. MTP weights (`mtp.*`) are kept raw.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import safe_open

from ninfer_jax.config import ConfigError, ModelConfig
from ninfer_jax.model.params import AttnParams, GDNParams, LayerParams, MLPParams, MoEParams, Params

log = logging.getLogger("ninfer_jax.loader")

DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}


class CheckpointError(ValueError):
    """A checkpoint whose files do not match its config; the message names the file or tensor."""


class _Tensors:
    """Lazy access to every tensor of a checkpoint by name, across shards."""

    def __init__(self, directory: Path):
        index = directory / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in directory.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{directory}: no *.safetensors files")
        self._handles = {}
        self._where: dict[str, str] = {}
        for name in files:
            path = directory / name
            if not path.exists():
                raise CheckpointError(f"{path}: shard named in the index is missing")
            try:
                handle = safe_open(str(path), framework="numpy")
            except Exception as e:  # safetensors raises its own error types for damaged headers
                raise CheckpointError(f"{path}: cannot read safetensors file ({e})") from None
            self._handles[name] = handle
            for key in handle.keys():
                self._where[key] = name
        self.bytes_read = 0

    def keys(self):
        return self._where.keys()

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in self._where:
            raise CheckpointError(f"checkpoint is missing tensor {name!r} (expected shape {shape})")
        try:
            array = self._handles[self._where[name]].get_tensor(name)
        except Exception as e:
            raise CheckpointError(f"tensor {name!r}: cannot read ({e})") from None
        if tuple(array.shape) != tuple(shape):
            raise CheckpointError(f"tensor {name!r} has shape {tuple(array.shape)}, expected {tuple(shape)}")
        if array.dtype not in (np.float32, np.float16, ml_dtypes.bfloat16):
            raise CheckpointError(f"tensor {name!r} has unsupported dtype {array.dtype}")
        self.bytes_read += array.nbytes
        return array


def _prefix(cfg: ModelConfig, tensors: _Tensors) -> str:
    for prefix in (("model.language_model.", "model.") if cfg.layout == "vlm" else ("model.",)):
        if f"{prefix}embed_tokens.weight" in tensors:
            return prefix
    raise CheckpointError(
        f"checkpoint is missing tensor 'model.{'language_model.' if cfg.layout == 'vlm' else ''}"
        "embed_tokens.weight' (no text model found)"
    )


def _load_layer(t: _Tensors, cfg: ModelConfig, i: int, p: str, put) -> LayerParams:
    h = cfg.hidden_size
    pre = f"{p}layers.{i}."
    if cfg.layer_types[i] == "linear_attention":
        a = pre + "linear_attn."
        cd, vd, hv = cfg.conv_dim, cfg.value_dim, cfg.linear_num_value_heads
        fused = np.concatenate(
            [
                t.get(a + "in_proj_qkv.weight", (cd, h)),
                t.get(a + "in_proj_z.weight", (vd, h)),
                t.get(a + "in_proj_b.weight", (hv, h)),
                t.get(a + "in_proj_a.weight", (hv, h)),
            ]
        ).T
        mixer = GDNParams(
            in_proj=put(fused),
            conv_w=put(t.get(a + "conv1d.weight", (cd, 1, cfg.linear_conv_kernel_dim))[:, 0, :].T),
            a_log=jnp.asarray(t.get(a + "A_log", (hv,)), jnp.float32),
            dt_bias=jnp.asarray(t.get(a + "dt_bias", (hv,)), jnp.float32),
            norm_w=put(t.get(a + "norm.weight", (cfg.linear_value_head_dim,))),
            out_proj=put(t.get(a + "out_proj.weight", (h, vd)).T),
        )
    else:
        a = pre + "self_attn."
        hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        fused = np.concatenate(
            [
                t.get(a + "q_proj.weight", (hq * 2 * d, h)),
                t.get(a + "k_proj.weight", (hkv * d, h)),
                t.get(a + "v_proj.weight", (hkv * d, h)),
            ]
        ).T
        mixer = AttnParams(
            qkv_proj=put(fused),
            q_norm=put(t.get(a + "q_norm.weight", (d,))),
            k_norm=put(t.get(a + "k_norm.weight", (d,))),
            o_proj=put(t.get(a + "o_proj.weight", (h, hq * d)).T),
        )

    def dense(prefix, inter):
        gate = t.get(prefix + "gate_proj.weight", (inter, h))
        up = t.get(prefix + "up_proj.weight", (inter, h))
        return MLPParams(
            gate_up=put(np.concatenate([gate, up]).T), down=put(t.get(prefix + "down_proj.weight", (h, inter)).T)
        )

    m = pre + "mlp."
    if cfg.is_moe:
        e, inter = cfg.num_experts, cfg.moe_intermediate_size
        if m + "experts.gate_up_proj" in t:
            gate_up = t.get(m + "experts.gate_up_proj", (e, 2 * inter, h))
            down = t.get(m + "experts.down_proj", (e, h, inter))
        else:  # one tensor per expert
            gate_up = np.stack(
                [
                    np.concatenate(
                        [
                            t.get(f"{m}experts.{j}.gate_proj.weight", (inter, h)),
                            t.get(f"{m}experts.{j}.up_proj.weight", (inter, h)),
                        ]
                    )
                    for j in range(e)
                ]
            )
            down = np.stack([t.get(f"{m}experts.{j}.down_proj.weight", (h, inter)) for j in range(e)])
        ffn = MoEParams(
            router=put(t.get(m + "gate.weight", (e, h))),
            gate_up=put(np.swapaxes(gate_up, 1, 2)),
            down=put(np.swapaxes(down, 1, 2)),
            shared=dense(m + "shared_expert.", cfg.shared_expert_intermediate_size),
            shared_gate=put(t.get(m + "shared_expert_gate.weight", (1, h)).T),
        )
    else:
        ffn = dense(m, cfg.intermediate_size)
    return LayerParams(
        input_norm=put(t.get(pre + "input_layernorm.weight", (h,))),
        post_norm=put(t.get(pre + "post_attention_layernorm.weight", (h,))),
        mixer=mixer,
        ffn=ffn,
    )


def load_checkpoint(path: str | Path, dtype: str = "bfloat16", progress=None) -> tuple[ModelConfig, Params]:
    """Read an HF Qwen3.5 checkpoint directory.

    Args:
      path: directory with config.json and *.safetensors (+ model.safetensors.index.json when sharded).
      dtype: "bfloat16" or "float32", the dtype every weight is converted to (A_log and dt_bias stay f32).
      progress: called as progress("loading", layers done, layers) after each layer.
    Returns:
      (ModelConfig, Params on the default device).
    Raises:
      ConfigError for a bad config.json, CheckpointError for missing, mis-shaped or unreadable tensors.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    directory = Path(path)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: not a checkpoint directory")
    cfg = ModelConfig.from_file(directory / "config.json")
    start = time.perf_counter()
    tensors = _Tensors(directory)
    prefix = _prefix(cfg, tensors)
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32

    def put(array):
        return jnp.asarray(np.ascontiguousarray(array.astype(np_dtype, copy=False)))

    v, h = cfg.vocab_size, cfg.hidden_size
    embed = put(tensors.get(prefix + "embed_tokens.weight", (v, h)))
    layers = []
    for i in range(cfg.num_layers):
        layers.append(_load_layer(tensors, cfg, i, prefix, put))
        log.info(
            "loading weights | layer %d/%d | %.2f GB read | %.1f s",
            i + 1, cfg.num_layers, tensors.bytes_read / 1e9, time.perf_counter() - start,
        )
        if progress is not None:
            progress("loading", i + 1, cfg.num_layers)
    final_norm = put(tensors.get(prefix + "norm.weight", (h,)))
    if cfg.tie_word_embeddings:
        lm_head = None
    else:
        lm_head = put(tensors.get("lm_head.weight", (v, h)).T)
    mtp_keys = [k for k in tensors.keys() if k.startswith("mtp.")]
    mtp = {k: put(tensors._handles[tensors._where[k]].get_tensor(k)) for k in mtp_keys} or None
    params = Params(embed=embed, layers=tuple(layers), final_norm=final_norm, lm_head=lm_head, mtp=mtp)
    jax.block_until_ready(params)
    log.info(
        "weights loaded | %s | %d layers | %.2f GB | %.1f s",
        cfg.architecture, cfg.num_layers, tensors.bytes_read / 1e9, time.perf_counter() - start,
    )
    return cfg, params


__all__ = ["CheckpointError", "ConfigError", "load_checkpoint"]
