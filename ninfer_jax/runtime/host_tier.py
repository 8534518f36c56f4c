"""The Host tier's bytes and copies: the slab pool buffer, write-through and restores (spec §5.4, §6.5, §7.6).

The index (`prefix_cache/`) decides which slab holds what and which copies run; this module moves the bytes.

`HostSlabBuffer` is the pool's memory: host_cache_bytes in chunks of at most 4 GiB of whole slabs (the index's
`HostSlabPool` geometry, so no slab crosses a chunk), each an anonymous mapping viewed as a numpy uint8
[slabs, slab_bytes] array. On a GPU every chunk is page-locked with cudaHostRegister, called through ctypes on
the CUDA runtime library the jax CUDA plugin installs (DESIGN.md "Host tier"); elsewhere it is plain memory,
committed page by page as slabs are first written. A budget the machine cannot hold, an allocation or a
registration that fails, is a `HostTierError` at startup.

Slab layout, one for both directions (the runner's gathers produce it and its scatters read it):
  page bundle, one slab:  for every attention layer in forward order, its K page then its V page
                          ([64, Hkv, D] each, raw bytes); slab_bytes is the bundle rounded up to 4 KiB;
  state image, image_slabs slabs:  for every GDN layer in forward order, its ssm row [Hv, Dk, Dv] f32 then
                          its conv row [K-1, conv_dim]; the image's packed byte o lives in its
                          (o // slab_bytes)-th slab.

`HostTier` runs the copies through the runner's jitted transfer ops, in batches of the runner's bucket sizes:
  write-through  a device-side gather of the listed pages (and one state slot) whose output lands in pinned
                 host memory, dispatched by the worker; a writer thread waits for it and copies it into the
                 slab rows, and the worker completes the index's HostWrite when `landed()` returns it (§7.6:
                 asynchronous write-through; the worker never waits for a host copy);
  restore        each run of consecutive slabs moves straight from the page-locked chunk (a contiguous view
                 per piece of the runner's batch sizes, DESIGN.md: about 50 GB/s) and is scattered into the
                 donated pools (pages, or the lane's state slot). The worker only dispatches: JAX orders the
                 scatters before any later step that reads or reuses the pages or slot, so the lane's first
                 prefill chunk is queued right behind them and the copies run while the device finishes the
                 work ahead of them (the round in flight, other lanes' chunks). A watcher thread waits for
                 the copies and times them; until they land, their slabs must not be rewritten, so the
                 writer thread holds every Host write queued after a restore until that restore has landed
                 (a write queued before it cannot target its slabs: they held landed bytes when it was
                 dispatched).
NOTE: the layer-pipelined form of §6.5/§12.1 (the copy hidden behind the lane's own first prefill step) is
not built: the copy overlaps the device work queued before the lane's step, not that step; see
docs/STATUS.md.

`inject_fault(kind)` makes the next write ("write") or restore ("restore") raise `HostTransferError` (the
spec's forced transfer error, for fault-injection tests).
"""

from __future__ import annotations

import collections
import ctypes
import ctypes.util
import functools
import glob
import logging
import mmap
import os
import queue
import sys
import threading
import time

import jax
import numpy as np

from ninfer_jax.prefix_cache.host_slabs import HostSlabPool
from ninfer_jax.runtime.runner import split_transfer

log = logging.getLogger("ninfer_jax.host_tier")


class HostTierError(RuntimeError):
    """The Host tier cannot be set up (budget, allocation or page-locking); raised at engine start."""


class HostTransferError(RuntimeError):
    """A copy between the Host tier and the device failed (engine-wide failure)."""


def physical_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _allocate_chunk(nbytes: int) -> mmap.mmap:
    """Anonymous, page-aligned, zero-filled memory, committed lazily by the kernel."""
    return mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0),
                     prot=mmap.PROT_READ | mmap.PROT_WRITE)


