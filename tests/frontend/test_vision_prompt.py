"""A chat's images in its PreparedPrompt: placeholder spans as transformers' processor expands them, media keys
(spec §5.1) by decoded pixels, hints past the spans, and refusals naming the part."""

import io

import numpy as np
import pytest
from PIL import Image

from frontend_support import qwen35_dir, tokenizer  # noqa: F401  (fixtures)
from ninfer_jax.frontend import Breakpoint, ChatTemplate, VisionFrontend, prepare_chat
from ninfer_jax.frontend.image_processing import ImageError, ImageProcessorConfig
from ninfer_jax.frontend.mrope import mrope_positions
from ninfer_jax.frontend.prepared_prompt import continue_prompt
from ninfer_jax.prefix_cache import BLOCK_TOKENS
from ninfer_jax.prefix_cache.hashing import block_lookup_hash, encode_tokens

# Qwen3.5's processor: 16-pixel patches merged 2 x 2; a small minimum area keeps the spans short
PROCESSOR = ImageProcessorConfig(min_pixels=32 * 32, max_pixels=256 * 256, patch_size=16, merge_size=2,
                                 image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5))


def encoded(pixels: np.ndarray, fmt: str = "PNG") -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, fmt)
    return out.getvalue()


def pixels(seed: int, height: int, width: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def chat(first, second):
    return [
        {"role": "system", "content": "You read images."},
        {"role": "user", "content": [{"type": "text", "text": "Here is a chart: " * 20},
                                     {"type": "image", "image": first},
                                     {"type": "text", "text": "and a photo"},
                                     {"type": "image", "image": second},
                                     {"type": "text", "text": "What differs?"}]},
    ]


@pytest.fixture(scope="module")
def vision(tokenizer):  # noqa: F811
    return VisionFrontend(PROCESSOR, tokenizer.token_to_id("<|image_pad|>"))


def test_images_expand_as_the_processor_does_with_positions_hints_and_media_keys(tokenizer, vision):  # noqa: F811
    a, b = pixels(1, 100, 140), pixels(2, 64, 300)
    messages = chat(encoded(a), encoded(b))
    p = prepare_chat(tokenizer, messages, vision=vision, breakpoints=[Breakpoint(1, 1)])
    grids = [im.grid for im in p.media.images]
    lengths = [im.length for im in p.media.images]
    assert grids == [(1, 6, 8), (1, 4, 18)] and lengths == [12, 18]  # sides rounded to 32 pixels
    # transformers' processor: each <|image_pad|> of the rendered text repeated per token, then tokenized
    text = ChatTemplate.qwen35().render(messages).text
    pieces = text.split("<|image_pad|>")
    expanded = pieces[0] + "".join("<|image_pad|>" * n + piece for n, piece in zip(lengths, pieces[1:]))
    assert p.token_ids.tolist() == tokenizer.encode(expanded)
    pad = vision.image_pad_id
    for im in p.media.images:
        assert (p.token_ids[im.begin:im.end] == pad).all() and p.token_ids[im.end] != pad
    positions, delta = mrope_positions(p.num_tokens, [(im.begin, im.grid) for im in p.media.images], 2)
    np.testing.assert_array_equal(p.media.rope_positions, positions)
    assert p.media.rope_delta == delta < 0
    # the breakpoint on the image part: just past its <|vision_end|>
    vision_end = tokenizer.token_to_id("<|vision_end|>")
    first = p.media.images[0]
    assert p.token_ids[first.end] == vision_end
    assert any(h.position == first.end + 1 and h.kind.name == "EXPLICIT" for h in p.tap_hints)

    # The media key digests decoded pixels: the same image as a BMP keys the same; another image differs from the
    # first block it overlaps, and blocks before it are unchanged.
    same = prepare_chat(tokenizer, chat(encoded(a, "BMP"), encoded(b)), vision=vision)
    assert (same.block_hashes == p.block_hashes).all()
    changed = a.copy()
    changed[50, 70] ^= 1
    other = prepare_chat(tokenizer, chat(encoded(changed), encoded(b)), vision=vision)
    assert (other.token_ids == p.token_ids).all()
    differs = np.flatnonzero(other.block_hashes != p.block_hashes)
    assert differs[0] == first.begin // BLOCK_TOKENS and len(differs) == len(p.block_hashes) - differs[0]


def test_an_unusable_image_part_is_refused_naming_it(tokenizer, vision):  # noqa: F811
    good = encoded(pixels(3, 64, 64))
    cases = [
        (chat(good, b"not an image"), vision, "messages[1].content[3]: not an image"),
        (chat(good, good), None, "messages[1].content[1]: this model has no vision tower"),
        (chat(good, good), VisionFrontend(PROCESSOR, vision.image_pad_id, max_images=1),
         "messages[1].content[3]: at most 1 images"),
        (chat(good, np.zeros((4, 4), np.uint8)), vision, "messages[1].content[3]: an image array must be"),
        ([{"role": "user", "content": [{"type": "video", "video": good}]}], vision,
         "messages[0].content[0]: videos are not supported"),
    ]
    for messages, frontend, message in cases:
        with pytest.raises(ImageError, match=message.replace("[", r"\[").replace("]", r"\]")):
            prepare_chat(tokenizer, messages, vision=frontend)
    spoofed = chat(good, good)
    spoofed[1]["content"][0]["text"] = "<|image_pad|>"  # text may not hold the placeholder
    with pytest.raises(ImageError, match="3 <\\|image_pad\\|> tokens for 2 images"):
        prepare_chat(tokenizer, spoofed, vision=vision)


def test_a_prompt_with_images_continued_by_text_has_the_positions_and_hashes_of_the_longer_sequence(
        tokenizer, vision):  # noqa: F811
    """A preempted request's prefix: the prompt and its output so far. Its MRoPE positions are the whole sequence's
    (text after the images: index plus the rope delta), and its block hashes the ones the cache chains for generated
    blocks (each block's media key, salted in block 0)."""
    p = prepare_chat(tokenizer, chat(encoded(pixels(1, 100, 140)), encoded(pixels(2, 64, 300))), vision=vision,
                     cache_salt="tenant")
    output = np.random.default_rng(3).integers(0, 1000, 2 * BLOCK_TOKENS + 7)
    c = continue_prompt(p, output)
    n = c.num_tokens
    assert n == p.num_tokens + len(output) and (c.token_ids[p.num_tokens:] == output).all()
    positions, delta = mrope_positions(n, [(im.begin, im.grid) for im in p.media.images], 2)
    np.testing.assert_array_equal(c.media.rope_positions, positions)
    assert c.media.rope_delta == delta == p.media.rope_delta and c.media.images == p.media.images
    chain, previous = [], 0
    for b in range(n // BLOCK_TOKENS):
        previous = block_lookup_hash(previous, encode_tokens(c.token_ids[b * BLOCK_TOKENS:(b + 1) * BLOCK_TOKENS]),
                                     p.block_extra(b))
        chain.append(previous)
    assert c.block_hashes.tolist() == chain and (c.block_hashes[:len(p.block_hashes)] == p.block_hashes).all()
    assert c.salt == p.salt and c.tap_hints == p.tap_hints
