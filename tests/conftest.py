"""Shared fixtures: random tiny checkpoints in HF layout (the oracle built from them is `tests/oracle.py`)."""

from __future__ import annotations

import os
import warnings

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
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
