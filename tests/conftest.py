"""Shared fixtures: random tiny checkpoints in HF layout and the HF transformers oracle built from them."""

from __future__ import annotations

import os
import warnings

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
warnings.filterwarnings("ignore", message=".*Triton.*deprecated.*")

from ninfer_jax.model.tiny import preset_config, write_random_checkpoint  # noqa: E402

# Small vocabulary for the oracle tests: the logits matmul would otherwise dominate every CPU run.
ORACLE_VOCAB = 1024


def oracle_config(preset: str, layout: str = "text", **overrides) -> dict:
    overrides.setdefault("vocab_size", ORACLE_VOCAB)
    overrides.setdefault("eos_token_id", 7)
    return preset_config(preset, layout=layout, **overrides)


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory):
    """make(preset, layout="text", seed=0, dtype="float32", shards=1, **text_overrides) -> directory."""
    made = {}

    def make(preset, layout="text", seed=0, dtype="float32", shards=1, **overrides):
        key = (preset, layout, seed, dtype, shards, tuple(sorted(overrides.items())))
        if key not in made:
            directory = tmp_path_factory.mktemp(f"{preset}-{layout}")
            made[key] = write_random_checkpoint(
                directory, oracle_config(preset, layout, **overrides), seed=seed, dtype=dtype, shards=shards
            )
        return made[key]

    return make


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
