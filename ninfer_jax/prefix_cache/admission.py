"""Admission source choice and capacity arithmetic (spec §6.2, §6.3).

Candidates are the root, the deepest valid snapshot ``s*`` and the deepest valid snapshot
whose image, tail and path are all Device resident ``s_dev`` (at most three)::

    cost(s) = restore_seconds(host path + host image + host tail bytes)
            + prefill_seconds(base=F_s, tokens=n - F_s)

The cheapest wins (ties: fewer transferred bytes, then the deeper frontier). Capacity is
arithmetic, exact because every unpinned Device cache entry owns one page group::

    need_pages(s) = host-only path blocks (H2D destinations)
                  + 1 if the tail is Host-only (restored into a cache-owned page)
                  + entitlement_pages - floor(F_s / 64)     (the lane's private pages; the
                                                             tail's private copy is one of them)
    available(s)  = free + device-evictable - entries this admission pins itself

When the chosen source does not fit, the next cheaper-to-materialise one is tried: ``s_dev``,
then the root. When none fits, the request is TemporarilyBlocked if the root's entitlement
fits the whole pool (active entitlements hold the pages) and PermanentlyInfeasible if it does
not even fit an empty cache. A candidate with a block or tail another admission is still
filling is skipped. The cost model only ranks; readiness never depends on it (§10.10).

Quotes carry the index's ``cache_epoch``; any mutation that could invalidate a quote bumps it,
so a stale quote is detected in O(1) and re-quoted.
"""

from __future__ import annotations

import dataclasses
import enum
import math

from .cost import CacheCostModel
from .hashing import BLOCK_TOKENS
from .tree import ABSENT, FILLING, RESIDENT, BlockNode, Snapshot


class Readiness(enum.Enum):
    READY = "ready"
    TEMPORARILY_BLOCKED = "temporarily_blocked"
    PERMANENTLY_INFEASIBLE = "permanently_infeasible"


class StaleQuoteError(RuntimeError):
    """The cache changed since the quote was made (its cache_epoch is old): quote again."""


@dataclasses.dataclass(frozen=True, slots=True)
class MatchResult:
    """What a prompt matches (spec §6.1).

    Attributes:
      path: matched nodes N_0..N_{k-1} (full blocks below floor((n-1)/64)).
      candidates: valid snapshots on the path with F <= n - 1, by frontier.
      deepest: s*, the deepest candidate (None when there is none).
      deepest_device: s_dev, the deepest candidate restorable without Host copies.
      prompt_tokens: n.
      epoch: the index's cache_epoch when matched.
    """

    path: list[BlockNode]
    candidates: list[Snapshot]
    deepest: Snapshot | None
    deepest_device: Snapshot | None
    prompt_tokens: int
    epoch: int

    @property
    def cached_prefix_tokens(self) -> int:
        """Tokens of the longest cached block prefix, reusable or not (reuse-loss attribution)."""
        return BLOCK_TOKENS * len(self.path)


@dataclasses.dataclass(frozen=True, slots=True)
class SourceCandidate:
    """One admission source with its transfer, cost and capacity figures.

    ``snapshot`` is None for the root. ``own_evictable`` counts the device-LRU entries
    (path nodes, tail) this admission would pin and so cannot evict for itself.
    """

    snapshot: Snapshot | None
    frontier: int
    host_path_blocks: int
    host_tail: bool
    host_image: bool
    transfer_bytes: int
    filling: bool
    own_evictable: int
    cost_seconds: float
    need_pages: int


@dataclasses.dataclass(frozen=True, slots=True)
class AdmissionQuote:
    """The selected source, exact at admission (spec §8.1 HybridAdmissionQuote)."""

    readiness: Readiness
    source: SourceCandidate | None
    candidates: tuple[SourceCandidate, ...]
    match: MatchResult
    entitlement_pages: int
    epoch: int

    @property
    def reuse_tokens(self) -> int:
        """F_s of the chosen source (reported as cached_tokens); 0 unless Ready."""
        return self.source.frontier if self.source is not None else 0


