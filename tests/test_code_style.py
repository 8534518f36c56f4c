"""The repository passes ruff's pycodestyle and pyflakes rules as pyproject.toml configures them."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_the_code_passes_ruff():
    run = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(ROOT)], capture_output=True,
                         text=True, cwd=ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
