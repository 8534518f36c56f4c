"""The Host tier's memory: the slab pool as page-locked chunks of host memory (spec §5.4).

`HostSlabBuffer` holds host_cache_bytes in chunks of at most 4 GiB of whole slabs (the index's `HostSlabPool`
geometry, so no slab crosses a chunk), each an anonymous mapping viewed as numpy uint8 [slabs, slab_bytes]. On a
GPU every chunk is page-locked with cudaHostRegister, called through ctypes on the CUDA runtime library the jax
CUDA plugin installs (DESIGN.md "Host tier"); elsewhere it is plain memory, committed page by page as slabs are
first written. A budget the machine cannot hold, an allocation or a registration that fails, is a
`HostTierError` at startup.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import mmap
import os
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ninfer_jax.prefix_cache.host_slabs import HostSlabPool


# Chunks page-locked at once (`HostSlabBuffer.lock`).
LOCK_THREADS = 8
PAGE_BYTES = mmap.PAGESIZE


class HostTierError(RuntimeError):
    """The Host tier cannot be set up (budget, allocation or page-locking); raised at engine start."""


def physical_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _allocate_chunk(nbytes: int) -> mmap.mmap:
    """Anonymous, page-aligned, zero-filled memory, committed lazily by the kernel, in huge pages where the kernel
    gives them on request (fewer faults to commit it: 7.6 against 3.4 GB/s on one core of a 2-core CPU machine)."""
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0),
                   prot=mmap.PROT_READ | mmap.PROT_WRITE)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mm.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel without transparent huge pages: small pages
            pass
    return mm


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
      lock_now: page-lock here; False leaves it to `lock()` (the engine's start runs it beside the warm-up).
    Raises:
      HostTierError: the budget exceeds the machine's memory, or allocating or page-locking a chunk failed.
    """

    def __init__(self, pool: HostSlabPool, *, pin: bool | None = None, lock_now: bool = True):
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
                self.chunks.append(np.frombuffer(mm, np.uint8).reshape(-1, self.slab_bytes))
            if lock_now:
                self.lock()
        except BaseException:
            self.close()
            raise

    def lock(self, threads: int = LOCK_THREADS) -> None:
        """Page-locks every chunk (nothing without `pin`), up to `threads` chunks at once: locking faults in and
        zeroes each page, which cudaHostRegister alone did at about 3 GB/s (10.3 s for 30 GiB on the H200's host),
        slowing the warm-up's tracing beside it. Raises HostTierError if a chunk fails; those locked stay so until
        `close()`."""
        if self._lock is None or self._locked:
            return
        lock = self._lock
        addresses = [a.ctypes.data for a in self.chunks]

        def one(c: int) -> int:
            # Commit the pages first (numpy writes without the GIL): the registration then pins present pages,
            # and the faults, the bulk of the work, run on every thread at once.
            self.chunks[c].reshape(-1)[::PAGE_BYTES] = 0
            lock.register(addresses[c], self.chunks[c].nbytes)
            return addresses[c]

        with ThreadPoolExecutor(max(1, min(threads, len(addresses))), thread_name_prefix="host-lock") as pool:
            futures = [pool.submit(one, c) for c in range(len(addresses))]
        errors = []
        for future in futures:
            try:
                self._locked.append(future.result())
            except HostTierError as e:
                errors.append(e)
        if errors:
            raise errors[0]

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

__all__ = ["HostSlabBuffer", "HostTierError", "physical_memory_bytes"]
