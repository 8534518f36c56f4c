"""WriteBack: the asynchronous write-through of blocks and snapshot images to the Host tier (spec §7.4, §7.6,
§7.7), and the Host link's failure state.

A HostWrite the index hands out already holds what it needs (slabs Filling, sources pinned), so only its
device gathers wait: `take` defers them and `dispatch` starts them right after the scheduler's next model step,
while that step computes. The Host tier's writer thread copies them into the slabs, and `poll` completes the
landed writes in the index. A failed copy, here or in a restore, sets `failed`: no copy runs after it, and the
scheduler's next `poll` raises the failure, which fails the engine.
"""

from __future__ import annotations

from ninfer_jax.prefix_cache import PrefixIndex
from ninfer_jax.prefix_cache.results import HostWrite
from ninfer_jax.prefix_cache.tree import Snapshot
from ninfer_jax.runtime.device.host_tier import HostTier, HostTransferError
from ninfer_jax.runtime.prefix.slots import SlotTable


class WriteBack:
    """Deferred, dispatched and landed Host writes; `failed` once any Host copy failed."""

    MAX_QUEUED_WRITE_BYTES = 4 << 30  # gathered bytes waiting for the writer thread (host memory they hold)

    def __init__(self, index: PrefixIndex, host: HostTier | None, slots: SlotTable):
        self.index, self.host, self.slots = index, host, slots
        self.failed = False  # a copy failed (or the engine did): no copy runs any more
        self.counters = {"host_writes_failed": 0, "host_restores_failed": 0}
        self._deferred: list[HostWrite] = []  # taken, their copies not started yet
        self._failure: HostTransferError | None = None  # a writer or watcher thread's failure, not raised yet

    def take(self, write: HostWrite) -> None:
        """Takes a write the index handed out; `dispatch` starts its copies."""
        if write.empty:
            self.index.complete_host_write(write)
        elif self.failed or self.host is None:
            self._write_failed(write)
        else:
            self._deferred.append(write)

    def take_snapshot(self, snapshot: Snapshot) -> None:
        """The write-through of a newly published snapshot's image (and tail)."""
        if self.host is not None and not self.failed:
            self.take(self.index.write_snapshot(snapshot))

    def dispatch(self) -> None:
        """Starts every deferred write: the gathers are dispatched, the host copy is the writer thread's. A failure
        fails the link and raises."""
        writes, self._deferred = self._deferred, []
        for i, write in enumerate(writes):
            try:
                self._dispatch(write)
            except BaseException:
                for rest in writes[i + 1:]:
                    self._write_failed(rest)
                raise

    def _dispatch(self, write: HostWrite) -> None:
        if self.host.queued_bytes > self.MAX_QUEUED_WRITE_BYTES:  # deferred writes imply a Host tier
            self.poll(wait=True)  # the writer fell behind: bound the gathered bytes held in host memory
        if self.failed:  # a copy failed in the writer thread (the engine fails at its next step)
            self._write_failed(write)
            return
        s = write.snapshot
        tail = write.tail_slab >= 0
        try:
            self.host.write(write, [n.device_page for n in write.nodes] + ([s.tail_page] if tail else []),
                            list(write.node_slabs) + ([write.tail_slab] if tail else []),
                            self.slots.snapshot(s.device_slot) if write.image_slabs else -1, write.image_slabs)
        except BaseException:
            self._write_failed(write)
            self.failed = True
            raise

    def poll(self, wait: bool = False) -> None:
        """Completes in the index every write that landed (with `wait`, after dispatching the deferred ones and
        waiting for all). A failed copy fails the link; `raise_failure` then raises it."""
        if self.host is None:
            return
        if wait:
            self.dispatch()
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

    def raise_failure(self) -> None:
        """Raises HostTransferError once for a copy that failed in the writer or watcher thread."""
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure

    def restore_failed(self) -> None:
        """A restore or prefetch failed at its dispatch (the caller re-raises it)."""
        self.failed = True
        self.counters["host_restores_failed"] += 1

    def fail(self) -> None:
        """The engine failed: no copy runs any more, deferred writes complete as failed."""
        self.failed = True
        for write in self._deferred:
            self._write_failed(write)
        self._deferred = []

    def _write_failed(self, write: HostWrite) -> None:
        if not self.failed:
            self.counters["host_writes_failed"] += 1
        self.index.complete_host_write(write, ok=False)

    def _copy_failed(self, what: str, failure: BaseException) -> None:
        self.failed = True
        self._failure = HostTransferError(f"{what}: {failure}")
        self._failure.__cause__ = failure
