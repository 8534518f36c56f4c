"""One report per benchmark run: `<name>.json` (every number), `<name>.md` (the page) and, where the script
draws one, `<name>_<plot>.png`, each naming the command, date, commit and device.

A page's hand-written part (its `## Notes` section, and everything after it) survives a re-run: the script
rewrites the numbers above it and keeps the notes.
"""

from __future__ import annotations

import datetime
import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs" / "benchmarks"
NOTES = "## Notes"


def command_line(argv: list[str] | None = None) -> str:
    """The command that ran this process, as a user types it (`python scripts/x.py ...`)."""
    argv = sys.argv if argv is None else argv
    script = Path(argv[0])
    try:
        script = script.resolve().relative_to(ROOT)
    except ValueError:
        pass
    return "python " + shlex.join([script.as_posix(), *argv[1:]])


def commit() -> str:
    """The checkout's short commit hash, with "+" when files differ from it; "unknown" outside git."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head + ("+" if dirty else "")) if head else "unknown"


def device_name() -> str:
    """The first jax device's kind, when this process has jax loaded (a parent process that leaves the GPU to
    its children passes theirs instead)."""
    if "jax" not in sys.modules:
        return ""
    import jax

    return str(jax.devices()[0].device_kind)


def run_meta(command: str | None = None, device: str | None = None, **extra) -> dict:
    """The fields every report carries: command, date (UTC), commit, device, and jax's version when loaded."""
    meta = {"command": command or command_line(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": commit(), "device": device if device is not None else device_name()}
    if "jax" in sys.modules:
        meta["jax"] = sys.modules["jax"].__version__
    return {**meta, **extra}


def header(title: str, meta: dict, *lines: str) -> list[str]:
    """A page's title and its run lines: the command, then date, commit and device, then `lines`."""
    return [f"# {title}", "", f"- command: `{meta['command']}`", f"- {run_line(meta)}",
            *[f"- {line}" for line in lines], ""]


def run_line(meta: dict) -> str:
    """"date: ...; commit: ...; device: ...; jax: ..." of a report's fields (those present)."""
    return "; ".join(f"{k}: {meta[k]}" for k in ("date", "commit", "device", "jax") if meta.get(k))


def table(columns: list[str], rows: list[list]) -> list[str]:
    """A markdown table; each cell as str() gives it, its pipes escaped (a shape named "[qkv|z]" is one cell)."""
    def line(cells) -> str:
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

    return [line(columns), "|" + "---|" * len(columns), *[line(r) for r in rows]]


def write_report(out: str | Path, name: str, data: dict, markdown: list[str],
                 plots: dict[str, Callable[[Path], bool]] | None = None) -> Path:
    """Writes `<name>.json` (`data`, which should hold `run_meta()`'s fields) and the page `<name>.md`
    (`write_page`) under `out`; returns the page's path."""
    write_json(out, name, data)
    return write_page(out, name, markdown, plots)


def write_json(out: str | Path, name: str, data: dict) -> Path:
    """Writes `<name>.json` under `out` (created); returns its path."""
    path = Path(out) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")
    return path


def write_page(out: str | Path, name: str, markdown: list[str],
               plots: dict[str, Callable[[Path], bool]] | None = None) -> Path:
    """Writes the page `<name>.md` under `out`: `markdown`, each plot that draws, then the existing page's notes.

    Args:
        out: the report folder (created).
        name: the file stem.
        markdown: the page's lines, without notes: those of an existing page are kept after them.
        plots: draw functions by key, each given its path `<name>_<key>.png` and returning whether it drew (a
            missing matplotlib, or no data, draws nothing; an error costs the plot, not the report).

    Returns:
        The page's path.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    lines = list(markdown)
    for key, draw in (plots or {}).items():
        path = out / f"{name}_{key}.png"
        try:
            drawn = draw(path)
        except Exception as e:  # noqa: BLE001
            print(f"no {path.name}: {type(e).__name__}: {e}", flush=True)
            drawn = False
        if drawn:
            lines += [f"![{key}]({path.name})", ""]
    page = out / f"{name}.md"
    notes = _notes(page)
    page.write_text("\n".join(lines).rstrip("\n") + "\n" + (f"\n{notes}" if notes else ""))
    return page


def _notes(page: Path) -> str:
    """The `## Notes` section (to the end) of an existing page, or ""."""
    if not page.exists():
        return ""
    text = page.read_text()
    at = text.find(f"\n{NOTES}\n")
    return text[at + 1:] if at >= 0 else ""


def fmt(x, digits: int = 3) -> str:
    """A number for a table: "-" for None, 3 significant digits below 1000, thousands separated above."""
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}g}" if abs(x) < 1000 else f"{x:,.0f}"
    return str(x)