def entitlement_pages(prompt_tokens: int, output_window_tokens: int, cushion_pages: int = 0) -> int:
    """Pages a lane may grow into: the prompt plus a bounded output window plus a cushion."""
    return math.ceil((prompt_tokens + output_window_tokens) / BLOCK_TOKENS) + cushion_pages


def assess_source(match: MatchResult, s: Snapshot | None, entitlement: int, cost: CacheCostModel,
                  block_bytes: int, image_bytes: int) -> SourceCandidate:
    """Transfer bytes, cost and page need of resuming ``match``'s prompt from ``s`` (root if None)."""
    n = match.prompt_tokens
    host_blocks = own = 0
    filling = False
    frontier = 0
    host_tail = host_image = False
    if s is not None:
        frontier = s.frontier
        for node in match.path[:s.anchor.depth + 1]:
            state = node.device_state
            if state is ABSENT:
                host_blocks += 1
            elif state is FILLING:
                filling = True
            if node.lru is not None:
                own += 1
        if s.tail_len:
            host_tail = s.tail_device is ABSENT
            filling = filling or s.tail_device is FILLING
            if s.lru is not None:
                own += 1
        host_image = s.image_device is not RESIDENT
    transfer = host_blocks * block_bytes + (block_bytes if host_tail else 0) + (image_bytes if host_image else 0)
    seconds = cost.restore_seconds(transfer) + cost.prefill_seconds(frontier, n - frontier)
    need = host_blocks + (1 if host_tail else 0) + max(0, entitlement - frontier // BLOCK_TOKENS)
    return SourceCandidate(snapshot=s, frontier=frontier, host_path_blocks=host_blocks, host_tail=host_tail,
                           host_image=host_image, transfer_bytes=transfer, filling=filling, own_evictable=own,
                           cost_seconds=seconds, need_pages=need)


def fits(candidate: SourceCandidate, free_pages: int, evictable_pages: int) -> bool:
    """need_pages(s) <= free + evictable - the entries this admission pins itself."""
    return candidate.need_pages <= free_pages + evictable_pages - candidate.own_evictable


def make_quote(match: MatchResult, entitlement: int, cost: CacheCostModel, *, block_bytes: int,
               image_bytes: int, free_pages: int, evictable_pages: int, capacity_pages: int,
               epoch: int) -> AdmissionQuote:
    """Chooses the source and classifies readiness (spec §6.2, §6.3)."""
    seen: list[Snapshot | None] = [None]
    for s in (match.deepest, match.deepest_device):
        if s is not None and s not in seen:
            seen.append(s)
    assessed = [assess_source(match, s, entitlement, cost, block_bytes, image_bytes) for s in seen]
    root = assessed[0]
    usable = [c for c in assessed if not c.filling]
    chosen = min(usable, key=lambda c: (c.cost_seconds, c.transfer_bytes, -c.frontier))
    order = [chosen]
    for c in assessed[1:]:
        if c.snapshot is match.deepest_device and c is not chosen and not c.filling:
            order.append(c)
    if root is not chosen:
        order.append(root)
    for c in order:
        if fits(c, free_pages, evictable_pages):
            return AdmissionQuote(Readiness.READY, c, tuple(assessed), match, entitlement, epoch)
    readiness = (Readiness.TEMPORARILY_BLOCKED if root.need_pages <= capacity_pages
                 else Readiness.PERMANENTLY_INFEASIBLE)
    return AdmissionQuote(readiness, None, tuple(assessed), match, entitlement, epoch)


def backfill_admissible(borrower_need: int, head_root_need: int, free_pages: int, evictable_pages: int,
                        donor_entitlements_released: int) -> bool:
    """The backfill proof's arithmetic (spec §6.3; hybrid mode does not issue it).

    A request behind a blocked FIFO head may borrow only if both it and the head's root source
    still fit once the donors' entitlements are released::

        need(borrower) + need(head root) <= free + all_evictable + sum(donor entitlements released)
    """
    return borrower_need + head_root_need <= free_pages + evictable_pages + donor_entitlements_released
