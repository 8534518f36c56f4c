"""Taps: where a lane's prefill writes snapshots, and their publication (spec §7.1-§7.4, §12.2).

Taps are realised inside the prefill chunk by the kernels' state taps (the zero-split tap of §7.2-§7.3): no
chunk split, exact or flexible alike. Each tap gets a staging slot when its chunk is dispatched and is published
once its anchor block is a committed node (§7.4): right after that chunk, or, with an MTP backend one token behind,
after the next step when the tap lies at the chunk's end.
"""

from __future__ import annotations

from ninfer_jax.frontend.prepared_prompt import TapHintKind
from ninfer_jax.prefix_cache import (
    BLOCK_TOKENS, HintKind, Placement, PlannedTap, PrefixIndex, SnapshotKind, TapHint, TapPlanOptions, TapSource,
    plan_taps,
)
from ninfer_jax.prefix_cache.hashing import strictly_inside
from ninfer_jax.prefix_cache.tree import Snapshot
from ninfer_jax.runtime.prefix.records import LaneRecord
from ninfer_jax.runtime.prefix.slots import SlotTable

_HINTS = {
    TapHintKind.EXPLICIT: HintKind.EXPLICIT,
    TapHintKind.AUTOMATIC: HintKind.AUTOMATIC,
    TapHintKind.GENERATION_OPENER: HintKind.OPENER,
    TapHintKind.END_OF_TOOLS: HintKind.TOOLS_END,
    TapHintKind.END_OF_SYSTEM: HintKind.SYSTEM_END,
    TapHintKind.MESSAGE_BOUNDARY: HintKind.MESSAGE,
}
POLICIES = ("hpc", "align")


class TapScheduler:
    """Plans a lane's taps at admission, hands the kernel each chunk's tap slots, and publishes them.

    policy "hpc" plans by the spec (§7.1); "align" keeps one state at the prompt's last chunk boundary, as vLLM
    does, for comparison only.
    """

    def __init__(self, index: PrefixIndex, slots: SlotTable, *, policy: str, prefill_chunk: int, max_taps: int):
        if policy not in POLICIES:
            raise ValueError(f"cache policy must be one of {POLICIES}, got {policy!r}")
        self.index, self.slots, self.policy = index, slots, policy
        self.prefill_chunk, self.max_taps = prefill_chunk, max_taps
        self.plan_options = TapPlanOptions.from_options(index.options)
        self.counters = {"taps_planned": 0, "taps_published": 0, "taps_duplicate": 0, "taps_skipped_passed": 0}

    def plan(self, record: LaneRecord, prompt, base: int, existing: list[int]) -> None:
        """The lane's taps beyond `base` (its reuse), none where a snapshot already is (`existing` frontiers)."""
        n = len(prompt.token_ids)
        if self.policy == "align":
            last = base + (n - 1 - base) // self.prefill_chunk * self.prefill_chunk
            last -= last % BLOCK_TOKENS
            taps = [] if last <= base or last in existing or strictly_inside(last, prompt.vision_spans) else \
                [PlannedTap(last, Placement.FLEXIBLE, SnapshotKind.TAP, TapSource.PROMPT_TAIL, 4, 0)]
        else:
            hints = [TapHint(h.position, _HINTS[h.kind]) for h in prompt.tap_hints]
            from_endpoint = record.source is not None and record.source.kind is SnapshotKind.ENDPOINT
            taps = plan_taps(n, base, hints, existing, prompt.vision_spans, options=self.plan_options,
                             resumed_from_endpoint=from_endpoint)
        record.taps = taps
        self.counters["taps_planned"] += len(taps)

    def add_boundary(self, record: LaneRecord, position: int) -> bool:
        """Adds an exact Boundary tap at `position` to a prefilling lane's plan (§12.2); False if planned."""
        if any(t.position == position for t in record.taps):
            return False
        tap = PlannedTap(position, Placement.EXACT, SnapshotKind.BOUNDARY, TapSource.EXPLICIT, 1, len(record.taps))
        record.taps = sorted(record.taps + [tap], key=lambda t: t.position)
        return True

    def for_chunk(self, record: LaneRecord, computed: int, end: int) -> tuple[list[int], list[int]]:
        """Staging slots for the taps in (computed, end]: (absolute positions, runner slots) for the kernel."""
        positions, slots = [], []
        taps = record.taps
        record.chunks += 1
        while taps and taps[0].position <= computed:
            taps.pop(0)  # passed without a slot (more taps than one chunk takes): skipped
            self.counters["taps_skipped_passed"] += 1
        while taps and taps[0].position <= end and len(positions) < self.max_taps:
            tap = taps.pop(0)
            grant = self.index.begin_snapshot(tap.position, kind=tap.kind, resumed_from=record.source,
                                              previous_tap=record.last_tap, previous_frontier=record.deepest)
            if grant is None:
                continue  # no slot worth taking (§9.2): the tap is skipped and counted by the index
            record.staged.append((tap, grant.slot, record.chunks))
            positions.append(tap.position)
            slots.append(self.slots.snapshot(grant.slot))
        return positions, slots

    def publish(self, record: LaneRecord) -> list[Snapshot]:
        """Publishes the taps of each chunk whose anchors are all committed nodes, in chunk order; returns the new
        snapshots. A chunk whose deepest anchor is not committed yet (an MTP backend one token behind) waits."""
        published = []
        while record.staged:
            chunk = [entry for entry in record.staged if entry[2] == record.staged[0][2]]
            if chunk[-1][0].position // BLOCK_TOKENS > len(record.path):
                break
            del record.staged[:len(chunk)]
            previous = None
            for tap, slot, _ in chunk:
                result = self.index.publish_snapshot(slot, tap.kind, record.path[tap.position // BLOCK_TOKENS - 1])
                self.counters["taps_published" if result.published else "taps_duplicate"] += 1
                if previous is not None and previous.kind is SnapshotKind.TAP and previous.frontier < tap.position:
                    self.index.supersede(previous)  # a deeper tap of the chunk supersedes the previous one
                previous = record.last_tap = result.snapshot
                record.deepest = max(record.deepest, tap.position)
                if result.published:
                    published.append(result.snapshot)
        return published

    def drop_staged(self, record: LaneRecord) -> None:
        """Releases the staging slots of a chunk that never completed."""
        for _, slot, _ in record.staged:
            self.index.release_staging_slot(slot)
        record.staged.clear()
