"""Figures of a suite's results file (`PLOTTERS`): for ``pretrain_step``, each measured ratio beside its estimate
(analytic memory, flop ratio) and how both move with the model size and the batch; for ``pretrain_quality``,
validation perplexity against peak memory and the validation curves. ``--suite pretrain_quality`` draws its own;
any can be redrawn:

    python scripts/benchmark.py --plot benchmarks/results/pretrain_step.json --plot_dir docs/figures
"""

from __future__ import annotations

import math
from pathlib import Path

from benchmarks.suites import lipconvnet, svd_network, svd_network_mnist

METHODS = {"poet-bs": "POET-BS 256", "poet-fs": "POET-FS ½"}
SIZE = {"llama-60m": 60, "llama-130m": 130, "llama-350m": 350, "llama-1.3b": 1300}


def _label(row: dict) -> str:
    return f"{row['preset'].removeprefix('llama-')}, {row['batch'].replace('x', ' × ')}"


def _bars(axis, rows: list[dict], measured: str, estimate: str, ylabel: str, reference: float) -> None:
    """Measured bars with the estimate drawn on each; one group per (model, batch), one bar per method."""
    labels = list(dict.fromkeys(_label(r) for r in rows))
    width = 0.8 / len(METHODS)
    for k, (method, name) in enumerate(METHODS.items()):
        picked = {_label(r): r for r in rows if r["method"] == method}
        xs = [i + (k - (len(METHODS) - 1) / 2) * width for i, label in enumerate(labels) if label in picked]
        values = [picked[label] for label in labels if label in picked]
        axis.bar(xs, [r[measured] for r in values], width * 0.9, label=f"{name}, measured")
        axis.scatter(
            xs,
            [r[estimate] for r in values],
            marker="_",
            s=400,
            color="black",
            zorder=3,
            label="estimate" if k == 0 else None,
        )
    axis.axhline(reference, color="grey", linewidth=0.8, linestyle="--")
    axis.set_xticks(range(len(labels)), labels, rotation=20)
    axis.set_ylabel(ylabel)
    axis.legend(fontsize=8)


def _scaling(axis, rows: list[dict], x_of, xlabel: str) -> None:
    for method, name in METHODS.items():
        picked = sorted((x_of(r), r) for r in rows if r["method"] == method and x_of(r) is not None)
        xs = [x for x, _ in picked]
        axis.plot(xs, [r["memory ratio"] for _, r in picked], "o-", label=f"{name}: memory / AdamW")
        axis.plot(xs, [r["time ratio"] for _, r in picked], "s--", label=f"{name}: time / AdamW")
    axis.axhline(1.0, color="grey", linewidth=0.8)
    axis.set_xlabel(xlabel)
    axis.legend(fontsize=7)


def _save(figure, path: Path) -> Path:
    """Lay ``figure`` out, write it to ``path`` and free it."""
    import matplotlib.pyplot as plt

    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def plot_pretrain_step(rows: list[dict], out_dir: str | Path, machine: str = "") -> list[Path]:
    """Write ``pretrain_step_estimates.png`` (memory and time ratios against AdamW with their estimates) and
    ``pretrain_step_scaling.png`` (the ratios against model size at the suite's smallest batch, and against the
    batch at llama-130m); returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = [r for r in rows if r.get("accumulation", 1) == 1]
    figure, (memory, time) = plt.subplots(1, 2, figsize=(12, 4.2))
    _bars(memory, rows, "memory ratio", "analytic estimate ratio", "peak memory / AdamW's (lower is better)", 1.0)
    _bars(time, rows, "time ratio", "flop ratio", "step time / AdamW's (lower is better)", 1.0)
    figure.suptitle(
        f"One pretraining step against AdamW, with the analytic estimate and flop ratio of each\n{machine}", fontsize=9
    )
    paths = [_save(figure, out / "pretrain_step_estimates.png")]

    figure, (by_size, by_batch) = plt.subplots(1, 2, figsize=(11, 4))
    smallest = {}
    for r in rows:  # per model, its smallest batch
        batch = int(r["batch"].split("x")[0])
        key = (r["preset"], r["method"])
        if key not in smallest or batch < smallest[key][0]:
            smallest[key] = (batch, r)
    _scaling(by_size, [r for _, r in smallest.values()], lambda r: SIZE.get(r["preset"]), "model size (M parameters)")
    by_size.set_xticks(sorted({SIZE[r["preset"]] for _, r in smallest.values() if r["preset"] in SIZE}))
    _scaling(
        by_batch,
        [r for r in rows if r["preset"] == "llama-130m"],
        lambda r: int(r["batch"].split("x")[0]),
        "micro-batch (sequences of 256 tokens), llama-130m",
    )
    figure.suptitle(f"How the ratios move with model size and batch\n{machine}", fontsize=9)
    return [*paths, _save(figure, out / "pretrain_step_scaling.png")]


def plot_pretrain_quality(rows: list[dict], out_dir: str | Path, machine: str = "") -> list[Path]:
    """Write ``pretrain_quality_memory.png`` (each method's validation perplexity at its best rate against the whole
    process's peak memory) and ``pretrain_quality_curves.png`` (the validation curves at the best rates); returns the
    paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    best = [r for r in rows if r["best"]]
    figure, axis = plt.subplots(figsize=(7.5, 4.8))
    for row in best:
        axis.scatter(row["peak MB"], row["val perplexity"], s=50, zorder=3, label=f"{row['method']} ({row['rate']:g})")
    axis.legend(fontsize=8)
    axis.set_xlabel("peak memory of the whole process (MB, lower is better)")
    axis.set_ylabel("validation perplexity (lower is better)")
    axis.grid(alpha=0.3)
    axis.set_title(
        f"Pretraining to a flat validation loss, each method at its best rate\n{machine}; each run one torch thread",
        fontsize=9,
    )
    paths = [_save(figure, out / "pretrain_quality_memory.png")]

    figure, axis = plt.subplots(figsize=(7.5, 4.8))
    for row in best:
        steps, losses = zip(*row["validation losses"], strict=True)
        axis.plot(steps, [math.exp(loss) for loss in losses], label=f"{row['method']} ({row['rate']:g})")
    axis.set_yscale("log")
    axis.set_xlabel("optimizer step")
    axis.set_ylabel("validation perplexity")
    axis.grid(alpha=0.3, which="both")
    axis.legend(fontsize=8)
    axis.set_title(f"Validation curves at each method's best rate\n{machine}; each run one torch thread", fontsize=9)
    return [*paths, _save(figure, out / "pretrain_quality_curves.png")]


PLOTTERS = {
    "pretrain_step": plot_pretrain_step,
    "pretrain_quality": plot_pretrain_quality,
    "svd_network": svd_network.plot,
    "svd_network_mnist": svd_network_mnist.plot,
    "lipconvnet": lipconvnet.plot,
}
