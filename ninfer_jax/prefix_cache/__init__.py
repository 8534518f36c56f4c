"""Hybrid prefix cache (HPC) index: model-agnostic, pure Python + numpy (spec §5–§10).

Modules, one job each:
  hashing     block keys and chained xxh3 lookup hashes (§5.1)
  tree        block nodes, snapshots, exact matching, path counters (§5.2, §5.3, §6.1)
  pools       Device page groups and snapshot slots as int ids with owner states (§5.4)
  host_slabs  Host slab pool accounting, chunks and copy runs (§5.4)
  eviction    device LRU / dead-KV / superseded lists and GDSF valuation (§9.1, §9.3)
  reclaim     dropping copies, losing the last copy, the eviction procedures (§9.1–§9.4)
  lookup      prompt matching: the path and its valid resume points (§6.1)
  admission   source choice, capacity arithmetic, readiness, backfill proof (§6.2, §6.3)
  staging     admission staging: pins, reservations, restores, activation (§6.4, §6.5)
  prefetch    the waiting head's Host-only path blocks into spare Device pages (§6.6)
  publication taps and endpoints: slots, publication, supersession, image write-through (§7.4, §9.2, §9.3)
  results     the typed results handed to the engine, and the stats counters
  cost        prefill and restore seconds (§6.2, §11.4)
  taps        tap planning (§7.1)
  options     derived option defaults (§14.2)
  index       PrefixIndex, the façade the engine calls
  invariants  check_invariants: rebuild every derived value and compare (§10)

Nothing here imports jax or the model.
"""

from .admission import (AdmissionQuote, MatchResult, Readiness, SourceCandidate, StaleQuoteError,
                        backfill_admissible, entitlement_pages)
from .cost import CacheCostModel
from .hashing import (BLOCK_TOKEN_BYTES, BLOCK_TOKENS, LOOKUP_HASH_SEED, HashFn, VisionItem, block_hashes,
                      block_lookup_hash, default_hash_fn, encode_tokens, media_keys)
from .host_slabs import HostSlabPool, SlabRun, SlabState
from .index import CacheGeometry, PrefixIndex
from .invariants import check_invariants
from .options import DEFAULT_HOST_CACHE_BYTES, PrefixCacheOptions
from .pools import DevicePagePool, OwnerState, PoolExhausted, SnapshotSlotPool
from .results import (BlockCommit, BlockRestore, CommitOutcome, HostWrite, PageGrant, Prefetch, PrefixCacheStats,
                      PublishResult, Reclaimed, SlotGrant, Staging)
from .taps import HintKind, Placement, PlannedTap, TapHint, TapPlanner, TapPlanOptions, TapSource, plan_taps
from .tree import BlockNode, Residency, Snapshot, SnapshotKind

__all__ = [
    "AdmissionQuote", "BLOCK_TOKENS", "BLOCK_TOKEN_BYTES", "BlockCommit", "BlockNode", "BlockRestore",
    "CacheCostModel", "CacheGeometry", "CommitOutcome", "DEFAULT_HOST_CACHE_BYTES", "DevicePagePool", "HashFn",
    "HintKind", "HostSlabPool", "HostWrite", "LOOKUP_HASH_SEED", "MatchResult", "OwnerState", "PageGrant",
    "Placement", "PlannedTap", "Prefetch", "PoolExhausted", "PrefixCacheOptions", "PrefixCacheStats", "PrefixIndex",
    "PublishResult", "Readiness", "Reclaimed", "Residency", "SlabRun", "SlabState", "SlotGrant", "Snapshot",
    "SnapshotKind", "SnapshotSlotPool", "SourceCandidate", "StaleQuoteError", "Staging", "TapHint", "TapPlanOptions",
    "TapPlanner", "TapSource", "VisionItem", "backfill_admissible", "block_hashes", "block_lookup_hash",
    "check_invariants", "default_hash_fn", "encode_tokens", "entitlement_pages", "media_keys", "plan_taps",
]
