"""The fine-tuning methods on the reporting set: models no default or rate was chosen on.

The **reporting set** (`REPORTING_TASKS`): a wide, shallow LLaMA (3 blocks of width 384) trained on the plays until its
validation loss is flat and fine-tuned on Milton; a LLaMA of 6 blocks of width 192 trained on another corpus with its
own tokenizer (the top-level modules of this interpreter's standard library) and fine-tuned on the library's unit
tests; all-MiniLM-L6-v2 telling comedy, tragedy and history apart in passages of plays it saw none of in training.
LoRA, OFT and POET each run at their default rate and at the best rate of the choosing sweep
(``benchmarks/results/finetune_choice.json``, `benchmarks.suites.finetune_choice`), on every seed of `SEEDS` (the data
order, LoRA's initialization), one process each. A row's ``loss gain / OFT's`` is, per seed, its evaluation-loss gain
over that of OFT at its default rate with the same seed; the row gives the mean and the range over the seeds.
"""

from __future__ import annotations

import json
import statistics
from functools import partial
from typing import Any

from ..results import load_results
from .finetune_choice import default_rates, job_argv
from .finetune_quality import ENCODER_TASKS, TASKS, quality_row, run_parallel

REPORTING_TASKS = ("lm-384x3", "code-192x6", "genre")
SEEDS = (0, 1, 2)
# `run` adds "testbed": how each trained LM of both sets was pretrained (benchmarks/testbed.py's record of it)
SETTINGS: dict[str, Any] = {"tasks": REPORTING_TASKS, "seeds": SEEDS, "shapes": {t: TASKS[t] for t in REPORTING_TASKS}}


def testbed_records() -> dict[str, dict[str, Any]]:
    """Each trained LM's pretraining record: its recipe, parameters, steps and validation losses."""
    from .. import testbed

    return {
        name: json.loads((testbed.ensure_causal_lm(name=name) / "testbed.json").read_text())
        for name in testbed.TRAINED_CAUSAL_LMS
    }


def chosen_rates() -> dict[str, dict[str, float]]:
    """Each method's ``{"default": rate, "best": rate}``, the best from the committed choosing sweep."""
    choice = load_results("finetune_choice")["rows"]
    best = {row["method"]: row["rate"] for row in choice if row["best"]}
    return {method: {"default": rate, "best": best[method]} for method, rate in default_rates().items()}


def run(quick: bool = False, workers: int = 2) -> list[dict[str, Any]]:
    rates = chosen_rates()
    seeds = SEEDS[:1] if quick else SEEDS
    jobs = {  # the encoder's runs first: they need nothing built
        (task, method, rate, seed): partial(job_argv, task, method, rate, seed, quick)
        for task in sorted(REPORTING_TASKS, key=lambda task: task not in ENCODER_TASKS)
        for method, chosen in rates.items()
        for rate in sorted(set(chosen.values()))
        for seed in seeds
    }
    results = run_parallel(jobs, workers)
    SETTINGS["testbed"] = testbed_records()
    oft = rates["oft"]["default"]
    rows = []
    for task in REPORTING_TASKS:
        for method, chosen in rates.items():
            for rate in sorted(set(chosen.values())):
                per_seed = [
                    quality_row(task, method, results[(task, method, rate, seed)], results[(task, "oft", oft, seed)])
                    for seed in seeds
                ]
                rows.append(seed_summary(per_seed, rate, chosen))
    return rows


def seed_summary(per_seed: list[dict[str, Any]], rate: float, chosen: dict[str, float]) -> dict[str, Any]:
    """One method at one rate over the seeds: the first seed's row with every measured column a mean, the loss gain's
    range, and which of the method's rates it is."""
    row = dict(per_seed[0])
    for key, value in per_seed[0].items():
        if isinstance(value, float) and key != "trainable (M)":
            row[key] = statistics.mean(r[key] for r in per_seed)
    gains = [r["loss gain / OFT's"] for r in per_seed]
    metric = f"{row['metric']} after"
    return {
        **row,
        "rate": rate,
        "setting": " = ".join(name for name, value in chosen.items() if value == rate),
        "seeds": len(per_seed),
        "loss gain / OFT's min": min(gains),
        "loss gain / OFT's max": max(gains),
        "loss after per seed": [r["loss after"] for r in per_seed],
        f"{metric} per seed": [r[metric] for r in per_seed],
    }
