"""Results files measured on a tree with uncommitted changes (``+changes`` in their commit), which no reader can
check out and rerun.

``--check_figures`` fails on a results file whose commit carries ``+changes`` unless `STILL_ON_CHANGES` names it
(with why it is not re-measured yet), and on a file `STILL_ON_CHANGES` names that no longer carries it, until its
name is taken off: the list only shrinks.
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.results import load_results

# Results files still measured on uncommitted changes, each left for its cost (a quality sweep of hours, or a timing
# suite that needs the machine to itself); every one is re-measured by `python scripts/benchmark.py --suite <name>`
# on a clean checkout.
STILL_ON_CHANGES: dict[str, str] = {
    "finetune_choice": "57 fine-tuning runs, about 3 hours",
    "finetune_report": "54 fine-tuning runs, about 3 hours",
    "finetune_sweep": "a fine-tuning sweep of hours",
    "pretrain_quality": "about 29 pretraining runs, about 2 hours",
}


def uncommitted_source_problems(root: Path) -> list[str]:
    """One line per results file under ``root`` measured on uncommitted changes that `STILL_ON_CHANGES` does not
    allow, and per allowed name whose file no longer is."""
    problems = []
    for path in sorted((root / "benchmarks" / "results").glob("*.json")):
        on_changes = load_results(path.stem, root).get("commit", "").endswith("+changes")
        relative = path.relative_to(root)
        if on_changes and path.stem not in STILL_ON_CHANGES:
            problems.append(f"{relative}: measured on uncommitted changes: commit, then measure it again")
        elif not on_changes and path.stem in STILL_ON_CHANGES:
            problems.append(f"{relative}: measured on a committed tree: take {path.stem!r} off STILL_ON_CHANGES")
    return problems
