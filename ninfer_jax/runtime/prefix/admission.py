"""Admitter: maps a new lane onto the deepest usable cached prefix (spec §6.4-§6.6, §12.2).

quote -> stage -> restore -> activate: Host-only path blocks, tail and image are restored into the staged pages
and the lane's state slot; the lane maps the shared path pages, a partial tail is copied into a private page and
the state is copied from the snapshot's slot (or restored, or starts at zero). Restores are only dispatched: JAX
orders their scatters before every later step on the donated state, so their Filling windows open and close
inside one scheduler call. While the FIFO head waits, its Host-only path is prefetched (§6.6); with coalescing, a
head that shares more with a prefilling sibling than the cache serves waits for that sibling's tap (§12.2): any
sibling with concurrent_prefill, else only the samples of its own n > 1 call (its `group`).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from ninfer_jax.prefix_cache import BLOCK_TOKENS, PrefixIndex, Readiness
from ninfer_jax.prefix_cache.results import Staging
from ninfer_jax.runtime.device.host_tier import HostTier
from ninfer_jax.runtime.prefix.records import LaneRecord
from ninfer_jax.runtime.prefix.slots import SlotTable
from ninfer_jax.runtime.prefix.taps import TapScheduler
from ninfer_jax.runtime.prefix.write_back import WriteBack
from ninfer_jax.runtime.request import Request


@dataclasses.dataclass(frozen=True)
class Admission:
    """The answer to an admission: READY with the lane's pages and reuse, or why not (nothing changed then)."""

    readiness: Readiness
    pages: tuple[int, ...] = ()  # page of block b at index b: the shared path, then the lane's private pages
    reused_tokens: int = 0  # tokens whose KV and state the lane starts with (cached_tokens, spec §8.3)
    record: LaneRecord | None = None


