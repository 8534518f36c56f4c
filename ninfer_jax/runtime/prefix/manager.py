"""PrefixCacheBinding: the worker's side of the hybrid prefix cache, Device and Host tiers (spec §6-§9).

The PrefixIndex decides (identity, residency, pins, eviction); this binding asks it and performs the copies
its answers call for, through the ModelRunner and the HostTier:
  admit    quote -> stage -> restore -> activate (§6.4, §6.5): Host-only path blocks, tail and image are
           restored into the staged pages and the lane's state slot; the lane maps the shared path pages,
           a partial tail is copied into a private page, the state is copied from the snapshot's slot (or
           restored, or starts at zero);
  taps     the planner's taps (§7.1) are realised *inside* the prefill chunk by the kernels' state taps
           (the zero-split tap of §7.2-§7.3): no chunk split, exact or flexible alike; each is published
           once its anchor block is a committed node (§7.4), then written through to the Host;
  commit   every full block joins the tree as it completes, in prefill and decode (§7.5, §7.6);
  finish   the endpoint snapshot (§7.7, written through to the Host), release of the path with the
           write-through of its Device-only blocks in one batch (§7.6), the lane's private pages freed;
  coalesce with concurrent_prefill, a head sharing more with a prefilling sibling than the cache serves
           waits for the sibling's Boundary tap at their divergence (§12.2);
  prefetch while the FIFO head waits (for a lane or for pages), up to 256 of its source's Host-only path
           blocks are copied into spare Device pages, so its admission restores only the rest (§6.6).
State slots: the runner's C + D state slots are a lane's active slot or an index snapshot slot's, through two
tables (`lane_slot`, `state_slot`; at start lane i has slot i and snapshot slot s has C + s). An endpoint
swaps them (§7.7: the active image itself becomes the snapshot, frozen, no copy): the lane's slot becomes the
snapshot's and the lane takes the free snapshot slot's, whose stale state nothing reads (a lane starting at
position 0 starts from zero, and a resumed one has its slot loaded first).

With the cache disabled (no_prefix_reuse) the same binding only hands out and frees pages: nothing is
inserted, tapped or published (§7.7 "disabled requests"), and no Host tier is allocated.

Restores and prefetches are dispatched on the worker thread and complete in the index in the same call: JAX
orders their scatters before every later step on the donated state, so their Filling windows open and close
inside one worker call; the Host tier's watcher thread sees the copies land, and writes queued behind them
wait for that before touching the slabs they read. Write-through is
asynchronous: the worker dispatches the gathers (`dispatch_writes`, right after its next model step is
dispatched), the Host tier's writer thread copies them into the slabs, and `poll_writes` (every worker step)
completes them in the index. A failed copy marks the binding failed:
the index is told (the write fails, the staging is cancelled), and no copy runs after it.
A prefetch completes in the index inside the call that starts it (its scatters are ordered before any step
that reads the pages), so an admission never sees a prefetch still landing (§6.6 "settle_prefetch" has
nothing to wait for).
"""

from __future__ import annotations

import collections
import logging

import numpy as np

from ninfer_jax.frontend.prepared_prompt import TapHintKind
from ninfer_jax.prefix_cache import (
    BLOCK_TOKENS, CacheGeometry, HintKind, OwnerState, Placement, PlannedTap, PrefixCacheOptions, PrefixIndex,
    Readiness, SnapshotKind, TapHint, TapPlanOptions, TapSource, block_lookup_hash, encode_tokens, plan_taps,
)
from ninfer_jax.prefix_cache.host_slabs import SlabState
from ninfer_jax.prefix_cache.results import HostWrite, Staging
from ninfer_jax.prefix_cache.tree import RESIDENT, BlockNode, Snapshot
from ninfer_jax.runtime.device.host_buffer import HostSlabBuffer
from ninfer_jax.runtime.device.host_tier import HostTier, HostTransferError
from ninfer_jax.runtime.request import Request

