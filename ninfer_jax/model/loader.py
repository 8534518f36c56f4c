"""Load an HF Qwen3.5 checkpoint directory (config.json + *.safetensors) into a Params pytree.

Accepts the VLM layout (`model.language_model.*`; the vision tower `model.visual.*` loads on its own, by
`load_vision_checkpoint`) and the plain
text layout (`model.*`), one file or many (with `model.safetensors.index.json`), MoE experts fused
(`experts.gate_up_proj [E, 2I, H]`, `experts.down_proj [E, H, I]`) or per expert
(`experts.{e}.gate_proj.weight`, ...), bf16 or fp32 on disk. Every tensor is checked for presence and
shape; a problem raises CheckpointError naming the tensor. The multi-token-prediction layer (`mtp.*`, the same
in both layouts) loads when present, whole or refused; without it `Params.mtp` is None.

Block-FP8 checkpoints (config.json `quantization_config`, Qwen's FP8 packs): a linear whose `weight` is
float8_e4m3fn [out, in] comes with `weight_scale_inv` [ceil(out/128), ceil(in/128)] (float32 or bf16) and stays
FP8 on the device as a QuantizedWeight; the linears the pack leaves unquantized load as above.
"""

from __future__ import annotations

import json
import logging
import struct
import time
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import safe_open

from ninfer_jax.config import ConfigError, ModelConfig, VisionConfig
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
from ninfer_jax.model.vision import VisionParams, vision_params_from_tensors

log = logging.getLogger("ninfer_jax.loader")

DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}


class CheckpointError(ValueError):
    """A checkpoint whose files do not match its config; the message names the file or tensor."""


