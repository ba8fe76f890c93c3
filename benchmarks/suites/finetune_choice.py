"""Each fine-tuning method's rate, swept on the choosing set: the models every fine-tuning default is chosen on.

The testbed's trained models (``benchmarks/testbed.py``) split in two. The **choosing set** (`CHOOSING_TASKS`): the
LLaMAs of 4 blocks of width 256 and of 12 of width 128, trained on the plays until their validation loss is flat and
fine-tuned on Milton, and all-MiniLM-L6-v2 telling four plays apart. The **reporting set**
(``benchmarks.suites.finetune_report``) is never swept.

LoRA (r 8, alpha 16; ``--learning_rate``), OFT (32-blocks; ``--learning_rate``) and POET (``--recipe default``;
``--poet_learning_rate``, the rate of a 32-block side) each run at every rate of `RATES` (doubling grids around each
default, LoRA's from the usual 2e-4), one process each, seed 0. On classification, LoRA's and OFT's rate also sets the
new head's; POET's head keeps 1e-3. A row's ``loss gain / OFT's`` is its evaluation-loss gain over that of OFT at its
default rate on the same task; a method's **best rate** (`best_rates`) is the one with the largest mean of that ratio
over the choosing tasks.
"""

from __future__ import annotations

import statistics
from functools import partial
from typing import Any

from .finetune_quality import TASKS, quality_row, run_parallel, task_argv

CHOOSING_TASKS = ("lm-256x4", "lm-128x12", "classification")
RATES = {
    "lora": (2e-4, 5e-4, 1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2),
    "oft": (2.5e-4, 5e-4, 1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2),
    "poet": (1.25e-4, 2.5e-4, 5e-4, 1e-3, 2e-3),
}
SETTINGS = {"tasks": CHOOSING_TASKS, "rates": RATES, "seed": 0, "shapes": {t: TASKS[t] for t in CHOOSING_TASKS}}


def default_rates() -> dict[str, float]:
    """The rate each method runs at when ``scripts/finetune.py`` is given none."""
    from poet_hf.recipes.finetune import ADAPTER_LEARNING_RATE
    from poet_hf.tuners.poet import POET_FINETUNE_RECIPES

    return {
        "lora": ADAPTER_LEARNING_RATE,
        "oft": ADAPTER_LEARNING_RATE,
        "poet": POET_FINETUNE_RECIPES["default"].learning_rate,
    }


def rate_argv(method: str, rate: float) -> list[str]:
    """``scripts/finetune.py`` arguments running ``method`` at ``rate``."""
    flag = "--poet_learning_rate" if method == "poet" else "--learning_rate"
    return ["--method", method, flag, f"{rate:g}"]


def job_argv(task: str, method: str, rate: float, seed: int, quick: bool) -> list[str]:
    """``scripts/finetune.py`` arguments running ``method`` at ``rate`` on ``task`` with ``seed`` (6 steps if
    ``quick``)."""
    return [*task_argv(task, 6 if quick else None, seed), *rate_argv(method, rate)]


def best_rates(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Each method's rate with the largest mean ``loss gain / OFT's`` over the tasks of ``rows``."""
    means: dict[tuple[str, float], list[float]] = {}
    for row in rows:
        means.setdefault((row["method"], row["rate"]), []).append(row["loss gain / OFT's"])
    methods = {method for method, _ in means}
    return {
        method: max((key for key in means if key[0] == method), key=lambda key: statistics.mean(means[key]))[1]
        for method in methods
    }


def run(quick: bool = False, workers: int = 2) -> list[dict[str, Any]]:
    defaults = default_rates()
    grids = {method: rates[2:3] if quick else rates for method, rates in RATES.items()}
    jobs = {
        (task, method, rate): partial(job_argv, task, method, rate, 0, quick)
        for task in CHOOSING_TASKS
        for method, rates in grids.items()
        for rate in sorted({*rates, defaults[method]})
    }
    results = run_parallel(jobs, workers)
    rows = []
    for (task, method, rate), result in results.items():
        row = quality_row(task, method, result, results[(task, "oft", defaults["oft"])])
        rows.append({**row, "rate": rate, "default": rate == defaults[method]})
    best = best_rates(rows)
    for row in rows:
        row["best"] = best[row["method"]] == row["rate"]
    return rows
