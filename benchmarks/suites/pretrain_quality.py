"""Pretraining quality against memory: POET and the low-memory optimizers, each trained until its validation loss is
flat, each at its best rate.

The README's main job made long: `scripts/pretrain.py` on the tiny preset (4 blocks of width 128, vocabulary 4096)
and the embedded corpus, `STEPS` steps of 8 × 256 tokens, evaluated every `EVAL_STEPS` steps on 128 validation
sequences; every run is the command a user types (only the method, its rate, the length and the evaluations set),
in its own process, two at a time with one torch thread each (`benchmarks.run_cache`). The methods (`METHODS`):

- ``POET-BS`` and ``POET-FS``: `--method poet-bs` (the preset's 32-blocks) and `--method poet-fs` (budget ½), the
  rotation rate ``--poet_learning_rate`` swept, the embeddings and head at the preset's ``--learning_rate``;
- ``AdamW`` and ``AdamW 8-bit`` (bitsandbytes' AdamW8bit, ``--optim adamw_bnb_8bit``) on every weight;
- ``GaLore 8-bit, layer-wise``: transformers' ``galore_adamw_8bit_layerwise`` on the blocks' linear layers at rank
  32 (a quarter of the width, as the GaLore paper's ranks for its smaller models), the projection renewed every 200
  steps, scale 0.25; on a CPU its step's ``torch.cuda.synchronize()`` is made a no-op (galore-torch calls it
  unconditionally);
- ``APOLLO-Mini, layer-wise``: transformers' ``apollo_adamw_layerwise`` with the APOLLO paper's Mini settings (rank
  1, random projection, tensor-wise scaling, scale 128) on the blocks' linear layers;
- ``POET-BS, every saving on``: POET-BS with nf4 ``W0``, 8-bit states, steps fused into the backward and activation
  checkpointing (`benchmarks.suites.savings_quality.EVERYTHING_ON`).

Each method's rate runs at the preset's value, half and twice (`POET_RATES`: the rotations' ``--poet_learning_rate``;
`ADAMW_RATES`: ``--learning_rate``) and, where the best sat at an edge, at further doublings past it until it sits
inside (`PAST_THE_EDGE`); the best has the lowest final validation loss. Memory is the whole process's
peak RSS, imports included, under glibc's default allocator, as the user's run sees it.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import Any

from benchmarks.run_cache import ROOT, code_version, run_parallel
from benchmarks.suites.savings_quality import EVERYTHING_ON
from poet_hf.recipes.presets import PRESETS
from poet_hf.recipes.script_arguments import JOB_DEFAULTS

STEPS = 1200
EVAL_STEPS = 100
APOLLO_MINI = "rank=1,proj=random,scale_type=tensor,scale=128,update_proj_gap=200"
SAVINGS = "POET-BS, every saving on"
METHODS: dict[str, list[str]] = {
    "POET-BS": ["--method", "poet-bs"],
    SAVINGS: ["--method", "poet-bs", *EVERYTHING_ON],
    "POET-FS": ["--method", "poet-fs"],
    "AdamW": ["--method", "adamw"],
    "AdamW 8-bit": ["--method", "adamw", "--optim", "adamw_bnb_8bit"],
    "GaLore 8-bit, layer-wise": ["--method", "galore", "--optim", "galore_adamw_8bit_layerwise"]
    + ["--optim_args", "rank=32,update_proj_gap=200,scale=0.25"],
    "APOLLO-Mini, layer-wise": ["--method", "adamw", "--optim", "apollo_adamw_layerwise"]
    + ["--optim_target_modules", r".*\.layers\..*_proj", "--optim_args", APOLLO_MINI],
}
POET_RATES = (2e-3, 4e-3, 8e-3)  # the tiny preset's rotation rate 4e-3, half and twice (`--poet_learning_rate`)
ADAMW_RATES = (2.5e-3, 5e-3, 1e-2)  # the tiny preset's 5e-3, half and twice (`--learning_rate`)
# The doublings past the edge at which each method's best sat, one at a time until the best is inside the grid.
SMALLER = (1.25e-3, 6.25e-4)
PAST_THE_EDGE = {"POET-BS": (1.6e-2,), SAVINGS: (1.6e-2,), "GaLore 8-bit, layer-wise": (2e-2,)}
PAST_THE_EDGE |= {"AdamW": SMALLER, "AdamW 8-bit": SMALLER, "APOLLO-Mini, layer-wise": SMALLER[:1]}
SLOWEST_FIRST = ("POET-FS", SAVINGS, "POET-BS")  # the order the runs start in, so that none is left to run alone
TINY_BATCH = f"{PRESETS['tiny'].batch_size}x{JOB_DEFAULTS['pretraining']['seq_len']}"  # sequences × tokens
SETTINGS: dict[str, Any] = {"preset": "tiny", "steps": STEPS, "eval_steps": EVAL_STEPS, "batch": TINY_BATCH}
SETTINGS["preset rates"] = {"POET": POET_RATES[1], "others": ADAMW_RATES[1]}
CACHE = ROOT / ".cache" / "pretrain_runs"


def job_argv(method: str, rate: float, quick: bool) -> list[str]:
    """``scripts/pretrain.py``'s arguments for ``method`` (a `METHODS` key) at ``rate``."""
    steps, every = (20, 10) if quick else (STEPS, EVAL_STEPS)
    rate_flag = "--poet_learning_rate" if method.startswith("POET") else "--learning_rate"
    return [*METHODS[method], rate_flag, f"{rate:g}", "--max_steps", str(steps), "--eval_strategy", "steps"] + [
        "--eval_steps",
        str(every),
        "--logging_steps",
        str(every),
        "--disable_tqdm",
        "true",
    ]


