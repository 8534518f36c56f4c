"""Checkpoint loading: both layouts, shards, bf16, and an error naming the problem for each bad input."""

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from oracle import oracle_config
from ninfer_jax.model import CheckpointError, ConfigError, forward, load_checkpoint
from ninfer_jax.model.tiny import params_tensors, write_checkpoint, write_random_checkpoint


@pytest.fixture()
def dense_dir(tmp_path):
    return write_random_checkpoint(tmp_path / "ckpt", oracle_config("tiny-dense", "text"), seed=3)


def _edit_config(directory, **text_fields):
    path = directory / "config.json"
    raw = json.loads(path.read_text())
    raw.update(text_fields)
    path.write_text(json.dumps(raw))


def _edit_tensors(directory, fn):
    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    fn(tensors)
    save_file(tensors, str(path))


def test_vlm_and_text_layouts_load_the_same_weights(tmp_path):
    text = write_random_checkpoint(tmp_path / "t", oracle_config("tiny-moe", "text"), seed=4)
    vlm = write_random_checkpoint(tmp_path / "v", oracle_config("tiny-moe", "vlm"), seed=4)
    (ct, pt), (cv, pv) = load_checkpoint(text, "float32"), load_checkpoint(vlm, "float32")
    assert ct.layout == "text" and cv.layout == "vlm" and ct.is_moe and cv.is_moe
    tokens = np.arange(70) % 1024
    np.testing.assert_array_equal(np.asarray(forward(pt, ct, tokens)), np.asarray(forward(pv, cv, tokens)))


def test_params_written_back_load_as_the_same_params(tmp_path):
    """params_tensors + write_checkpoint (how a trained model is written) invert the loader: MoE, VLM layout, MTP."""
    config = oracle_config("tiny-moe", "vlm")
    cfg, params = load_checkpoint(write_random_checkpoint(tmp_path / "a", config, seed=4), dtype="float32")
    _, again = load_checkpoint(write_checkpoint(tmp_path / "b", config, params_tensors(cfg, params)), dtype="float32")
    same = jax.tree.map(lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))), params, again)
    assert again.mtp is not None and all(jax.tree.leaves(same))


def test_sharded_bf16_checkpoint_loads_in_requested_dtype(tmp_path):
    single = write_random_checkpoint(tmp_path / "one", oracle_config("tiny-dense", "vlm"), seed=5, dtype="bfloat16")
    sharded = write_random_checkpoint(
        tmp_path / "many", oracle_config("tiny-dense", "vlm"), seed=5, dtype="bfloat16", shards=3
    )
    assert len(list(sharded.glob("*.safetensors"))) == 3
    (_, a), (cfg, b) = load_checkpoint(single, "bfloat16"), load_checkpoint(sharded, "bfloat16")
    assert b.embed.dtype == jnp.bfloat16 and b.layers[0].mixer.a_log.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(a.embed, np.float32), np.asarray(b.embed, np.float32))
    assert np.isfinite(np.asarray(forward(b, cfg, np.arange(10)))).all()


def test_missing_tensor_is_named(dense_dir):
    _edit_tensors(dense_dir, lambda t: t.pop("model.layers.2.linear_attn.A_log"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.2\.linear_attn\.A_log'"):
        load_checkpoint(dense_dir, "float32")


def test_misshaped_tensor_is_named_with_both_shapes(dense_dir):
    def shrink(t):
        t["model.layers.3.self_attn.k_proj.weight"] = t["model.layers.3.self_attn.k_proj.weight"][:-1]

    _edit_tensors(dense_dir, shrink)
    with pytest.raises(CheckpointError, match=r"'model\.layers\.3\.self_attn\.k_proj\.weight' has shape "
                                              r"\(127, 128\), expected \(128, 128\)"):
        load_checkpoint(dense_dir, "float32")


def test_unknown_architecture_is_named(dense_dir):
    _edit_config(dense_dir, architectures=["LlamaForCausalLM"])
    with pytest.raises(ConfigError, match="unsupported architecture 'LlamaForCausalLM'"):
        load_checkpoint(dense_dir, "float32")


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("num_attention_heads", 3, "'num_attention_heads' \\(3\\) must be a multiple of 'num_key_value_heads'"),
        ("linear_num_value_heads", 3, "'linear_num_value_heads' \\(3\\) must be a multiple"),
        ("hidden_size", -1, "'hidden_size' must be a positive integer"),
        ("layer_types", ["linear_attention"], "'layer_types' must list 4 entries"),
        ("hidden_act", "gelu", "'hidden_act' 'gelu' is not supported"),
        ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e6}, "'rope_parameters.rope_type' 'yarn'"),
    ],
)
def test_bad_config_field_is_named(dense_dir, field, value, message):
    _edit_config(dense_dir, **{field: value})
    with pytest.raises(ConfigError, match=message):
        load_checkpoint(dense_dir, "float32")


def test_missing_config_field_is_named(dense_dir):
    raw = json.loads((dense_dir / "config.json").read_text())
    del raw["linear_key_head_dim"]
    (dense_dir / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="missing field 'linear_key_head_dim'"):
        load_checkpoint(dense_dir, "float32")


def test_damaged_safetensors_file_is_named(dense_dir):
    path = dense_dir / "model.safetensors"
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with pytest.raises(CheckpointError, match="model.safetensors: cannot read safetensors file"):
        load_checkpoint(dense_dir, "float32")


def test_unsupported_dtype_argument_is_refused(dense_dir):
    with pytest.raises(ValueError, match="dtype must be one of"):
        load_checkpoint(dense_dir, "float16")


def test_tensor_dtype_on_disk_is_checked(dense_dir):
    _edit_tensors(dense_dir, lambda t: t.update({"model.norm.weight": np.zeros(128, np.int32)}))
    with pytest.raises(CheckpointError, match="'model.norm.weight' has unsupported dtype int32"):
        load_checkpoint(dense_dir, "float32")


def test_bf16_weights_are_bit_identical_after_load(tmp_path):
    directory = write_random_checkpoint(tmp_path / "b", oracle_config("tiny-dense", "text"), seed=6, dtype="bfloat16")
    _, params = load_checkpoint(directory, "bfloat16")
    disk = load_file(str(directory / "model.safetensors"))["model.norm.weight"]
    assert disk.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(np.asarray(params.final_norm).view(np.uint16), disk.view(np.uint16))


def test_a_built_in_checkpoint_another_version_wrote_is_written_again(tmp_path, monkeypatch):
    """The built-in default is reused while its stamp (the stored weights, the config, the writer version) matches,
    and replaced when it does not (a copy written before the MTP layer or the vision tower were): never served
    without them."""
    from ninfer_jax.model import tiny

    monkeypatch.setenv("NINFER_HOME", str(tmp_path))
    writes = []

    def write(directory):  # the real writer takes seconds (the tokenizer files)
        writes.append(directory)
        (directory / "config.json").write_text("{}")

    monkeypatch.setattr(tiny, "write_default_checkpoint", write)
    first = tiny.default_checkpoint()
    assert first == tmp_path / "tiny-trained-vlm" and len(writes) == 1
    assert tiny.default_checkpoint() == first and len(writes) == 1  # reused
    (first / tiny.STAMP).write_text("another version")
    (first / "left-over").write_text("x")
    assert tiny.default_checkpoint() == first and len(writes) == 2
    assert not (first / "left-over").exists() and (first / tiny.STAMP).read_text() != "another version"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-trained-vlm"]  # nothing else left behind
