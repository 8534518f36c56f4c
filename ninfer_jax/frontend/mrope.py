"""MRoPE positions of a prompt whose images are spans of placeholder tokens, as transformers' Qwen3.5
`get_rope_index` computes them.

Text tokens take one position on all three axes (time, height, width), counting on from the last. An image of
grid (t, h, w) patches is (t h w) / merge^2 placeholder tokens in row-major merged-patch order: its time
positions are its frame index, its height and width positions its merged row and column, each plus the position
it starts at; the next token starts max(h, w) / merge after it. A prompt's positions therefore run behind its
token count by the rope delta, which every later token (decode) adds to its index on all three axes.
"""

from __future__ import annotations

import numpy as np


def mrope_positions(length: int, images, merge: int) -> tuple[np.ndarray, int]:
    """(positions int32 [3, length], rope delta) of a prompt of `length` tokens.

    Args:
      images: (start, (t, h, w)) per image in order: the index of its first placeholder token and its patch grid
        (the vision tower's grid_thw, before merging).
      merge: the tower's spatial merge size.
    Raises:
      ValueError if a span overlaps another, runs past the prompt, or its grid does not divide by `merge`.
    """
    positions = np.zeros((3, length), np.int64)
    at = pos = 0  # the next token's index, and the position it takes
    for start, (t, h, w) in images:
        if h % merge or w % merge or min(t, h, w) < 1:
            raise ValueError(f"image grid {(t, h, w)} is not whole merged patches of {merge} x {merge}")
        gh, gw = h // merge, w // merge
        tokens = t * gh * gw
        if start < at or start + tokens > length:
            raise ValueError(f"an image span of {tokens} tokens at {start} overlaps another or the prompt's end "
                             f"({length} tokens)")
        positions[:, at:start] = pos + np.arange(start - at)
        pos += start - at
        frame, row, col = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
        positions[:, start:start + tokens] = pos + np.stack([frame, row, col]).reshape(3, -1)
        pos += max(h, w) // merge
        at = start + tokens
    positions[:, at:] = pos + np.arange(length - at)
    delta = int(positions.max()) + 1 - length if length else 0
    return positions.astype(np.int32), delta
