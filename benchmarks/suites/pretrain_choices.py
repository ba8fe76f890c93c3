"""POET-FS's pretraining choices besides the rate: the Cayley–Neumann terms, the merge interval and the R : P split.

The README's main job made longer, with POET-FS: `scripts/pretrain.py --method poet-fs` on the tiny preset and the
embedded corpus, `STEPS` steps of 8 × 256 tokens at the preset's rates, one seed, one choice changed per run
(`VARIANTS`); the reference merges every 200 steps (``T_m``: four merges in the run, where the paper's Table 4 has
200–400) and counts 6 Cayley–Neumann terms (PEFT's count n; the paper's k = n − 2 = 4). Every run is the command a user
types, in its own process, two at a time with one torch thread each (`benchmarks.run_cache`). Rows carry the final
validation perplexity, the rotation parameters (R and P of every block, `trainable_block_params`) and the largest
relative drift of a weight's singular values from initialisation to the end (`poet_hf.diagnostics.spectrum_report`),
which an orthogonal equivalence transformation keeps at zero save for the Neumann series' error.
"""

from __future__ import annotations

import json
import math
from functools import partial
from pathlib import Path
from typing import Any

from benchmarks.run_cache import ROOT, code_version, run_parallel
from benchmarks.suites import pretrain_quality
from benchmarks.suites.pretrain_quality import run_child

STEPS = 800
LOGGING_STEPS = 100
REFERENCE = "reference: n = 6 (k = 4), T_m = 200, R : P = ½ : ½"
VARIANTS: dict[str, list[str]] = {
    REFERENCE: [],
    "n = 5 (k = 3)": ["--neumann_terms", "5"],
    "T_m = 50 (the tiny preset's)": ["--merge_every", "50"],
    "T_m = 400": ["--merge_every", "400"],
    "R-heavy split, ¾ : ¼": ["--budget_input", "0.75", "--budget_output", "0.25"],
    "P-heavy split, ¼ : ¾": ["--budget_input", "0.25", "--budget_output", "0.75"],
}
SETTINGS: dict[str, Any] = {"preset": "tiny", "method": "poet-fs", "steps": STEPS, "variants": VARIANTS}
CACHE = ROOT / ".cache" / "pretrain_runs"


def job_argv(flags: list[str], quick: bool) -> list[str]:
    """``scripts/pretrain.py``'s arguments for one variant: POET-FS, the reference's merge interval unless ``flags``
    set another."""
    merge = [] if "--merge_every" in flags else ["--merge_every", "200"]
    steps, logging = (10, 5) if quick else (STEPS, LOGGING_STEPS)
    length = ["--max_steps", str(steps), "--logging_steps", str(logging), "--disable_tqdm", "true"]
    return ["--method", "poet-fs", *merge, *flags, *length]


def run_choice(argv: list[str], output_dir: Path) -> dict[str, Any]:
    """`benchmarks.suites.pretrain_quality.run_child`'s record of one run, with its rotation parameters and
    spectrum drift."""
    record = run_child(argv, output_dir)
    results = json.loads((output_dir / "results.json").read_text())
    spectrum = results["spectrum_drift"]
    return {**record, "rotation_params": results["trainable_block_params"], "max_drift": spectrum["max_drift"]}


def run(quick: bool = False, workers: int = 2) -> list[dict[str, Any]]:
    """One row per variant (`VARIANTS` order)."""
    version = code_version([ROOT / "scripts" / "pretrain.py", Path(__file__), Path(pretrain_quality.__file__)])
    jobs = {name: partial(job_argv, flags, quick) for name, flags in VARIANTS.items()}
    results = run_parallel(jobs, run_choice, CACHE, version, workers)
    return [_row(name, result) for name, result in results.items()]


def _row(name: str, result: dict[str, Any]) -> dict[str, Any]:
    recipe = result["recipe"]
    return {
        "run": name,
        "neumann_terms": recipe["neumann_terms"],
        "paper k": recipe["paper_neumann_k"],
        "merge_every": recipe["merge_every"],
        "budget": recipe["budget"],
        "merges": result["merges"],
        "steps": result["steps"],
        "rotation params": result["rotation_params"],
        "initial val perplexity": math.exp(result["initial_val_loss"]),
        "val perplexity": result["val_perplexity"],
        "max spectrum drift": result["max_drift"],
    }
