"""Shared fixtures: random tiny checkpoints in HF layout (the oracle built from them is `tests/oracle.py`)."""

from __future__ import annotations

import atexit
import gc
import os
import shutil
import tempfile
import warnings

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One compilation cache for the run (this process and the servers it starts): the suite builds many engines of the
# same shapes, and each would compile the same programs again (a restart test's engines load them instead).
# Compile counts are unaffected: a loaded program enters a step's cache as a compiled one does.
_XLA_CACHE = tempfile.mkdtemp(prefix="ninfer-jax-tests-xla-")
atexit.register(shutil.rmtree, _XLA_CACHE, ignore_errors=True)
os.environ.update(JAX_COMPILATION_CACHE_DIR=_XLA_CACHE, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                  JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")
# The suite's programs are tiny and each runs a few times, so LLVM's optimisation passes cost more than they save
# (about 5% of the suite's time). Subprocesses that set XLA_FLAGS themselves (the tensor parallel runs) keep the
# default level.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()
warnings.filterwarnings("ignore", message=".*Triton.*deprecated.*")

from ninfer_jax.model.tiny import write_random_checkpoint  # noqa: E402
from oracle import oracle_config  # noqa: E402


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory):
    """make(preset, layout="text", seed=0, dtype="float32", shards=1, **text_overrides) -> directory."""
    made = {}

    def make(preset, layout="text", seed=0, dtype="float32", shards=1, **overrides):
        key = (preset, layout, seed, dtype, shards, tuple(sorted(overrides.items())))
        if key not in made:
            directory = tmp_path_factory.mktemp(f"{preset}-{layout}")
            made[key] = write_random_checkpoint(
                directory, oracle_config(preset, layout, **overrides), seed=seed, dtype=dtype, shards=shards
            )
        return made[key]

    return make


@pytest.fixture(scope="module", autouse=True)
def free_compiled_programs():
    """Drops every compiled program after each test module. Each XLA CPU executable holds its own memory mappings,
    and jit caches keep them for the whole run: the suite reached 57k of the kernel's 65,530 (vm.max_map_count) by
    its middle, and an executable compiled past the limit crashed the process (SIGSEGV in XLA's compile or in
    executable.serialize()). A later module that needs a program again loads it from the run's compile cache."""
    yield
    import jax

    jax.clear_caches()
    gc.collect()