def _cuda_runtime() -> ctypes.CDLL:
    """The CUDA runtime library of the jax CUDA plugin's nvidia wheels (or the system's)."""
    patterns = ("nvidia/cu13/lib/libcudart.so*", "nvidia/cuda_runtime/lib/libcudart.so*")
    candidates = [p for base in sys.path if base for pat in patterns
                  for p in sorted(glob.glob(os.path.join(base, pat)))]
    system = ctypes.util.find_library("cudart")
    candidates += [system] if system else []
    errors = []
    for path in candidates:
        try:
            return ctypes.CDLL(path)
        except OSError as e:
            errors.append(f"{path}: {e}")
    raise HostTierError("cannot page-lock the Host tier: no CUDA runtime library (libcudart) found"
                        + (f" ({'; '.join(errors)})" if errors else ""))


class _PageLock:
    """cudaHostRegister / cudaHostUnregister through ctypes."""

    PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context

    def __init__(self):
        lib = _cuda_runtime()
        self._register, self._unregister = lib.cudaHostRegister, lib.cudaHostUnregister
        self._register.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        self._register.restype = ctypes.c_int
        self._unregister.argtypes = [ctypes.c_void_p]
        self._unregister.restype = ctypes.c_int
        self._error = lib.cudaGetErrorString
        self._error.argtypes = [ctypes.c_int]
        self._error.restype = ctypes.c_char_p

    def register(self, address: int, nbytes: int) -> None:
        err = self._register(address, nbytes, self.PORTABLE)
        if err:
            raise HostTierError(f"cudaHostRegister of {nbytes} B failed: {self._error(err).decode()} (error {err})")

    def unregister(self, address: int) -> None:
        self._unregister(address)


class HostSlabBuffer:
    """The slab pool's memory: chunk c holds slabs [c * slabs_per_chunk, ...) as uint8 [slabs, slab_bytes].

    Args:
      pool: the index's slab geometry (slab_bytes, slabs per chunk, chunks).
      pin: page-lock every chunk (cudaHostRegister); None = when jax's backend is a GPU.
    Raises:
      HostTierError: the budget exceeds the machine's memory, or allocating or page-locking a chunk failed.
    """

    def __init__(self, pool: HostSlabPool, *, pin: bool | None = None):
        self.pool = pool
        self.slab_bytes = pool.slab_bytes
        self.chunks: list[np.ndarray] = []
        self._maps: list[mmap.mmap] = []
        self._locked: list[int] = []
        self._lock: _PageLock | None = None
        total = pool.num_slabs * pool.slab_bytes
        memory = physical_memory_bytes()
        if memory is not None and total > memory:
            raise HostTierError(f"Host tier of {total / 2**20:.0f} MiB exceeds this machine's memory "
                                f"({memory / 2**20:.0f} MiB); lower host_cache_mib (0 disables the Host tier)")
        if pin is None:
            import jax

            pin = jax.default_backend() == "gpu"
        try:
            if pin:
                self._lock = _PageLock()
            for c in range(pool.num_chunks):
                nbytes = pool.chunk_bytes(c)
                try:
                    mm = _allocate_chunk(nbytes)
                except (OSError, MemoryError, ValueError) as e:
                    raise HostTierError(f"cannot allocate Host tier chunk {c} of {nbytes / 2**20:.0f} MiB "
                                        f"({total / 2**20:.0f} MiB in all): {e}; lower host_cache_mib") from e
                self._maps.append(mm)
                array = np.frombuffer(mm, np.uint8).reshape(-1, self.slab_bytes)
                self.chunks.append(array)
                if self._lock is not None:
                    address = array.ctypes.data
                    self._lock.register(address, nbytes)
                    self._locked.append(address)
        except BaseException:
            self.close()
            raise

    @property
    def pinned(self) -> bool:
        return bool(self._locked)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.chunks)

    def first_row(self, run) -> int:
        """The row of a SlabRun's first slab inside its chunk."""
        return run.first - run.chunk * self.pool.slabs_per_chunk

    def views(self, slabs: list[int]) -> list[np.ndarray]:
        """Each slab's row (a view into the pool's memory, no copy)."""
        return [self.chunks[chunk][row] for chunk, row in (divmod(s, self.pool.slabs_per_chunk) for s in slabs)]

    def read(self, slabs: list[int], out: np.ndarray) -> None:
        """Copies slab rows `slabs` into out[:len(slabs), :] (runs of consecutive slabs move as one copy)."""
        width = out.shape[1]
        for run in self.pool.runs(slabs):
            first = self.first_row(run)
            out[run.start:run.start + run.count] = self.chunks[run.chunk][first:first + run.count, :width]

    def write(self, slabs: list[int], rows: np.ndarray) -> None:
        """Copies rows[i] into the first rows.shape[1] bytes of slab slabs[i]."""
        width = rows.shape[1]
        for run in self.pool.runs(slabs):
            first = self.first_row(run)
            self.chunks[run.chunk][first:first + run.count, :width] = rows[run.start:run.start + run.count]

    def close(self) -> None:
        """Unregisters and releases every chunk (the buffer is unusable afterwards)."""
        if self._lock is not None:
            for address in self._locked:
                self._lock.unregister(address)
        self._locked = []
        self.chunks = []  # the arrays export the mappings' buffers: drop them first
        for mm in self._maps:
            try:
                mm.close()
            except BufferError:  # a view is still alive somewhere; the mapping goes with it
                pass
        self._maps = []