log = logging.getLogger("ninfer_jax.prefix_cache")

_HINTS = {
    TapHintKind.EXPLICIT: HintKind.EXPLICIT,
    TapHintKind.AUTOMATIC: HintKind.AUTOMATIC,
    TapHintKind.GENERATION_OPENER: HintKind.OPENER,
    TapHintKind.END_OF_TOOLS: HintKind.TOOLS_END,
    TapHintKind.END_OF_SYSTEM: HintKind.SYSTEM_END,
    TapHintKind.MESSAGE_BOUNDARY: HintKind.MESSAGE,
}
POLICIES = ("hpc", "align")


class LaneCache:
    """A lane's cache bookkeeping (only the worker thread touches it)."""

    __slots__ = ("enabled", "path", "source", "taps", "staged", "last_tap", "deepest", "hashes",
                 "cached_prefix_tokens", "source_kind", "restored_host_bytes")

    def __init__(self, enabled: bool):
        self.enabled = enabled  # False: the engine's cache is off, or the request opted out (a disabled request)
        self.path: list[BlockNode] = []  # node of block b at index b, for every committed block
        self.source: Snapshot | None = None  # the snapshot the lane resumed from
        self.taps: list[PlannedTap] = []  # planned taps not yet realised, by position
        self.staged: list[tuple[PlannedTap, int]] = []  # (tap, index slot) written by the current chunk
        self.last_tap: Snapshot | None = None
        self.deepest = 0  # frontier of the deepest snapshot on the lane's path
        self.hashes: list[int] = []  # lookup_hash of block b
        self.cached_prefix_tokens = 0
        self.source_kind = "root"
        self.restored_host_bytes = 0


