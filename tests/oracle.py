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
