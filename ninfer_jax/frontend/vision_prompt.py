"""A chat prompt's images: each `<|image_pad|>` the template renders expanded into its image's placeholder span,
with the image's pixels, its media key (spec §5.1) and the prompt's MRoPE positions.

The media key digests the decoded RGB pixels (and their shape), not the file bytes: the same screenshot sent again
as another encoding, or with other metadata, is the same image to the model, and the pixels are decoded anyway.
The digest also covers every earlier image (through `media_keys`), because an earlier image shifts every later
token's MRoPE position.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ninfer_jax.prefix_cache.hashing import BLOCK_TOKENS, VisionItem, media_keys

from .image_processing import (MAX_IMAGE_PIXELS, ImageError, ImageProcessorConfig, decode_image, image_grid,
                               image_patches, normalization_table, pixel_values_of)
from .mrope import mrope_positions

IMAGE_PAD = "<|image_pad|>"


@dataclass(frozen=True)
class VisionFrontend:
    """What the frontend needs to expand images: the checkpoint's processor config, the placeholder token, and
    the per-request limits."""

    processor: ImageProcessorConfig
    image_pad_id: int
    max_images: int = 16
    max_image_pixels: int = MAX_IMAGE_PIXELS  # decoded pixels of one image, before resizing

    @classmethod
    def from_checkpoint(cls, directory: str | Path, tokenizer=None, config_file: str | Path | None = None,
                        **limits) -> VisionFrontend | None:
        """The checkpoint's preprocessor_config.json (its defaults if absent) and image pad id (config.json's, or
        `config_file`'s, `image_token_id`, as transformers reads it, else the tokenizer's); None when neither names
        one."""
        directory = Path(directory)
        path = directory / "preprocessor_config.json"
        processor = ImageProcessorConfig.from_file(path) if path.is_file() else ImageProcessorConfig()
        pad = json.loads(Path(config_file or directory / "config.json").read_text()).get("image_token_id")
        if pad is None and tokenizer is not None:
            pad = tokenizer.token_to_id(IMAGE_PAD)
        return None if pad is None else cls(processor, int(pad), **limits)

    def limited_to(self, max_tokens: int) -> VisionFrontend:
        """This frontend with images resized down to at most `max_tokens` placeholder tokens each (the processor's
        max_pixels lowered, as transformers' processor takes it)."""
        processor = self.processor
        max_pixels = min(processor.max_pixels, max_tokens * processor.factor**2)
        return dataclasses.replace(self, processor=dataclasses.replace(
            processor, max_pixels=max_pixels, min_pixels=min(processor.min_pixels, max_pixels)))

    def patch_range(self) -> tuple[int, int]:
        """(fewest, most) patches of one image after resizing: the encoder's bucket range."""
        area = self.processor.patch_size**2
        return max(1, self.processor.min_pixels // area), self.processor.max_pixels // area

    def tokens_of(self, grid: tuple[int, int, int]) -> int:
        """Placeholder tokens of an image of patch grid (t, h, w)."""
        t, h, w = grid
        return t * h * w // self.processor.merge_size**2


@dataclass(frozen=True, eq=False)
class PromptImage:
    """One image of a prompt: its placeholder span [begin, begin + length) and what the encoder needs."""

    begin: int
    length: int
    grid: tuple[int, int, int]  # (t, h, w) in patches
    digest: bytes  # 32 bytes: sha256 of the decoded RGB pixels and their shape
    patches: np.ndarray  # uint8 [t h w, 3, P, P], resized, read-only: pixel_values before normalising
    normalization: np.ndarray  # float32 [3, 256]: each channel's normalised value of each byte
    temporal: int  # the processor's temporal patch size (each patch repeated)

    @property
    def end(self) -> int:
        return self.begin + self.length

    @property
    def pixel_values(self) -> np.ndarray:
        """The processor's pixel_values rows [t h w, 3 T P P] float32 (the engine computes them on the device)."""
        return pixel_values_of(self.normalization, self.patches, self.temporal)


@dataclass(frozen=True, eq=False)
class PromptMedia:
    """A prompt's images, its MRoPE positions and rope delta, and its blocks' media keys."""

    images: tuple[PromptImage, ...]
    rope_positions: np.ndarray  # [3, n] int32, read-only
    rope_delta: int  # added to a generated token's index on every axis
    block_extras: np.ndarray  # [ceil(n / 64)] uint64 media keys, the partial last block's included

    @property
    def spans(self) -> tuple[tuple[int, int], ...]:
        return tuple((image.begin, image.length) for image in self.images)

    def extra(self, block: int) -> int:
        """Block `block`'s media key (0 past the prompt)."""
        return int(self.block_extras[block]) if block < len(self.block_extras) else 0

    def continued(self, tokens: int) -> PromptMedia:
        """The media of the prompt continued by text to `tokens` tokens: each added token's position is its index
        plus the rope delta on every axis, as a generated token's."""
        n = self.rope_positions.shape[1]
        added = np.broadcast_to(np.arange(n, tokens, dtype=np.int32) + self.rope_delta, (3, tokens - n))
        positions = np.concatenate([self.rope_positions, added], axis=1)
        positions.setflags(write=False)
        return dataclasses.replace(self, rope_positions=positions)


def image_parts(messages: Sequence[Mapping[str, Any]]) -> list[tuple[str, Any]]:
    """Every image content part in order, as (its location `messages[i].content[j]`, its bytes or RGB array).
    Raises ImageError for a video part: the template would render its placeholder, which nothing would fill."""
    found = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, (list, tuple)):
            continue
        for j, part in enumerate(content):
            if not isinstance(part, Mapping):
                continue
            if part.get("type") == "video" or "video" in part:
                raise ImageError(f"messages[{i}].content[{j}]: videos are not supported; send frames as images")
            if part.get("type") == "image" or "image" in part:
                found.append((f"messages[{i}].content[{j}]", part.get("image")))
    return found


def pixel_digest(image: np.ndarray) -> bytes:
    """sha256 of an RGB uint8 image's shape and pixels."""
    return hashlib.sha256(np.asarray(image.shape, "<i8").tobytes() + np.ascontiguousarray(image).tobytes()).digest()


def decode_part(vision: VisionFrontend, where: str, data: Any) -> np.ndarray:
    """An image part's bytes (or an RGB uint8 array, from the Python API) as RGB uint8 [H, W, 3]; ImageError
    naming the part otherwise."""
    if isinstance(data, np.ndarray):
        if data.dtype != np.uint8 or data.ndim != 3 or data.shape[2] != 3 or 0 in data.shape:
            raise ImageError(f"{where}: an image array must be uint8 RGB [H, W, 3], got {data.dtype} {data.shape}")
        if data.shape[0] * data.shape[1] > vision.max_image_pixels:
            raise ImageError(f"{where}: the image has {data.shape[1]} x {data.shape[0]} pixels; at most "
                             f"{vision.max_image_pixels} are allowed")
        return data
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ImageError(f"{where}: an image part holds the image's bytes, got {type(data).__name__}")
    try:
        return decode_image(bytes(data), max_pixels=vision.max_image_pixels)
    except ImageError as error:
        raise ImageError(f"{where}: {error}") from None


def expand_images(vision: VisionFrontend | None, ids: np.ndarray, parts: list[tuple[str, Any]]
                  ) -> tuple[np.ndarray, PromptMedia, np.ndarray]:
    """Expands each image pad token of `ids` (one per part, in order) into its image's span.

    Returns (the expanded ids, the media, the expanded position of each original position [len(ids) + 1]).
    Raises ImageError naming the part: no vision tower, too many images, a bad image, or pad tokens that do not
    match the image parts one to one.
    """
    if vision is None:
        raise ImageError(f"{parts[0][0]}: this model has no vision tower; send text")
    if len(parts) > vision.max_images:
        raise ImageError(f"{parts[vision.max_images][0]}: at most {vision.max_images} images a prompt")
    pads = np.flatnonzero(ids == vision.image_pad_id)
    if len(pads) != len(parts):
        raise ImageError(f"{parts[0][0]}: the prompt holds {len(pads)} {IMAGE_PAD} tokens for {len(parts)} images "
                         "(text must not contain the placeholder)")
    decoded = [decode_part(vision, where, data) for where, data in parts]
    table = normalization_table(vision.processor)
    table.setflags(write=False)
    images, pieces, at, shift = [], [], 0, 0
    shifted = np.arange(len(ids) + 1)
    for (where, _), pad, rgb in zip(parts, pads, decoded):
        try:
            patches = image_patches(vision.processor, rgb)
        except ValueError as error:  # an aspect ratio the resize rule refuses
            raise ImageError(f"{where}: {error}") from None
        grid = image_grid(vision.processor, *rgb.shape[:2])
        length = vision.tokens_of(grid)
        pieces += [ids[at:pad], np.full(length, vision.image_pad_id, ids.dtype)]
        begin = pad + shift
        shifted[pad + 1:] += length - 1
        shift += length - 1
        at = pad + 1
        patches.setflags(write=False)
        images.append(PromptImage(int(begin), length, grid, pixel_digest(rgb), patches, table,
                                  vision.processor.temporal_patch_size))
    pieces.append(ids[at:])
    expanded = np.concatenate(pieces).astype(np.int32)
    n = len(expanded)
    positions, delta = mrope_positions(n, [(im.begin, im.grid) for im in images], vision.processor.merge_size)
    items = [VisionItem(im.digest, 0, im.grid, im.begin, im.length) for im in images]
    extras = np.asarray(media_keys(-(-n // BLOCK_TOKENS), items), np.uint64)
    positions.setflags(write=False)
    extras.setflags(write=False)
    return expanded, PromptMedia(tuple(images), positions, delta, extras), shifted
