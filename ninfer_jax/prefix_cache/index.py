"""PrefixIndex: the model-agnostic hybrid prefix cache index the engine drives (spec §5–§9).

It holds identity (the block tree), residency (which Device page group, snapshot slot and
Host slabs hold each entry), refs, pins and values, and decides every copy and eviction; it
never touches Device or Host memory. The engine performs the copies it asks for
(:class:`Staging` restores, :class:`HostWrite` write-through) and reports completion.

The request lifecycle, in calls::

    quote = index.quote(tokens, hashes, entitlement_pages=...)      # §6.1-§6.3, read-only
    staging = index.stage(quote)                                    # §6.4: pins, reserve, restores
    path = index.activate(staging); index.complete_restore(staging)
    grant = index.begin_snapshot(F, kind=..., resumed_from=...)     # §7.4/§9.2 staging slot
    index.publish_snapshot(grant.slot, kind, anchor, ...)           # §7.4, §7.7
    commit = index.commit_block(parent, tokens, hash, page)         # §7.6, per full block
    write = index.release_path(path)                                # §7.7 step 2, write-through
    index.complete_host_write(write)                                # §7.6 when the D2H lands
    index.write_snapshot(snapshot) / index.reclaim_device_pages(k)  # §9.3 / §9.5
    batch = index.prefetch(quote); index.complete_prefetch(batch)   # §6.6, for a waiting head
    saved = index.saved(); index.adopt_saved(saved, index.plan_load(saved), slabs)  # §5.5 save / load

Invariants (§10; ``check_invariants`` rebuilds and checks all of them):
  * every page group, slot and slab has exactly one owner state, and the ledgers add up;
  * an active lane's path nodes have ``active_refs > 0`` and a Device copy (or one filling);
  * a snapshot exists only while valid: every path node, its tail and its image keep a copy;
  * match compares tokens and extra keys exactly; hashes never decide equality;
  * a Filling destination is pinned until its transfer completes and is never freed;
  * ``cache_epoch`` changes on every mutation, so a quote taken before one is stale.
"""

from __future__ import annotations

import dataclasses

from . import admission, persistence
from .admission import AdmissionQuote, MatchResult, Readiness, StaleQuoteError
from .cost import CacheCostModel
from .eviction import EvictionLists, GdsfPolicy
from .hashing import HashFn, default_hash_fn
from .host_slabs import MAX_CHUNK_BYTES, HostSlabPool
from .invariants import check_invariants
from .lookup import match_prompt
from .options import PrefixCacheOptions
from .persistence import LoadPlan, SavedCache
from .pools import DevicePagePool, OwnerState, SnapshotSlotPool
from .paths import PathKeeper
from .prefetch import Prefetcher
from .publication import SnapshotPublisher
from .reclaim import Reclaimer
from .staging import AdmissionStager
from .results import (BlockCommit, HostWrite, PageGrant, Prefetch, PrefixCacheStats,
                      PublishResult, Reclaimed, SlotGrant, Staging)
from .tree import BlockNode, BlockTree, Snapshot, SnapshotKind

_ACTIVE, _CACHED = OwnerState.ACTIVE, OwnerState.CACHED


@dataclasses.dataclass(frozen=True)
class CacheGeometry:
    """Sizes the index needs from the engine.

    Attributes:
      device_pages: page groups in the Device KV pools (M).
      block_bytes: one block's page bundle across every enabled pool (H2D bytes per block).
      image_bytes: one snapshot state image (H2D bytes per image).
      max_host_chunk_bytes: largest pinned Host chunk.
    """

    device_pages: int
    block_bytes: int
    image_bytes: int
    max_host_chunk_bytes: int = MAX_CHUNK_BYTES


