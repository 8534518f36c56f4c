"""The prefix cache file: the Host tier saved at an orderly stop and loaded at the next start (spec §5.5).

Layout (little-endian)::

    b"NINFERPC" | u32 format | u32 0 | u64 n | n bytes of table JSON | u64 xxh64(table) | slab bytes

The table holds the fingerprint, the Host geometry, the block table (parents first) and the snapshot table, so
the loader decides before it reads any slab. The slab bytes follow in table order: each block's slab, then each
snapshot's image slabs and tail slab; every entry's bytes carry their own xxh64 in the table. A file is used only
when its fingerprint (checkpoint files, model config, dtype, kernels, this package's sources) and geometry equal
the running engine's, and its size matches its tables; a damaged file loads nothing. A save writes a temporary
file next to the target and renames it into place, so an unfinished save leaves the previous file.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import logging
import os
import struct
import time
from pathlib import Path

import xxhash

from ninfer_jax.prefix_cache.host_slabs import SlabState
from ninfer_jax.prefix_cache.persistence import SavedBlock, SavedCache, SavedSnapshot

log = logging.getLogger("ninfer_jax.cache_file")

MAGIC = b"NINFERPC"
FORMAT = 1
_HEAD = struct.Struct("<8sIIQ")
_U64 = struct.Struct("<Q")
_PACKAGE = Path(__file__).resolve().parent.parent
PROGRESS_BYTES = 2 << 30  # a progress line per this many bytes saved or read


class SaveAbandoned(Exception):
    """The save stopped because it was asked to (a second interrupt, §5.5); the previous file stays."""


class CacheFileError(ValueError):
    """The file cannot be used: damaged, or saved by another model, build or Host geometry."""


def source_identity() -> str:
    """A digest of this package's and the kernels' Python sources: any code change invalidates a saved file
    (the KV bytes depend on the code that computed them)."""
    h = hashlib.sha256()
    for root in (_PACKAGE, _PACKAGE.parent / "pallas_kernels"):
        for path in sorted(root.rglob("*.py")):
            h.update(str(path.relative_to(root.parent)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:32]


def checkpoint_identity(directory: str | Path) -> dict:
    """The checkpoint's absolute path and the size and modification time of each of its weight files."""
    directory = Path(directory).resolve()
    files = sorted(p for p in directory.iterdir() if p.suffix in (".safetensors", ".json") and p.is_file())
    return {"path": str(directory),
            "files": [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]}


# A load's reason when the file holds no snapshot: a Host tier that held none when it was saved (a resume needs one)
EMPTY = "the file holds no snapshot: the Host tier held none when it was saved"


@dataclasses.dataclass(frozen=True)
class LoadReport:
    """What a load did: `outcome` is "restored", "partly restored" or "not restored" (with `reason`)."""

    outcome: str
    reason: str = ""
    blocks: int = 0
    snapshots: int = 0
    saved_blocks: int = 0
    saved_snapshots: int = 0
    bytes_read: int = 0
    seconds: float = 0.0
    needed_mib: int = 0


