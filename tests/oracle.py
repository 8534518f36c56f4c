"""The test oracle: HF transformers' Qwen3.5 built from the tiny random checkpoints, and their small vocabulary."""

from __future__ import annotations

from ninfer_jax.model.tiny import preset_config

# Small vocabulary for the oracle tests: the logits matmul would otherwise dominate every CPU run.
ORACLE_VOCAB = 1024


def oracle_config(preset: str, layout: str = "text", **overrides) -> dict:
    overrides.setdefault("vocab_size", ORACLE_VOCAB)
    overrides.setdefault("eos_token_id", 7)
    return preset_config(preset, layout=layout, **overrides)


def hf_model(directory, layout="text"):
    """The HF transformers model for a checkpoint directory, float32, eval mode (test-only oracle)."""
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    if layout == "text":
        cls = transformers.AutoModelForCausalLM
    else:
        import json

        arch = json.loads((directory / "config.json").read_text())["architectures"][0]
        cls = getattr(transformers, arch)
    return cls.from_pretrained(directory, dtype=torch.float32).eval()


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
