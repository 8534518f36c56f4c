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


@pytest.mark.parametrize("preset", ["tiny-dense", "qwen3.5-27b"])
def test_mrope_positions_rotate_as_transformers(preset):
    """Distinct time, height and width positions (an image's tokens) against transformers' Qwen3.5 text rotary
    embedding and apply_rotary_pos_emb, at the tiny rotary width (8 frequencies: the sections cut short) and the
    27B's (32: every section whole); text positions (all three equal) give 1-D RoPE exactly."""
    import jax.numpy as jnp
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    from ninfer_jax.config import ModelConfig
    from ninfer_jax.model.qwen3_5 import rope
    from ninfer_jax.model.tiny import preset_config

    raw = preset_config(preset, "text")
    cfg = ModelConfig.from_dict(raw)
    rng = np.random.default_rng(0)
    t, heads = 12, 2
    positions = rng.integers(0, 50, (3, t))
    x = rng.normal(size=(t, heads, cfg.head_dim)).astype(np.float32)
    rotary = hf.Qwen3_5TextRotaryEmbedding(Qwen3_5TextConfig(**{k: v for k, v in raw.items()
                                                                if k not in ("architectures", "model_type")}))
    cos, sin = rotary(torch.tensor(x), torch.tensor(positions)[:, None, :])
    want, _ = hf.apply_rotary_pos_emb(torch.tensor(x)[None].transpose(1, 2), torch.tensor(x)[None].transpose(1, 2),
                                      cos, sin)
    got = np.asarray(rope(jnp.asarray(x), jnp.asarray(positions), cfg))
    np.testing.assert_allclose(got, want[0].transpose(0, 1).numpy(), rtol=0, atol=1e-5)
    same = np.broadcast_to(positions[0], (3, t))
    np.testing.assert_array_equal(np.asarray(rope(jnp.asarray(x), jnp.asarray(same), cfg)),
                                  np.asarray(rope(jnp.asarray(x), jnp.asarray(positions[0]), cfg)))
