"""The measured tables of docs/vision.md (the SVD network, the LipConvNet certification), rendered from their
results files by `benchmarks.rendering.figures`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from benchmarks.rendering.table_format import markdown_table, provenance

Load = Callable[[str], dict[str, Any]]

SVD_METHODS = {
    "auxiliary": "auxiliary reflection",
    "householder": "Householder, {features} sequential reflections",
    "householder_wy": "Householder, compact WY",
    "matrix_exp": "`matrix_exp`",
    "cayley": "Cayley",
}


def svd_network_table(load: Load, suite: str) -> str:
    """The SVD network of ``suite`` (``svd_network``: the digits; ``svd_network_mnist``: MNIST-5k), per map."""
    record = load(suite)
    rows = [
        [
            SVD_METHODS[r["method"]].format(features=r["features"]),
            f"{r['final_val_error'] * 100:.2f} %",
            f"{r['seconds_per_epoch']:.3g}",
            f"{r['time_vs_auxiliary']:.1f}",
        ]
        for r in record["rows"]
    ]
    header = f"validation error after {record['settings']['epochs']} epochs"
    return markdown_table(["method", header, "s / epoch", "time / auxiliary"], rows)


def speedup_span(load: Load, suite: str) -> str:
    """How many times longer an epoch of every other map takes than the auxiliary reflection's, as ``"a–b×"``."""
    ratios = [r["time_vs_auxiliary"] for r in load(suite)["rows"] if r["method"] != "auxiliary"]
    return f"{min(ratios):.0f}–{max(ratios):.0f}×"


def _percent(value: float) -> str:
    return f"{value * 100:.1f} %"


def lipconvnet_table(load: Load) -> str:
    """Clean and certified accuracy of each recipe, with its Lipschitz constant and training time."""
    rows = []
    for row in load("lipconvnet")["rows"]:
        certified = [_percent(value) for value in row["certified_accuracy_at"].values()]
        rows.append(
            [
                row["recipe"],
                f"{row['epochs']:g}",
                _percent(row["clean_accuracy"]),
                *certified,
                f"{row['lipschitz_constant']:.2f}",
                f"{row['train_seconds']:.0f} s",
            ]
        )
    radii = list(load("lipconvnet")["rows"][0]["certified_accuracy_at"])
    header = ["recipe", "epochs", "clean", f"certified at {radii[0]}", *radii[1:], "Lipschitz constant (pixel space)"]
    return markdown_table([*header, "training"], rows)


VISION_TABLES: dict[str, Callable[[Load], str]] = {
    "svd_network": lambda load: svd_network_table(load, "svd_network"),
    "svd_network_mnist": lambda load: svd_network_table(load, "svd_network_mnist"),
    "lipconvnet": lipconvnet_table,
}
VISION_FIGURES: dict[str, Callable[[Load], str]] = {
    "svd_network.source": lambda load: provenance(load("svd_network")),
    "svd_network_mnist.source": lambda load: provenance(load("svd_network_mnist")),
    "svd_network_mnist.speedup": lambda load: speedup_span(load, "svd_network_mnist"),
    "lipconvnet.source": lambda load: provenance(load("lipconvnet")),
}
