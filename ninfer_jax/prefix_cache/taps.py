"""Tap planning: where a request snapshots its prompt's state (spec §7.1).

``plan_taps(n, base, hints, existing_frontiers, vision_spans, options)`` returns taps sorted by
position, each ``p`` with ``base < p <= n - 1``, 64-aligned, not strictly inside a Vision span,
and not at an existing or already-planned snapshot. Candidates, in priority order:

  1 explicit markers (client-named breakpoints)              exact      published as Boundary
  2 start of the final assistant generation opener           exact      Tap
  3 end of tools / end of the leading System block           exact      Boundary
    protocol-automatic markers (planned as structural)       exact      Tap
  4 the prompt tail n - 1                                    flexible   Tap
  5 the ladder n - G * 2^k, k = 0, 1, ..., snapped back to   flexible   Tap
    a message boundary within tap_min_gap_tokens

Rules, applied in that order (ties by position):
  * semantic boundaries (opener, structural, automatic) closer than 64 tokens form one
    cluster (chained by consecutive gaps < 64); only its earliest position is kept, with the
    best priority of its members, and it is published as a Boundary if any member would be;
  * a request that resumed from an endpoint snapshot does not tap its generation opener;
  * a non-explicit candidate is dropped when an accepted tap, an existing snapshot on the path
    or the base lies at most 64 tokens before it; ladder candidates instead keep
    tap_min_gap_tokens on both sides; an explicit one is dropped only on an exact duplicate;
  * at most ``max_new_taps`` taps are kept (the first accepted in priority order).

Alignment (a documented choice): §5.3 says tap snapshots have ``tail_len == 0`` and §13.1 that
all taps are 64-aligned, while §7.4 also describes unaligned exact taps with a copied tail.
This planner follows §5.3/§13.1: every tap position is floored to the block boundary at or
below it (after moving a position strictly inside a Vision span to the span start, repeated
until stable). A later prompt diverging at the semantic boundary ``p`` then resumes at
``floor64(p)`` and re-prefills fewer than 64 tokens; in exchange a tap never needs a tail page,
publishes as soon as its anchor block commits, and stays a pure block-tree entry (the same
``floor(d/64) * 64`` choice §12.2 makes for coalescing). Endpoint snapshots stay exact (§7.7).
Exact taps split the prefill chunk at the floored position; flexible taps are realised at a
chunk boundary (the engine floors that to 64 as well).

The result is a pure function of its arguments (deterministic, independent of hint order).
"""

from __future__ import annotations

import bisect
import dataclasses
import enum
from typing import Iterable, Sequence

from .hashing import BLOCK_TOKENS, strictly_inside
from .tree import SnapshotKind


class HintKind(enum.Enum):
    EXPLICIT = "explicit"      # a client-named breakpoint (explicit evidence)
    OPENER = "opener"          # start of the final assistant generation opener
    TOOLS_END = "tools_end"    # end of the tools block
    SYSTEM_END = "system_end"  # end of the leading System/Developer block
    AUTOMATIC = "automatic"    # protocol-automatic marker (OpenAI default, Anthropic automatic)
    MESSAGE = "message"        # a message boundary: only snaps ladder taps


class TapSource(enum.Enum):
    EXPLICIT = "explicit"
    OPENER = "opener"
    STRUCTURAL = "structural"
    AUTOMATIC = "automatic"
    PROMPT_TAIL = "prompt_tail"
    LADDER = "ladder"


class Placement(enum.Enum):
    EXACT = "exact"        # splits the prefill chunk at the position
    FLEXIBLE = "flexible"  # realised at a chunk boundary, no split


@dataclasses.dataclass(frozen=True, slots=True)
class TapHint:
    position: int
    kind: HintKind


@dataclasses.dataclass(frozen=True, slots=True)
class PlannedTap:
    """A planned tap. ``rank`` is its acceptance order (priority order; lower is kept first)."""

    position: int
    placement: Placement
    kind: SnapshotKind
    source: TapSource
    priority: int
    rank: int


@dataclasses.dataclass(frozen=True)
class TapPlanOptions:
    max_new_taps: int = 8
    tap_ladder_tokens: int = 4096
    tap_min_gap_tokens: int = 1024
    block_tokens: int = BLOCK_TOKENS

    @classmethod
    def from_options(cls, options) -> "TapPlanOptions":
        """From a resolved ``PrefixCacheOptions``."""
        return cls(options.max_new_taps, options.tap_ladder_tokens, options.tap_min_gap_tokens)


_SEMANTIC = {
    HintKind.OPENER: (2, TapSource.OPENER, SnapshotKind.TAP),
    HintKind.TOOLS_END: (3, TapSource.STRUCTURAL, SnapshotKind.BOUNDARY),
    HintKind.SYSTEM_END: (3, TapSource.STRUCTURAL, SnapshotKind.BOUNDARY),
    HintKind.AUTOMATIC: (3, TapSource.AUTOMATIC, SnapshotKind.TAP),
}


@dataclasses.dataclass(frozen=True, slots=True)
class _Candidate:
    priority: int
    order: int       # position, or k for the ladder (generation order within a priority)
    position: int    # raw position before placement
    placement: Placement
    kind: SnapshotKind
    source: TapSource


