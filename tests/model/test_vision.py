"""The vision tower against transformers' Qwen3.5 vision model, and its loader's errors.

One preset: the dense and MoE models' towers are the same code in transformers (Qwen3_5VisionModel and
Qwen3_5MoeVisionModel differ only in name)."""

import numpy as np
import pytest
import torch
from oracle import hf_model, oracle_config
from safetensors.numpy import load_file, save_file

from ninfer_jax.model.loader import CheckpointError, load_vision_checkpoint
from ninfer_jax.model.tiny import write_random_checkpoint
from ninfer_jax.model.vision import (
    MAX_BUCKETS,
    encode_padded,
    encode_padded_batch,
    pad_image,
    padded_compile_count,
    patch_buckets,
    stack_images,
    vision_forward,
    warmup_padded,
)
from ninfer_jax.runtime.device.buckets import fit


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("vlm"), oracle_config("tiny-dense", "vlm"), seed=6)


@pytest.fixture(scope="module")
def towers(checkpoint):
    """(VisionConfig, our params, transformers' vision model), both read from the checkpoint."""
    vcfg, params = load_vision_checkpoint(checkpoint, "float32")
    visual = hf_model(checkpoint, "vlm").model.visual
    # transformers read the same tower from the checkpoint, not its own random init
    np.testing.assert_array_equal(visual.pos_embed.weight.detach().numpy(), np.asarray(params.pos_embed))
    return vcfg, params, visual


@pytest.mark.parametrize("grid", [
    # 4 x 6 patches: the 8 x 8 position table resampled down, non-square
    pytest.param([(1, 4, 6)], id="one-image"),
    # three sizes in one call (table resampled up, down, and a single merged token): no image attends to another
    pytest.param([(1, 12, 10), (1, 4, 6), (1, 2, 2)], id="three-images"),
])
def test_vision_tower_equals_transformers(towers, grid):
    vcfg, params, visual = towers
    n = sum(h * w for _, h, w in grid)
    pixels = np.random.default_rng(0).uniform(-1, 1, (n, vcfg.patch_dim)).astype(np.float32)
    ours = np.asarray(vision_forward(params, vcfg, pixels, grid))
    with torch.no_grad():
        theirs = visual(torch.tensor(pixels), grid_thw=torch.tensor(grid)).pooler_output.numpy()
    assert ours.shape == (n // 4, vcfg.out_hidden_size) and np.abs(theirs).max() > 1.0
    # float32 rounding of the same sums in another order (matmul for the Conv3d, XLA's attention for torch's
    # sdpa); 1e-4 on outputs of size ~1 leaves room for that and none for a wrong position or a crossed image
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)


