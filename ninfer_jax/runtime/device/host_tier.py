"""HostTier: the copies between the Host slab buffer and the device pools (spec §6.5, §7.6).

The index (`prefix_cache/`) decides which slab holds what and which copies run; this module moves the bytes, in
the slab layout of `device/transfer.py`, in batches of the runner's compiled transfer sizes:
  write-through  a device-side gather of the listed pages (and one state slot) lands in pinned host memory; a
                 writer thread waits for it and copies it into the slabs, and `landed()` hands the write back
                 (§7.6: the scheduler never waits for a host copy);
  restore        each run of consecutive slabs moves straight from the page-locked chunk and is scattered into
                 the donated pools. The caller only dispatches: JAX orders the scatters before any later step
                 that reads the pages or slot. A watcher thread waits for the copies and times them; the writer
                 holds every Host write queued after a restore until that restore has landed, so a slab being
                 read is never rewritten.
NOTE: the layer-pipelined restore of §6.5/§12.1 is not built: the copy overlaps the device work queued before
the lane's first step, not that step (docs/STATUS.md).

`inject_fault(kind)` makes the next "write" or "restore" raise `HostTransferError` (the spec's forced transfer
error, for fault-injection tests).
"""

from __future__ import annotations

import collections
import functools
import logging
import queue
import threading
import time

import jax
import numpy as np

from ninfer_jax.runtime.device.buckets import split_transfer
from ninfer_jax.runtime.device.host_buffer import HostSlabBuffer

log = logging.getLogger("ninfer_jax.host_tier")


class HostTransferError(RuntimeError):
    """A copy between the Host tier and the device failed (engine-wide failure)."""


