"""Where a checkpoint reference points: a folder, or a Hugging Face repo id (`Qwen/Qwen3.5-27B`, as vLLM takes it)
found in the local Hugging Face cache, or downloaded into it when `huggingface_hub` is installed.

A checkpoint's name (the model name the server reports and accepts) is the repo id for a repo id or a folder of the
cache's layout (`models--ORG--NAME/snapshots/COMMIT`), else the folder's name.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

log = logging.getLogger("ninfer_jax.hub")

# What a repo id looks like (an owner and a name); anything else names a folder
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# The files a checkpoint needs: weights, configs, tokenizer and chat template (no other formats or docs)
CHECKPOINT_FILES = ("*.safetensors", "*.safetensors.index.json", "*.json", "*.jinja", "*.txt", "*.model")


class CheckpointNotFound(FileNotFoundError):
    """A reference that names no folder and no repo in the cache; the message says what was looked for."""


def hub_cache() -> Path:
    """The Hugging Face hub cache: $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface"
    return Path(home) / "hub"


def resolve_checkpoint(reference: str | Path, revision: str = "main") -> tuple[Path, str]:
    """The checkpoint folder `reference` names, and its name. Raises CheckpointNotFound."""
    path = Path(reference).expanduser()
    if path.exists():
        return path, checkpoint_name(path)
    text = str(reference)
    if not _REPO_ID.match(text):
        raise CheckpointNotFound(f"{reference}: no such checkpoint folder")
    cached = cached_snapshot(text, revision)
    if cached is not None:
        return cached, text
    try:
        import huggingface_hub
    except ImportError:
        raise CheckpointNotFound(
            f"{reference}: no such folder, and repo {text} (revision {revision}) is not in the Hugging Face cache "
            f"{hub_cache()}; download it (`hf download {text}`) or install huggingface_hub to let ninfer-jax do it"
        ) from None
    log.info("downloading %s (revision %s) into %s", text, revision, hub_cache())
    try:
        folder = huggingface_hub.snapshot_download(text, revision=revision, allow_patterns=list(CHECKPOINT_FILES),
                                                   cache_dir=hub_cache())
    except Exception as error:  # offline, no such repo, gated, ...: its own words
        raise CheckpointNotFound(f"{reference}: no such folder, and downloading repo {text} failed: {error}") from None
    return Path(folder), text


def cached_snapshot(repo_id: str, revision: str = "main") -> Path | None:
    """The cache's snapshot folder of `repo_id` at `revision` (a branch or tag its refs name, or a commit), or None."""
    repo = hub_cache() / f"models--{repo_id.replace('/', '--')}"
    ref = repo / "refs" / revision
    commit = ref.read_text().strip() if ref.is_file() else revision
    snapshot = repo / "snapshots" / commit
    return snapshot if (snapshot / "config.json").is_file() else None


def checkpoint_name(path: Path) -> str:
    """ORG/NAME for a snapshot folder of the cache's layout, else the folder's (or a config file's) name."""
    parts = path.resolve().parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return parts[-3][len("models--"):].replace("--", "/")
    if path.is_file():  # a config file (load_format dummy): its folder's name for a config.json
        return path.resolve().parent.name if path.name == "config.json" else path.stem
    return path.name