class _Fp8(NamedTuple):
    """One FP8 linear (or a stack of them) as on disk: values [..., out, in], scales [..., out blocks, in blocks]."""

    values: np.ndarray  # float8_e4m3fn
    scales: np.ndarray  # float32


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
        self._headers: dict[str, tuple[int, dict]] = {}  # file -> (data start, header), for the FP8 reads
        self._where: dict[str, str] = {}
        self._directory = directory
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
            self._headers[name] = _read_header(path)
        self.bytes_read = 0

    def __iter__(self):
        return iter(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def is_fp8(self, name: str) -> bool:
        return name in self._where and self._info(name)["dtype"] == "F8_E4M3"

    def _info(self, name: str) -> dict:
        return self._headers[self._where[name]][1].get(name, {})

    def get_fp8(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """A float8_e4m3fn tensor, read from the file directly (safetensors' numpy reader has no FP8)."""
        info, (start, _) = self._info(name), self._headers[self._where[name]]
        if tuple(info["shape"]) != tuple(shape):
            raise CheckpointError(f"tensor {name!r} has shape {tuple(info['shape'])}, expected {tuple(shape)}")
        begin, end = info["data_offsets"]
        raw = np.fromfile(self._directory / self._where[name], np.uint8, count=end - begin, offset=start + begin)
        if raw.size != int(np.prod(shape)):
            raise CheckpointError(f"tensor {name!r}: file is truncated")
        self.bytes_read += raw.nbytes
        return raw.view(ml_dtypes.float8_e4m3fn).reshape(shape)

    def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in self._where:
            raise CheckpointError(f"checkpoint is missing tensor {name!r} (expected shape {shape})")
        if self.is_fp8(name):
            raise CheckpointError(f"tensor {name!r} is float8_e4m3fn, but the engine reads it unquantized")
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


def _read_header(path: Path) -> tuple[int, dict]:
    """A safetensors file's (offset of its data, header) (safe_open has read it once already, so it is sound)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return 8 + length, json.loads(f.read(length))


def _linear(t: _Tensors, cfg: ModelConfig, name: str, shape: tuple[int, int]) -> np.ndarray | _Fp8:
    """One linear's weight [out, in] as on disk: a float array, or FP8 values with their block scales."""
    if not t.is_fp8(name):
        return t.get(name, shape)
    if cfg.quantization is None:
        raise CheckpointError(f"tensor {name!r} is float8_e4m3fn, but config.json has no 'quantization_config'")
    blocks = tuple(-(-d // FP8_BLOCK) for d in shape)
    scales = t.get(name + "_scale_inv", blocks)  # float32, or bf16 from some tools
    return _Fp8(t.get_fp8(name, shape), scales.astype(np.float32))


def _stack(parts: list, what: str) -> np.ndarray | _Fp8:
    """Per-expert weights -> one [E, ...] stack; experts must be all FP8 or all unquantized."""
    if all(isinstance(p, _Fp8) for p in parts):
        return _Fp8(np.stack([p.values for p in parts]), np.stack([p.scales for p in parts]))
    if any(isinstance(p, _Fp8) for p in parts):
        raise CheckpointError(f"{what}: some experts are float8_e4m3fn and some are not")
    return np.stack(parts)


def _fuse(parts: list, put):
    """Linears that read one input ([..., out_i, in] each, on disk) -> one weight of x @ w shape [..., in, sum out_i].

    Unquantized parts are concatenated as they always were. FP8 parts share one QuantizedWeight while the
    outputs before each start on a block boundary; otherwise, and next to an unquantized part, the result is
    a ConcatWeight of the runs."""
    def cat(arrays):
        return np.concatenate(arrays, axis=-2) if len(arrays) > 1 else arrays[0]

    if not any(isinstance(p, _Fp8) for p in parts):
        return put(np.swapaxes(cat(parts), -1, -2))
    runs: list[list] = []
    for p in parts:
        last = runs[-1] if runs else None
        if last and isinstance(p, _Fp8) == isinstance(last[0], _Fp8) and (
            not isinstance(p, _Fp8) or sum(q.values.shape[-2] for q in last) % FP8_BLOCK == 0
        ):
            last.append(p)
        else:
            runs.append([p])

    def one(run):
        if not isinstance(run[0], _Fp8):
            return put(np.swapaxes(cat(run), -1, -2))
        # FP8 stays [out, in] as on disk: the kernels stream each row's 128-blocks (QuantizedWeight)
        return QuantizedWeight(put.raw(cat([q.values for q in run])), put.raw(cat([q.scales for q in run])))

    weights = tuple(one(run) for run in runs)
    return weights[0] if len(weights) == 1 else ConcatWeight(weights)


def _prefix(cfg: ModelConfig, tensors: _Tensors) -> str:
    for prefix in (("model.language_model.", "model.") if cfg.layout == "vlm" else ("model.",)):
        if f"{prefix}embed_tokens.weight" in tensors:
            return prefix
    raise CheckpointError(
        f"checkpoint is missing tensor 'model.{'language_model.' if cfg.layout == 'vlm' else ''}"
        "embed_tokens.weight' (no text model found)"
    )


def _load_layer(t: _Tensors, cfg: ModelConfig, pre: str, kind: str, put) -> LayerParams:
    """The decoder layer whose tensors are named `pre`..., its mixer of `kind` (a config.layer_types entry)."""
    h = cfg.hidden_size

    def lin(name, shape):
        return _linear(t, cfg, name, shape)
    if kind == "linear_attention":
        a = pre + "linear_attn."
        cd, vd, hv = cfg.conv_dim, cfg.value_dim, cfg.linear_num_value_heads
        in_proj = _fuse(
            [
                lin(a + "in_proj_qkv.weight", (cd, h)),
                lin(a + "in_proj_z.weight", (vd, h)),
                lin(a + "in_proj_b.weight", (hv, h)),
                lin(a + "in_proj_a.weight", (hv, h)),
            ],
            put,
        )
        mixer = GDNParams(
            in_proj=in_proj,
            conv_w=put(t.get(a + "conv1d.weight", (cd, 1, cfg.linear_conv_kernel_dim))[:, 0, :].T),
            a_log=put.raw(t.get(a + "A_log", (hv,)), np.float32),
            dt_bias=put.raw(t.get(a + "dt_bias", (hv,)), np.float32),
            norm_w=put(t.get(a + "norm.weight", (cfg.linear_value_head_dim,))),
            out_proj=_fuse([lin(a + "out_proj.weight", (h, vd))], put),
        )
    else:
        a = pre + "self_attn."
        hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        qkv_proj = _fuse(
            [
                lin(a + "q_proj.weight", (hq * 2 * d, h)),
                lin(a + "k_proj.weight", (hkv * d, h)),
                lin(a + "v_proj.weight", (hkv * d, h)),
            ],
            put,
        )
        mixer = AttnParams(
            qkv_proj=qkv_proj,
            q_norm=put(t.get(a + "q_norm.weight", (d,))),
            k_norm=put(t.get(a + "k_norm.weight", (d,))),
            o_proj=_fuse([lin(a + "o_proj.weight", (h, hq * d))], put),
        )

    def dense(prefix, inter):
        gate = lin(prefix + "gate_proj.weight", (inter, h))
        up = lin(prefix + "up_proj.weight", (inter, h))
        return MLPParams(gate_up=_fuse([gate, up], put),
                         down=_fuse([lin(prefix + "down_proj.weight", (h, inter))], put))

    m = pre + "mlp."
    if cfg.is_moe:
        e, inter = cfg.num_experts, cfg.moe_intermediate_size
        if m + "experts.gate_up_proj" in t:
            gate_up = t.get(m + "experts.gate_up_proj", (e, 2 * inter, h))
            down = t.get(m + "experts.down_proj", (e, h, inter))
            gate_up, down = put(np.swapaxes(gate_up, 1, 2)), put(np.swapaxes(down, 1, 2))
        else:  # one tensor per expert, as the FP8 packs store them (quantized per expert)
            gate, up, dn = (
                _stack([lin(f"{m}experts.{j}.{kind}.weight", shape) for j in range(e)], f"{m}experts.*.{kind}")
                for kind, shape in (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter)))
            )
            gate_up, down = _fuse([gate, up], put), _fuse([dn], put)
        ffn = MoEParams(
            router=put(t.get(m + "gate.weight", (e, h))),
            gate_up=gate_up,
            down=down,
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


def _load_mtp(t: _Tensors, cfg: ModelConfig, put) -> MTPParams | None:
    """The MTP layer: None when the checkpoint has no `mtp.*` tensor; one missing from a partial layer is named."""
    if not any(k.startswith("mtp.") for k in t):
        return None
    h = cfg.hidden_size
    return MTPParams(
        fc=_fuse([_linear(t, cfg, "mtp.fc.weight", (h, 2 * h))], put),
        pre_fc_norm_embedding=put(t.get("mtp.pre_fc_norm_embedding.weight", (h,))),
        pre_fc_norm_hidden=put(t.get("mtp.pre_fc_norm_hidden.weight", (h,))),
        layer=_load_layer(t, cfg, "mtp.layers.0.", "full_attention", put),
        norm=put(t.get("mtp.norm.weight", (h,))),
    )


def _checkpoint_dir(path: str | Path, dtype: str) -> Path:
    """The checkpoint directory, once it and `dtype` are checked."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    directory = Path(path)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: not a checkpoint directory")
    return directory


class _Putter:
    """array -> a contiguous array in `dtype` ("bfloat16" or "float32") on the default device, or in host memory
    (`host`: a tensor-parallel engine then places each shard on its own device, and a model larger than one device
    never lands whole on one)."""

    def __init__(self, dtype: str, host: bool = False):
        self.np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32
        self.host = host

    def __call__(self, array):
        return self.raw(array, self.np_dtype)

    def raw(self, array, dtype=None):
        """`array` as it is (in `dtype` when given): FP8 values and their scales, the GDN's float32 constants."""
        array = np.ascontiguousarray(array if dtype is None else array.astype(dtype, copy=False))
        return array if self.host else jnp.asarray(array)


def load_checkpoint(path: str | Path, dtype: str = "bfloat16", progress=None,
                    host: bool = False) -> tuple[ModelConfig, Params]:
    """Read an HF Qwen3.5 checkpoint directory.

    Args:
      path: directory with config.json and *.safetensors (+ model.safetensors.index.json when sharded).
      dtype: "bfloat16" or "float32", the dtype every weight is converted to (A_log and dt_bias stay f32),
        except FP8 linears, which stay FP8 with float32 block scales.
      progress: called as progress("loading", layers done, layers) after each layer.
      host: keep the weights in host memory (numpy) for a tensor-parallel engine to place shard by shard.
    Returns:
      (ModelConfig, Params on the default device, or in host memory).
    Raises:
      ConfigError for a bad config.json, CheckpointError for missing, mis-shaped or unreadable tensors.
    """
    directory = _checkpoint_dir(path, dtype)
    cfg = ModelConfig.from_file(directory / "config.json")
    start = time.perf_counter()
    tensors = _Tensors(directory)
    prefix = _prefix(cfg, tensors)
    put = _Putter(dtype, host)

    v, h = cfg.vocab_size, cfg.hidden_size
    embed = put(tensors.get(prefix + "embed_tokens.weight", (v, h)))
    layers = []
    for i in range(cfg.num_layers):
        layers.append(_load_layer(tensors, cfg, f"{prefix}layers.{i}.", cfg.layer_types[i], put))
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
    params = Params(embed=embed, layers=tuple(layers), final_norm=final_norm, lm_head=lm_head,
                    mtp=_load_mtp(tensors, cfg, put))
    if not host:
        jax.block_until_ready(params)
    log.info(
        "weights loaded | %s | %d layers | %.2f GB | %.1f s",
        cfg.architecture, cfg.num_layers, tensors.bytes_read / 1e9, time.perf_counter() - start,
    )
    return cfg, params


def load_vision_checkpoint(path: str | Path, dtype: str = "bfloat16") -> tuple[VisionConfig, VisionParams]:
    """Read a VLM checkpoint's vision tower (`model.visual.*`), every tensor checked for presence and shape.

    Returns:
      (VisionConfig, VisionParams on the default device, in `dtype`).
    Raises:
      ConfigError for a config.json without a valid `vision_config`, CheckpointError for missing, mis-shaped or
      unreadable tensors.
    """
    directory = _checkpoint_dir(path, dtype)
    vcfg = VisionConfig.from_file(directory / "config.json")
    tensors = _Tensors(directory)
    put = _Putter(dtype)

    params = vision_params_from_tensors(vcfg, tensors.get, put)
    jax.block_until_ready(params)
    return vcfg, params


def has_vision_tower(config_file: str | Path) -> bool:
    """Whether a config.json declares a vision tower (`vision_config`: a VLM); False for one that cannot be read."""
    try:
        return "vision_config" in json.loads(Path(config_file).read_text())
    except (OSError, ValueError):
        return False


def load_dummy(config_file: str | Path, dtype: str = "bfloat16", init=None):
    """Random weights at a config.json's shapes (`load_format="dummy"`, as vLLM's): benchmarks and serving tests
    at real shapes with no checkpoint on disk. Seed 0, so two loads of one config hold the same weights.
    init(make, cfg): makes the params from `make()` (a tensor-parallel engine's `ParallelLayout.init_params`, which
    makes each device's shards in place); None: on the default device.

    Returns:
      (ModelConfig, Params, (VisionConfig, VisionParams) or None: a random tower when the config has one).
    Raises:
      ConfigError for a missing or invalid config.json.
    """
    from ninfer_jax.model.random_init import random_params
    from ninfer_jax.model.tiny import random_vision_tensors

    config_file = Path(config_file)
    if not config_file.is_file():
        raise ConfigError(f"load_format 'dummy' reads the model's shapes from a config.json: {config_file} is not a "
                          "file")
    cfg = ModelConfig.from_file(config_file)
    start = time.perf_counter()
    def make():
        return random_params(cfg, seed=0, dtype=DTYPES[dtype], fp8=cfg.quantization is not None)

    # one program, as the mesh's init is: op by op, a fused op's float result can differ in the last bit
    params = jax.jit(make)() if init is None else init(make, cfg)
    jax.block_until_ready(params)
    log.info("dummy weights | %s | %.1f s", config_file, time.perf_counter() - start)
    if not has_vision_tower(config_file):
        return cfg, params, None
    vcfg = VisionConfig.from_file(config_file)
    tensors = random_vision_tensors(vcfg, np.random.default_rng(0))
    put = _Putter(dtype)
    return cfg, params, (vcfg, vision_params_from_tensors(vcfg, lambda name, shape: tensors[name], put))


__all__ = ["CheckpointError", "ConfigError", "has_vision_tower", "load_checkpoint", "load_dummy",
           "load_vision_checkpoint"]