class HostTier:
    """Copies between the Host slab buffer and the device pools, through the runner's transfer programs.

    Args:
      runner: the ModelRunner, with its Host transfers enabled (`enable_host_transfers`).
      buffer: the slab pool's memory; the HostTier closes it.
    """

    KINDS = ("write", "restore")
    RESTORE_AHEAD = 2  # restore copies dispatched ahead of their scatters (see restore)

    def __init__(self, runner, buffer: HostSlabBuffer):
        if not runner.transfer_sizes:
            raise ValueError("the runner's Host transfers are not enabled")
        self.runner, self.buffer, self.pool = runner, buffer, buffer.pool
        self.counters = collections.Counter()
        self._faults: collections.Counter = collections.Counter()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()  # (token, parts, bytes) for the writer; None stops it
        self._landing = threading.Condition()  # guards the three below
        self._landed: list = []
        self._queued = self._queued_bytes = 0
        self._writer = threading.Thread(target=self._write_loop, name="ninfer-host-writer", daemon=True)
        self._writer.start()
        self._restores: queue.SimpleQueue = queue.SimpleQueue()  # (copies, start) for the watcher; None stops it
        self._restores_dispatched = 0  # the scheduler's count; a write job waits until this many have landed
        self._restores_landed = 0  # guarded by _landing
        self._restore_failure: BaseException | None = None  # guarded by _landing
        self._watcher = threading.Thread(target=self._restore_loop, name="ninfer-host-restores", daemon=True)
        self._watcher.start()

    # --- fault injection -------------------------------------------------------------------------
    def inject_fault(self, kind: str, times: int = 1) -> None:
        """The next `times` transfers of `kind` ("write" or "restore") raise HostTransferError."""
        if kind not in self.KINDS:
            raise ValueError(f"fault kind must be one of {self.KINDS}, got {kind!r}")
        self._faults[kind] += times

    def _transfer(self, kind: str) -> None:
        if self._faults[kind] > 0:
            self._faults[kind] -= 1
            raise HostTransferError(f"injected Host {kind} transfer failure")

    # --- write-through (device -> host), asynchronous ---------------------------------------------
    def write(self, token, pages: list[int], page_slabs: list[int], image_slot: int = -1,
              image_slabs: list[int] = ()) -> None:
        """Dispatches the device-side gathers of `pages` (into `page_slabs`, pairwise) and of state slot
        `image_slot` (into `image_slabs`), and queues their copy into the slabs for the writer thread; returns
        without waiting. `landed()` hands `token` back once the copy is done (or failed).

        The gathers read the pools in the device's order, so a page or slot reused after this call still
        gives its bytes of now; the caller keeps the destination slabs unused until `token` lands.
        """
        self._transfer("write")
        runner, parts, done = self.runner, [], 0
        for count in split_transfer(len(pages), runner.transfer_sizes):
            ids = np.asarray(pages[done:done + count], np.int32)
            parts.append((runner.gather_pages(ids), page_slabs[done:done + count], count))
            done += count
        if image_slabs:
            parts.append((runner.gather_slot(image_slot), list(image_slabs), len(image_slabs)))
        nbytes = sum(len(slabs) for _, slabs, _ in parts) * self.pool.slab_bytes
        self.counters["written_bytes"] += nbytes
        self.counters["write_batches"] += len(parts)
        with self._landing:
            self._queued_bytes += nbytes
            self._queued += 1
        self._jobs.put((token, parts, nbytes, self._restores_dispatched))

    def _write_loop(self) -> None:
        """The writer thread: each job's gathered rows into their slabs, in submission order, once the restores
        dispatched before the job have read their slabs."""
        while True:
            job = self._jobs.get()
            if job is None:
                return
            token, parts, nbytes, fence = job
            error = None
            try:
                for i, (array, slabs, count) in enumerate(parts):
                    t0 = time.perf_counter()
                    rows = np.asarray(array).view(np.uint8)  # waits for the gather and its copy to the host
                    if i == 0:
                        with self._landing:
                            self._landing.wait_for(lambda: self._restores_landed >= fence)
                    t1 = time.perf_counter()
                    self.buffer.write(slabs, rows[:count])
                    self.counters["write_fetch_ns"] += int((t1 - t0) * 1e9)
                    self.counters["write_copy_ns"] += int((time.perf_counter() - t1) * 1e9)
            except BaseException as e:  # reported to the scheduler, which fails the engine
                error = e
            with self._landing:
                self._landed.append((token, error))
                self._queued_bytes -= nbytes
                self._landing.notify_all()

    @property
    def queued_bytes(self) -> int:
        """Gathered bytes the writer has not copied yet."""
        return self._queued_bytes

    def landed(self, wait: bool = False) -> list[tuple[object, BaseException | None]]:
        """(token, error or None) of every write that landed since the last call, in submission order; with
        `wait`, first waits until every queued write and every restore has landed."""
        with self._landing:
            if wait:
                self._landing.wait_for(lambda: len(self._landed) == self._queued
                                       and self._restores_landed == self._restores_dispatched)
            out, self._landed = self._landed, []
            self._queued -= len(out)
        return out

    # --- restores (host -> device) ---------------------------------------------------------------
    def _rows(self, chunk: int, first: int, count: int):
        """Slab rows [first, first + count) of `chunk` as the source of one host-to-device copy.

        Page-locked: the contiguous view itself (the DMA reads the pool directly, DESIGN.md "Host tier").
        Pageable: a private copy, since a CPU device may alias the numpy buffer and the slab may be
        rewritten once the restore returns."""
        view = self.buffer.chunks[chunk][first:first + count].view(np.uint32)  # the transfers' words
        return jax.device_put(view if self.buffer.pinned else view.copy())

    def restore(self, slabs: list[int], pages: list[int], image_slabs: list[int] = (), slot: int = -1) -> int:
        """Slabs into device pages (pairwise) and an image's slabs into state slot `slot`; returns the bytes moved.

        Each run of consecutive slabs moves in pieces of the runner's batch sizes that sum exactly to the run
        (`split_transfer`), each piece one contiguous view of the slab pool, then a donated scatter places it.
        Copies are dispatched RESTORE_AHEAD pieces before their scatters: a copy dispatched after a scatter
        waits for it, so alternating them falls well short of the pinned copy rate
        (docs/benchmarks/prefix_cache_restore.md). The scatters' page ids
        and slot go to the device first, in one transfer: an id copy queued behind the big copies would hold
        its scatter back until they land.
        Returns once everything is dispatched; the watcher thread sees the copies land (`landed(wait=True)`
        waits for them, and a failed copy is `take_restore_failure()`'s).
        """
        self._transfer("restore")
        start = time.perf_counter()
        pieces = self._page_pieces(slabs, pages)
        moved = len(slabs) * self.pool.slab_bytes  # counters count slab bytes (the Host footprint moved)
        if image_slabs:
            pieces.append(self._image_piece(image_slabs, slot))
            moved += len(image_slabs) * self.pool.slab_bytes
        targets = jax.device_put([target for _, target, _ in pieces])
        staged = [copy() for copy, _, _ in pieces[:self.RESTORE_AHEAD]]
        for i, (_, _, place) in enumerate(pieces):
            if i + self.RESTORE_AHEAD < len(pieces):
                staged.append(pieces[i + self.RESTORE_AHEAD][0]())
            place(targets[i], staged[i])
        self.counters["restore_batches"] += len(pieces)
        self.counters["restored_bytes"] += moved
        self._restores_dispatched += 1
        self._restores.put((staged, start))
        return moved

    def _restore_loop(self) -> None:
        """The watcher thread: waits for each restore's copies in dispatch order, times them from dispatch to
        landing, and lets the writes queued behind them go on."""
        while True:
            job = self._restores.get()
            if job is None:
                return
            staged, start = job
            error = None
            try:
                self._await_copies(staged)
            except BaseException as e:  # reported to the scheduler, which fails the engine
                error = e
            with self._landing:
                self.counters["restore_ns"] += int((time.perf_counter() - start) * 1e9)
                self._restores_landed += 1
                if error is not None and self._restore_failure is None:
                    self._restore_failure = error
                self._landing.notify_all()

    @staticmethod
    def _await_copies(staged: list) -> None:
        """Returns once a restore's host-to-device copies have landed (raises if one failed)."""
        jax.block_until_ready(staged)

    def take_restore_failure(self) -> BaseException | None:
        """The first restore copy that failed after its dispatch, once (None when none did)."""
        with self._landing:
            failure, self._restore_failure = self._restore_failure, None
        return failure

    def _page_pieces(self, slabs: list[int], pages: list[int]) -> list[tuple]:
        """(copy, page ids, place) per restore batch of `slabs` -> `pages`: copy() starts the host-to-device copy
        of one contiguous view, place(ids, rows) scatters it."""
        runner, pool, pieces = self.runner, self.pool, []
        for run in pool.runs(slabs):
            first = self.buffer.first_row(run)
            done = 0
            for n in split_transfer(run.count, runner.transfer_sizes):
                ids = np.asarray(pages[run.start + done:run.start + done + n], np.int32)
                pieces.append((functools.partial(self._rows, run.chunk, first + done, n), ids, runner.scatter_pages))
                done += n
        return pieces

    def _image_piece(self, slabs: list[int], slot: int) -> tuple:
        """(copy, slot, place) of an image's slabs into state slot `slot`."""
        runs = self.pool.runs(slabs)
        if len(runs) == 1:  # the usual case: an image's slabs are allocated consecutively
            run = runs[0]
            copy = functools.partial(self._rows, run.chunk, self.buffer.first_row(run), run.count)
        else:
            def copy():
                host = np.empty((len(slabs), self.pool.slab_bytes), np.uint8)
                self.buffer.read(slabs, host)
                return jax.device_put(host.view(np.uint32))
        return copy, np.int32(slot), self.runner.scatter_slot

    def close(self) -> None:
        """Lets the restores land and the writer finish what is queued, then releases the slab buffer."""
        self._restores.put(None)
        self._watcher.join()
        self._jobs.put(None)
        self._writer.join()
        self.buffer.close()

    def stats(self) -> dict:
        return {
            "host_cache_bytes": self.buffer.nbytes,
            "host_pinned": self.buffer.pinned,
            "host_slab_bytes": self.pool.slab_bytes,
            "host_image_slabs": self.pool.image_slabs,
            "host_chunks": self.pool.num_chunks,
            "host_restored_bytes": self.counters["restored_bytes"],
            "host_written_bytes": self.counters["written_bytes"],
            "host_restore_batches": self.counters["restore_batches"],
            "host_restore_seconds": self.counters["restore_ns"] / 1e9,
            "host_write_batches": self.counters["write_batches"],
            # the writer thread's time: waiting for each gather to reach host memory, then copying it into slabs
            "host_write_fetch_seconds": self.counters["write_fetch_ns"] / 1e9,
            "host_write_copy_seconds": self.counters["write_copy_ns"] / 1e9,
        }


__all__ = ["HostTier", "HostTransferError"]
