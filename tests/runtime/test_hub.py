"""Checkpoint references as vLLM takes them: a Hugging Face repo id found in the local cache loads under that name,
a snapshot folder of the cache's layout is named by its repo, and a reference that names nothing is refused
saying where it looked."""

import shutil
import sys

import pytest

from ninfer_jax import Engine
from ninfer_jax.hub import CheckpointNotFound, resolve_checkpoint

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture()
def hub(tmp_path, monkeypatch, checkpoint_factory):
    """An HF cache holding `tiny/org-model` at `main`, and no huggingface_hub to download with."""
    cache = tmp_path / "hub"
    repo = cache / "models--tiny--org-model"
    shutil.copytree(checkpoint_factory("tiny-dense", "text", seed=2), repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    return repo / "snapshots" / COMMIT


def test_a_repo_id_in_the_cache_loads_under_its_name(hub):
    assert resolve_checkpoint("tiny/org-model") == (hub, "tiny/org-model")
    assert resolve_checkpoint("tiny/org-model", revision=COMMIT) == (hub, "tiny/org-model")
    assert resolve_checkpoint(hub) == (hub, "tiny/org-model")  # the snapshot folder itself
    with Engine.from_pretrained("tiny/org-model", max_concurrency=1, max_model_len=256, kv_capacity=512,
                                warmup=False) as engine:
        assert engine.model_name == "tiny/org-model"
        assert len(engine.generate([5, 6, 7]).token_ids) > 0


def test_a_reference_that_names_nothing_says_where_it_looked(hub, tmp_path):
    with pytest.raises(CheckpointNotFound, match="repo tiny/other .* is not in the Hugging Face cache .*hub"):
        resolve_checkpoint("tiny/other")
    with pytest.raises(CheckpointNotFound, match="revision v2"):
        resolve_checkpoint("tiny/org-model", revision="v2")
    with pytest.raises(CheckpointNotFound, match="no such checkpoint folder"):
        Engine.from_pretrained(tmp_path / "missing" / "deeper" / "model", warmup=False)
