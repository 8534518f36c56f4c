"""Image preprocessing against transformers' Qwen2-VL image processor (Pillow backend): the same pixel_values
bit for bit and the same image_grid_thw; decoding a request's image bytes as transformers converts them to RGB,
and refusing what cannot be used."""

import io

import numpy as np
import pytest

from ninfer_jax.config import ConfigError
from ninfer_jax.frontend.image_processing import ImageError, ImageProcessorConfig, decode_image, preprocess_images

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


def _encoded(image, fmt: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **options)
    return buffer.getvalue()


def test_decoded_images_equal_transformers_rgb_conversion():
    from PIL import Image
    from transformers.image_transforms import convert_to_rgb

    rng = np.random.default_rng(0)
    rgba = Image.fromarray(rng.integers(0, 256, (9, 13, 4), dtype=np.uint8), "RGBA")
    grey = Image.fromarray(rng.integers(0, 256, (7, 5), dtype=np.uint8), "L")
    palette = grey.convert("P")
    palette.info["transparency"] = 3
    for image, fmt in ((rgba, "PNG"), (grey, "JPEG"), (palette, "GIF"), (rgba.convert("RGB"), "WEBP")):
        data = _encoded(image, fmt, **({"lossless": True} if fmt == "WEBP" else {}))
        want = convert_to_rgb(Image.open(io.BytesIO(data)), return_numpy=True)
        got = decode_image(data)
        assert got.dtype == np.uint8 and got.shape == (*image.size[::-1], 3)
        np.testing.assert_array_equal(got, want)


def test_images_a_request_cannot_use_are_refused_saying_why():
    from PIL import Image

    image = Image.fromarray(np.zeros((40, 30, 3), np.uint8))
    png = _encoded(image, "PNG")
    cases = [(b"hello, not an image", "not an image"), (_encoded(image, "TIFF"), "format TIFF is not supported"),
             (png[:len(png) // 2], "cannot be decoded"),
             (_encoded(image, "GIF", save_all=True, append_images=[Image.fromarray(np.ones((40, 30, 3), np.uint8))]),
              "animated")]
    for data, words in cases:
        with pytest.raises(ImageError, match=words):
            decode_image(data)
    with pytest.raises(ImageError, match="30 x 40 pixels; at most 1000"):
        decode_image(png, max_pixels=1000)
