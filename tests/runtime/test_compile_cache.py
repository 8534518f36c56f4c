"""The entry points' persistent compilation cache (`ninfer_jax/compile_cache.py`): where it lives, how it is
turned off, a folder it cannot use, and a second run that compiles nothing new."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ninfer_jax.compile_cache import default_compile_cache_dir, enable_compile_cache

ROOT = Path(__file__).resolve().parents[2]


def test_the_default_folder_follows_jax_then_xdg_then_home(monkeypatch, tmp_path):
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "jax"))
    assert default_compile_cache_dir() == str(tmp_path / "jax")
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_compile_cache_dir() == str(tmp_path / "xdg" / "ninfer_jax" / "xla")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_compile_cache_dir() == str(tmp_path / "home" / ".cache" / "ninfer_jax" / "xla")


@pytest.mark.parametrize("off", [None, "", "none", "OFF"])
def test_none_turns_it_off(off):
    assert enable_compile_cache(off) is None


def test_a_folder_that_cannot_be_made_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(ValueError, match="compile cache folder .*file/xla"):
        enable_compile_cache(str(blocker / "xla"))


def test_a_second_run_of_ninfer_generate_loads_every_program_from_the_cache(tmp_path):
    folder = tmp_path / "xla"
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env["JAX_PLATFORMS"] = "cpu"
    command = [sys.executable, "-m", "ninfer_jax.generate", "--max-tokens", "2", "--max-concurrency", "1",
               "--compile-cache-dir", str(folder), "hello"]
    first = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-2000:]
    entries = sorted(p.name for p in folder.iterdir())
    assert len(entries) >= 8  # the prefill buckets and decode, greedy and full, and the cache's small steps
    second = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr[-2000:]
    assert f"compile cache | {folder} | {len(entries)} entries" in second.stderr
    assert sorted(p.name for p in folder.iterdir()) == entries  # every program was a hit: nothing new written
