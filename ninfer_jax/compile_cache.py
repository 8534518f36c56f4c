"""jax's persistent compilation cache for the entry points, so a restart loads the engine's compiled steps
instead of compiling them again (about 3 minutes for the 35B-A3B's buckets on the H200).

It is a process-wide jax setting, so the library never turns it on by itself: the server and `ninfer-generate`
call `enable_compile_cache` with their `--compile-cache-dir` (default: $JAX_COMPILATION_CACHE_DIR if set, else
the `xla` folder of `ninfer_jax.home.ninfer_home()`, ~/.cache/ninfer_jax/xla by default; "none" turns it off).
Library users can set JAX_COMPILATION_CACHE_DIR themselves. Entries are keyed by jax on the program, the compiler
options and the device, so a changed model, option or jax version compiles again rather than loading a wrong
program. Entries that no longer decompress (a disk error, a copy cut short) are dropped at start, so they are
written again.
"""

from __future__ import annotations

import json
import logging
import os
import zlib
from pathlib import Path

from ninfer_jax.home import ninfer_home

log = logging.getLogger("ninfer_jax.compile_cache")

OFF = ("", "none", "off")


def default_compile_cache_dir() -> str:
    """$JAX_COMPILATION_CACHE_DIR, else the user's cache folder for ninfer_jax."""
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return os.environ["JAX_COMPILATION_CACHE_DIR"]
    return str(ninfer_home() / "xla")


def add_compile_cache_argument(parser) -> None:
    """The entry points' `--compile-cache-dir` option (on an argparse parser or argument group)."""
    parser.add_argument("--compile-cache-dir", default=default_compile_cache_dir(),
                        help="keep compiled programs here for the next start; none: off (default "
                             "$JAX_COMPILATION_CACHE_DIR, else ~/.cache/ninfer_jax/xla)")


def enable_compile_cache(path: str | None) -> str | None:
    """Turns jax's persistent compilation cache on at `path` (None or one of OFF: off); returns the folder used.

    Raises:
      ValueError: the folder cannot be created or written.
    """
    if path is None or path.strip().lower() in OFF:
        return None
    import jax

    folder = Path(path).expanduser().resolve()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"compile cache folder {folder}: {e.strerror or e}") from e
    if not os.access(folder, os.W_OK):
        raise ValueError(f"compile cache folder {folder} is not writable")
    dropped = drop_damaged_entries(folder)
    jax.config.update("jax_compilation_cache_dir", str(folder))
    # Every step is worth keeping: the small cache copies compile in well under the default 1 s floor, but
    # each still costs a restart its compile.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    log.info("compile cache | %s | %d entries | %d damaged entries dropped", folder,
             sum(1 for _ in folder.glob("*-cache")), dropped)
    return str(folder)


# Entries already found whole, by name, with the size and modification time they had then: a warm start reads only
# the entries written since (decompressing 149 entries of the 35B-A3B took 3.8 s of every start).
CHECKED = "ninfer-checked.json"


def drop_damaged_entries(folder: Path) -> int:
    """Removes the entries that do not decompress; returns how many. jax warns about a damaged entry at every
    start, compiles its program again and never rewrites the file, so each restart would pay that compile. An
    entry whose size and modification time are those it had when last found whole is not read again."""
    checked = _read_checked(folder / CHECKED)
    whole: dict[str, list[int]] = {}
    dropped = 0
    for entry in folder.glob("*-cache"):
        try:
            stat = entry.stat()
            mark = [stat.st_size, stat.st_mtime_ns]
            if checked.get(entry.name) == mark or _decompresses(entry.read_bytes()):
                whole[entry.name] = mark
                continue
        except OSError:
            continue
        try:
            entry.unlink()
            dropped += 1
        except OSError as e:
            log.warning("compile cache | cannot drop damaged entry %s | %s", entry.name, e.strerror or e)
    if whole != checked:
        _write_checked(folder / CHECKED, whole)
    return dropped


def _read_checked(path: Path) -> dict:
    try:
        checked = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return checked if isinstance(checked, dict) else {}


def _write_checked(path: Path, whole: dict) -> None:
    """Written whole or not at all (a start cut short leaves the last one)."""
    temporary = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        temporary.write_text(json.dumps(whole))
        temporary.replace(path)
    except OSError as e:
        log.warning("compile cache | cannot record the checked entries in %s | %s", path, e.strerror or e)


def _decompresses(data: bytes) -> bool:
    """Whether a cache entry is a whole zlib or zstd stream (jax writes one or the other); a zstd entry counts
    as whole when the zstandard package is not there to check it."""
    if data[:4] == b"\x28\xb5\x2f\xfd":
        try:
            import zstandard
        except ImportError:
            return True
        try:
            zstandard.ZstdDecompressor().decompress(data)
            return True
        except zstandard.ZstdError:
            return False
    try:
        stream = zlib.decompressobj()
        stream.decompress(data)
        return stream.eof and not stream.unused_data
    except zlib.error:
        return False


__all__ = ["add_compile_cache_argument", "default_compile_cache_dir", "drop_damaged_entries",
           "enable_compile_cache"]
