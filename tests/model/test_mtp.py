"""The MTP layer against transformers' own Qwen3.5 modules (fp32), and its loading."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file
from safetensors.torch import load_file as load_torch

from oracle import ORACLE_VOCAB, hf_model, oracle_config
from ninfer_jax.model import CheckpointError, load_checkpoint
from ninfer_jax.model.mtp import mtp_forward, mtp_logits
from ninfer_jax.model.params import AttnParams, MLPParams, MoEParams, QuantizedWeight
from ninfer_jax.model.random_init import random_params
from ninfer_jax.model.tiny import write_random_checkpoint

SEQ = 70  # crosses a 64-token page


def _oracle_mtp(hf, directory, hidden, next_tokens):
    """transformers' decoder layer of full-attention type, RMSNorm and rotary embedding, and a torch Linear for fc,
    loaded with the checkpoint's mtp.* tensors: (final-normed MTP hidden [T, H], logits [T, V])."""
    cfg, model = hf.config, hf.model
    tensors = load_torch(str(directory / "model.safetensors"))
    mtp = {k.removeprefix("mtp."): v for k, v in tensors.items() if k.startswith("mtp.")}
    attn_index = cfg.layer_types.index("full_attention")
    layer = type(model.layers[attn_index])(cfg, attn_index).eval()
    layer.load_state_dict({k.removeprefix("layers.0."): v for k, v in mtp.items() if k.startswith("layers.0.")})

    def norm(name):
        n = type(model.norm)(cfg.hidden_size, eps=cfg.rms_norm_eps)
        n.load_state_dict({"weight": mtp[name + ".weight"]})
        return n

    fc = torch.nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
    fc.load_state_dict({"weight": mtp["fc.weight"]})
    t = hidden.shape[0]
    with torch.no_grad():
        e = norm("pre_fc_norm_embedding")(model.embed_tokens(next_tokens[None]))
        x = fc(torch.cat([e, norm("pre_fc_norm_hidden")(hidden[None])], dim=-1))
        positions = torch.arange(t).view(1, 1, -1).expand(3, 1, -1)  # the target's own positions, 0..T-1
        causal = torch.full((t, t), float("-inf")).triu(1)[None, None]
        x = layer(x, position_embeddings=model.rotary_emb(x, positions), attention_mask=causal)
        out = norm("norm")(x)[0]
        return out.numpy(), hf.lm_head(out).numpy()


@pytest.mark.parametrize("preset,seed", [("tiny-dense", 21), ("tiny-moe", 22)])
def test_mtp_layer_matches_transformers_modules(checkpoint_factory, preset, seed):
    directory = checkpoint_factory(preset, "text", seed=seed)
    cfg, params = load_checkpoint(directory, "float32")
    chex.assert_shape(params.mtp.fc, (2 * cfg.hidden_size, cfg.hidden_size))
    assert isinstance(params.mtp.layer.mixer, AttnParams)
    assert isinstance(params.mtp.layer.ffn, MoEParams if cfg.is_moe else MLPParams)
    tokens = torch.tensor(np.random.default_rng(seed).integers(0, ORACLE_VOCAB, SEQ + 1))
    hf = hf_model(directory)
    with torch.no_grad():  # the target's final-normed hidden states at positions 0..SEQ-1
        hidden = hf.model(input_ids=tokens[None, :SEQ]).last_hidden_state[0]
    theirs_hidden, theirs_logits = _oracle_mtp(hf, directory, hidden, tokens[1:])
    ours_hidden = mtp_forward(params, cfg, jnp.asarray(hidden.numpy()), tokens[1:].numpy())
    ours_logits = np.asarray(mtp_logits(params, ours_hidden))
    chex.assert_shape(ours_logits, (SEQ, ORACLE_VOCAB))
    assert np.abs(theirs_logits).max() > 1.0  # the comparison is not between near-zero outputs
    chex.assert_trees_all_close(np.asarray(ours_hidden), theirs_hidden, atol=1e-4, rtol=0)
    chex.assert_trees_all_close(ours_logits, theirs_logits, atol=1e-4, rtol=0)


def test_checkpoint_without_mtp_loads_with_none(tmp_path):
    directory = write_random_checkpoint(tmp_path / "c", oracle_config("tiny-dense", "vlm"), seed=3)
    tensors = load_file(str(directory / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if not k.startswith("mtp.")}, str(directory / "model.safetensors"))
    cfg, params = load_checkpoint(directory, "float32")
    assert params.mtp is None
    with pytest.raises(ValueError, match="no MTP layer"):
        mtp_forward(params, cfg, jnp.zeros((1, cfg.hidden_size)), [0])


def test_partial_mtp_layer_is_refused_naming_the_missing_tensor(tmp_path):
    directory = write_random_checkpoint(tmp_path / "c", oracle_config("tiny-dense", "text"), seed=3)
    tensors = load_file(str(directory / "model.safetensors"))
    del tensors["mtp.layers.0.self_attn.k_norm.weight"]
    save_file(tensors, str(directory / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'mtp\.layers\.0\.self_attn\.k_norm\.weight'"):
        load_checkpoint(directory, "float32")


def test_random_params_make_the_loaded_mtp_layer(tmp_path):
    one_layer = oracle_config("tiny-dense", "text", num_hidden_layers=1, layer_types=["full_attention"])
    cfg, loaded = load_checkpoint(write_random_checkpoint(tmp_path / "c", one_layer), "bfloat16")
    made = random_params(cfg, seed=1)

    def shapes(tree):
        return jax.tree.map(lambda a: (a.shape, a.dtype), tree)

    assert shapes(made.mtp) == shapes(loaded.mtp)
    fp8 = random_params(cfg, seed=1, fp8=True).mtp
    assert isinstance(fp8.layer.mixer.qkv_proj, QuantizedWeight) and fp8.fc.dtype == jnp.bfloat16
    hidden = jnp.asarray(np.random.default_rng(0).standard_normal((5, cfg.hidden_size)), jnp.bfloat16)
    out = mtp_forward(made, cfg, hidden, np.arange(5))
    assert out.dtype == jnp.bfloat16 and np.isfinite(np.asarray(out, np.float32)).all()
