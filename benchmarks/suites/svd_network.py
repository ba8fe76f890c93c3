"""The auxiliary-reflection paper's SVD network (its §5.1 / Figure 3) on the bundled digits: each orthogonal map's
final validation error and time per epoch, against the auxiliary reflection in the same run.

``poet_hf.vision.svd_experiment.run_svd_experiment`` at ``scripts/train_svd_network.py``'s defaults (64-wide, 3 SVD
layers, 20 epochs, Adam 1e-3, batch 64, seed 0) on one thread, as docs/vision.md quotes it. The paper's 784-wide
MNIST-5k network is `benchmarks.suites.svd_network_mnist`. Rows keep each epoch's validation error and training time,
from which ``svd_network_digits.png`` is drawn.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

SETTINGS = {"dataset": "digits", "epochs": 20, "threads": 1, "seed": 0}
FIGURE = "svd_network_digits.png"


def run_on(settings: dict[str, Any], quick: bool) -> list[dict[str, Any]]:
    """One row per orthogonal map of `run_svd_experiment` with ``settings``: final validation error, seconds per
    epoch, time against the auxiliary reflection, and the curves (``quick``: 2 epochs)."""
    from poet_hf.vision.svd_experiment import SvdExperimentArgs, run_svd_experiment

    with tempfile.TemporaryDirectory() as out:
        args = SvdExperimentArgs(
            dataset=settings["dataset"],
            num_train_epochs=2 if quick else settings["epochs"],
            torch_threads=settings["threads"],
            seed=settings["seed"],
            output_dir=out,
        )
        results = run_svd_experiment(args)
    return [
        {
            "method": method,
            "dataset": settings["dataset"],
            "features": results["features"],
            "epochs": args.num_train_epochs,
            "final_val_error": result["final_val_error"],
            "seconds_per_epoch": result["seconds_per_epoch"],
            "time_vs_auxiliary": result["time_vs_auxiliary"],
            "val_error": result["val_error"],
            "train_seconds": result["train_seconds"],
        }
        for method, result in results["runs"].items()
    ]


def plot_rows(rows: list[dict[str, Any]], out_dir: str | Path, name: str) -> list[Path]:
    """Draw ``name`` (error against epochs and against training time) into ``out_dir`` from a suite's rows."""
    from poet_hf.vision.svd_experiment import plot_svd_experiment

    runs = {row["method"]: row for row in rows}
    results = {"features": rows[0]["features"], "args": {"dataset": rows[0]["dataset"]}, "runs": runs}
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    return [plot_svd_experiment(results, Path(out_dir) / name)]


def plot(rows: list[dict[str, Any]], out_dir: str | Path, machine: str = "") -> list[Path]:
    """``svd_network_digits.png`` from this suite's rows."""
    return plot_rows(rows, out_dir, FIGURE)


def run(quick: bool = False) -> list[dict[str, Any]]:
    """One row per orthogonal map on the digits."""
    return run_on(SETTINGS, quick)
