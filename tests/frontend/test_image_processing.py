"""Image preprocessing against transformers' Qwen2-VL image processor (Pillow backend): the same pixel_values
bit for bit and the same image_grid_thw."""

import numpy as np
import pytest

from ninfer_jax.config import ConfigError
from ninfer_jax.frontend.image_processing import ImageProcessorConfig, preprocess_images

# Qwen3.5's released preprocessor_config.json (its image fields)
QWEN35 = {"size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16, "temporal_patch_size": 2,
          "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
# A small pixel budget, so that shrinking an image costs little
SMALL = {**QWEN35, "size": {"longest_edge": 128 * 96, "shortest_edge": 32 * 32}}


def _image(rng, height, width):
    # smooth gradients plus noise: bicubic's overshoot clips at 0 and 255 in places, as in photographs
    y, x = np.mgrid[:height, :width]
    base = np.stack([x * 255 / width, y * 255 / height, (x + y) * 127 / (width + height)], -1)
    return np.clip(base + rng.normal(0, 40, (height, width, 3)), 0, 255).astype(np.uint8)


@pytest.mark.parametrize("config,sizes,resized", [
    # 300 x 500 rounds to 288 x 512 (within the budget); 64 x 100 grows to the 65536-pixel minimum; 256 x 256 is
    # already on the grid (Pillow's copy)
    pytest.param(QWEN35, [(300, 500), (64, 100), (256, 256)], [(288, 512), (224, 320), (256, 256)],
                 id="qwen3.5-round-grow-keep"),
    # 400 x 300 shrinks to the 12288-pixel maximum
    pytest.param(SMALL, [(400, 300)], [(128, 96)], id="shrink"),
])
def test_pixel_values_equal_transformers(config, sizes, resized):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    rng = np.random.default_rng(1)
    images = [_image(rng, h, w) for h, w in sizes]
    pixel_values, grid_thw = preprocess_images(ImageProcessorConfig.from_dict(config), images)
    theirs = Qwen2VLImageProcessorPil(**config)(images, input_data_format="channels_last", return_tensors="np")
    np.testing.assert_array_equal(grid_thw, theirs["image_grid_thw"])
    assert pixel_values.dtype == theirs["pixel_values"].dtype == np.float32
    np.testing.assert_array_equal(pixel_values, theirs["pixel_values"])
    assert [tuple(int(v) * 16 for v in g[1:]) for g in grid_thw] == resized


def test_bad_images_and_configs_are_named():
    cfg = ImageProcessorConfig.from_dict(QWEN35)
    with pytest.raises(ValueError, match=r"image 1: expected a non-empty uint8 RGB array \[H, W, 3\], got float32"):
        preprocess_images(cfg, [np.zeros((32, 32, 3), np.uint8), np.zeros((32, 32, 3), np.float32)])
    with pytest.raises(ValueError, match="image 0: image is 1000 x 4: its aspect ratio must be at most 200"):
        preprocess_images(cfg, [np.zeros((4, 1000, 3), np.uint8)])
    with pytest.raises(ConfigError, match="field 'patch_size' must be a positive integer"):
        ImageProcessorConfig.from_dict({**QWEN35, "patch_size": 0})