class HostTier:
    """Copies between the Host slab buffer and the device pools, through the runner's transfer ops.

    Args:
      runner: the ModelRunner (gains the transfer ops here; compile them with its warmup).
      pool: the index's HostSlabPool.
      pin: see HostSlabBuffer.
    """

    KINDS = ("write", "restore")
    RESTORE_AHEAD = 2  # restore copies dispatched ahead of their scatters (see restore)

    def __init__(self, runner, pool: HostSlabPool, *, pin: bool | None = None):
        self.runner, self.pool = runner, pool
        self.buffer = HostSlabBuffer(pool, pin=pin)
        runner.enable_host_transfers(pool.slab_bytes, pool.image_slabs)
        self.counters = collections.Counter()
        self._faults: collections.Counter = collections.Counter()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()  # (token, parts, bytes) for the writer; None stops it
        self._landing = threading.Condition()  # guards the three below
        self._landed: list = []
        self._queued = self._queued_bytes = 0
        self._writer = threading.Thread(target=self._write_loop, name="ninfer-host-writer", daemon=True)
        self._writer.start()
        self._restores: queue.SimpleQueue = queue.SimpleQueue()  # (copies, start) for the watcher; None stops it
        self._restores_dispatched = 0  # the worker's count; a write job waits until this many have landed
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
            except BaseException as e:  # reported to the worker, which fails the engine
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

        Page-locked: the contiguous view itself (the DMA reads the pool directly, DESIGN.md: 50 GB/s).
        Pageable: a private copy, since a CPU device may alias the numpy buffer and the slab may be
        rewritten once the restore returns."""
        view = self.buffer.chunks[chunk][first:first + count].view(np.uint32)  # the transfers' words
        return jax.device_put(view if self.buffer.pinned else view.copy())

    def restore(self, slabs: list[int], pages: list[int], image_slabs: list[int] = (), slot: int = -1) -> int:
        """Slabs into device pages (pairwise) and an image's slabs into state slot `slot`; returns the bytes moved.

        Each run of consecutive slabs moves in pieces of the runner's batch sizes that sum exactly to the run
        (`split_transfer`), each piece one contiguous view of the slab pool, then a donated scatter places it.
        Copies are dispatched RESTORE_AHEAD pieces before their scatters: a copy dispatched after a scatter
        waits for it, so copy, scatter, copy ... ran at 41 GB/s where two copies ahead ran at 53 GB/s of a
        54 GB/s pinned ceiling (H200, 35B-A3B pages, scripts/restore_scatter_probe.py). The scatters' page ids
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
            except BaseException as e:  # reported to the worker, which fails the engine
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


__all__ = ["HostSlabBuffer", "HostTier", "HostTierError", "HostTransferError", "physical_memory_bytes"]