def plan_taps(n: int, base: int, hints: Iterable[TapHint], existing_frontiers: Iterable[int] = (),
              vision_spans: Sequence[tuple[int, int]] = (), options: TapPlanOptions = TapPlanOptions(),
              resumed_from_endpoint: bool = False) -> list[PlannedTap]:
    """Plans a request's taps (spec §7.1); see the module docstring for every rule.

    Args:
      n: prompt tokens.
      base: F_s, the frontier the request resumes from (0 from the root).
      hints: tap hints and message boundaries from the Frontend.
      existing_frontiers: frontiers of snapshots already on this prompt's path.
      vision_spans: ``(begin, length)`` Vision token spans.
      options: budget, ladder spacing G, minimum gap, block size.
      resumed_from_endpoint: the request resumed from an endpoint snapshot (drop the opener).
    """
    block = options.block_tokens
    if n < 2 or base >= n - 1 or options.max_new_taps <= 0:
        return []
    hints = sorted(set(hints), key=lambda h: (h.position, h.kind.value))
    messages = sorted({h.position for h in hints if h.kind is HintKind.MESSAGE})
    spans = sorted(vision_spans)

    def place(p: int) -> int | None:
        p = min(p, n - 1)
        while True:
            span = strictly_inside(p, spans)
            if span is not None:
                p = span[0]
            aligned = p - p % block
            if aligned == p and span is None:
                break
            p = aligned
        return p if p > base else None

    cands = [_Candidate(1, h.position, h.position, Placement.EXACT, SnapshotKind.BOUNDARY, TapSource.EXPLICIT)
             for h in hints if h.kind is HintKind.EXPLICIT]
    cands += _semantic_clusters(hints, resumed_from_endpoint, block)
    cands.append(_Candidate(4, n - 1, n - 1, Placement.FLEXIBLE, SnapshotKind.TAP, TapSource.PROMPT_TAIL))
    gap = options.tap_min_gap_tokens
    k = 0
    while n - options.tap_ladder_tokens * (1 << k) > base:
        q = n - options.tap_ladder_tokens * (1 << k)
        i = bisect.bisect_right(messages, q)
        if i and messages[i - 1] >= q - gap:
            q = messages[i - 1]
        cands.append(_Candidate(5, k, q, Placement.FLEXIBLE, SnapshotKind.TAP, TapSource.LADDER))
        k += 1
    cands.sort(key=lambda c: (c.priority, c.order))

    anchors = sorted(set(existing_frontiers) | {base})  # accepted taps join as they are kept
    taken = set(existing_frontiers)
    out: list[PlannedTap] = []
    for c in cands:
        p = place(c.position)
        if p is None or p in taken:
            continue
        if c.source is TapSource.LADDER:
            if _nearest_distance(anchors, p) < gap:
                continue
        elif c.source is not TapSource.EXPLICIT:
            i = bisect.bisect_right(anchors, p)
            if i and p - anchors[i - 1] <= block:
                continue
        out.append(PlannedTap(p, c.placement, c.kind, c.source, c.priority, len(out)))
        taken.add(p)
        bisect.insort(anchors, p)
        if len(out) == options.max_new_taps:
            break
    out.sort(key=lambda t: t.position)
    return out


def _semantic_clusters(hints: list[TapHint], resumed_from_endpoint: bool, block: int) -> list[_Candidate]:
    """One candidate per cluster of semantic boundaries closer than a block (earliest kept)."""
    members = [h for h in hints if h.kind in _SEMANTIC
               and not (resumed_from_endpoint and h.kind is HintKind.OPENER)]
    out: list[_Candidate] = []
    cluster: list[TapHint] = []
    for h in members + [None]:
        if cluster and (h is None or h.position - cluster[-1].position >= block):
            first = cluster[0]
            _, source, _ = _SEMANTIC[first.kind]
            priority = min(_SEMANTIC[m.kind][0] for m in cluster)
            boundary = any(_SEMANTIC[m.kind][2] is SnapshotKind.BOUNDARY for m in cluster)
            kind = SnapshotKind.BOUNDARY if boundary else SnapshotKind.TAP
            out.append(_Candidate(priority, first.position, first.position, Placement.EXACT, kind, source))
            cluster = []
        if h is not None:
            cluster.append(h)
    return out


def _nearest_distance(sorted_positions: list[int], p: int) -> int:
    i = bisect.bisect_left(sorted_positions, p)
    best = 1 << 62
    if i < len(sorted_positions):
        best = sorted_positions[i] - p
    if i:
        best = min(best, p - sorted_positions[i - 1])
    return best


class TapPlanner:
    """``plan_taps`` bound to one engine's options."""

    def __init__(self, options: TapPlanOptions):
        self.options = options

    def plan(self, n: int, base: int, hints: Iterable[TapHint], existing_frontiers: Iterable[int] = (),
             vision_spans: Sequence[tuple[int, int]] = (), resumed_from_endpoint: bool = False) -> list[PlannedTap]:
        return plan_taps(n, base, hints, existing_frontiers, vision_spans, self.options, resumed_from_endpoint)