def run_child(argv: list[str], output_dir: Path) -> dict[str, Any]:
    """One pretraining run, ``scripts/pretrain.py`` with ``argv`` in a fresh process with one torch thread: its
    ``results.json``, the whole process's peak RSS and its RSS once torch, transformers and poet_hf are imported."""
    import os

    patch = "torch.cuda.synchronize = lambda device=None: None\n" if "galore" in " ".join(argv) else ""
    script = str(ROOT / "scripts" / "pretrain.py")
    code = (
        "import resource, runpy, sys, torch, transformers, poet_hf.recipes.pretrain\n"
        f"from benchmarks.common import status_mb\n{patch}imports = status_mb('VmRSS')\n"
        f"sys.argv = [{script!r}, *{argv!r}, '--output_dir', {str(output_dir)!r}]\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"
        "print('PEAK', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, imports)\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
    if out.returncode:
        raise RuntimeError(f"pretraining {argv} failed:\n{out.stderr[-3000:]}")
    peak, imports = map(float, next(line for line in out.stdout.splitlines() if line.startswith("PEAK "))[5:].split())
    results = json.loads((output_dir / "results.json").read_text())
    keep = ("val_loss", "val_perplexity", "initial_val_loss", "validation_losses", "steps", "merges")
    keep += ("trainable_params", "wall_time_s")
    return {**{key: results[key] for key in keep}, "recipe": results["recipe"], "peak_mb": peak, "imports_mb": imports}


def preset_rates(method: str) -> tuple[float, float, float]:
    """``method``'s preset rate, half and twice."""
    return POET_RATES if method.startswith("POET") else ADAMW_RATES


def rates(method: str) -> tuple[float, ...]:
    """Every rate ``method`` runs at, smallest first."""
    return tuple(sorted((*preset_rates(method), *PAST_THE_EDGE.get(method, ()))))


def run(quick: bool = False, workers: int = 2) -> list[dict[str, Any]]:
    """One row per method and rate (`METHODS` order), each method's best rate marked."""
    version = code_version([ROOT / "scripts" / "pretrain.py", Path(__file__)])
    swept = {method: preset_rates(method)[1:2] if quick else rates(method) for method in METHODS}
    order = sorted(METHODS, key=lambda m: SLOWEST_FIRST.index(m) if m in SLOWEST_FIRST else len(SLOWEST_FIRST))
    jobs = {(m, r): partial(job_argv, m, r, quick) for m in order for r in swept[m]}
    results = run_parallel(jobs, run_child, CACHE, version, workers)
    best = {m: min(grid_rates, key=lambda r, m=m: _loss((m, r), results)) for m, grid_rates in swept.items()}
    return [_row(m, r, results[(m, r)], best) for m, grid_rates in swept.items() for r in grid_rates]


def _loss(key: tuple[str, float], results: dict[Any, dict[str, Any]]) -> float:
    loss = results[key]["val_loss"]
    return loss if math.isfinite(loss) else math.inf


def _row(method: str, rate: float, result: dict[str, Any], best: dict[str, float]) -> dict[str, Any]:
    recipe = result["recipe"]
    return {
        "method": method,
        "rate": rate,
        "best": best[method] == rate,
        "optimizer": recipe["optimizer"],
        "val loss": result["val_loss"],
        "val perplexity": result["val_perplexity"],
        "validation losses": result["validation_losses"],
        "steps": result["steps"],
        "merges": result["merges"],
        "peak MB": result["peak_mb"],
        "above imports MB": result["peak_mb"] - result["imports_mb"],
        "trainable (M)": result["trainable_params"] / 1e6,
    }
