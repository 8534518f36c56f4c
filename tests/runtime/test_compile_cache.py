"""The entry points' persistent compilation cache (`ninfer_jax/compile_cache.py`): where it lives, how it is
turned off, a folder it cannot use, damaged entries, and a second run that compiles nothing new."""

import os
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from ninfer_jax import compile_cache
from ninfer_jax.compile_cache import default_compile_cache_dir, drop_damaged_entries, enable_compile_cache

ROOT = Path(__file__).resolve().parents[2]


def test_the_default_folder_follows_jax_then_ninfer_home(monkeypatch, tmp_path):
    monkeypatch.delenv("NINFER_HOME", raising=False)
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "jax"))
    assert default_compile_cache_dir() == str(tmp_path / "jax")
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_compile_cache_dir() == str(tmp_path / "xdg" / "ninfer_jax" / "xla")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_compile_cache_dir() == str(tmp_path / "home" / ".cache" / "ninfer_jax" / "xla")
    monkeypatch.setenv("NINFER_HOME", str(tmp_path / "ours"))  # one folder for the checkpoint and the programs
    assert default_compile_cache_dir() == str(tmp_path / "ours" / "xla")


@pytest.mark.parametrize("off", [None, "", "none", "OFF"])
def test_none_turns_it_off(off):
    assert enable_compile_cache(off) is None


def test_a_folder_that_cannot_be_made_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(ValueError, match="compile cache folder .*file/xla"):
        enable_compile_cache(str(blocker / "xla"))


def test_damaged_entries_are_dropped_and_whole_ones_kept(tmp_path):
    whole = zlib.compress(b"an executable" * 100)
    (tmp_path / "jit_a-1-cache").write_bytes(whole)
    (tmp_path / "jit_b-2-cache").write_bytes(whole[: len(whole) // 2])  # a copy cut short
    (tmp_path / "jit_c-3-cache").write_bytes(b"\x00" * 64)  # not a compressed stream at all
    (tmp_path / "notes.txt").write_text("not an entry")
    assert drop_damaged_entries(tmp_path) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["jit_a-1-cache", "ninfer-checked.json", "notes.txt"]


def test_an_entry_found_whole_is_read_again_only_once_it_changes(tmp_path, monkeypatch):
    whole = zlib.compress(b"an executable" * 100)
    (tmp_path / "jit_a-1-cache").write_bytes(whole)
    (tmp_path / "jit_b-2-cache").write_bytes(whole)
    read = []
    real = compile_cache._decompresses
    monkeypatch.setattr(compile_cache, "_decompresses", lambda data: read.append(len(data)) or real(data))
    assert drop_damaged_entries(tmp_path) == 0 and len(read) == 2
    assert drop_damaged_entries(tmp_path) == 0 and len(read) == 2  # both unchanged: neither read
    (tmp_path / "jit_b-2-cache").write_bytes(whole[:-3])  # cut short after it was found whole
    assert drop_damaged_entries(tmp_path) == 1 and read[2:] == [len(whole) - 3]
    assert not (tmp_path / "jit_b-2-cache").exists()
    (tmp_path / compile_cache.CHECKED).write_text("{not json")  # a damaged record: every entry is read again
    assert drop_damaged_entries(tmp_path) == 0 and len(read) == 4


def test_a_second_run_of_ninfer_generate_loads_every_program_from_the_cache(tmp_path):
    folder = tmp_path / "xla"
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env["JAX_PLATFORMS"] = "cpu"
    command = [sys.executable, "-m", "ninfer_jax.generate", "--max-tokens", "2", "--max-concurrency", "1",
               "--max-model-len", "256", "--max-image-tokens", "16", "--compile-cache-dir", str(folder), "hello"]
    first = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-2000:]
    entries = sorted(p.name for p in folder.glob("*-cache"))
    assert len(entries) >= 8  # the prefill buckets and decode, greedy and full, and the cache's small steps
    damaged = folder / next(e for e in entries if "decode_step" in e)
    damaged.write_bytes(b"\x78\x9c damaged on disk")
    second = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr[-2000:]
    assert f"compile cache | {folder} | {len(entries) - 1} entries | 1 damaged entries dropped" in second.stderr
    # every other program was a hit (nothing new written); the damaged one was compiled and written again
    assert sorted(p.name for p in folder.glob("*-cache")) == entries
    assert drop_damaged_entries(folder) == 0  # the rewritten entry is whole
