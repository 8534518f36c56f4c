"""The test oracle: HF transformers' Qwen3.5 built from the tiny random checkpoints, and their small vocabulary."""

from __future__ import annotations

import contextlib

from ninfer_jax.model.tiny import preset_config

# Small vocabulary for the oracle tests: the logits matmul would otherwise dominate every CPU run.
ORACLE_VOCAB = 1024


def oracle_config(preset: str, layout: str = "text", **overrides) -> dict:
    overrides.setdefault("vocab_size", ORACLE_VOCAB)
    overrides.setdefault("eos_token_id", 7)
    return preset_config(preset, layout=layout, **overrides)


def hf_model(directory, layout="text", eager_experts: bool = False):
    """The HF transformers model for a checkpoint directory, float32, eval mode (test-only oracle); eager_experts:
    the MoE experts as a loop of `linear` calls rather than a grouped matmul (for `fp8_activations`)."""
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    if layout == "text":
        cls = transformers.AutoModelForCausalLM
    else:
        import json

        arch = json.loads((directory / "config.json").read_text())["architectures"][0]
        cls = getattr(transformers, arch)
    extra = {"experts_implementation": "eager"} if eager_experts else {}
    return cls.from_pretrained(directory, dtype=torch.float32, **extra).eval()


def forward_greedy(directory):
    """run(prompt, tokens) -> the greedy choice at each generated position of one transformers forward over prompt +
    tokens (its cached generate() can flip a near-tie on a long random prompt; this oracle has no cache path)."""
    import torch

    model = hf_model(directory)

    def run(prompt, tokens):
        with torch.no_grad():
            logits = model(torch.tensor(list(prompt) + list(tokens))[None]).logits[0]
        return tuple(int(logits[len(prompt) - 1 + i].argmax()) for i in range(len(tokens)))

    return run


def dequantized_copy(fp8_dir, target):
    """An FP8 pack's weights dequantized with numpy (each value times its 128 x 128 block's scale) and written as
    an ordinary float32 checkpoint in `target`. Read through torch's safetensors, not the engine's loader."""
    import json

    import numpy as np
    from safetensors.numpy import save_file
    from safetensors.torch import load_file

    tensors = {}
    for path in sorted(fp8_dir.glob("*.safetensors")):
        tensors.update({k: v.float().numpy() for k, v in load_file(str(path)).items()})
    out = {}
    for name, t in tensors.items():
        if name.endswith("_scale_inv"):
            continue
        if name + "_scale_inv" in tensors:
            s = tensors[name + "_scale_inv"]
            t = t * np.repeat(np.repeat(s, 128, axis=0)[: t.shape[0]], 128, axis=1)[:, : t.shape[1]]
        out[name] = np.ascontiguousarray(t, np.float32)
    target.mkdir(parents=True, exist_ok=True)
    save_file(out, str(target / "model.safetensors"), metadata={"format": "pt"})
    raw = json.loads((fp8_dir / "config.json").read_text())
    del raw["quantization_config"]
    (target / "config.json").write_text(json.dumps(raw))
    return target


# The linears an FP8 pack quantizes (`tiny.FP8_LINEARS`) as transformers names their weights; the experts are 3-D.
_FP8_WEIGHTS = (".in_proj_qkv.weight", ".in_proj_z.weight", ".linear_attn.out_proj.weight", ".q_proj.weight",
                ".k_proj.weight", ".v_proj.weight", ".o_proj.weight", ".gate_proj.weight", ".up_proj.weight",
                ".down_proj.weight", ".experts.gate_up_proj", ".experts.down_proj")


@contextlib.contextmanager
def fp8_activations(model):
    """Within it, every input to one of `model`'s FP8-pack linears is quantized as the packs' `activation_scheme:
    dynamic` says and vLLM and SGLang do: per token and 128-group, scale amax / 448, values rounded to e4m3 and
    multiplied back (torch's own cast). The router, gates, in_proj_a/b and lm_head keep their inputs. MoE experts
    must be eager (`hf_model(..., eager_experts=True)`): a grouped matmul calls no `linear`."""
    import torch

    if any(type(m).__name__.endswith("Experts") and m.config._experts_implementation != "eager"
           for m in model.modules()):
        raise ValueError("fp8_activations: the model's experts are not eager (hf_model(..., eager_experts=True))")

    # by address range: an expert's weight is a view into its layer's 3-D parameter
    quantized = [(p.data_ptr(), p.data_ptr() + p.nbytes) for name, p in model.named_parameters()
                 if name.endswith(_FP8_WEIGHTS) and not name.startswith("model.visual.")]
    linear = torch.nn.functional.linear

    def fp8_linear(x, weight, bias=None):
        if any(lo <= weight.data_ptr() < hi for lo, hi in quantized):
            groups = x.reshape(*x.shape[:-1], x.shape[-1] // 128, 128)
            scale = groups.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 448.0
            x = ((groups / scale).to(torch.float8_e4m3fn).to(x.dtype) * scale).reshape(x.shape)
        return linear(x, weight, bias)

    torch.nn.functional.linear = fp8_linear
    try:
        yield
    finally:
        torch.nn.functional.linear = linear
