"""Results files: each suite's rows, with the machine, date, commit and command that measured them.

``benchmarks/results/<suite>.json`` is written by ``python scripts/benchmark.py --suite <suite>`` and committed; the
README's and the docs' measured figures are rendered from these files (`benchmarks.rendering.figures`), never typed.
"""

from __future__ import annotations

import datetime
import json
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "benchmarks" / "results"


def results_path(suite: str, root: Path = ROOT) -> Path:
    return root / "benchmarks" / "results" / f"{suite}.json"


# What a measurement does not run: a results file or a page changed since the commit leaves the code measured as
# committed (one suite's results written while the next suite runs).
NOT_MEASURED = (":!benchmarks/results", ":!docs", ":!README.md")


def commit() -> str:
    """The checkout's commit, with ``+changes`` when the code in the working tree differs from it."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    head = git("rev-parse", "--short=12", "HEAD") or "unknown"
    return head + ("+changes" if git("status", "--porcelain", "--untracked-files=no", "--", ".", *NOT_MEASURED) else "")


def save_results(suite: str, rows: list[dict], machine: str, command: str, settings: dict | None = None) -> Path:
    """Write ``rows`` of ``suite`` with where and how they were measured; returns the file."""
    path = results_path(suite)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "suite": suite,
        "machine": machine,
        "date": datetime.date.today().isoformat(),
        "commit": commit(),
        "command": command,
        "settings": settings or {},
        "rows": rows,
    }
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


def load_results(suite: str, root: Path = ROOT) -> dict[str, Any]:
    """The results file of ``suite``; ``FileNotFoundError`` names the command that writes it."""
    path = results_path(suite, root)
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: `python scripts/benchmark.py --suite {suite}` writes it")
    return json.loads(path.read_text())
