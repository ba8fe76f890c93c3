"""LipConvNet-5 on the bundled digits, trained and certified as ``scripts/train_vision.py`` does it.

Two runs of ``scripts/train_vision.py``, each in its own process as a user starts it (one torch thread, the recipe's
seed, 1,437 training and 360 held-out images at 24 × 24): the quick default recipe (AdamW, cosine, 8 initial channels, 4
epochs) and the ECO paper's recipe shortened to 12 epochs (``--recipe eco-paper --num_train_epochs 12``: 32 initial
channels, SGD 0.05 decayed ×0.1 at epochs 3 and 9, crop and flip). Rows carry the clean accuracy, the certified accuracy
at the papers' radii, the certified Lipschitz constant, the training time and the certified-accuracy curve, from which
``lipconvnet5_digits_eco_paper_12ep.png`` is drawn.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.run_cache import ROOT

RECIPES = {"quick default": [], "eco-paper, 12 epochs": ["--recipe", "eco-paper", "--num_train_epochs", "12"]}
SETTINGS = {"dataset": "digits", "recipes": RECIPES}
FIGURE = "lipconvnet5_digits_eco_paper_12ep.png"
PAPER_RECIPE = "eco-paper, 12 epochs"


def train_row(name: str, argv: list[str], quick: bool) -> dict[str, Any]:
    """Train and certify one recipe with ``scripts/train_vision.py`` in its own process, as a user runs it (``quick``:
    one epoch on 128 images)."""
    shorten = ["--num_train_epochs", "1", "--max_train_samples", "128"] if quick else []
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, str(ROOT / "scripts" / "train_vision.py"), *argv, *shorten, "--output_dir", out]
        done = subprocess.run([*command, "--disable_tqdm", "true"], capture_output=True, text=True, cwd=ROOT)
        if done.returncode:
            raise RuntimeError(f"train_vision.py {argv} failed:\n{done.stderr[-3000:]}")
        metrics = json.loads((Path(out) / "results.json").read_text())
    keep = ("epochs", "clean_accuracy", "certified_accuracy_at", "lipschitz_constant", "train_seconds")
    keep += ("train_examples", "certified_curve")
    row = {"recipe": name, "argv": argv, **{key: metrics[key] for key in keep}}
    return {**row, "test_examples": metrics["num_examples"]}


def plot(rows: list[dict[str, Any]], out_dir: str | Path, machine: str = "") -> list[Path]:
    """``lipconvnet5_digits_eco_paper_12ep.png``: the paper recipe's certified accuracy against the radius."""
    from poet_hf.recipes.vision_run import plot_certified_curve

    row = next(row for row in rows if row["recipe"] == PAPER_RECIPE)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    title = f"LipConvNet-5, digits, eco-paper recipe, {row['epochs']:g} epochs"
    return [plot_certified_curve(row, Path(out_dir) / FIGURE, title)]


def run(quick: bool = False) -> list[dict[str, Any]]:
    """One row per recipe (`RECIPES` order)."""
    return [train_row(name, argv, quick) for name, argv in RECIPES.items()]
