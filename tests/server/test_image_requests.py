"""Images through the server to the built-in tiny checkpoint's vision tower, with the official clients: the image's
tokens are counted as its processor config sizes it, a second turn reuses them from the cache, and a file that is
not an image is a 400 naming the request's block (not the template message it became)."""

from __future__ import annotations

import base64
import io

import anthropic
import numpy as np
import pytest
from PIL import Image

from ninfer_jax.frontend.image_processing import ImageProcessorConfig, image_grid
from ninfer_jax.model.tiny import default_checkpoint
from server_support import claude, oai, real_engine, server  # noqa: F401

HEIGHT, WIDTH = 24, 40


@pytest.fixture(scope="module")
def engine():
    return real_engine()


def _png() -> bytes:
    y, x = np.mgrid[:HEIGHT, :WIDTH]
    pixels = np.stack([x * 6, y * 10, (x + y) * 4], axis=-1).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def test_an_image_reaches_the_vision_model_and_its_tokens_are_cached_on_the_next_turn(oai, engine):
    config = ImageProcessorConfig.from_file(default_checkpoint() / "preprocessor_config.json")
    _, grid_h, grid_w = image_grid(config, HEIGHT, WIDTH)
    image_tokens = grid_h * grid_w // config.merge_size ** 2
    url = "data:image/png;base64," + base64.b64encode(_png()).decode()
    question = {"type": "text", "text": "What does this screenshot show? " + " ".join(f"Row {i}." for i in range(30))}
    fields = {"model": engine.model_name, "max_tokens": 3, "temperature": 0, "reasoning_effort": "none"}
    turn = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, question]}]
    first = oai.chat.completions.create(messages=turn, **fields)
    text_only = oai.chat.completions.create(messages=[{"role": "user", "content": [question]}], **fields)
    # <|vision_start|>, the image's tokens, <|vision_end|> where the text-only prompt has nothing
    assert first.usage.prompt_tokens - text_only.usage.prompt_tokens == image_tokens + 2
    second = oai.chat.completions.create(messages=turn + [
        {"role": "assistant", "content": first.choices[0].message.content or "ok"},
        {"role": "user", "content": "And the colours?"}], **fields)
    # the image starts a few tokens in: a reuse longer than its span reaches past its end
    assert second.usage.prompt_tokens_details.cached_tokens >= image_tokens + 2


def test_a_file_that_is_not_an_image_is_400_naming_the_anthropic_block(claude, engine):
    with pytest.raises(anthropic.BadRequestError) as raised:
        claude.messages.create(model=engine.model_name, max_tokens=3, system="Look closely.", messages=[
            {"role": "user", "content": [
                {"type": "text", "text": "What is this?"},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": base64.b64encode(b"plain text, not a PNG").decode()}}]}])
    # the template's messages[1].content[1] (the system prompt is its message 0) is the request's messages.0.content.1
    assert raised.value.body["error"]["message"].startswith("messages.0.content.1.source.data: not an image")


def test_an_anthropic_image_block_is_read_from_the_cache_on_the_next_turn(claude, engine):
    data = base64.b64encode(_png()).decode()
    text = "Describe the screenshot. " + " ".join(f"Item {i}." for i in range(30))
    turn = [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}},
        {"type": "text", "text": text}]}]
    fields = {"model": engine.model_name, "max_tokens": 1}
    first = claude.messages.create(messages=turn, **fields)
    second = claude.messages.create(messages=turn + [
        {"role": "assistant", "content": "".join(b.text for b in first.content if b.type == "text") or "ok"},
        {"role": "user", "content": "Which colours?"}], **fields)
    config = ImageProcessorConfig.from_file(default_checkpoint() / "preprocessor_config.json")
    _, grid_h, grid_w = image_grid(config, HEIGHT, WIDTH)
    assert second.usage.cache_read_input_tokens >= grid_h * grid_w // config.merge_size ** 2 + 2
