"""ModelConfig: the Qwen3.5 text-model hyperparameters, parsed and validated from an HF `config.json`."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

# architectures -> (is_moe, layout). The VLM classes keep the text model under model.language_model.
ARCHITECTURES = {
    "Qwen3_5ForCausalLM": (False, "text"),
    "Qwen3_5MoeForCausalLM": (True, "text"),
    "Qwen3_5ForConditionalGeneration": (False, "vlm"),
    "Qwen3_5MoeForConditionalGeneration": (True, "vlm"),
}
LAYER_TYPES = ("linear_attention", "full_attention")


class ConfigError(ValueError):
    """A config.json that does not describe a supported Qwen3.5 model; the message names the field."""


@dataclasses.dataclass(frozen=True)
class QuantizationConfig:
    """A checkpoint's weight quantization (config.json `quantization_config`): block-FP8 only, the format of
    Qwen's FP8 packs. Which linears are quantized is read from the tensors; the list of those left
    unquantized is kept as the pack states it."""

    quant_method: str = "fp8"
    fmt: str = "e4m3"
    activation_scheme: str = "dynamic"
    weight_block_size: tuple[int, int] = (128, 128)
    modules_to_not_convert: tuple[str, ...] = ()

    @classmethod
    def from_dict(cls, raw: Any) -> "QuantizationConfig":
        if not isinstance(raw, dict):
            raise ConfigError(f"config.json: field 'quantization_config' must be an object, got {raw!r}")

        def refuse(field, value, supported):
            raise ConfigError(
                f"config.json: field 'quantization_config.{field}' {value!r} is not supported ({supported})"
            )

        method = raw.get("quant_method")
        if method != "fp8":
            refuse("quant_method", method, "only 'fp8': block-FP8 weights as in Qwen's FP8 checkpoints")
        fmt = raw.get("fmt", "e4m3")
        if fmt != "e4m3":
            refuse("fmt", fmt, "only 'e4m3'")
        scheme = raw.get("activation_scheme", "dynamic")
        if scheme != "dynamic":
            refuse("activation_scheme", scheme, "only 'dynamic': the checkpoint holds no activation scales")
        block = raw.get("weight_block_size")
        if block != [128, 128]:
            refuse("weight_block_size", block, "only [128, 128]")
        # vLLM's name for the same list is ignored_layers
        skip = raw.get("modules_to_not_convert", raw.get("ignored_layers")) or []
        if not isinstance(skip, list) or not all(isinstance(m, str) for m in skip):
            refuse("modules_to_not_convert", skip, "a list of module names")
        return cls(fmt=fmt, activation_scheme=scheme, weight_block_size=(128, 128), modules_to_not_convert=tuple(skip))


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Text-model hyperparameters (hashable: a static argument of the jitted steps)."""

    architecture: str
    is_moe: bool
    layout: str  # "text": weights under model.*; "vlm": under model.language_model.*
    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    rms_norm_eps: float
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    intermediate_size: int = 0  # dense MLP
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 262144
    eos_token_ids: tuple[int, ...] = ()
    quantization: QuantizationConfig | None = None  # None: the checkpoint's weights are all unquantized
    # MRoPE: rotary frequencies 1, 4, 7, ... (below 3 x the second entry) turn with an image token's height
    # position, 2, 5, 8, ... (below 3 x the third) with its width, the rest with its time (transformers' default)
    mrope_section: tuple[int, int, int] = (11, 11, 10)

    # --- derived sizes -------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def gdn_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    @property
    def attn_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")

    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    # --- parsing ---------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        archs = raw.get("architectures") or []
        if not isinstance(archs, list) or len(archs) != 1:
            raise ConfigError(f"config.json: 'architectures' must name exactly one class, got {archs!r}")
        arch = archs[0]
        if arch not in ARCHITECTURES:
            raise ConfigError(
                f"config.json: unsupported architecture {arch!r}; supported: {', '.join(ARCHITECTURES)}"
            )
        is_moe, layout = ARCHITECTURES[arch]
        text = raw.get("text_config", raw) if layout == "vlm" else raw
        if not isinstance(text, dict):
            raise ConfigError("config.json: 'text_config' must be an object")

        def need(name, kind=int):
            if name not in text:
                raise ConfigError(f"config.json: missing field {name!r}")
            value = text[name]
            if kind is int and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ConfigError(f"config.json: field {name!r} must be a positive integer, got {value!r}")
            if kind is float and (not isinstance(value, (int, float)) or value <= 0):
                raise ConfigError(f"config.json: field {name!r} must be a positive number, got {value!r}")
            return value

        num_layers = need("num_hidden_layers")
        layer_types = text.get("layer_types")
        if layer_types is None:
            interval = text.get("full_attention_interval", 4)
            layer_types = [
                "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)
            ]
        if (
            not isinstance(layer_types, list)
            or len(layer_types) != num_layers
            or any(t not in LAYER_TYPES for t in layer_types)
        ):
            raise ConfigError(
                f"config.json: field 'layer_types' must list {num_layers} entries of {LAYER_TYPES}, "
                f"got {layer_types!r}"
            )

        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ConfigError(f"config.json: field 'rope_parameters.rope_type' {rope_type!r} is not supported")
        rope_theta = rope.get("rope_theta", text.get("rope_theta"))
        if not isinstance(rope_theta, (int, float)) or rope_theta <= 0:
            raise ConfigError(f"config.json: field 'rope_theta' must be a positive number, got {rope_theta!r}")
        partial = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
        mrope = rope.get("mrope_section", [11, 11, 10])
        if not (isinstance(mrope, (list, tuple)) and len(mrope) == 3
                and all(isinstance(n, int) and n >= 0 for n in mrope)):
            raise ConfigError(f"config.json: field 'rope_parameters.mrope_section' must be 3 counts, got {mrope!r}")
        head_dim = need("head_dim")
        rotary_dim = int(head_dim * partial)
        if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
            raise ConfigError(f"config.json: field 'partial_rotary_factor' {partial!r} gives a bad rotary dim")

        heads, kv_heads = need("num_attention_heads"), need("num_key_value_heads")
        if heads % kv_heads:
            raise ConfigError(
                f"config.json: field 'num_attention_heads' ({heads}) must be a multiple of "
                f"'num_key_value_heads' ({kv_heads})"
            )
        lk, lv = need("linear_num_key_heads"), need("linear_num_value_heads")
        if lv % lk:
            raise ConfigError(
                f"config.json: field 'linear_num_value_heads' ({lv}) must be a multiple of "
                f"'linear_num_key_heads' ({lk})"
            )
        if text.get("attention_bias", False):
            raise ConfigError("config.json: field 'attention_bias' = true is not supported by Qwen3.5")
        act = text.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"config.json: field 'hidden_act' {act!r} is not supported (Qwen3.5 uses 'silu')")

        moe = {}
        if is_moe:
            moe = dict(
                num_experts=need("num_experts"),
                num_experts_per_tok=need("num_experts_per_tok"),
                moe_intermediate_size=need("moe_intermediate_size"),
                shared_expert_intermediate_size=need("shared_expert_intermediate_size"),
            )
            if moe["num_experts_per_tok"] > moe["num_experts"]:
                raise ConfigError("config.json: field 'num_experts_per_tok' exceeds 'num_experts'")
        else:
            moe = dict(intermediate_size=need("intermediate_size"))

        eos = text.get("eos_token_id", raw.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        tie = raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        quant = raw.get("quantization_config", text.get("quantization_config"))
        return cls(
            architecture=arch,
            is_moe=is_moe,
            layout=layout,
            vocab_size=need("vocab_size"),
            hidden_size=need("hidden_size"),
            layer_types=tuple(layer_types),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rotary_dim=rotary_dim,
            rope_theta=float(rope_theta),
            mrope_section=tuple(mrope),
            rms_norm_eps=float(need("rms_norm_eps", float)),
            linear_num_key_heads=lk,
            linear_num_value_heads=lv,
            linear_key_head_dim=need("linear_key_head_dim"),
            linear_value_head_dim=need("linear_value_head_dim"),
            linear_conv_kernel_dim=need("linear_conv_kernel_dim"),
            tie_word_embeddings=bool(tie),
            max_position_embeddings=int(text.get("max_position_embeddings", 262144)),
            eos_token_ids=tuple(int(e) for e in eos_ids),
            quantization=None if quant is None else QuantizationConfig.from_dict(quant),
            **moe,
        )

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        return cls.from_dict(read_config_json(path))

    def with_overrides(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)


def read_config_json(path: str | Path) -> dict[str, Any]:
    """A config.json's object, or a ConfigError naming the file."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no config.json") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: must hold a JSON object")
    return raw


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """The vision tower's hyperparameters (config.json `vision_config`; hashable: a static jit argument). A field
    config.json leaves out takes transformers' Qwen3_5VisionConfig default, as transformers reads it."""

    depth: int = 27
    hidden_size: int = 1152
    intermediate_size: int = 4304
    num_heads: int = 16
    out_hidden_size: int = 3584
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    num_position_embeddings: int = 2304
    in_channels: int = 3
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """One row of pixel_values: channels x temporal x patch x patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def merged_dim(self) -> int:
        """The merger's input: the hidden states of one spatial_merge_size^2 block, concatenated."""
        return self.hidden_size * self.spatial_merge_size**2

    @property
    def grid_side(self) -> int:
        """The side of the square learned position table (transformers truncates a non-square count the same)."""
        return int(self.num_position_embeddings**0.5)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> VisionConfig:
        """From a whole config.json object."""
        vision = raw.get("vision_config")
        if not isinstance(vision, dict):
            raise ConfigError("config.json: no 'vision_config' object (the checkpoint has no vision tower)")
        fields = {}
        for f in dataclasses.fields(cls):
            if f.name == "rope_theta" or f.name not in vision:
                continue
            value = vision[f.name]
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"config.json: field 'vision_config.{f.name}' must be a positive integer, "
                                  f"got {value!r}")
            fields[f.name] = value
        act = vision.get("hidden_act", "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            raise ConfigError(f"config.json: field 'vision_config.hidden_act' {act!r} is not supported "
                              "(Qwen3.5 uses 'gelu_pytorch_tanh')")
        rope = vision.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ConfigError(f"config.json: field 'vision_config.rope_parameters.rope_type' "
                              f"{rope['rope_type']!r} is not supported (only 'axial')")
        theta = rope.get("rope_theta", cls.rope_theta)
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
            raise ConfigError(f"config.json: field 'vision_config.rope_parameters.rope_theta' must be a positive "
                              f"number, got {theta!r}")
        vcfg = cls(**fields, rope_theta=float(theta))
        if vcfg.hidden_size % vcfg.num_heads or vcfg.head_dim % 4:
            raise ConfigError(
                f"config.json: field 'vision_config.hidden_size' ({vcfg.hidden_size}) must be 'num_heads' "
                f"({vcfg.num_heads}) heads of a multiple of 4 (the 2-D rotary splits each head in four)"
            )
        return vcfg

    @classmethod
    def from_file(cls, path: str | Path) -> VisionConfig:
        return cls.from_dict(read_config_json(path))
