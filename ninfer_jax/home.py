"""The one folder for ninfer-jax's own files: the built-in checkpoint and the compiled programs."""

from __future__ import annotations

import os
from pathlib import Path


def ninfer_home() -> Path:
    """$NINFER_HOME, else $XDG_CACHE_HOME/ninfer_jax, else ~/.cache/ninfer_jax."""
    if os.environ.get("NINFER_HOME"):
        return Path(os.environ["NINFER_HOME"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ninfer_jax"