class PrefixIndex:
    """The hybrid prefix cache index (one per Engine; the scheduler is its only mutator)."""

    def __init__(self, geometry: CacheGeometry, options: PrefixCacheOptions,
                 cost: CacheCostModel | None = None, hash_fn: HashFn = default_hash_fn):
        self.geometry = geometry
        self.options = options
        self.cost = cost if cost is not None else CacheCostModel()
        self.hash_fn = hash_fn
        self.tree = BlockTree()
        self.pages = DevicePagePool(geometry.device_pages)
        self.slots = SnapshotSlotPool(options.device_snapshot_slots)
        self.slabs = HostSlabPool(options.host_cache_bytes, geometry.block_bytes, geometry.image_bytes,
                                  geometry.max_host_chunk_bytes)
        self.lists = EvictionLists()
        self.gdsf = GdsfPolicy(self.tree, self.cost, geometry.image_bytes,
                               self.slabs.image_slabs * self.slabs.slab_bytes, self.slabs.slab_bytes)
        self.stats = PrefixCacheStats()
        self.reclaimer = Reclaimer(self.tree, self.pages, self.slots, self.slabs, self.lists, self.gdsf, self.stats)
        self.publisher = SnapshotPublisher(self.tree, self.pages, self.slots, self.slabs, self.lists, self.gdsf,
                                           self.reclaimer, self.stats)
        self.stager = AdmissionStager(self.pages, self.lists, self.reclaimer, self.publisher, self.stats)
        self.prefetcher = Prefetcher(self.pages, self.lists, self.reclaimer, self.stats)
        self.paths = PathKeeper(self.tree, self.pages, self.slabs, self.lists, self.gdsf, self.reclaimer, self.stats)
        self._epoch = 0

    # ---- queries -------------------------------------------------------------------------

    @property
    def cache_epoch(self) -> int:
        """Changes on every mutation that could invalidate a quote."""
        return self._epoch

    @property
    def inflation(self) -> float:
        """GDSF's L (never decreases)."""
        return self.gdsf.inflation

    @property
    def root(self) -> BlockNode:
        return self.tree.root

    def node(self, node_id: int) -> BlockNode | None:
        return self.tree.nodes.get(node_id)

    def snapshot(self, snapshot_id: int) -> Snapshot | None:
        return self.tree.snapshots.get(snapshot_id)

    def available_pages(self) -> int:
        """free + evictable (spec §5.4); active growth always wins over cache."""
        return self.pages.num_free + self.lists.device_evictable

    @property
    def staging_slots(self) -> set[int]:
        """Slots held by pending taps and endpoints (ACTIVE)."""
        return self.publisher.staging_slots

    def is_current(self, quote: AdmissionQuote) -> bool:
        return quote.epoch == self._epoch

    # ---- lookup and admission (§6) -------------------------------------------------------

    def match(self, tokens, block_hashes=None, extras=None, vision_spans=()) -> MatchResult:
        """Matches a prompt (spec §6.1); read-only.

        Args:
          tokens: the prompt: int32 little-endian ``bytes`` or a numpy int array (cheap), or a
            sequence of ints.
          block_hashes: lookup_hash of every full block (PreparedPrompt.block_hashes); computed
            with the index's hash function when None.
          extras: per-block media keys (0 / None when no Vision item overlaps).
          vision_spans: ``(begin, length)`` spans; frontiers strictly inside one are rejected.
        """
        self.stats.lookups += 1
        return match_prompt(self.tree, tokens, block_hashes, extras, vision_spans, self.hash_fn, self._epoch)

    def quote(self, tokens, block_hashes=None, *, entitlement_pages: int, extras=None,
              vision_spans=()) -> AdmissionQuote:
        """Matches, chooses a source and classifies readiness (spec §6.1–§6.3); read-only."""
        m = self.match(tokens, block_hashes, extras, vision_spans)
        return admission.make_quote(
            m, entitlement_pages, self.cost, block_bytes=self.geometry.block_bytes,
            image_bytes=self.geometry.image_bytes, free_pages=self.pages.num_free,
            evictable_pages=self.lists.device_evictable, capacity_pages=self.pages.capacity, epoch=self._epoch)

    def stage(self, quote: AdmissionQuote) -> Staging:
        """Stages a Ready quote (spec §6.4 steps 1–3): pins, evicts, reserves, lists restores.

        Raises:
          StaleQuoteError: the cache changed since the quote.
          ValueError: the quote is not Ready.
        """
        if quote.readiness is not Readiness.READY:
            raise ValueError(f"cannot stage a {quote.readiness.value} quote")
        if quote.epoch != self._epoch:
            raise StaleQuoteError(f"quote epoch {quote.epoch} != cache_epoch {self._epoch}")
        staging = self.stager.stage(quote)
        self._epoch += 1
        return staging

    def activate(self, staging: Staging) -> list[BlockNode]:
        """Hands the staged path to the lane: admission pins become active refs (spec §6.4)."""
        path = self.stager.activate(staging)
        self._epoch += 1
        return path

    def complete_restore(self, staging: Staging) -> None:
        """The restore batch landed: destinations become Resident, restore pins drop (spec §6.5)."""
        self.stager.complete_restore(staging)
        self._epoch += 1

    def cancel_staging(self, staging: Staging) -> None:
        """A request cancelled before activation: restores have landed (the engine waited), the
        lane's reservation returns and every admission pin is released."""
        self.stager.cancel(staging)
        self._epoch += 1

    def prefetch_room(self) -> int:
        """Pages a prefetch could take now (free + Host-backed cached); O(1), for the retry rule."""
        return self.prefetcher.spare_pages()

    def prefetch(self, quote: AdmissionQuote, max_blocks: int = 256) -> Prefetch | None:
        """Reserves Device pages for up to ``max_blocks`` Host-only path blocks of the source ``quote``
        (usually TemporarilyBlocked) would choose (spec §6.6); None when there is nothing to copy or no room.
        The engine copies ``restores`` and calls ``complete_prefetch``."""
        batch = self.prefetcher.plan(quote, max_blocks)
        if batch is not None:
            self._epoch += 1
        return batch

    def complete_prefetch(self, batch: Prefetch, ok: bool = True) -> None:
        """The prefetch copies landed (or failed): blocks become Resident cached, the path unpins."""
        self.prefetcher.complete(batch, ok)
        self._epoch += 1

    # ---- lanes: pages, blocks, release (§7.5–§7.7) ---------------------------------------

    def allocate_pages(self, k: int) -> PageGrant | None:
        """``k`` private (ACTIVE) page groups for a lane, evicting from the device LRU as needed.
        Returns None, evicting nothing, when even an empty cache could not free them."""
        if k > self.available_pages():
            return None
        out = Reclaimed()
        self.reclaimer.evict_device(k, out)
        self._epoch += 1
        return PageGrant(self.pages.allocate(k, _ACTIVE), out)

    def free_pages(self, pages) -> None:
        """Returns a lane's private pages (Duplicate pages, growth, an unused tail page)."""
        for page in pages:
            if not self.pages.is_state(page, _ACTIVE):
                raise ValueError(f"page {page} is not a lane's private page")
        self.pages.free(pages)
        self._epoch += 1

    def acquire_path(self, path: list[BlockNode]) -> None:
        """Adds one active ref to each node of a root path (a lane mapping cached blocks)."""
        self.paths.acquire(path)
        self._epoch += 1

    def commit_block(self, parent: BlockNode, tokens, block_hash: int, page: int, extra: int = 0) -> BlockCommit:
        """Publishes a lane's committed full block under ``parent`` (spec §7.6).

        Args:
          parent: the lane's previous block node (held by the lane) or the root.
          tokens: the block's 64 tokens (256 int32 bytes, or anything ``encode_tokens`` takes).
          block_hash: its lookup hash (selects the child only).
          page: the lane's private page holding the block's KV.
          extra: the block's media key.
        Returns:
          the node (now holding one more active ref for the lane) and whether the lane's page
          stays private (Duplicate) or became the cache's (Inserted / Adopted).
        """
        commit = self.paths.commit(parent, tokens, block_hash, page, extra)
        self._epoch += 1
        return commit

    def release_path(self, path: list[BlockNode]) -> HostWrite:
        """A lane releases its path (spec §7.7 step 2, §7.6 write-through).

        Device-only nodes are written through in one batch: slabs are taken (§9.3; blocks no
        snapshot can reach only take free or dead-KV slabs), the path stays pinned until
        ``complete_host_write``, and then joins the device LRU in reverse block order. Without
        a write the nodes join it now, in reverse block order.
        """
        write = self.paths.release(path)
        self._epoch += 1
        return write

    # ---- pins ----------------------------------------------------------------------------

    def pin_path(self, node: BlockNode) -> None:
        """Pins ``node`` and every ancestor (pins are closed upward): no eviction, no deletion."""
        self.lists.pin_nodes(node.path(), 1)
        self._epoch += 1

    def unpin_path(self, node: BlockNode) -> None:
        self.lists.pin_nodes(node.path(), -1)
        self._epoch += 1

    def pin_snapshot(self, s: Snapshot) -> None:
        """Pins a snapshot and its anchor path until unpinned."""
        self.pin_path(s.anchor)
        s.pins += 1
        self.lists.refresh_snapshot(s)

    def unpin_snapshot(self, s: Snapshot) -> None:
        if s.pins <= 0:
            raise ValueError(f"{s} is not pinned")
        s.pins -= 1
        self.lists.refresh_snapshot(s)
        self.unpin_path(s.anchor)

    # ---- snapshots (§7.4, §7.7, §9.2, §9.3 supersession) ---------------------------------

    def begin_snapshot(self, frontier: int, *, kind: SnapshotKind = SnapshotKind.TAP,
                       resumed_from: Snapshot | None = None, previous_tap: Snapshot | None = None,
                       previous_frontier: int = 0, tail_len: int = 0) -> SlotGrant | None:
        """Supersedes the lineage's older snapshots, then takes a staging slot (§9.2 order).

        Args:
          frontier: F of the snapshot about to be taken.
          kind: Tap/Boundary (which also supersede ``previous_tap``) or Endpoint.
          resumed_from: the snapshot this request resumed from (superseded when shallower).
          previous_tap: this prompt's previous tap.
          previous_frontier: the lineage's previous snapshot frontier (priority estimate).
          tail_len: F % 64 for an endpoint.
        Returns:
          the slot (ACTIVE until published or released), or None: the tap or endpoint is skipped.
        """
        self._epoch += 1
        return self.publisher.begin(frontier, kind, resumed_from, previous_tap, previous_frontier, tail_len)

    def release_staging_slot(self, slot: int) -> None:
        """A pending tap is dropped (its lane finished without publishing it)."""
        self.publisher.release_staging_slot(slot)
        self._epoch += 1

    def publish_snapshot(self, slot: int, kind: SnapshotKind, anchor: BlockNode, tail_tokens=b"",
                         tail_extra: int = 0, tail_page: int = -1) -> PublishResult:
        """Publishes the image in staging ``slot`` at F = 64 (anchor.depth + 1) + len(tail).

        Taps and Boundaries are 64-aligned (no tail). An endpoint's tail page (the lane's
        partial last page, or a cache-owned copy) becomes the snapshot's. A duplicate of an
        existing (anchor, tail) is a no-op that returns the slot, refreshes the existing one's
        recency and retains it again if superseded; the tail page then stays with the caller.
        """
        self._epoch += 1
        return self.publisher.publish(slot, kind, anchor, tail_tokens, tail_extra, tail_page)

    def supersede(self, s: Snapshot) -> bool:
        """Marks ``s`` superseded (§9.3); a Boundary only while the tree below it is one chain."""
        self._epoch += 1
        return self.publisher.supersede(s)

    def write_snapshot(self, s: Snapshot) -> HostWrite:
        """Write-through of a snapshot's image (and tail) to Host slabs, GDSF-bounded (§9.3).

        Returns an empty HostWrite when there is nothing to write or no room worth taking:
        the snapshot then stays Device-only.
        """
        self._epoch += 1
        return self.publisher.write(s)

    def complete_host_write(self, write: HostWrite, ok: bool = True) -> None:
        """A write-through landed (``ok``) or failed: Host copies become Resident or are freed."""
        if write.done or write.empty:
            write.done = True
            return
        self.paths.complete_write(write, ok)
        if write.snapshot is not None:
            self.publisher.complete_write(write, ok)
        self.lists.pin_nodes(write.pinned, -1)
        write.done = True
        self._epoch += 1

    def make_host_room(self, k: int) -> Reclaimed:
        """Frees ``k`` Host slabs in §9.3 order (what a write would do), for prefetch and tests."""
        out = Reclaimed()
        self.reclaimer.make_host_room(k, out)
        self._epoch += 1
        return out

    # ---- Device (§9.1, §9.5) -------------------------------------------------------------

    def reclaim_device_pages(self, k: int) -> Reclaimed:
        """Evicts from the device LRU until ``k`` page groups are free (hybrid_reclaim_device_kv)."""
        out = Reclaimed()
        self.reclaimer.evict_device(k, out)
        self._epoch += 1
        return out

    def demote_device(self) -> Reclaimed:
        """Drops the Device copy of every unheld cache entry that also has a Host copy: blocks, tails and
        snapshot images (an operator's "move the cache to the Host", and the Host-restore benchmark's setup).
        Entries without a Host copy, and whatever a lane or a copy holds, stay as they are."""
        out = self.reclaimer.demote_device()
        self._epoch += 1
        return out

    def clear(self) -> Reclaimed:
        """Deletes every cache entry nothing holds, with its copies on both tiers (an operator's reset, vLLM's
        reset_prefix_cache): what running lanes, admissions and copies in flight hold stays."""
        out = self.reclaimer.clear()
        self._epoch += 1
        return out

    # ---- persistence (§5.5) --------------------------------------------------------------

    def saved(self) -> SavedCache:
        """What a save writes: retained snapshots complete on the Host, with their Host-resident paths."""
        return persistence.collect(self.tree)

    def plan_load(self, saved: SavedCache) -> LoadPlan:
        """What of `saved` this (empty) index's Host tier takes back (persistence.plan)."""
        return persistence.plan(saved, self.slabs.num_free, self.cost, self.slabs.slab_bytes)

    def adopt_saved(self, saved: SavedCache, plan: LoadPlan, slabs: list[int]) -> None:
        """Rebuilds the planned entries Host-only, parents before children, evicting nothing.

        Args:
          saved, plan: a save and what of it to load; the index must be empty (a load precedes any request).
          slabs: `plan.slabs` slabs taken by the caller (FILLING, now holding the bytes), in file order: each
            block's slab, then each snapshot's image slabs and its tail slab.
        """
        persistence.adopt(self, saved, plan, slabs)
        self._epoch += 1

    def check_invariants(self) -> None:
        """Rebuilds every derived value from the tree; AssertionError on any mismatch (§10)."""
        check_invariants(self)

    sanity_check = check_invariants  # SGLang's name for the same check
