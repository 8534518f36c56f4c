"""PrefixCacheManager: the scheduler's one entry to the hybrid prefix cache, Device and Host tiers (spec §6-§9).

The PrefixIndex decides (identity, residency, pins, eviction); the manager asks it and has the device side do the
copies its answers call for. The scheduler calls a handful of verbs:
  admit / prefetch   map a new lane onto the deepest usable cached prefix (`Admitter`, §6);
  taps_for_chunk     the staging slots of the taps a prefill chunk writes in-kernel (`TapScheduler`, §7.1-§7.3);
  computed           after a chunk or a decode round: commit completed blocks (§7.5, §7.6), publish taps (§7.4);
  grow               one more private page for a decoding lane (§9.5);
  release            endpoint snapshot (§7.7), release of the path with its write-through (§7.6), pages freed;
  poll / flush       complete landed Host writes (raising a failed copy), start the deferred ones (`WriteBack`).
With the cache disabled (no_prefix_reuse) the same manager only hands out and frees pages: nothing is inserted,
tapped or published, and there is no Host tier.
"""

from __future__ import annotations

import collections
import logging

from ninfer_jax.prefix_cache import BLOCK_TOKENS, OwnerState, PrefixIndex, Readiness, SnapshotKind
from ninfer_jax.prefix_cache import block_lookup_hash, encode_tokens
from ninfer_jax.prefix_cache.host_slabs import SlabState
from ninfer_jax.prefix_cache.tree import RESIDENT, Snapshot
from ninfer_jax.runtime.device.cache_file import SaveAbandoned
from ninfer_jax.runtime.device.host_tier import HostTier
from ninfer_jax.runtime.prefix.admission import Admission, Admitter
from ninfer_jax.runtime.prefix.records import FinishedRecords, LaneRecord, count_by_tier
from ninfer_jax.runtime.prefix.slots import SlotTable
from ninfer_jax.runtime.prefix.taps import TapScheduler
from ninfer_jax.runtime.prefix.write_back import WriteBack
from ninfer_jax.runtime.request import Request

log = logging.getLogger("ninfer_jax.prefix_cache")


