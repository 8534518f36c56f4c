"""Host slab pool accounting: one pinned budget cut into equal slabs (spec §5.4).

A slab holds one block bundle (the Main page packed with its Host layout, then the backend
page at the next 4 KiB boundary); ``slab_bytes`` is the bundle rounded up to 4 KiB. KV
blocks, snapshot images and snapshot tails share the one pool with no fixed split:

  * a block or a tail takes one slab;
  * an image takes ``image_slabs = ceil(image_bytes / slab_bytes)`` slabs, not necessarily
    contiguous (its packed byte ``o`` lives in its ``o // slab_bytes``-th slab).

The budget is pinned in chunks of at most 4 GiB of whole slabs; slab ``i`` lives in chunk
``i // slabs_per_chunk`` at byte ``(i % slabs_per_chunk) * slab_bytes``, so a slab never
crosses chunks. :meth:`HostSlabPool.runs` splits a list of slabs into runs of consecutive
slabs inside one chunk, which a copy moves as one strided transfer.

Invariants:
  * every slab is in exactly one state (Free / Node / SnapshotImage / SnapshotTail / Filling)
    and ``node + image + tail + filling + free == num_slabs`` (checked by :meth:`check`);
  * the free list is an index stack (O(1) per slab); a batch is handed out sorted and freed
    so the smallest ids pop first, which favours consecutive slabs;
  * a nonzero budget below one snapshot image plus one block is rejected at construction.
"""

from __future__ import annotations

import dataclasses
import enum
import math

from .pools import IdPool

SLAB_ALIGN = 4096
MAX_CHUNK_BYTES = 4 << 30


class SlabState(enum.IntEnum):
    """Owner state of one Host slab."""

    FREE = 0
    NODE = 1
    IMAGE = 2
    TAIL = 3
    FILLING = 4


@dataclasses.dataclass(frozen=True, slots=True)
class SlabRun:
    """``count`` consecutive slabs from ``first`` inside chunk ``chunk`` starting at byte ``offset``.

    ``start`` is the index in the caller's list where the run begins (so a paired list of
    device pages can be cut at the same places).
    """

    start: int
    first: int
    count: int
    chunk: int
    offset: int


def round_up(value: int, align: int) -> int:
    return (value + align - 1) // align * align


class HostSlabPool:
    """Accounting of the Host slab pool; the bytes themselves belong to the engine.

    Args:
      budget_bytes: host_cache_bytes; 0 disables the Host tier (no slabs).
      block_bundle_bytes: one block's packed bytes across its pools (before rounding).
      image_bytes: one snapshot state image's packed bytes.
      max_chunk_bytes: largest pinned chunk (4 GiB).
    Raises:
      ValueError: a nonzero budget smaller than one snapshot plus one block, or nonsense sizes.
    """

    def __init__(self, budget_bytes: int, block_bundle_bytes: int, image_bytes: int,
                 max_chunk_bytes: int = MAX_CHUNK_BYTES):
        if block_bundle_bytes <= 0 or image_bytes <= 0:
            raise ValueError(f"block_bundle_bytes ({block_bundle_bytes}) and image_bytes ({image_bytes}) "
                             "must be positive")
        if budget_bytes < 0:
            raise ValueError(f"host cache budget must be >= 0, got {budget_bytes}")
        self.slab_bytes = round_up(block_bundle_bytes, SLAB_ALIGN)
        self.image_slabs = math.ceil(image_bytes / self.slab_bytes)
        self.budget_bytes = budget_bytes
        minimum = (self.image_slabs + 1) * self.slab_bytes
        if 0 < budget_bytes < minimum:
            raise ValueError(
                f"host cache budget {budget_bytes} B is below one snapshot plus one block "
                f"({self.image_slabs} image slabs + 1 block slab of {self.slab_bytes} B = {minimum} B); "
                f"raise --host-cache-mib or set it to 0 to disable the Host tier")
        self.slabs_per_chunk = max_chunk_bytes // self.slab_bytes
        if budget_bytes and self.slabs_per_chunk < 1:
            raise ValueError(f"slab of {self.slab_bytes} B does not fit a {max_chunk_bytes} B pinned chunk")
        num_slabs = budget_bytes // self.slab_bytes
        self._ids = IdPool(num_slabs, SlabState, "host slabs")
        self.num_chunks = math.ceil(num_slabs / self.slabs_per_chunk) if num_slabs else 0

    # ---- geometry ------------------------------------------------------------------------

    @property
    def num_slabs(self) -> int:
        return self._ids.capacity

    @property
    def enabled(self) -> bool:
        return self.num_slabs > 0

    @property
    def num_free(self) -> int:
        return self._ids.num_free

    def chunk_slabs(self, chunk: int) -> int:
        """Number of slabs in ``chunk`` (the last chunk may be short)."""
        return min(self.slabs_per_chunk, self.num_slabs - chunk * self.slabs_per_chunk)

    def chunk_bytes(self, chunk: int) -> int:
        """Bytes to pin for ``chunk`` (whole slabs, at most the chunk limit)."""
        return self.chunk_slabs(chunk) * self.slab_bytes

    def location(self, slab: int) -> tuple[int, int]:
        """Returns ``(chunk, byte offset in that chunk)`` of ``slab``."""
        if not 0 <= slab < self.num_slabs:
            raise IndexError(f"slab {slab} out of range [0, {self.num_slabs})")
        chunk, index = divmod(slab, self.slabs_per_chunk)
        return chunk, index * self.slab_bytes

    def slabs_for_snapshot(self, with_tail: bool) -> int:
        """Slabs one snapshot needs: its image, plus one for a tail."""
        return self.image_slabs + (1 if with_tail else 0)

    def runs(self, slabs: list[int], pages: list[int] | None = None) -> list[SlabRun]:
        """Splits ``slabs`` (in the caller's order) into runs of consecutive slabs in one chunk.

        With ``pages`` (the paired device page of each slab) a run also requires the pages to
        advance by one, so a run is one strided copy per plane in either direction.
        """
        out: list[SlabRun] = []
        spc = self.slabs_per_chunk
        i, n = 0, len(slabs)
        while i < n:
            first = slabs[i]
            chunk = first // spc
            j = i + 1
            while (j < n and slabs[j] == slabs[j - 1] + 1 and slabs[j] // spc == chunk
                   and (pages is None or pages[j] == pages[j - 1] + 1)):
                j += 1
            out.append(SlabRun(start=i, first=first, count=j - i, chunk=chunk,
                               offset=(first % spc) * self.slab_bytes))
            i = j
        return out

    # ---- allocation ----------------------------------------------------------------------

    def allocate(self, k: int, state: SlabState = SlabState.FILLING) -> list[int]:
        """Takes ``k`` free slabs (ascending, favouring consecutive ids). Raises PoolExhausted."""
        return self._ids.allocate(k, state)

    def free(self, slabs) -> None:
        self._ids.free(slabs)

    def set_state(self, slab: int, state: SlabState) -> None:
        self._ids.set_state(slab, state)

    def state(self, slab: int) -> SlabState:
        return self._ids.state(slab)

    def count(self, state: SlabState) -> int:
        return self._ids.count(state)

    def ledger(self) -> dict[str, int]:
        return self._ids.ledger()

    def check(self, expected: dict[int, SlabState] | None = None) -> None:
        """Rebuilds the ledger; with ``expected`` every non-free slab must have exactly that owner state."""
        self._ids.check(expected, unowned_ok=())
