"""POET's fine-tuning choices besides the rate, swept on the choosing set (`benchmarks.suites.finetune_choice`).

On each choosing task, OFT at its defaults and POET at its default rate with one choice of ``--recipe default``
changed: the block layout (OFT's contiguous blocks or permuted ones, ``--spo block``), the block size (each side at
``lr·32/b``), the merge interval, the Cayley–Neumann terms, and the paper's fully stochastic recipe (``--recipe
paper``) with and without the rate scaled to each side's size (``--poet_reference_block 0``: one rate for every side,
the fine-tuning default before it). Seed 0, one process each (`benchmarks.suites.finetune_quality.run_parallel`).
Rows carry the evaluation-loss gain over OFT's on the same task and the largest angle a layer turned by at step 5
(``angle @5``, degrees).
"""

from __future__ import annotations

from functools import partial
from typing import Any

from .finetune_choice import CHOOSING_TASKS
from .finetune_quality import TASKS, quality_row, run_parallel, task_argv

POET = ["--method", "poet"]
PERMUTED = [*POET, "--spo", "block"]
VARIANTS = {
    "OFT (block 32)": ["--method", "oft"],
    "POET (`--recipe default`: contiguous 32-blocks)": POET,
    "permuted 32-blocks (`--spo block`)": PERMUTED,
    "permuted 16-blocks (each side at lr·32/16)": [*PERMUTED, "--block_size", "16"],
    "permuted 64-blocks (each side at lr·32/64)": [*PERMUTED, "--block_size", "64"],
    "a merge every 20 steps": [*POET, "--merge_every", "20"],
    "5 Cayley–Neumann terms": [*POET, "--neumann_terms", "5"],
    "`--recipe paper` (fully stochastic, budget ½)": [*POET, "--recipe", "paper"],
    "`--recipe paper`, one rate for every side": [*POET, "--recipe", "paper", "--poet_reference_block", "0"],
}
OFT = "OFT (block 32)"
SETTINGS = {"tasks": CHOOSING_TASKS, "variants": VARIANTS, "seed": 0, "shapes": {t: TASKS[t] for t in CHOOSING_TASKS}}


def run(quick: bool = False, workers: int = 2) -> list[dict[str, Any]]:
    jobs = {
        (task, variant): partial(lambda t, flags: [*task_argv(t, 6 if quick else None), *flags], task, flags)
        for task in CHOOSING_TASKS
        for variant, flags in VARIANTS.items()
    }
    results = run_parallel(jobs, workers)
    rows = []
    for (task, variant), result in results.items():
        method = "oft" if variant == OFT else "poet"
        rows.append({**quality_row(task, method, result, results[(task, OFT)]), "variant": variant})
    return rows
