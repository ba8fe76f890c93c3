"""POET's fine-tuning rotation rate, swept on models trained until their validation loss is flat.

Each task of ``finetune_quality.TRAINED_TASKS`` (two LMs pretrained here to a flat validation loss and the real
all-MiniLM-L6-v2 encoder) runs OFT at its defaults and POET's default recipe at every rotation rate of `RATES`
(``--poet_learning_rate``, the rate of a 32-block side; a new classification head keeps lr 1e-3), one process each.
The grid doubles, so for any rate inside it half and twice are rows too. A row's ``loss gain / OFT's`` is its
evaluation-loss gain over OFT's in the same run; ``plateau`` says whether the rate and both neighbours reach 0.9 of
OFT's gain. The default is a rate that holds the plateau on every task.
"""

from __future__ import annotations

from typing import Any

from .finetune_quality import TRAINED_TASKS
from .finetune_quality import run as run_variants

RATES = (6.25e-5, 1.25e-4, 2.5e-4, 5e-4, 1e-3)
PLATEAU = 0.9  # of OFT's loss gain


def variants(rates: tuple[float, ...] = RATES) -> dict[str, list[str]]:
    rows = {"oft": ["--method", "oft"]}
    for rate in rates:
        rows[f"poet lr {rate:g}"] = ["--method", "poet", "--poet_learning_rate", f"{rate:g}"]
    return rows


def mark_plateau(rows: list[dict[str, Any]], rates: tuple[float, ...] = RATES) -> list[dict[str, Any]]:
    """Add ``plateau``: the rate and the grid's rates at half and twice it all reach `PLATEAU` of OFT's gain."""
    gain = {(row["task"], row["method"]): row["loss gain / OFT's"] for row in rows}
    for row in rows:
        if not row["method"].startswith("poet lr "):
            continue
        index = rates.index(float(row["method"].removeprefix("poet lr ")))
        if 0 < index < len(rates) - 1:
            neighbours = [f"poet lr {rates[i]:g}" for i in (index - 1, index, index + 1)]
            row["plateau"] = all(gain[(row["task"], name)] >= PLATEAU for name in neighbours)
    return rows


def run(quick: bool = False, tasks: tuple[str, ...] = TRAINED_TASKS) -> list[dict[str, Any]]:
    return mark_plateau(run_variants(quick=quick, repeats=1, tasks=tasks, variants=variants()))