class Admitter:
    """Admission, its Host restores, the waiting head's prefetch and in-flight coalescing."""

    PREFETCH_BLOCKS = 256  # one prefetch batch (§6.6)

    def __init__(self, index: PrefixIndex, host: HostTier | None, runner, slots: SlotTable, write_back: WriteBack,
                 taps: TapScheduler, *, enabled: bool, coalesce: bool):
        self.index, self.host, self.runner, self.slots = index, host, runner, slots
        self.write_back, self.taps = write_back, taps
        self.enabled, self.coalesce = enabled, coalesce and enabled
        self.counters = {"coalesce_taps": 0, "coalesce_waits": 0}
        self._coalescing: set[str] = set()  # ids of heads waiting for a sibling (counted once each)
        self._last_prefetch: tuple[str, int, int] | None = None  # (head id, blocks copied, spare pages before)

    def admit(self, req: Request, lane: int, entitlement: int,
              running: Sequence[tuple[Request, LaneRecord]] = ()) -> Admission:
        """Admits `req` into `lane` with `entitlement` pages. `running` are the lanes' requests and records: a head
        that shares more with a prefilling one than the cache serves waits for it (when coalescing is on)."""
        prompt = req.prefix  # the prompt, and a preempted request's output so far
        record = LaneRecord(self.enabled and req.sampling.uses_prefix_cache, [int(h) for h in prompt.block_hashes])
        if not record.enabled:  # pages only: nothing is read, inserted, tapped or published (§7.7)
            record.source_kind = "disabled" if self.enabled else "root"
            grant = self.index.allocate_pages(entitlement)
            if grant is None:
                return Admission(Readiness.TEMPORARILY_BLOCKED)
            return Admission(Readiness.READY, tuple(grant.pages), 0, record)
        quote = self.index.quote(prompt.token_ids, record.hashes, entitlement_pages=entitlement,
                                 extras=prompt.block_extras, vision_spans=prompt.vision_spans)
        if quote.readiness is not Readiness.READY:
            return Admission(quote.readiness)
        # Prompts with images are not coalesced (§12.2): a sibling's Boundary tap could fall inside an image span
        if ((self.coalesce or req.group is not None) and prompt.media is None
                and self._await_sibling(req, quote.source.frontier, running)):
            return Admission(Readiness.TEMPORARILY_BLOCKED)  # holding no pins: nothing was staged
        staging = self.index.stage(quote)
        record.restored_host_bytes = self._restore(staging, lane)
        record.path = self.index.activate(staging)
        self.index.complete_restore(staging)
        s = staging.snapshot
        if s is not None:
            if staging.image_slot >= 0:  # the image is on the Device; a Host image was restored into the slot
                self.runner.copy_slot(self.slots.snapshot(staging.image_slot), self.slots.lane(lane))
            if s.tail_len:
                self.runner.copy_page(s.tail_page, staging.lane_pages[0], s.tail_len)
        reused = staging.reuse_tokens
        record.source, record.deepest = s, reused
        record.source_kind = "root" if s is None else s.kind.value
        record.cached_prefix_tokens = quote.match.cached_prefix_tokens
        self.taps.plan(record, prompt, reused, [c.frontier for c in quote.match.candidates])
        pages = tuple(n.device_page for n in record.path) + tuple(staging.lane_pages)
        return Admission(Readiness.READY, pages, reused, record)

    def _restore(self, staging: Staging, lane: int) -> int:
        """Dispatches the staging's Host-only blocks, tail and image (§6.5); returns the bytes restored. A failed
        copy cancels the staging and fails the Host link."""
        pairs = [(r.slab, r.page) for r in staging.restores]
        if staging.tail_restore is not None:
            pairs.append((staging.tail_restore.slab, staging.tail_restore.page))
        if not pairs and not staging.image_slabs:
            return 0
        try:
            if self.write_back.failed or self.host is None:
                raise RuntimeError("Host restore after a failed copy")
            return self.host.restore([p[0] for p in pairs], [p[1] for p in pairs], staging.image_slabs,
                                     self.slots.lane(lane))
        except BaseException:
            self.write_back.restore_failed()
            # NOTE: the engine fails with this error; the staged pages keep whatever landed (never read).
            self.index.cancel_staging(staging)
            raise

    def prefetch(self, req: Request, entitlement: int) -> int:
        """§6.6: the waiting FIFO head's Host-only source path blocks into spare Device pages; returns how many
        were copied. Retried for the same head only while the last attempt copied blocks or the spare room grew,
        since each attempt matches the whole prompt. A failed copy fails the Host link."""
        if not (self.enabled and req.sampling.uses_prefix_cache) or self.host is None or self.write_back.failed:
            return 0
        room = self.index.prefetch_room()
        last = self._last_prefetch
        if last is not None and last[0] == req.id and last[1] == 0 and room <= last[2]:
            return 0
        prompt = req.prefix
        quote = self.index.quote(prompt.token_ids, [int(h) for h in prompt.block_hashes],
                                 entitlement_pages=entitlement, extras=prompt.block_extras,
                                 vision_spans=prompt.vision_spans)
        batch = self.index.prefetch(quote, self.PREFETCH_BLOCKS)
        copied = 0
        if batch is not None:
            try:
                self.host.restore([r.slab for r in batch.restores], [r.page for r in batch.restores])
            except BaseException:
                self.write_back.restore_failed()
                self.index.complete_prefetch(batch, ok=False)
                raise
            self.index.complete_prefetch(batch)
            copied = len(batch.restores)
        self._last_prefetch = (req.id, copied, room)
        return copied

    def _await_sibling(self, req: Request, served: int, running: Sequence[tuple[Request, LaneRecord]]) -> bool:
        """In-flight prefix coalescing (§12.2): whether `req` should wait for a prefilling sibling.

        The target is the block boundary below the divergence d (at most n - 1 for both prompts), added to the
        sibling's plan as an exact Boundary tap, which costs no split (the kernel writes it inside the chunk).
        The head waits only while the sibling has not passed the target and the wait saves at least a block; a
        skipped tap, a finished or cancelled sibling ends the wait, and each sibling chunk re-arms admission.
        """
        n = req.prefix.num_tokens
        for other, record in running:
            if (not other.prefilling or not record.enabled or not (self.coalesce or other.group == req.group)
                    or other.prompt.salt != req.prompt.salt):  # another salt's blocks are not this prompt's
                continue
            a, b = req.prefix.token_ids, other.prefix.token_ids
            m = min(len(a), len(b))
            differ = np.flatnonzero(a[:m] != b[:m])
            d = int(differ[0]) if differ.size else m
            target = min(d, n - 1, len(b) - 1)
            target -= target % BLOCK_TOKENS
            if target <= other.computed or target - served < BLOCK_TOKENS:
                continue
            if self.taps.add_boundary(record, target):
                self.counters["coalesce_taps"] += 1
            if req.id not in self._coalescing:
                self._coalescing.add(req.id)
                self.counters["coalesce_waits"] += 1
            return True
        self._coalescing.discard(req.id)
        return False