class PrefixCacheManager:
    """Admission, taps, block commit and release against the PrefixIndex, with their device and Host copies.

    Args:
      index: the PrefixIndex over the engine's pages and snapshot slots.
      host: the Host tier (None: Device only, or the cache disabled).
      runner: the ModelRunner (slot and page copies).
      lanes: C, the scheduler's lanes.
      enabled: False for no_prefix_reuse: pages only.
      policy, prefill_chunk, max_taps: tap planning (`TapScheduler`).
      coalesce: in-flight prefix coalescing (§12.2), with the "hpc" policy only.
      backend_lag: how many tokens the speculative backend's pages trail the target's while a lane runs (MTP: 1,
        its row of a position needs the next token); blocks commit only once every pool has them (§7.4, §7.6).
    """

    def __init__(self, index: PrefixIndex, host: HostTier | None, runner, *, lanes: int, enabled: bool,
                 policy: str = "hpc", prefill_chunk: int, max_taps: int, coalesce: bool = False,
                 backend_lag: int = 0):
        self.index, self.host, self.enabled, self.policy = index, host, enabled, policy
        self.backend_lag = backend_lag
        self.slots = SlotTable(lanes, index.options.device_snapshot_slots)
        self.write_back = WriteBack(index, host, self.slots)
        self.taps = TapScheduler(index, self.slots, policy=policy, prefill_chunk=prefill_chunk, max_taps=max_taps)
        self.admitter = Admitter(index, host, runner, self.slots, self.write_back, self.taps, enabled=enabled,
                                 coalesce=coalesce and policy == "hpc")
        self.counters = {"endpoints_published": 0, "endpoints_duplicate": 0}
        self.finished = FinishedRecords()
        self._lanes: list[LaneRecord | None] = [None] * lanes  # the record of the request holding each lane

    @property
    def pages(self):
        return self.index.pages

    @property
    def lane_slots(self):
        """Lane -> its runner state slot (the decode step's input)."""
        return self.slots.lane_slots

    def lane_slot(self, lane: int) -> int:
        return self.slots.lane(lane)

    # --- the scheduler's verbs -------------------------------------------------------------------
    def admit(self, req: Request, lane: int, entitlement: int, running=()) -> Admission:
        """Admits `req` into the free `lane` (`running`: the requests holding lanes). READY admissions hold
        their pages and record until `release`."""
        others = [(r, self._lanes[r.lane]) for r in running if r is not None]
        admission = self.admitter.admit(req, lane, entitlement, others)
        if admission.readiness is Readiness.READY:
            self._lanes[lane] = admission.record
        return admission

    def prefetch(self, req: Request, entitlement: int) -> int:
        """Copies the waiting head's Host-only path blocks to the Device (§6.6); returns how many."""
        return self.admitter.prefetch(req, entitlement)

    def taps_for_chunk(self, req: Request, end: int) -> tuple[list[int], list[int]]:
        """(positions, runner slots) of the taps the lane's chunk up to `end` writes."""
        record = self._lanes[req.lane]
        if not record.enabled:
            return [], []
        return self.taps.for_chunk(record, req.computed, end)

    def computed(self, req: Request) -> None:
        """After a prefill chunk or decode round: commit the blocks every pool has completed, then publish the
        taps anchored on them."""
        record = self._lanes[req.lane]
        if not record.enabled:
            return
        self._commit_blocks(req, record, req.computed - self.backend_lag)
        self._publish_taps(record)

    def _publish_taps(self, record: LaneRecord) -> None:
        for snapshot in self.taps.publish(record):
            self.write_back.take_snapshot(snapshot)  # write-through of each new image (§7.4)

    def grow(self, req: Request) -> int | None:
        """One more private page for an active lane, evicting cache if needed; None when impossible. Pages that
        Host writes in flight still read are not evictable; when nothing else is, those writes are waited for
        once, so a lane is never cut short by a copy about to land."""
        grant = self.index.allocate_pages(1)
        if grant is None and self.host is not None and not self.write_back.failed:
            self.write_back.poll(wait=True)
            grant = self.index.allocate_pages(1)
        return None if grant is None else grant.pages[0]

    def release(self, req: Request, reason: str) -> None:
        """Settlement of the request holding a lane, at its end or its preemption: endpoint snapshot, path released,
        private pages freed. The lane's pages are no longer the request's after this call."""
        lane = req.lane
        record, self._lanes[lane] = self._lanes[lane], None
        write, endpoint = None, None
        if record.enabled:
            kept = reason in ("stop", "length", "cancelled", "preempted") and not self.write_back.failed
            if kept:
                # At the end the backend's pages count up to its own frontier (§7.7): the last blocks commit, and
                # the taps waiting for them publish.
                self._commit_blocks(req, record, req.computed)
                self._publish_taps(record)
            self.taps.drop_staged(record)
            if kept and self.policy == "hpc" and not req.state_ahead:
                endpoint = self._endpoint(req, lane, record)
            write = self.index.release_path(record.path)
            record.path = []
        self.index.free_pages([p for p in req.pages if self.index.pages.is_state(p, OwnerState.ACTIVE)])
        self.finished.add(req.id, record.summary(req.cached_tokens))
        # The lane holds nothing any more; now the copies, which may fail (§7.6 blocks, §7.7 endpoint).
        if write is not None:
            self.write_back.take(write)
        if endpoint is not None:
            self.write_back.take_snapshot(endpoint)

    def poll(self) -> None:
        """Completes the Host writes that landed; raises HostTransferError for a copy that failed meanwhile."""
        self.write_back.poll()
        self.write_back.raise_failure()

    def flush(self) -> None:
        """Starts the deferred Host writes (call right after a model step's dispatch, so they overlap it)."""
        self.write_back.dispatch()

    # --- commit and endpoints --------------------------------------------------------------------
    def _commit_blocks(self, req: Request, record: LaneRecord, frontier: int) -> None:
        """Commits the lane's blocks that end at or before `frontier` (§7.6)."""
        while (len(record.path) + 1) * BLOCK_TOKENS <= frontier:
            b = len(record.path)
            data = encode_tokens(req.token_slice(b * BLOCK_TOKENS, (b + 1) * BLOCK_TOKENS))
            extra = req.prompt.block_extra(b)  # its media key: the prompt's last partial block may hold an image
            if b >= len(record.hashes):  # a generated block: chain its hash on
                record.hashes.append(block_lookup_hash(record.hashes[-1] if record.hashes else 0, data, extra))
            parent = record.path[-1] if record.path else self.index.root
            record.path.append(self.index.commit_block(parent, data, record.hashes[b], req.pages[b], extra).node)

    def _endpoint(self, req: Request, lane: int, record: LaneRecord) -> Snapshot | None:
        """Publishes the endpoint snapshot; returns it when new (for its write-through)."""
        end = req.computed
        if end == 0 or end - record.deepest < BLOCK_TOKENS:
            return None
        tail_len = end % BLOCK_TOKENS
        grant = self.index.begin_snapshot(end, kind=SnapshotKind.ENDPOINT, resumed_from=record.source,
                                          previous_tap=record.last_tap, previous_frontier=record.deepest,
                                          tail_len=tail_len)
        if grant is None:
            return None
        # No step in flight reads the lane any more (it settles after its last round is read).
        self.slots.hand_over(lane, grant.slot)
        blocks = end // BLOCK_TOKENS
        anchor = record.path[blocks - 1] if blocks else self.index.root
        tail = encode_tokens(req.token_slice(blocks * BLOCK_TOKENS, end)) if tail_len else b""
        # The partial last page moves to the snapshot without a copy: the writer is terminating.
        result = self.index.publish_snapshot(grant.slot, SnapshotKind.ENDPOINT, anchor, tail,
                                             req.prompt.block_extra(blocks) if tail_len else 0,
                                             tail_page=req.pages[blocks] if tail_len else -1)
        self.counters["endpoints_published" if result.published else "endpoints_duplicate"] += 1
        return result.snapshot if result.published else None

    # --- the engine's calls ----------------------------------------------------------------------
    def demote_device(self) -> dict:
        """Drops every Device cache copy that has a Host copy (PrefixIndex.demote_device); counts what went."""
        if not self.enabled:
            return {"pages": 0, "slots": 0}
        self.write_back.poll(wait=True)  # a block still being written has no Host copy yet
        out = self.index.demote_device()
        return {"pages": len(out.freed_pages), "slots": len(out.freed_slots)}

    def clear(self) -> dict:
        """Deletes every cache entry no running request holds, on both tiers (PrefixIndex.clear); counts what
        went. Host writes in flight land first, so the entries they pin go too."""
        if not self.enabled:
            return {"blocks": 0, "snapshots": 0, "pages": 0, "slots": 0, "slabs": 0}
        self.write_back.poll(wait=True)
        out = self.index.clear()
        return {"blocks": len(out.lost_nodes), "snapshots": len(out.deleted_snapshots),
                "pages": len(out.freed_pages), "slots": len(out.freed_slots), "slabs": len(out.freed_slabs)}

    def record(self, request_id: str) -> dict | None:
        """The cache record of a recent finished request (cached_tokens, source, restored_host_bytes, ...)."""
        return self.finished.get(request_id)

    def load(self, cache_file):
        """Loads a prefix cache file into the Host tier (before any request); returns its LoadReport."""
        return cache_file.load(self.index, self.host.buffer)

    def save(self, cache_file, abandon=None) -> str | None:
        """Saves the Host tier once every write landed (no lane runs); returns why not, or None when saved.
        `abandon`: an Event that stops the save (`PrefixCacheFile.save`)."""
        self.write_back.poll(wait=True)
        if self.write_back.failed:
            return "a Host copy failed"
        try:
            cache_file.save(self.index, self.host.buffer, abandon)
        except (OSError, SaveAbandoned) as e:
            return str(e) if isinstance(e, SaveAbandoned) else f"{type(e).__name__}: {e}"
        return None

    def fail(self) -> None:
        """The engine failed: no copy runs any more (writes complete as failed, restores raise)."""
        self.write_back.fail()

    def close(self) -> None:
        """Releases the Host tier's memory (after the scheduler stopped; queued writes finish first)."""
        if self.host is not None:
            self.host.close()

    def check(self, lanes: list[Request | None]) -> None:
        """The index's invariants, every ACTIVE page owned by exactly one lane, the slot tables a permutation, and
        nothing Filling or pinned (after the Host writes in flight have landed)."""
        self.write_back.poll(wait=True)
        self.index.check_invariants()
        owned = [p for r in lanes if r is not None for p in r.pages if self.pages.is_state(p, OwnerState.ACTIVE)]
        assert len(owned) == len(set(owned)), "a private page is mapped by two lanes"
        active = self.pages.count(OwnerState.ACTIVE)
        assert active == len(owned), f"{active} ACTIVE pages but lanes own {len(owned)}"
        self.slots.check()
        held = [r for r in lanes if r is not None]
        assert all(self._lanes[r.lane] is not None for r in held), "a running lane has no cache record"
        assert sum(r is not None for r in self._lanes) == len(held), "a cache record outlived its lane"
        staging = sum(len(self._lanes[r.lane].staged) for r in held)
        assert len(self.index.staging_slots) == staging, "a staging slot is held by no lane"
        # Restores complete inside the scheduler call that starts them, and writes have landed: nothing is Filling.
        assert self.pages.count(OwnerState.FILLING) == 0, "a Device page is still Filling"
        assert self.index.slabs.count(SlabState.FILLING) == 0, "a Host slab is still Filling"
        pinned = [n for n in self.index.tree.nodes.values() if n.pins]
        pinned += [s for s in self.index.tree.snapshots.values() if s.pins]
        assert not pinned, f"pins leaked: {pinned[:4]}"
        if self.host is not None:
            assert self.host.buffer.chunks or self.write_back.failed, "the Host slab buffer is gone"

    def stats(self, detail: bool = True) -> dict:
        """The cache's counters and tables. With `detail`, once the Host writes in flight have landed and with the
        per-tier counts (a walk of every node and snapshot); without, what costs no walk and no wait."""
        self.write_back.poll(wait=detail)
        tree, index_stats = self.index.tree, self.index.stats
        out = {
            "enabled": self.enabled,
            "policy": self.policy,
            "nodes": len(tree.nodes),  # the root is not among them
            "snapshots": len(tree.snapshots),
            "device_pages_cached": self.pages.count(OwnerState.CACHED),
            "device_snapshot_slots": self.index.options.device_snapshot_slots,
            "snapshot_slots": self.index.slots.ledger(),
            "host_tier": self.host is not None,
            "host_slabs": self.index.slabs.ledger(),
            **(self.host.stats() if self.host is not None else {}),
            **self.taps.counters, **self.admitter.counters, **self.write_back.counters, **self.counters,
            **index_stats.as_dict(),
            "host_evictions": {  # §9.3, by reason
                "dead_kv": index_stats.host_dead_reclaimed,
                "superseded": index_stats.host_superseded_evicted,
                "gdsf": index_stats.host_gdsf_evicted,
                "gdsf_device_kept": index_stats.host_gdsf_demoted,
            },
        }
        if detail:
            snaps = list(tree.snapshots.values())
            nodes = [n for n in tree.nodes.values() if n.parent is not None]
            out.update({
                "nodes_by_tier": count_by_tier((n.device_state is RESIDENT, n.host_state is RESIDENT) for n in nodes),
                "snapshots_by_kind": dict(collections.Counter(s.kind.value for s in snaps)),
                "snapshots_by_tier": count_by_tier((s.image_device is RESIDENT, s.image_host is RESIDENT)
                                                   for s in snaps),
                "snapshot_hits": sum(s.hits for s in snaps),
                "snapshots_superseded": sum(s.superseded for s in snaps),
            })
        return out
