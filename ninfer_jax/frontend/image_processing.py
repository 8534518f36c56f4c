"""Images -> the vision tower's pixel_values and image_grid_thw, as transformers' Qwen2-VL image processor makes
them (the class Qwen3.5 checkpoints name in preprocessor_config.json).

Per image, RGB uint8 [H, W, 3]: `smart_resize` picks the size (each side a multiple of patch * merge, the pixel
count within [shortest_edge, longest_edge], the aspect kept as closely as possible); Pillow resizes with bicubic;
values become float64 * rescale_factor, then float32 (x - mean) / std; the image is cut into patch x patch
squares in spatial-merge-block order and each square repeated temporal_patch_size times (a still image fills
the tower's temporal kernel).

NOTE: equal to transformers' Pillow backend (`Qwen2VLImageProcessorPil`), bit for bit. Its torchvision backend,
chosen where torchvision is installed, resizes with torch's antialiased bicubic, which rounds some pixels of a
resized image differently; an image already at its target size comes out the same from both.
Videos are not supported.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from ninfer_jax.config import ConfigError

BICUBIC = 3  # PIL.Image.Resampling.BICUBIC, the processor's `resample`


@dataclasses.dataclass(frozen=True)
class ImageProcessorConfig:
    """preprocessor_config.json's image fields. A field the file leaves out takes the transformers class's default
    (Qwen2-VL's: patch 14, CLIP mean and std), as transformers reads it; Qwen3.5's files set them all."""

    min_pixels: int = 56 * 56  # size.shortest_edge
    max_pixels: int = 28 * 28 * 1280  # size.longest_edge
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, float, float] = (0.48145466, 0.4578275, 0.40821073)
    image_std: tuple[float, float, float] = (0.26862954, 0.26130258, 0.27577711)
    rescale_factor: float = 1 / 255

    @property
    def factor(self) -> int:
        """Each side of a resized image is a multiple of this: one merged token's pixels."""
        return self.patch_size * self.merge_size

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ImageProcessorConfig:
        def refuse(field, why):
            raise ConfigError(f"preprocessor_config.json: field {field!r} {why}")

        for flag in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
            if raw.get(flag, True) is not True:
                refuse(flag, f"= {raw[flag]!r} is not supported (only true)")
        if raw.get("resample", BICUBIC) != BICUBIC:
            refuse("resample", f"= {raw['resample']!r} is not supported (only {BICUBIC}, bicubic)")
        size = raw.get("size") or {}
        if not isinstance(size, dict):
            refuse("size", f"must be an object, got {size!r}")
        # As transformers: min_pixels / max_pixels, where given, override size
        fields = {
            "min_pixels": raw.get("min_pixels", size.get("shortest_edge", cls.min_pixels)),
            "max_pixels": raw.get("max_pixels", size.get("longest_edge", cls.max_pixels)),
        }
        for name in ("patch_size", "temporal_patch_size", "merge_size"):
            fields[name] = raw.get(name, getattr(cls, name))
        for name, value in fields.items():
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                refuse(name, f"must be a positive integer, got {value!r}")
        if fields["min_pixels"] > fields["max_pixels"]:
            refuse("size", f"has shortest_edge {fields['min_pixels']} > longest_edge {fields['max_pixels']}")
        for name in ("image_mean", "image_std"):
            value = raw.get(name, getattr(cls, name))
            if isinstance(value, (int, float)):  # one number for every channel
                value = [value] * 3
            if not isinstance(value, (list, tuple)) or len(value) != 3 or not all(
                    isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
                refuse(name, f"must be 3 numbers, got {value!r}")
            if name == "image_std" and not all(v > 0 for v in value):
                refuse(name, f"must be positive, got {value!r}")
            fields[name] = tuple(float(v) for v in value)
        rescale = raw.get("rescale_factor", cls.rescale_factor)
        if isinstance(rescale, bool) or not isinstance(rescale, (int, float)) or rescale <= 0:
            refuse("rescale_factor", f"must be a positive number, got {rescale!r}")
        return cls(**fields, rescale_factor=float(rescale))

    @classmethod
    def from_file(cls, path: str | Path) -> ImageProcessorConfig:
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"{path}: cannot read ({e})") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: must hold a JSON object")
        return cls.from_dict(raw)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The resized (height, width): transformers' rule, Python's round (half to even) included."""
    if max(height, width) / min(height, width) > 200:
        ratio = max(height, width) / min(height, width)
        raise ValueError(f"image is {width} x {height}: its aspect ratio must be at most 200, got {ratio}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def image_grid(cfg: ImageProcessorConfig, height: int, width: int) -> tuple[int, int, int]:
    """An image's (t, h, w) in patches; the tower gives it h * w / merge_size^2 tokens."""
    h, w = smart_resize(height, width, cfg.factor, cfg.min_pixels, cfg.max_pixels)
    return 1, h // cfg.patch_size, w // cfg.patch_size


def normalization_table(cfg: ImageProcessorConfig) -> np.ndarray:
    """float32 [3, 256]: each channel's normalised value of each byte, in transformers' float order (the product
    in float64, rounded to float32, then normalised in float32), so a lookup equals the processor bit for bit."""
    x = (np.arange(256, dtype=np.float64) * cfg.rescale_factor).astype(np.float32)
    return (x[None, :] - np.array(cfg.image_mean, np.float32)[:, None]) / np.array(cfg.image_std, np.float32)[:, None]


def image_patches(cfg: ImageProcessorConfig, image: np.ndarray) -> np.ndarray:
    """One image [H, W, 3] uint8 resized, as uint8 patches [gh * gw, 3, P, P] in merge-block order: pixel_values
    before normalisation and the temporal repeat (an eighth of their bytes, what the engine sends the device)."""
    from PIL import (
        Image,  # the frontend's decoder; imported where an image is processed
    )

    height, width = image.shape[:2]
    new_h, new_w = smart_resize(height, width, cfg.factor, cfg.min_pixels, cfg.max_pixels)
    resized = np.asarray(Image.fromarray(image).resize((new_w, new_h), resample=BICUBIC))
    p, m = cfg.patch_size, cfg.merge_size
    gh, gw = new_h // p, new_w // p
    x = resized.reshape(gh // m, m, p, gw // m, m, p, 3).transpose(0, 3, 1, 4, 6, 2, 5)  # (gh, gw, mh, mw, C, ph, pw)
    return np.ascontiguousarray(x).reshape(gh * gw, 3, p, p)


def pixel_values_of(table: np.ndarray, patches: np.ndarray, temporal: int) -> np.ndarray:
    """uint8 patches [n, 3, P, P] (`image_patches`) -> pixel_values rows [n, 3 * T * P * P] float32, by the
    processor's `normalization_table` and its temporal patch size T (each patch repeated)."""
    x = table[np.arange(3)[None, :, None, None], patches]
    n, _, p, _ = patches.shape
    return np.broadcast_to(x[:, :, None], (n, 3, temporal, p, p)).reshape(n, -1)


def _patches(cfg: ImageProcessorConfig, image: np.ndarray) -> np.ndarray:
    """One image [H, W, 3] uint8 -> its rows of pixel_values [gh * gw, 3 * T * P * P] float32."""
    return pixel_values_of(normalization_table(cfg), image_patches(cfg, image), cfg.temporal_patch_size)


def preprocess_images(cfg: ImageProcessorConfig, images) -> tuple[np.ndarray, np.ndarray]:
    """Images -> (pixel_values float32 [sum of h*w, 3*T*P*P], image_grid_thw int64 [n, 3]), image after image.

    Args:
      images: decoded RGB images, each a uint8 array [H, W, 3].
    Raises:
      ValueError naming the image for a wrong array or an aspect ratio over 200.
    """
    rows, grids = [], []
    for i, image in enumerate(images):
        if (not isinstance(image, np.ndarray) or image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3
                or 0 in image.shape):
            what = f"{image.dtype} {image.shape}" if isinstance(image, np.ndarray) else type(image).__name__
            raise ValueError(f"image {i}: expected a non-empty uint8 RGB array [H, W, 3], got {what}")
        try:
            rows.append(_patches(cfg, image))
        except ValueError as e:
            raise ValueError(f"image {i}: {e}") from None
        grids.append(image_grid(cfg, *image.shape[:2]))
    if not rows:
        raise ValueError("no images")
    return np.concatenate(rows), np.array(grids, np.int64)


# --- decoding ---------------------------------------------------------------------------------------------------
# What a request's image may be before any pixel is decoded: formats Pillow reads safely and clients send, and a
# pixel bound read from the header, so a small file that decodes to gigabytes is refused before it does.
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
MAX_IMAGE_PIXELS = 64 << 20


class ImageError(ValueError):
    """An image a request cannot use: not an image, a format not taken, too large, or animated."""


def decode_image(data: bytes, *, max_pixels: int = MAX_IMAGE_PIXELS) -> np.ndarray:
    """An encoded image (PNG, JPEG, WebP, GIF or BMP bytes) -> RGB uint8 [H, W, 3], transparency composited onto
    white as transformers' `convert_to_rgb` does. Raises ImageError saying what is wrong."""
    import io

    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))  # reads the header only
    except UnidentifiedImageError:
        raise ImageError("not an image (or a format that cannot be read)") from None
    except Exception as e:  # a damaged header
        raise ImageError(f"the image cannot be read: {e}") from None
    if image.format not in IMAGE_FORMATS:
        raise ImageError(f"image format {image.format} is not supported; send {', '.join(IMAGE_FORMATS)}")
    width, height = image.size
    if width * height > max_pixels:
        raise ImageError(f"the image has {width} x {height} pixels; at most {max_pixels} are allowed")
    if getattr(image, "n_frames", 1) > 1:
        raise ImageError("animated images are not supported; send one frame")
    try:
        image.load()
    except Exception as e:  # a truncated or damaged body
        raise ImageError(f"the image cannot be decoded: {e}") from None
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        image = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba)
    return np.array(image.convert("RGB"))
