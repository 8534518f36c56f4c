"""Hybrid prefix cache options with the spec's derived defaults (spec §14.2).

The only capacity a deployment chooses is the Host budget; every other value is derived
from the rest of the configuration when it is left unset:

  value                   default                                   reason
  host_cache_bytes        8 GiB; 0 disables the Host tier          the Legacy Host KV default
  device_snapshot_slots   C + 1 with a Host tier, C + 2 without     one resident snapshot per
                                                                    conversation plus staging
  max_new_taps            8 with a Host tier, 2 without             without Host, taps evict
                                                                    other conversations' snapshots
  tap_ladder_tokens (G)   max(4096, 2 * chunk)                      ladder taps land on chunk
                                                                    boundaries
  tap_min_gap_tokens      max(1024, chunk)                          the same

(C = max_concurrency, chunk = prefill_chunk.) A resolved :class:`PrefixCacheOptions` always
holds concrete, validated values; invalid or conflicting ones raise ``ValueError`` naming the
option.
"""

from __future__ import annotations

import dataclasses

from .hashing import BLOCK_TOKENS

GiB = 1 << 30
DEFAULT_HOST_CACHE_BYTES = 8 * GiB


# The default rules (spec §14.2), here once: PrefixCacheOptions.resolve and the engine's EngineOptions.resolve
# both call them.
def default_snapshot_slots(max_concurrency: int, host_tier: bool) -> int:
    """D when unset: one resident snapshot per lane plus staging, C + 1 with a Host tier, C + 2 without."""
    return max_concurrency + (1 if host_tier else 2)


def default_max_new_taps(host_tier: bool) -> int:
    """Taps planned per request when unset: 8 with a Host tier, 2 without (taps would evict other conversations'
    snapshots)."""
    return 8 if host_tier else 2


def default_tap_ladder_tokens(prefill_chunk: int) -> int:
    """G when unset: max(4096, 2 * chunk), so ladder taps land on chunk boundaries."""
    return max(4096, 2 * prefill_chunk)


def default_tap_min_gap_tokens(prefill_chunk: int) -> int:
    """The ladder's minimum gap when unset: max(1024, chunk)."""
    return max(1024, prefill_chunk)


def tap_spacing_problem(tap_ladder_tokens: int, tap_min_gap_tokens: int) -> str | None:
    """Why a ladder spacing and a minimum gap cannot go together (None: they can)."""
    if tap_min_gap_tokens > tap_ladder_tokens:
        return (f"tap_min_gap_tokens ({tap_min_gap_tokens}) must not exceed tap_ladder_tokens ({tap_ladder_tokens}): "
                f"the first ladder step would always violate the gap")
    return None


@dataclasses.dataclass(frozen=True)
class PrefixCacheOptions:
    """Resolved Hybrid prefix cache options (all values concrete).

    Build with :meth:`resolve`; direct construction validates too.
    """

    host_cache_bytes: int
    device_snapshot_slots: int
    max_new_taps: int
    tap_ladder_tokens: int
    tap_min_gap_tokens: int

    def __post_init__(self):
        if self.host_cache_bytes < 0:
            raise ValueError(f"host_cache_bytes must be >= 0 (0 disables the Host tier), got {self.host_cache_bytes}")
        if self.device_snapshot_slots < 1:
            raise ValueError(f"device_snapshot_slots must be >= 1, got {self.device_snapshot_slots}")
        if self.max_new_taps < 0:
            raise ValueError(f"max_new_taps must be >= 0, got {self.max_new_taps}")
        if self.tap_ladder_tokens < BLOCK_TOKENS:
            raise ValueError(f"tap_ladder_tokens must be >= {BLOCK_TOKENS}, got {self.tap_ladder_tokens}")
        if self.tap_min_gap_tokens < BLOCK_TOKENS:
            raise ValueError(f"tap_min_gap_tokens must be >= {BLOCK_TOKENS}, got {self.tap_min_gap_tokens}")
        spacing = tap_spacing_problem(self.tap_ladder_tokens, self.tap_min_gap_tokens)
        if spacing:
            raise ValueError(spacing)

    @property
    def host_tier(self) -> bool:
        """Whether a Host tier exists (a nonzero budget)."""
        return self.host_cache_bytes > 0

    @classmethod
    def resolve(cls, max_concurrency: int, prefill_chunk: int,
                host_cache_bytes: int | None = DEFAULT_HOST_CACHE_BYTES, *,
                device_snapshot_slots: int | None = None, max_new_taps: int | None = None,
                tap_ladder_tokens: int | None = None,
                tap_min_gap_tokens: int | None = None) -> "PrefixCacheOptions":
        """Resolves every unset value from the configuration (spec §14.2).

        Args:
          max_concurrency: C, the number of lanes (>= 1).
          prefill_chunk: tokens per prefill pass (>= 1).
          host_cache_bytes: the Host slab pool budget; ``None`` means the 8 GiB default, 0
            disables the Host tier.
          device_snapshot_slots, max_new_taps, tap_ladder_tokens, tap_min_gap_tokens:
            explicit overrides; ``None`` derives the default.
        Raises:
          ValueError: for an invalid or conflicting value, naming it.
        """
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        if host_cache_bytes is None:
            host_cache_bytes = DEFAULT_HOST_CACHE_BYTES
        host = host_cache_bytes > 0
        if device_snapshot_slots is None:
            device_snapshot_slots = default_snapshot_slots(max_concurrency, host)
        if max_new_taps is None:
            max_new_taps = default_max_new_taps(host)
        if tap_ladder_tokens is None:
            tap_ladder_tokens = default_tap_ladder_tokens(prefill_chunk)
        if tap_min_gap_tokens is None:
            tap_min_gap_tokens = default_tap_min_gap_tokens(prefill_chunk)
        return cls(host_cache_bytes=host_cache_bytes, device_snapshot_slots=device_snapshot_slots,
                   max_new_taps=max_new_taps, tap_ladder_tokens=tap_ladder_tokens,
                   tap_min_gap_tokens=tap_min_gap_tokens)
