"""MRoPE positions of prompts with image spans against transformers' Qwen3.5 get_rope_index."""

import types

import numpy as np
import pytest
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from ninfer_jax.frontend.mrope import mrope_positions


def _transformers(length, images, merge):
    model = types.SimpleNamespace(config=types.SimpleNamespace(vision_config=types.SimpleNamespace(
        spatial_merge_size=merge)))
    model.get_vision_position_ids = lambda *a, **k: hf.Qwen3_5Model.get_vision_position_ids(model, *a, **k)
    kinds = torch.zeros(1, length, dtype=torch.int32)
    for start, (t, h, w) in images:
        kinds[0, start:start + t * h * w // merge**2] = 1
    grids = torch.tensor([g for _, g in images]) if images else None
    positions, delta = hf.Qwen3_5Model.get_rope_index(model, torch.zeros(1, length, dtype=torch.long), kinds, grids)
    return positions[:, 0].numpy(), int(delta[0, 0])


@pytest.mark.parametrize("length, images", [
    (20, []),  # text only: one position per token on every axis, delta 0
    (40, [(3, (1, 4, 6)), (13, (1, 8, 8))]),  # text, an image, text, a larger square image, text
    # an image first, one text token (real prompts always separate images: vision_end, vision_start), a wide one
    (12, [(0, (1, 4, 4)), (5, (1, 2, 6))]),
])
def test_positions_and_rope_delta_equal_transformers(length, images):
    got, delta = mrope_positions(length, images, merge=2)
    want, want_delta = _transformers(length, images, 2)
    np.testing.assert_array_equal(got, want)
    assert delta == want_delta


def test_spans_that_overlap_or_run_past_the_prompt_are_refused():
    with pytest.raises(ValueError, match="overlaps"):
        mrope_positions(20, [(2, (1, 4, 4)), (4, (1, 4, 4))], merge=2)
    with pytest.raises(ValueError, match="prompt's end"):
        mrope_positions(5, [(2, (1, 4, 4))], merge=2)
    with pytest.raises(ValueError, match="merged patches"):
        mrope_positions(20, [(2, (1, 3, 4))], merge=2)