def test_padded_encoding_equals_the_reference_on_its_valid_rows(checkpoint, towers):
    """Two grids, each padded to a bucket larger than it, one per call and both in one batch: the valid rows equal
    vision_forward (fp32 1e-5 of the largest value; bf16 3e-2, a couple of bf16 steps from rounding the same sums
    in another order) and transformers (fp32, 1e-4), so no valid patch attended to padding or another image."""
    vcfg, params, visual = towers
    bf16_params = load_vision_checkpoint(checkpoint, "bfloat16")[1]
    buckets = patch_buckets(vcfg, 256, min_patches=16)
    rng = np.random.default_rng(2)
    refs, images = [], []
    for grid, bucket in [((1, 4, 6), 32), ((1, 12, 10), 128)]:
        n = grid[1] * grid[2]
        assert fit(n, buckets, "{}") == bucket > n
        pixels = rng.uniform(-1, 1, (n, vcfg.patch_dim)).astype(np.float32)
        padded = pad_image(vcfg, pixels, grid, bucket)
        with torch.no_grad():
            theirs = visual(torch.tensor(pixels), grid_thw=torch.tensor([grid])).pooler_output.numpy()
        out = np.asarray(encode_padded(params, vcfg, *padded))
        assert out.shape == (bucket // 4, vcfg.out_hidden_size) and np.isfinite(out).all()
        ref = np.asarray(vision_forward(params, vcfg, pixels, [grid]))
        np.testing.assert_allclose(out[: n // 4], ref, atol=1e-5 * np.abs(ref).max(), rtol=0)
        np.testing.assert_allclose(out[: n // 4], theirs, atol=1e-4, rtol=0)
        refs.append(ref)
        images.append(pad_image(vcfg, pixels, grid, 128))
    # both images in one call, each attending within itself
    batch = np.asarray(encode_padded_batch(params, vcfg, *stack_images(images)))
    for out, ref in zip(batch, refs):
        np.testing.assert_allclose(out[: len(ref)], ref, atol=1e-5 * np.abs(ref).max(), rtol=0)
    # bf16, the larger image only (the same program in another dtype)
    out = np.asarray(encode_padded(bf16_params, vcfg, *padded), np.float32)
    ref = np.asarray(vision_forward(bf16_params, vcfg, pixels, [grid]), np.float32)
    np.testing.assert_allclose(out[: n // 4], ref, atol=3e-2 * np.abs(ref).max(), rtol=0)


def test_padded_rows_unspecified_attention_output_never_reaches_valid_rows(towers, monkeypatch):
    """jax does not specify the output rows of masked queries (cuDNN may skip them): NaN there must not reach a
    valid row through the next layer's values (0 * NaN)."""
    import jax

    from ninfer_jax.model import vision

    real = jax.nn.dot_product_attention

    def nan_past_the_query_lengths(q, k, v, *, query_seq_lengths, **kwargs):
        out = real(q, k, v, query_seq_lengths=query_seq_lengths, **kwargs)
        rows = np.arange(q.shape[1])[None, :, None, None] >= query_seq_lengths[:, None, None, None]
        return jax.numpy.where(rows, np.nan, out)

    monkeypatch.setattr(jax.nn, "dot_product_attention", nan_past_the_query_lengths)
    vcfg, params, _ = towers
    grid, n = (1, 4, 6), 24
    pixels = np.random.default_rng(3).uniform(-1, 1, (n, vcfg.patch_dim)).astype(np.float32)
    fresh = jax.jit(vision.padded_tower, static_argnames=("vcfg", "attention"))  # traced with the fake
    out = np.asarray(fresh(params, vcfg, *pad_image(vcfg, pixels, grid, 64)))
    monkeypatch.undo()
    ref = np.asarray(vision_forward(params, vcfg, pixels, [grid]))
    np.testing.assert_allclose(out[: n // 4], ref, atol=1e-5 * np.abs(ref).max(), rtol=0)


def test_images_served_after_warmup_compile_nothing(towers):
    """Every bucket compiled at startup; then images of each, however the caller passes them, run those."""
    import jax

    vcfg, params, _ = towers
    buckets = (16, 64)  # not compiled by another test: the warm-up's programs are counted
    before = padded_compile_count()
    warmup_padded(params, vcfg, buckets)
    assert padded_compile_count() == before + len(buckets)
    rng = np.random.default_rng(4)
    for grid, bucket in [((1, 2, 2), 16), ((1, 4, 4), 16), ((1, 6, 8), 64)]:
        n = grid[1] * grid[2]
        image = pad_image(vcfg, rng.uniform(-1, 1, (n, vcfg.patch_dim)).astype(np.float32), grid, bucket)
        encode_padded(params, vcfg, *image)
        encode_padded(params, vcfg, *jax.device_put(image._replace(n_valid=n)), attention="xla")
    assert padded_compile_count() == before + len(buckets)


def test_patch_buckets_cover_the_largest_image_and_refuse_a_larger_one(towers):
    vcfg = towers[0]
    buckets = patch_buckets(vcfg, 65536)  # the processor's default ceiling: 16777216 pixels of 16 x 16 patches
    fine = [(1024 << k) + (256 << k) * j for k in range(6) for j in range(4)] + [65536]
    assert buckets == (64, 128, 256, 512, *fine) and len(buckets) <= MAX_BUCKETS
    # a 1344-pixel image's 7056 patches pad to 7168 (1.6%), not to the next power of two (16%)
    assert patch_buckets(vcfg, 7056, min_patches=256)[-4:] == (4096, 5120, 6144, 7168)
    small = patch_buckets(vcfg, 100, min_patches=16)
    assert small == (16, 32, 64, 128)
    with pytest.raises(ValueError, match=r"\(1, 12, 12\) has 144 patches, more than its bucket of 128"):
        pad_image(vcfg, np.zeros((144, vcfg.patch_dim), np.float32), (1, 12, 12), small[-1])
    with pytest.raises(ValueError, match="more than 32: raise min_patches"):
        patch_buckets(vcfg, 1 << 20, min_patches=4)


def test_missing_vision_tensor_is_named(checkpoint, tmp_path):
    tensors = load_file(str(checkpoint / "model.safetensors"))
    del tensors["model.visual.blocks.1.attn.qkv.bias"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((checkpoint / "config.json").read_text())
    with pytest.raises(CheckpointError, match=r"missing tensor 'model.visual.blocks.1.attn.qkv.bias' .*\(96,\)"):
        load_vision_checkpoint(tmp_path, "float32")


def test_a_vlm_checkpoint_carries_the_preprocessing_its_tower_takes(checkpoint, towers):
    from ninfer_jax.frontend.image_processing import ImageProcessorConfig

    vcfg = towers[0]
    pre = ImageProcessorConfig.from_file(checkpoint / "preprocessor_config.json")
    assert (pre.patch_size, pre.temporal_patch_size, pre.merge_size) == \
        (vcfg.patch_size, vcfg.temporal_patch_size, vcfg.spatial_merge_size)
    assert (pre.min_pixels, pre.max_pixels, pre.image_mean) == (65536, 16777216, (0.5, 0.5, 0.5))


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
def test_a_prompt_with_images_gives_transformers_logits(tmp_path_factory, preset):
    """Text, an image, text, a larger image, text through the tower, the placeholder spans and MRoPE positions:
    the logits of transformers' Qwen3.5 VLM forward (fp32, 1e-4)."""
    from ninfer_jax.frontend.mrope import mrope_positions
    from ninfer_jax.model import forward, load_checkpoint

    image_token = 1000  # inside the oracle's vocabulary
    raw = {**oracle_config(preset, "vlm"), "image_token_id": image_token}
    path = write_random_checkpoint(tmp_path_factory.mktemp("vlm-prompt"), raw, seed=8)
    cfg, params = load_checkpoint(path, "float32")
    vcfg, vparams = load_vision_checkpoint(path, "float32")
    grids, merge = [(1, 4, 6), (1, 8, 8)], vcfg.spatial_merge_size
    rng = np.random.default_rng(1)
    text = [rng.integers(0, 900, n).tolist() for n in (5, 4, 3)]
    ids = np.array(text[0] + [image_token] * 6 + text[1] + [image_token] * 16 + text[2], np.int64)
    positions, _ = mrope_positions(len(ids), [(5, grids[0]), (15, grids[1])], merge)
    pixels = rng.uniform(-1, 1, (sum(h * w for _, h, w in grids), vcfg.patch_dim)).astype(np.float32)
    ours = np.asarray(forward(params, cfg, ids, image_embeds=vision_forward(vparams, vcfg, pixels, grids),
                              image_spans=ids == image_token, rope_positions=positions))
    with torch.no_grad():
        theirs = hf_model(path, "vlm")(input_ids=torch.tensor(ids)[None], pixel_values=torch.tensor(pixels),
                                       image_grid_thw=torch.tensor(grids),
                                       mm_token_type_ids=torch.tensor(ids == image_token)[None].int()).logits[0]
    assert np.abs(theirs.numpy()).max() > 1.0
    np.testing.assert_allclose(ours, theirs.numpy(), atol=1e-4, rtol=0)