class PrefixCacheFile:
    """Save and load of one engine's Host tier at `path`.

    Args:
      path: the file (its parent directory must exist).
      fingerprint: what must be equal for a file to be used (JSON-serialisable).
    """

    def __init__(self, path: str | Path, fingerprint: dict):
        self.path = Path(path).resolve()
        self.fingerprint = json.loads(json.dumps(fingerprint))  # the form it takes after a round trip

    # --- save ------------------------------------------------------------------------------------
    def save(self, index, buffer, abandon=None) -> dict:
        """Writes the index's saved entries (PrefixIndex.saved) with their slab bytes; returns counts.

        Every Host write must have landed (the caller polls them first). Raises OSError when the file cannot
        be written, and SaveAbandoned once `abandon` (a threading.Event) is set: checked before the save begins,
        before each entry's slabs and before the rename. Either way the previous file stays in place.
        """
        def check():
            if abandon is not None and abandon.is_set():
                raise SaveAbandoned("abandoned by a second interrupt")

        check()
        start = time.perf_counter()
        saved: SavedCache = index.saved()
        slab_bytes = buffer.slab_bytes
        entries = [[b.slab] for b in saved.blocks] + [
            list(s.image_slabs) + ([s.tail_slab] if s.tail_slab >= 0 else []) for s in saved.snapshots]
        checksums = [_checksum(buffer, slabs) for slabs in entries]
        table = json.dumps({
            "fingerprint": self.fingerprint,
            "geometry": _geometry(index),
            "blocks": [[b.parent, b.lookup_hash, b.extra, _b64(b.tokens), c]
                       for b, c in zip(saved.blocks, checksums)],
            "snapshots": [[s.kind, s.anchor, _b64(s.tail_tokens), s.tail_extra, s.hits, len(s.image_slabs),
                           s.tail_slab >= 0, c] for s, c in zip(saved.snapshots, checksums[len(saved.blocks):])],
        }).encode()
        temporary = self.path.with_name(self.path.name + ".tmp")
        try:
            with open(temporary, "wb") as f:
                f.write(_HEAD.pack(MAGIC, FORMAT, 0, len(table)))
                f.write(table)
                f.write(_U64.pack(xxhash.xxh64_intdigest(table)))
                written, total = 0, saved.slab_count * slab_bytes
                for slabs in entries:
                    check()
                    for view in buffer.views(slabs):
                        f.write(memoryview(view))
                    written = _progress("saving prefix cache", written, len(slabs) * slab_bytes, total, start)
                f.flush()
                os.fsync(f.fileno())
            check()
            os.replace(temporary, self.path)
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise
        nbytes = saved.slab_count * slab_bytes
        seconds = time.perf_counter() - start
        log.info("prefix cache saved | %s | %d blocks, %d snapshots | %.1f MiB | %.2f s | %.2f GB/s",
                 self.path, len(saved.blocks), len(saved.snapshots), nbytes / 2**20, seconds,
                 nbytes / max(seconds, 1e-9) / 1e9)
        return {"blocks": len(saved.blocks), "snapshots": len(saved.snapshots), "bytes": nbytes,
                "seconds": seconds}

    # --- load ------------------------------------------------------------------------------------
    def load(self, index, buffer) -> LoadReport:
        """Loads what the index's Host tier can take of the file into it (Host-only entries); a missing,
        mismatched or damaged file loads nothing. Never raises for the file's content."""
        if not self.path.exists():
            report = LoadReport("not restored", "no file yet; the save at shutdown writes it")
            log.info("prefix cache not restored | %s | %s", self.path, report.reason)
            return report
        log.info("loading prefix cache | %s | %.1f MiB", self.path, self.path.stat().st_size / 2**20)
        try:
            report = self._load(index, buffer)
        except CacheFileError as e:
            report = LoadReport("not restored", str(e))
        except OSError as e:
            report = LoadReport("not restored", f"cannot read it: {e}")
        if report.outcome == "restored":
            log.info("prefix cache restored | %d blocks, %d snapshots", report.blocks, report.snapshots)
        elif report.outcome == "partly restored":
            log.warning("prefix cache partly restored | kept %d of %d snapshots, %d of %d blocks | the file needs "
                        "a Host tier of %d MiB", report.snapshots, report.saved_snapshots, report.blocks,
                        report.saved_blocks, report.needed_mib)
        elif report.reason == EMPTY:  # nothing went wrong: there was nothing to keep
            log.info("prefix cache not restored | %s", report.reason)
        else:
            log.warning("prefix cache not restored | %s | the save at shutdown replaces the file", report.reason)
        return report

    def _load(self, index, buffer) -> LoadReport:
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            head = f.read(_HEAD.size)
            if len(head) < _HEAD.size:
                raise CacheFileError("damaged: shorter than its header")
            magic, fmt, _, n = _HEAD.unpack(head)
            if magic != MAGIC:
                raise CacheFileError("not a prefix cache file")
            if fmt != FORMAT:
                raise CacheFileError(f"format {fmt}, this build reads format {FORMAT}")
            if n > size:
                raise CacheFileError("damaged: its table runs past the end of the file")
            raw = f.read(n)
            digest = f.read(_U64.size)
            if len(raw) != n or len(digest) != _U64.size or _U64.unpack(digest)[0] != xxhash.xxh64_intdigest(raw):
                raise CacheFileError("damaged: its table does not match its checksum")
            try:
                table = json.loads(raw)
            except ValueError as e:
                raise CacheFileError(f"damaged: its table is not JSON ({e})") from None
            if not isinstance(table, dict):
                raise CacheFileError("damaged: its table is not an object")
            if table.get("fingerprint") != self.fingerprint:
                raise CacheFileError("saved by another model, checkpoint, dtype, kernel choice or build of "
                                     f"ninfer_jax ({_difference(table.get('fingerprint'), self.fingerprint)})")
            if table.get("geometry") != _geometry(index):
                raise CacheFileError(f"Host geometry {table.get('geometry')} differs from this engine's "
                                     f"{_geometry(index)}")
            saved, checksums = _tables(table, index.slabs.image_slabs)
            data_start = _HEAD.size + n + _U64.size
            if size != data_start + saved.slab_count * buffer.slab_bytes:
                raise CacheFileError(f"damaged: {size} bytes where its tables describe "
                                     f"{data_start + saved.slab_count * buffer.slab_bytes}")
            if not saved.snapshots:
                return LoadReport("not restored", EMPTY, saved_blocks=len(saved.blocks))
            plan = index.plan_load(saved)
            needed_mib = -(-saved.slab_count * buffer.slab_bytes // 2**20)
            if not plan.snapshots:
                return LoadReport("not restored", f"the Host tier holds none of its {len(saved.snapshots)} "
                                  f"snapshots (the file needs {needed_mib} MiB)", saved_blocks=len(saved.blocks),
                                  saved_snapshots=len(saved.snapshots), needed_mib=needed_mib)
            start = time.perf_counter()
            slabs = index.slabs.allocate(plan.slabs, SlabState.FILLING)
            try:
                nbytes = self._read(f, data_start, saved, plan, checksums, buffer, slabs)
            except BaseException:
                index.slabs.free(slabs)
                raise
        seconds = time.perf_counter() - start
        log.info("prefix cache read | %.1f MiB | %.2f s | %.2f GB/s", nbytes / 2**20, seconds,
                 nbytes / max(seconds, 1e-9) / 1e9)
        index.adopt_saved(saved, plan, slabs)
        return LoadReport("restored" if plan.complete(saved) else "partly restored", "", len(plan.blocks),
                          len(plan.snapshots), len(saved.blocks), len(saved.snapshots), nbytes, seconds, needed_mib)

    def _read(self, f, data_start: int, saved: SavedCache, plan, checksums: list[int], buffer, slabs) -> int:
        """Reads the planned entries' bytes into `slabs` (file order), checking each entry's checksum."""
        slab_bytes = buffer.slab_bytes
        offsets, at = [], data_start
        for count in [1] * len(saved.blocks) + [s.slab_count for s in saved.snapshots]:
            offsets.append(at)
            at += count * slab_bytes
        rows = list(plan.blocks) + [len(saved.blocks) + i for i in plan.snapshots]
        counts = [1] * len(plan.blocks) + [saved.snapshots[i].slab_count for i in plan.snapshots]
        taken, nbytes, start, total = iter(slabs), 0, time.perf_counter(), len(slabs) * slab_bytes
        for row, count in zip(rows, counts):
            mine = [next(taken) for _ in range(count)]
            f.seek(offsets[row])
            digest = xxhash.xxh64()
            for view in buffer.views(mine):
                if f.readinto(memoryview(view)) != slab_bytes:
                    raise CacheFileError("damaged: the file ends inside its slab bytes")
                digest.update(memoryview(view))
            if digest.intdigest() != checksums[row]:
                raise CacheFileError(f"damaged: the bytes of entry {row} do not match their checksum")
            nbytes = _progress("loading prefix cache", nbytes, count * slab_bytes, total, start)
        return nbytes


def _progress(what: str, done: int, step: int, total: int, start: float) -> int:
    """done + step, logging a progress line each time the sum passes a multiple of PROGRESS_BYTES."""
    after = done + step
    if after // PROGRESS_BYTES > done // PROGRESS_BYTES:
        seconds = time.perf_counter() - start
        log.info("%s | %.1f of %.1f GiB | %.1f s | %.2f GB/s", what, after / 2**30, total / 2**30, seconds,
                 after / max(seconds, 1e-9) / 1e9)
    return after


def _geometry(index) -> dict:
    return {"slab_bytes": index.slabs.slab_bytes, "image_slabs": index.slabs.image_slabs,
            "block_bytes": index.geometry.block_bytes, "image_bytes": index.geometry.image_bytes}


def _tables(table: dict, image_slabs: int) -> tuple[SavedCache, list[int]]:
    """The SavedCache and per-entry checksums of a parsed table; CacheFileError when malformed."""
    try:
        blocks, checksums = [], []
        for row, (parent, lookup_hash, extra, tokens, checksum) in enumerate(table["blocks"]):
            if not -1 <= parent < row:
                raise CacheFileError(f"damaged: block {row} names parent {parent}")
            blocks.append(SavedBlock(int(parent), int(lookup_hash), int(extra), base64.b64decode(tokens), -1))
            checksums.append(int(checksum))
        snapshots = []
        for kind, anchor, tail, tail_extra, hits, images, has_tail, checksum in table["snapshots"]:
            if not -1 <= anchor < len(blocks) or images != image_slabs:
                raise CacheFileError(f"damaged: a snapshot names anchor {anchor} with {images} image slabs")
            # The saving process's slab ids mean nothing here: only how many there are (placeholders).
            snapshots.append(SavedSnapshot(str(kind), int(anchor), base64.b64decode(tail), int(tail_extra),
                                           int(hits), tuple([-1] * images), 0 if has_tail else -1))
            checksums.append(int(checksum))
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, CacheFileError):
            raise
        raise CacheFileError(f"damaged: malformed tables ({e})") from None
    return SavedCache(tuple(blocks), tuple(snapshots)), checksums


def _checksum(buffer, slabs: list[int]) -> int:
    digest = xxhash.xxh64()
    for view in buffer.views(slabs):
        digest.update(memoryview(view))
    return digest.intdigest()


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _difference(saved, running) -> str:
    if not isinstance(saved, dict):
        return "no fingerprint"
    keys = sorted(k for k in set(saved) | set(running) if saved.get(k) != running.get(k))
    return "differs in " + ", ".join(keys)


__all__ = ["CacheFileError", "LoadReport", "PrefixCacheFile", "checkpoint_identity", "source_identity"]
