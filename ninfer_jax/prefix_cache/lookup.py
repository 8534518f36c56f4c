"""Prompt lookup: the matched path and the valid resume points on it (spec §6.1).

1. Walk from the root: for block ``b < floor((n - 1) / 64)`` find the child by
   ``block_hashes[b]`` and accept it only when its tokens and extra key are equal. Stop at the
   first miss: the matched path ``N_0 .. N_{k-1}``.
2. Candidates: every snapshot anchored on the path (or the root) whose tail tokens (and the
   tail block's extra key) equal the prompt's, with ``F <= n - 1`` (at least one prompt token
   is always prefilled) and ``F`` not strictly inside a Vision span.
3. ``s*`` is the deepest candidate; ``s_dev`` the deepest whose image, tail and every path
   node are Device resident.

Read-only, O(k + snapshots on the path); the walk compares 256-byte token slices
(timings: docs/benchmarks/prefix_index.md).
"""

from __future__ import annotations

import numpy as np

from .admission import MatchResult
from .hashing import BLOCK_TOKENS, HashFn, block_hashes, encode_tokens, strictly_inside
from .tree import RESIDENT, BlockTree, Snapshot


def match_prompt(tree: BlockTree, tokens, hashes, extras, vision_spans, hash_fn: HashFn,
                 epoch: int) -> MatchResult:
    """Matches ``tokens`` against ``tree`` (see the module docstring); ``hashes`` may be None."""
    data = encode_tokens(tokens)
    n = len(data) // 4
    if n < 1:
        raise ValueError("cannot match an empty prompt")
    if hashes is None:
        hashes = block_hashes(data, extras, hash_fn=hash_fn)
    elif isinstance(hashes, np.ndarray):
        hashes = hashes.tolist()
    path, anchors = tree.walk(data, hashes, extras, (n - 1) // BLOCK_TOKENS)
    candidates: list[Snapshot] = []
    n_extras = len(extras) if extras is not None else 0
    for node in anchors:
        begin = BLOCK_TOKENS * (node.depth + 1)
        block_extra = extras[node.depth + 1] if node.depth + 1 < n_extras else 0
        for s in node.snapshots:
            f = s.frontier
            if f > n - 1:
                continue
            if s.tail_len and (s.tail_extra != block_extra or data[4 * begin:4 * f] != s.tail_tokens):
                continue
            if vision_spans and strictly_inside(f, vision_spans):
                continue
            candidates.append(s)
    candidates.sort(key=lambda s: s.frontier)
    deepest_device = None
    if candidates:
        reach = candidates[-1].anchor.depth + 1
        resident = 0
        while resident < reach and path[resident].device_state is RESIDENT:
            resident += 1
        for s in reversed(candidates):
            if s.anchor.depth < resident and s.device_complete():
                deepest_device = s
                break
    return MatchResult(path, candidates, candidates[-1] if candidates else None, deepest_device, n, epoch)
