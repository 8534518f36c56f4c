"""Logit parity of our functional Qwen3.5 with HF transformers' Qwen3_5 / Qwen3_5Moe classes (fp32)."""

import chex
import numpy as np
import pytest
import torch

from oracle import ORACLE_VOCAB, hf_model
from ninfer_jax.model import forward, load_checkpoint

CASES = [
    # preset, layout, seed
    ("tiny-dense", "text", 11),
    ("tiny-dense", "vlm", 12),
    ("tiny-moe", "text", 14),
    ("tiny-moe", "vlm", 15),
]
PROMPT_LEN = 203  # > 200 and not a multiple of 64


def _both_logits(directory, layout, seed):
    cfg, params = load_checkpoint(directory, dtype="float32")
    tokens = np.random.default_rng(seed).integers(0, ORACLE_VOCAB, PROMPT_LEN)
    ours = np.asarray(forward(params, cfg, tokens))
    with torch.no_grad():
        theirs = hf_model(directory, layout)(input_ids=torch.tensor(tokens)[None]).logits[0].numpy()
    chex.assert_shape(ours, (PROMPT_LEN, ORACLE_VOCAB))
    assert np.abs(theirs).max() > 1.0  # the comparison is not between near-zero outputs
    return cfg, ours, theirs


@pytest.mark.parametrize("preset,layout,seed", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_logits_match_transformers(checkpoint_factory, preset, layout, seed):
    cfg, ours, theirs = _both_logits(checkpoint_factory(preset, layout, seed=seed), layout, seed)
    assert cfg.linear_num_value_heads > cfg.linear_num_key_heads  # grouped value heads exercised
    assert not cfg.tie_word_embeddings
    chex.assert_trees_all_close(ours, theirs, atol=1e-4, rtol=0)


def test_tied_embeddings_logits_match_transformers(checkpoint_factory):
    # Tied logits read the unnormalised embedding (std 1), so they reach ~30; the bound is relative.
    directory = checkpoint_factory("tiny-dense", "text", seed=13, tie_word_embeddings=True)
    cfg, ours, theirs = _both_logits(directory, "text", 13)
    assert cfg.tie_word_embeddings
    chex.assert_trees_all_close(ours, theirs, atol=1e-5 * np.abs(theirs).max(), rtol=0)


@pytest.mark.parametrize("preset,seed", [("tiny-dense", 11), ("tiny-moe", 14)])
def test_logits_match_transformers_with_pallas_kernels(checkpoint_factory, preset, seed):
    """The same oracle with the kernel switch on (Pallas in interpret mode on CPU)."""
    from ninfer_jax.model import KernelConfig

    directory = checkpoint_factory(preset, "text", seed=seed)
    cfg, params = load_checkpoint(directory, dtype="float32")
    tokens = np.random.default_rng(seed).integers(0, ORACLE_VOCAB, PROMPT_LEN)
    ours = np.asarray(forward(params, cfg, tokens, KernelConfig("pallas", interpret=True)))
    with torch.no_grad():
        theirs = hf_model(directory)(input_ids=torch.tensor(tokens)[None]).logits[0].numpy()
    chex.assert_trees_all_close(ours, theirs, atol=1e-4, rtol=0)
