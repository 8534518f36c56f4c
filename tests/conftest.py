"""Shared fixtures: random tiny checkpoints in HF layout (the oracle built from them is `tests/oracle.py`)."""

from __future__ import annotations

import atexit
import collections
import os
import shutil
import tempfile
import warnings

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One compilation cache for the run (this process, its xdist workers, which inherit the environment, and the servers
# they start): the suite builds many engines of the same shapes, and each would compile the same programs again (a
# restart test's engines load them instead). Compile counts are unaffected: a loaded program enters a step's cache
# as a compiled one does.
_XLA_CACHE = os.environ.get("NINFER_TESTS_XLA_CACHE")
if _XLA_CACHE is None:  # the process that made it removes it
    _XLA_CACHE = os.environ["NINFER_TESTS_XLA_CACHE"] = tempfile.mkdtemp(prefix="ninfer-jax-tests-xla-")
    atexit.register(shutil.rmtree, _XLA_CACHE, ignore_errors=True)
os.environ.update(JAX_COMPILATION_CACHE_DIR=_XLA_CACHE, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                  JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")
# The suite's programs are tiny and each runs a few times, so LLVM's optimisation passes cost more than they save
# (about 5% of the suite's time). XLA CPU's fusion emitters JIT each kernel into mappings of its own (about 370 per
# program of a hundred kernels, 13 with one LLVM module of legacy emitters), and the jit caches keep every program:
# the suite reached 64,849 mappings and died with SIGSEGV in XLA's compile at the kernel's vm.max_map_count (65,530).
# Subprocesses inherit these flags (the tensor parallel runs add 8 forced host devices).
_FAST_COMPILES = ("--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
                  " --xla_cpu_parallel_codegen_split_count=1")
# (XLA CPU flags: a GPU build of jaxlib refuses them, so JAX_PLATFORMS=cuda runs the kernel tests compiled)
if os.environ["JAX_PLATFORMS"] == "cpu" and _FAST_COMPILES not in os.environ.get("XLA_FLAGS", ""):  # xdist: inherited
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FAST_COMPILES}".strip()
warnings.filterwarnings("ignore", message=".*Triton.*deprecated.*")

from ninfer_jax.model.tiny import write_random_checkpoint  # noqa: E402
from oracle import oracle_config  # noqa: E402

# The files that take half a minute or more on a 2-core CI machine, longest first (`--durations`, 2026-12-03). xdist
# hands whole files to its two workers in order (`--dist loadfile --no-loadscope-reorder`); its default order, most
# tests first, left these (few tests, long fixtures) to the end, where one worker ran them while the other idled.
LONG_FILES = (
    "runtime/test_tensor_parallel.py", "runtime/test_sampling_features.py", "engine_cache/test_chained_verify.py",
    "runtime/test_engine.py", "model/test_gdn_decode_layer.py", "runtime/test_speculative.py",
    "runtime/test_compile_cache.py", "engine_cache/test_cache_scenarios.py", "engine_cache/test_kv_profiles.py",
    "server/test_server_cli.py", "engine_cache/test_wide_serving.py", "engine_cache/test_speculative_cache.py",
    "server/test_server_fuzz.py", "engine_cache/test_persistence.py", "server/test_server_n.py",
    "runtime/test_mixed_steps.py", "benchmarks/test_bench_trace.py", "training/test_train_tiny_mtp.py",
    "engine_cache/test_vision_cache.py", "engine_cache/test_host_faults.py", "engine_cache/test_host_tier.py",
)


def pytest_collection_modifyitems(config, items):
    """The long files first, in LONG_FILES' order, then the rest by their number of tests (xdist's default order);
    each file's tests stay together and in order."""
    rank = {f"tests/{name}": i for i, name in enumerate(LONG_FILES)}
    files = collections.Counter(item.nodeid.split("::")[0] for item in items)
    items.sort(key=lambda item: (rank.get(f := item.nodeid.split("::")[0], len(rank)),
                                 0 if f in rank else -files[f], f))


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


@pytest.fixture
def gemm_on_cpu(monkeypatch):
    """The FP8 GEMM taken as on a Hopper GPU, with the kernels' jnp references standing in (Mosaic GPU does not run
    on CPU; K in two ranges where it can be, as a split product); returns the producer kernels' calls."""
    import jax.numpy as jnp

    from pallas_kernels import fp8_gemm, fp8_matmul, fp8_rows

    calls = []
    monkeypatch.setattr(fp8_gemm, "available", lambda: True)
    monkeypatch.setattr(fp8_rows, "gated_rms_norm_fp8", lambda c, z, w, eps, z_col: calls.append(("norm", z_col))
                        or fp8_rows.norm_reference(c, z[:, z_col:z_col + c.shape[1] * c.shape[2]].reshape(c.shape), w,
                                                   eps))
    monkeypatch.setattr(fp8_rows, "swiglu_fp8", lambda gu: calls.append(("swiglu",)) or fp8_rows.swiglu_reference(gu))
    def gemm(q, s, v, sc, out_dtype, partial_sums=False):  # K in two ranges where it has an even count of blocks
        v = fp8_matmul.unblocked(v)
        if q.shape[1] % 256:
            return fp8_gemm.reference_rows(q, s, v, sc).astype(out_dtype)
        half, blocks = q.shape[1] // 2, q.shape[1] // 256
        parts = jnp.stack([fp8_gemm.reference_rows(q[:, :half], s[:blocks], v[:, :half], sc[:, :blocks]),
                           fp8_gemm.reference_rows(q[:, half:], s[blocks:], v[:, half:], sc[:, blocks:])])
        return parts if partial_sums else fp8_matmul.sum_partials(parts, out_dtype)

    monkeypatch.setattr(fp8_gemm, "fp8_gemm_rows", gemm)
    return calls