class PrefixCacheBinding:
    """Admission, taps, block commit and finish against the PrefixIndex, with their device copies."""

    RECORDS = 1024  # per-request cache records kept for `record()`
    PREFETCH_BLOCKS = 256  # one prefetch batch (§6.6)
    MAX_QUEUED_WRITE_BYTES = 4 << 30  # gathered write-through bytes waiting for the writer thread

    def __init__(self, runner, *, num_pages: int, lanes: int, prefill_chunk: int, page_bytes: int,
                 image_bytes: int, enabled: bool, policy: str = "hpc", host_cache_bytes: int = 0,
                 device_snapshot_slots: int | None = None, max_new_taps: int | None = None,
                 tap_ladder_tokens: int | None = None, tap_min_gap_tokens: int | None = None,
                 pin_host: bool | None = None, coalesce: bool = False):
        """host_cache_bytes sizes the Host slab pool (0: Device only; ignored when the cache is disabled).

        Raises ValueError for a Host budget below one snapshot plus one block, HostTierError when the
        budget cannot be allocated or page-locked.
        """
        if policy not in POLICIES:
            raise ValueError(f"cache policy must be one of {POLICIES}, got {policy!r}")
        self.runner, self.enabled, self.policy = runner, enabled, policy
        self.coalesce = coalesce and enabled and policy == "hpc"  # §12.2, with concurrent_prefill
        self.lanes, self.prefill_chunk = lanes, prefill_chunk
        self.options = PrefixCacheOptions.resolve(
            lanes, prefill_chunk, host_cache_bytes if enabled else 0, device_snapshot_slots=device_snapshot_slots,
            max_new_taps=max_new_taps, tap_ladder_tokens=tap_ladder_tokens, tap_min_gap_tokens=tap_min_gap_tokens,
        )
        self.index = PrefixIndex(CacheGeometry(num_pages, page_bytes, image_bytes), self.options)
        self.host: HostTier | None = None
        if self.index.slabs.enabled:
            runner.enable_host_transfers(self.index.slabs.slab_bytes, self.index.slabs.image_slabs)
            self.host = HostTier(runner, HostSlabBuffer(self.index.slabs, pin=pin_host))
        self.failed = False  # a copy failed (or the engine did): no copy runs any more
        self.write_failure: HostTransferError | None = None  # a writer/watcher failure the worker has not raised yet
        self._deferred_writes: list[HostWrite] = []  # taken, their copies not started yet (dispatch_writes)
        self.tap_options = TapPlanOptions.from_options(self.options)
        self.counters = {"taps_planned": 0, "taps_published": 0, "taps_duplicate": 0, "endpoints_published": 0,
                         "endpoints_duplicate": 0, "host_writes_failed": 0, "host_restores_failed": 0,
                         "taps_skipped_passed": 0, "coalesce_taps": 0, "coalesce_waits": 0}
        self._coalescing: set[str] = set()  # ids of heads waiting for a sibling (counted once each)
        self._last_prefetch: tuple[str, int, int] | None = None  # (head id, blocks copied, spare pages before)
        self.records: collections.OrderedDict[str, dict] = collections.OrderedDict()
        self.lane_slots = np.arange(lanes, dtype=np.int32)  # lane -> its active state slot (the decode input)
        self._snapshot_slots = np.arange(lanes, lanes + self.options.device_snapshot_slots, dtype=np.int32)

    @property
    def pages(self):
        return self.index.pages

    def state_slot(self, index_slot: int) -> int:
        """The runner's state slot that holds the index's snapshot slot `index_slot`."""
        return int(self._snapshot_slots[index_slot])

    def lane_slot(self, lane: int) -> int:
        """The runner's state slot that is lane `lane`'s active state."""
        return int(self.lane_slots[lane])

    # --- admission (§6) --------------------------------------------------------------------------
    def admit(self, req: Request, lane: int, entitlement: int, lanes=()) -> Readiness:
        """Maps the lane onto the deepest usable cached prefix; READY, or why not (nothing changes then).

        `lanes` are the running requests: a head that shares more with a prefilling one than the cache
        serves now waits for that sibling's snapshot at the divergence (§12.2, when coalescing is on).
        """
        req.cache = lc = LaneCache(self.enabled and req.sampling.prefix_cache)
        lc.hashes = [int(h) for h in req.prompt.block_hashes]
        if not lc.enabled:  # pages only: nothing is read, inserted, tapped or published (§7.7)
            lc.source_kind = "disabled" if self.enabled else "root"
            grant = self.index.allocate_pages(entitlement)
            if grant is None:
                return Readiness.TEMPORARILY_BLOCKED
            req.pages = list(grant.pages)
            return Readiness.READY
        quote = self.index.quote(req.prompt_ids, lc.hashes, entitlement_pages=entitlement)
        if quote.readiness is not Readiness.READY:
            return quote.readiness
        if self.coalesce and self._await_sibling(req, quote.source.frontier, lanes):
            return Readiness.TEMPORARILY_BLOCKED  # holding no pins: nothing was staged
        staging = self.index.stage(quote)
        lc.restored_host_bytes = self._restore(staging, lane)
        lc.path = self.index.activate(staging)
        self.index.complete_restore(staging)
        s = staging.snapshot
        if s is not None:
            if staging.image_slot >= 0:  # the image is on the Device; a Host image was restored into the slot
                self.runner.copy_slot(self.state_slot(staging.image_slot), self.lane_slot(lane))
            if s.tail_len:
                self.runner.copy_page(s.tail_page, staging.lane_pages[0], s.tail_len)
        req.pages = [n.device_page for n in lc.path] + list(staging.lane_pages)
        req.computed = req.cached_tokens = staging.reuse_tokens
        lc.source, lc.deepest = s, staging.reuse_tokens
        lc.source_kind = "root" if s is None else s.kind.value
        lc.cached_prefix_tokens = quote.match.cached_prefix_tokens
        lc.taps = self._plan(req, [c.frontier for c in quote.match.candidates])
        self.counters["taps_planned"] += len(lc.taps)
        return Readiness.READY

    def _restore(self, staging: Staging, lane: int) -> int:
        """Copies the staging's Host-only blocks, tail and image (§6.5); returns the bytes restored.

        The blocks and the tail land in their staged (Filling) pages, the image in the lane's state slot,
        all before the lane's first step. A failed copy cancels the staging and fails the binding.
        """
        pairs = [(r.slab, r.page) for r in staging.restores]
        if staging.tail_restore is not None:
            pairs.append((staging.tail_restore.slab, staging.tail_restore.page))
        if not pairs and not staging.image_slabs:
            return 0
        try:
            if self.failed or self.host is None:
                raise RuntimeError("Host restore after a failed copy")
            moved = self.host.restore([p[0] for p in pairs], [p[1] for p in pairs], staging.image_slabs,
                                      self.lane_slot(lane))
        except BaseException:
            self.failed = True
            self.counters["host_restores_failed"] += 1
            # NOTE: the engine fails with this error; the staged pages keep whatever landed (never read).
            self.index.cancel_staging(staging)
            raise
        return moved

    def prefetch(self, req: Request, entitlement: int) -> int:
        """§6.6: the waiting FIFO head's Host-only source path blocks into spare Device pages; returns how
        many were copied. Retried for the same head only while the last attempt copied blocks or the spare
        room grew, since each attempt matches the whole prompt. A failed copy fails the binding."""
        if not (self.enabled and req.sampling.prefix_cache) or self.host is None or self.failed:
            return 0
        room = self.index.prefetch_room()
        last = self._last_prefetch
        if last is not None and last[0] == req.id and last[1] == 0 and room <= last[2]:
            return 0
        quote = self.index.quote(req.prompt_ids, [int(h) for h in req.prompt.block_hashes],
                                 entitlement_pages=entitlement)
        batch = self.index.prefetch(quote, self.PREFETCH_BLOCKS)
        copied = 0
        if batch is not None:
            try:
                self.host.restore([r.slab for r in batch.restores], [r.page for r in batch.restores])
            except BaseException:
                self.failed = True
                self.counters["host_restores_failed"] += 1
                self.index.complete_prefetch(batch, ok=False)
                raise
            self.index.complete_prefetch(batch)
            copied = len(batch.restores)
        self._last_prefetch = (req.id, copied, room)
        return copied

    def _await_sibling(self, req: Request, served: int, lanes) -> bool:
        """In-flight prefix coalescing (§12.2): whether `req` should wait for a prefilling sibling.

        The target is the block boundary below the divergence d (at most n - 1 for both prompts). It is
        added to the sibling's plan as an exact Boundary tap, which costs no split here (the kernel writes
        it inside the chunk). The head waits only while the sibling has not passed the target and the wait
        saves at least a block; a skipped tap, a finished or cancelled sibling ends the wait, so a missing
        snapshot never blocks it for long. Each sibling chunk re-arms admission (the worker re-quotes).
        """
        n = req.num_prompt
        for other in lanes:
            if other is None or not other.prefilling or other.cache is None or not other.cache.enabled:
                continue
            a, b = req.prompt_ids, other.prompt_ids
            m = min(len(a), len(b))
            differ = np.flatnonzero(a[:m] != b[:m])
            d = int(differ[0]) if differ.size else m
            target = min(d, n - 1, other.num_prompt - 1)
            target -= target % BLOCK_TOKENS
            if target <= other.computed or target - served < BLOCK_TOKENS:
                continue
            lc = other.cache
            if all(t.position != target for t in lc.taps):
                tap = PlannedTap(target, Placement.EXACT, SnapshotKind.BOUNDARY, TapSource.EXPLICIT, 1, len(lc.taps))
                lc.taps = sorted(lc.taps + [tap], key=lambda t: t.position)
                self.counters["coalesce_taps"] += 1
            if req.id not in self._coalescing:
                self._coalescing.add(req.id)
                self.counters["coalesce_waits"] += 1
            return True
        self._coalescing.discard(req.id)
        return False

    def _plan(self, req: Request, existing: list[int]) -> list[PlannedTap]:
        n, base = req.num_prompt, req.computed
        if self.policy == "align":  # vLLM's mode: one state at the prompt's last chunk boundary
            last = base + (n - 1 - base) // self.prefill_chunk * self.prefill_chunk
            last -= last % BLOCK_TOKENS
            if last <= base or last in existing:
                return []
            return [PlannedTap(last, Placement.FLEXIBLE, SnapshotKind.TAP, TapSource.PROMPT_TAIL, 4, 0)]
        hints = [TapHint(h.position, _HINTS[h.kind]) for h in req.prompt.tap_hints]
        resumed_endpoint = req.cache.source is not None and req.cache.source.kind is SnapshotKind.ENDPOINT
        return plan_taps(n, base, hints, existing, options=self.tap_options, resumed_from_endpoint=resumed_endpoint)

    # --- prefill taps (§7.1-§7.4) ----------------------------------------------------------------
    def chunk_taps(self, req: Request, end: int) -> tuple[list[int], list[int]]:
        """Staging slots for the taps in (computed, end]: (absolute positions, state slots) for the kernel."""
        lc = req.cache
        positions, slots = [], []
        while lc and lc.taps and lc.taps[0].position <= req.computed:
            lc.taps.pop(0)  # passed without a slot (more taps than one chunk takes): skipped
            self.counters["taps_skipped_passed"] += 1
        while lc and lc.taps and lc.taps[0].position <= end and len(positions) < self.runner.max_taps:
            tap = lc.taps.pop(0)
            grant = self.index.begin_snapshot(tap.position, kind=tap.kind, resumed_from=lc.source,
                                              previous_tap=lc.last_tap, previous_frontier=lc.deepest)
            if grant is None:
                continue  # no slot worth taking (§9.2): the tap is skipped and counted by the index
            lc.staged.append((tap, grant.slot))
            positions.append(tap.position)
            slots.append(self.state_slot(grant.slot))
        return positions, slots

    def after_compute(self, req: Request) -> None:
        """After a prefill chunk or decode step: commit completed blocks, then publish staged taps."""
        lc = req.cache
        if not lc.enabled:
            return
        self._commit_blocks(req)
        previous, published = None, []
        for tap, slot in lc.staged:
            result = self.index.publish_snapshot(slot, tap.kind, lc.path[tap.position // BLOCK_TOKENS - 1])
            self.counters["taps_published" if result.published else "taps_duplicate"] += 1
            if previous is not None and previous.kind is SnapshotKind.TAP and previous.frontier < tap.position:
                self.index.supersede(previous)  # a deeper tap of the same prompt supersedes the previous one
            previous = lc.last_tap = result.snapshot
            lc.deepest = max(lc.deepest, tap.position)
            if result.published:
                published.append(result.snapshot)
        lc.staged.clear()
        for snapshot in published:  # write-through of each new image (§7.4)
            self._write_snapshot(snapshot)

    def _commit_blocks(self, req: Request) -> None:
        lc = req.cache
        while (len(lc.path) + 1) * BLOCK_TOKENS <= req.computed:
            b = len(lc.path)
            tokens = req.token_slice(b * BLOCK_TOKENS, (b + 1) * BLOCK_TOKENS)
            data = encode_tokens(tokens)
            if b >= len(lc.hashes):  # a generated block: chain its hash on
                lc.hashes.append(block_lookup_hash(lc.hashes[-1] if lc.hashes else 0, data))
            parent = lc.path[-1] if lc.path else self.index.root
            commit = self.index.commit_block(parent, data, lc.hashes[b], req.pages[b])
            lc.path.append(commit.node)

    # --- finish (§7.7) ---------------------------------------------------------------------------
    def finish(self, req: Request, lane: int, reason: str) -> None:
        """Terminal settlement: endpoint snapshot, release the path, free the lane's private pages."""
        lc: LaneCache | None = getattr(req, "cache", None)
        write, endpoint = None, None
        if lc is not None and lc.enabled:
            for _, slot in lc.staged:  # taps of a chunk that never completed
                self.index.release_staging_slot(slot)
            lc.staged.clear()
            if reason in ("stop", "length", "cancelled") and self.policy == "hpc" and not self.failed:
                self._commit_blocks(req)
                endpoint = self._endpoint(req, lane)
            write = self.index.release_path(lc.path)
            lc.path = []
        private = [p for p in req.pages if self.index.pages.is_state(p, OwnerState.ACTIVE)]
        self.index.free_pages(private)
        req.pages = []
        self._remember(req)
        # The lane holds nothing any more; now the copies, which may fail (§7.6 blocks, §7.7 endpoint).
        if write is not None:
            self._write(write)
        if endpoint is not None:
            self._write_snapshot(endpoint)

    # --- write-through (§7.6, §7.4, §7.7) --------------------------------------------------------
    def _write_snapshot(self, s: Snapshot) -> None:
        if self.host is not None and not self.failed:
            self._write(self.index.write_snapshot(s))

    def _write(self, write: HostWrite) -> None:
        """Takes a HostWrite the index handed out (§7.6); `dispatch_writes` starts its copies. The index already
        holds what the write needs (slabs Filling, sources pinned), so only the device gathers wait: the worker
        dispatches them right after its next model step, while that step computes, instead of now, while the
        device idles between steps."""
        if write.empty:
            self.index.complete_host_write(write)
        elif self.failed or self.host is None:
            self._write_failed(write)
        else:
            self._deferred_writes.append(write)

    def dispatch_writes(self) -> None:
        """Starts every deferred HostWrite: the gathers are dispatched and the host copy is the writer thread's;
        `poll_writes` completes it in the index when it lands. A failure fails the binding and raises."""
        writes, self._deferred_writes = self._deferred_writes, []
        for i, write in enumerate(writes):
            try:
                self._dispatch(write)
            except BaseException:
                for rest in writes[i + 1:]:
                    self._write_failed(rest)
                raise

    def _dispatch(self, write: HostWrite) -> None:
        if self.host.queued_bytes > self.MAX_QUEUED_WRITE_BYTES:  # deferred writes imply a Host tier
            self.poll_writes(wait=True)  # the writer fell behind: bound the gathered bytes held in host memory
        if self.failed:  # a copy failed in the writer thread (the engine fails at its next step)
            self._write_failed(write)
            return
        s = write.snapshot
        tail = write.tail_slab >= 0
        try:
            self.host.write(write, [n.device_page for n in write.nodes] + ([s.tail_page] if tail else []),
                            list(write.node_slabs) + ([write.tail_slab] if tail else []),
                            self.state_slot(s.device_slot) if write.image_slabs else -1, write.image_slabs)
        except BaseException:
            self._write_failed(write)
            self.failed = True
            raise

    def _write_failed(self, write: HostWrite) -> None:
        if not self.failed:
            self.counters["host_writes_failed"] += 1
        self.index.complete_host_write(write, ok=False)

    def poll_writes(self, wait: bool = False) -> None:
        """Completes in the index every Host write that landed (with `wait`, after the deferred ones are
        dispatched and all have landed). A failed copy fails the binding; `raise_write_failure` (the worker's
        step) then fails the engine."""
        if self.host is None:
            return
        if wait:
            self.dispatch_writes()
        for write, failure in self.host.landed(wait):
            if failure is None and not self.failed:
                self.index.complete_host_write(write, ok=True)
                continue
            self._write_failed(write)
            if failure is not None and not self.failed:
                self._copy_failed("Host write-through failed", failure)
        failure = self.host.take_restore_failure()
        if failure is not None and not self.failed:
            self.counters["host_restores_failed"] += 1
            self._copy_failed("Host restore failed after its dispatch", failure)

    def _copy_failed(self, what: str, failure: BaseException) -> None:
        self.failed = True
        self.write_failure = HostTransferError(f"{what}: {failure}")
        self.write_failure.__cause__ = failure

    def raise_write_failure(self) -> None:
        """Raises HostTransferError once for a Host copy that failed in the writer or watcher thread."""
        failure, self.write_failure = self.write_failure, None
        if failure is not None:
            raise failure

    def fail(self) -> None:
        """The engine failed: no copy runs any more (writes complete as failed, restores raise)."""
        self.failed = True
        for write in self._deferred_writes:
            self._write_failed(write)
        self._deferred_writes = []

    def _endpoint(self, req: Request, lane: int) -> Snapshot | None:
        """Publishes the endpoint snapshot; returns it when new (for its write-through)."""
        lc = req.cache
        end = req.computed
        if end == 0 or end - lc.deepest < BLOCK_TOKENS:
            return None
        tail_len = end % BLOCK_TOKENS
        grant = self.index.begin_snapshot(end, kind=SnapshotKind.ENDPOINT, resumed_from=lc.source,
                                          previous_tap=lc.last_tap, previous_frontier=lc.deepest,
                                          tail_len=tail_len)
        if grant is None:
            return None
        # The lane's state becomes the snapshot's in place (§7.7): the two slot tables swap, nothing is copied.
        # No step in flight reads the lane any more (it settles after its last round is read).
        mine = self.lane_slot(lane)
        self.lane_slots[lane], self._snapshot_slots[grant.slot] = self._snapshot_slots[grant.slot], mine
        blocks = end // BLOCK_TOKENS
        anchor = lc.path[blocks - 1] if blocks else self.index.root
        tail = encode_tokens(req.token_slice(blocks * BLOCK_TOKENS, end)) if tail_len else b""
        # The partial last page moves to the snapshot without a copy: the writer is terminating.
        result = self.index.publish_snapshot(grant.slot, SnapshotKind.ENDPOINT, anchor, tail,
                                             tail_page=req.pages[blocks] if tail_len else -1)
        self.counters["endpoints_published" if result.published else "endpoints_duplicate"] += 1
        return result.snapshot if result.published else None

    # --- growth (§9.5) ---------------------------------------------------------------------------
    def grow(self, req: Request) -> int | None:
        """One more private page for an active lane, evicting cache if needed; None when impossible. Pages
        that Host writes in flight still read are not evictable; when nothing else is, those writes are
        waited for once, so a lane is never cut short by a copy that is about to land."""
        grant = self.index.allocate_pages(1)
        if grant is None and self.host is not None and not self.failed:
            self.poll_writes(wait=True)
            grant = self.index.allocate_pages(1)
        return None if grant is None else grant.pages[0]

    def demote_device(self) -> dict:
        """Drops every Device cache copy that has a Host copy (PrefixIndex.demote_device); counts what went."""
        if not self.enabled:
            return {"pages": 0, "slots": 0}
        self.poll_writes(wait=True)  # a block still being written has no Host copy yet
        out = self.index.demote_device()
        return {"pages": len(out.freed_pages), "slots": len(out.freed_slots)}

    # --- checks and stats ------------------------------------------------------------------------
    def check(self, lanes: list[Request | None]) -> None:
        """The index's invariants, and every ACTIVE page belongs to exactly one lane (after in-flight Host
        writes have landed)."""
        self.poll_writes(wait=True)
        self.index.check_invariants()
        owned = [p for r in lanes if r is not None for p in r.pages if self.pages.is_state(p, OwnerState.ACTIVE)]
        assert len(owned) == len(set(owned)), "a private page is mapped by two lanes"
        active = self.pages.count(OwnerState.ACTIVE)
        assert active == len(owned), f"{active} ACTIVE pages but lanes own {len(owned)}"
        slots = np.concatenate([self.lane_slots, self._snapshot_slots])
        assert sorted(slots) == list(range(len(slots))), f"state slots not one per lane and snapshot slot: {slots}"
        staging = sum(len(r.cache.staged) for r in lanes if r is not None and getattr(r, "cache", None))
        assert len(self.index.staging_slots) == staging, "a staging slot is held by no lane"
        # Restores complete inside the worker call that starts them, and writes have landed: nothing is Filling.
        assert self.pages.count(OwnerState.FILLING) == 0, "a Device page is still Filling"
        assert self.index.slabs.count(SlabState.FILLING) == 0, "a Host slab is still Filling"
        pinned = [n for n in self.index.tree.nodes.values() if n.pins]
        pinned += [s for s in self.index.tree.snapshots.values() if s.pins]
        assert not pinned, f"pins leaked: {pinned[:4]}"
        if self.host is not None:
            assert self.host.buffer.chunks or self.failed, "the Host slab buffer is gone"

    def _remember(self, req: Request) -> None:
        self.records[req.id] = request_record(req)
        while len(self.records) > self.RECORDS:
            self.records.popitem(last=False)

    def record(self, request_id: str) -> dict | None:
        """The cache record of a recent finished request (cached_tokens, source, restored_host_bytes, ...)."""
        return self.records.get(request_id)

    def stats(self) -> dict:
        """The cache's counters and tables, once the Host writes in flight have landed."""
        self.poll_writes(wait=True)
        tree = self.index.tree
        snaps = list(tree.snapshots.values())
        by_kind = collections.Counter(s.kind.value for s in snaps)
        nodes = [n for n in tree.nodes.values() if n.parent is not None]
        return {
            "enabled": self.enabled,
            "policy": self.policy,
            "nodes": len(nodes),
            "nodes_by_tier": _by_tier((n.device_state is RESIDENT, n.host_state is RESIDENT) for n in nodes),
            "snapshots": len(snaps),
            "snapshots_by_kind": dict(by_kind),
            "snapshots_by_tier": _by_tier((s.image_device is RESIDENT, s.image_host is RESIDENT) for s in snaps),
            "snapshot_hits": sum(s.hits for s in snaps),
            "snapshots_superseded": sum(s.superseded for s in snaps),
            "device_pages_cached": self.pages.count(OwnerState.CACHED),
            "device_snapshot_slots": self.options.device_snapshot_slots,
            "host_tier": self.host is not None,
            "host_slabs": self.index.slabs.ledger(),
            **(self.host.stats() if self.host is not None else {}),
            **self.counters,
            **self.index.stats.as_dict(),
            "host_evictions": {  # §9.3, by reason
                "dead_kv": self.index.stats.host_dead_reclaimed,
                "superseded": self.index.stats.host_superseded_evicted,
                "gdsf": self.index.stats.host_gdsf_evicted,
                "gdsf_device_kept": self.index.stats.host_gdsf_demoted,
            },
        }

    def close(self) -> None:
        """Releases the Host tier's memory (after the worker stopped; queued writes finish first)."""
        if self.host is not None:
            self.host.close()


def _by_tier(copies) -> dict[str, int]:
    """Counts entries by where their copies are: (on the Device, on the Host) pairs -> device/host/both."""
    out = {"device": 0, "host": 0, "both": 0}
    for device, host in copies:
        if device or host:
            out["both" if device and host else "device" if device else "host"] += 1
    return out


def request_record(req: Request) -> dict:
    """The per-request cache record (spec: cached_tokens = reuse tokens, cached_prefix_tokens, source,
    restored_host_bytes)."""
    lc = getattr(req, "cache", None)
    return {
        "cached_tokens": req.cached_tokens,
        "cached_prefix_tokens": lc.cached_prefix_tokens if lc else 0,
        "source": lc.source_kind if lc else "root",
        "restored_host_bytes": lc.restored_host_bytes if lc else 0,
    }


__all__ = ["LaneCache", "POLICIES", "PrefixCacheBinding", "request_record"]
