"""Diagnostics of orthogonal training: spectra, orthogonality error, ``||Q||`` and vector probing (POET §9)."""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import cast

import torch
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn

from .orthogonal import spo_generator
from .orthogonal.spectra import svdvals
from .orthogonal.statistics import block_statistics, largest_rotation_angle, rotation_metrics
from .sharded import full_tensor
from .tuners.rotation.layer import RotationLayer, SideRotations, rotation_layers

PROBE_MERGE_COUNT = -1  # the probe vectors are drawn from a generator no merge uses


def target_weight_matrices(model: nn.Module, names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """Effective out × in weights of every POET layer, or of a baseline's modules named in ``names``.

    For a baseline, the modules whose names end with one of ``names``: a plain Linear's weight (a ``Conv1D``'s,
    GPT-2's in × out layout, transposed), or a PEFT layer's base weight plus its delta (LoRA, for example).

    Args:
        model: the model.
        names: for a baseline, the module-name endings to read (e.g. ``q_proj``).

    Returns:
        ``{module name: out × in float32 weight}``.
    """
    layers = rotation_layers(model)
    if layers:
        return {name: layer.effective_weight_matrix(dtype=torch.float32).detach() for name, layer in layers}
    from transformers.pytorch_utils import Conv1D

    weights = {}
    for name, module in model.named_modules():
        if not any(name.endswith(n) for n in names or []):
            continue
        if isinstance(module, BaseTunerLayer):
            base = module.get_base_layer()
            weight = full_tensor(cast(torch.Tensor, base.weight)).detach().float()
            for adapter in module.active_adapters:
                weight = weight + module.get_delta_weight(adapter).detach().float()  # type: ignore[attr-defined]  # every PEFT layer has it
            weights[name] = weight.T if isinstance(base, Conv1D) else weight
        elif isinstance(module, (nn.Linear, Conv1D)):
            weight = full_tensor(module.weight).detach().float()  # gathered when FSDP2 shards it
            weights[name] = weight.T if isinstance(module, Conv1D) else weight
    return weights


@torch.no_grad()
def singular_values(
    model: nn.Module,
    names: list[str] | None = None,
    layer_context: Callable[[RotationLayer], AbstractContextManager] | None = None,
) -> dict[str, torch.Tensor]:
    """Singular values (descending, float64) of every target weight.

    See [`target_weight_matrices`][poet_hf.diagnostics.target_weight_matrices].

    Args:
        model: the model.
        names: for a baseline, the module-name endings to read.
        layer_context: a context each POET layer is read inside (DeepSpeed ZeRO-3's gather of its parameters,
            `poet_hf.training.zero.gathered_layer`); none by default.

    Returns:
        ``{module name: singular values}``.
    """
    if layer_context is None or not rotation_layers(model):
        return {name: svdvals(w) for name, w in target_weight_matrices(model, names).items()}
    values = {}
    for name, layer in rotation_layers(model):
        with layer_context(layer):
            values[name] = svdvals(layer.effective_weight_matrix(dtype=torch.float32).detach())
    return values


def spectrum_report(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> dict[str, float]:
    """Spectrum drift between two [`singular_values`][poet_hf.diagnostics.singular_values] snapshots.

    Per layer the drift is ``max_i |σ_i(after) − σ_i(before)| / σ_max(before)``; the report gives the largest
    and mean drift and the largest relative change of ``σ_max``.

    Args:
        before: the snapshot at the start.
        after: the snapshot at the end.

    Returns:
        ``{"layers", "max_drift", "mean_drift", "max_sigma_max_change"}``.
    """
    drifts, top = [], []
    for name, s0 in before.items():
        s1 = after[name]
        drifts.append(float((s1 - s0).abs().max() / s0.max()))
        top.append(float(s1.max() / s0.max() - 1))
    if not drifts:
        return {"layers": 0}
    return {
        "layers": len(drifts),
        "max_drift": max(drifts),
        "mean_drift": sum(drifts) / len(drifts),
        "max_sigma_max_change": max(top, key=abs),
    }


def plot_spectra(
    before: dict[str, torch.Tensor], after: dict[str, torch.Tensor], path: Path, title: str, max_layers: int = 4
) -> Path:
    """A PNG of singular values before and after training for a few layers (like the POET paper's Figure 1).

    Args:
        before: the snapshot at the start.
        after: the snapshot at the end.
        path: the PNG to write.
        title: the figure's title.
        max_layers: how many layers to plot.

    Returns:
        ``path``.

    Raises:
        ValueError: there are no weights to plot.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(before)[:: max(1, len(before) // max_layers)][:max_layers]
    if not names:
        raise ValueError("no target weights to plot")
    fig, axes = plt.subplots(1, len(names), figsize=(4 * len(names), 3.2), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        ax.plot(before[name].numpy(), label="before", lw=2)
        ax.plot(after[name].numpy(), label="after", lw=1.2, ls="--")
        ax.set_title(name.removeprefix("base_model.model.").removeprefix("model."), fontsize=8)
        ax.set_xlabel("index")
        ax.set_ylabel("singular value")
    axes[0][0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _probe_vector(layer: RotationLayer, adapter: str, side: str, dim: int) -> torch.Tensor:
    settings = layer.rotation_settings[adapter]
    generator = spo_generator(settings.seed, PROBE_MERGE_COUNT, settings.layer_name, side)
    v = torch.randn(dim, generator=generator, dtype=torch.float64)
    return v / v.norm()


@torch.no_grad()
def rotation_stats(
    layer: RotationLayer, adapter: str = "default", rotations: SideRotations | None = None
) -> dict[str, float]:
    """One layer's [`block_statistics`][poet_hf.orthogonal.statistics.block_statistics], in float64.

    Args:
        layer: a POET or OFT layer.
        adapter: the adapter to measure.
        rotations: the layer's ``float64_rotations(adapter)``, when the caller has them.

    Returns:
        ``{"q_norm", "orth_error", "neumann_bound"}``.
    """
    rotations = rotations if rotations is not None else layer.float64_rotations(adapter)
    return block_statistics(rotations, layer.rotation_settings[adapter].orthogonal_map)


@torch.no_grad()
def paper_metrics(
    layer: RotationLayer, adapter: str = "default", rotations: SideRotations | None = None
) -> dict[str, dict[str, float]]:
    """Per side, the POET paper's ``e_orth`` and ``Tr(R)/m`` of one layer's rotation.

    See [`rotation_metrics`][poet_hf.orthogonal.statistics.rotation_metrics].

    Args:
        layer: a POET or OFT layer.
        adapter: the adapter to measure.
        rotations: the layer's ``float64_rotations(adapter)``, when the caller has them.

    Returns:
        ``{side: {"e_orth", "trace"}}``.
    """
    rotations = rotations if rotations is not None else layer.float64_rotations(adapter)
    return {side: rotation_metrics(rotations[side][1], spec) for side, spec in layer.sides(adapter).items()}


@torch.no_grad()
def rotation_angle(layer: RotationLayer, adapter: str = "default") -> float:
    """How far, in degrees, one layer's live rotations can turn a vector.

    POET's two sides add up; OFT has one. See
    [`largest_rotation_angle`][poet_hf.orthogonal.statistics.largest_rotation_angle].

    Args:
        layer: a POET or OFT layer.
        adapter: the adapter to measure.

    Returns:
        The angle in degrees.
    """
    orthogonal_map = layer.rotation_settings[adapter].orthogonal_map  # estimated norms: no SVD per block
    norms = {
        side: orthogonal_map.generator_norms(
            full_tensor(layer.rotation_parameter(adapter, side)).float(), spec.block, estimate=True
        )
        for side, spec in layer.sides(adapter).items()
    }
    return largest_rotation_angle(norms)


def neumann_drift_bound(model: nn.Module, merge_history: list[dict]) -> float | None:
    """Bound on any singular value's relative drift over a run.

    Each merge and the live rotations scale a singular value by at most ``1 + ε``, with ``ε`` from the
    Cayley–Neumann truncation (POET §5).

    Args:
        model: the trained model.
        merge_history: what each merge reported (``MergeReinitCallback.history``), with ``max_neumann_bound``.

    Returns:
        The relative bound, or ``None`` without rotation layers.
    """
    layers = rotation_layers(model)
    if not layers:
        return None
    live = max(rotation_stats(layer)["neumann_bound"] for _, layer in layers)
    return math.prod(1 + m["max_neumann_bound"] for m in merge_history) * (1 + live) - 1


@torch.no_grad()
def poet_statistics(model: nn.Module, adapter: str = "default") -> dict[str, float]:
    """Live-primitive statistics for logging.

    - ``poet/q_norm``: the largest ``||Q||_2`` of any block; ``poet/block_orth_error``: the largest
      ``||B Bᵀ − I||_F / √b`` of any block;
    - ``poet/e_orth_{R,P}`` and ``poet/trace_{R,P}``: the paper's ``||R Rᵀ − I||_F / ||I||_F`` and ``Tr(R)/m`` of the
      whole rotation (`paper_metrics`), averaged over layers and,
      under ``poet/<metric>/<layer type>`` (``q_proj``, ``up_proj`` …), over the layers of each type;
    - ``poet/probe_cos_{R,P}``: the mean vector-probe cosine ``vᵀ R v`` with one fixed random unit vector per layer
      and side (the paper's Fig. 2).

    Args:
        model: the model.
        adapter: the adapter whose layers to measure.

    Returns:
        ``{statistic name: value}``; empty without POET layers.
    """
    q_norm, block_error, merge_count = 0.0, 0.0, 0
    per_type: dict[str, list[float]] = {}
    for name, layer in rotation_layers(model, adapter):
        rotations = layer.float64_rotations(adapter)  # one evaluation per layer and side serves every statistic
        stats = rotation_stats(layer, adapter, rotations)
        q_norm, block_error = max(q_norm, stats["q_norm"]), max(block_error, stats["orth_error"])
        merge_count = int(layer.merge_counts[adapter])
        layer_type = name.rsplit(".", 1)[-1]
        for side, metrics in paper_metrics(layer, adapter, rotations).items():
            letter = "R" if side == "input" else "P"
            for metric, value in metrics.items():
                per_type.setdefault(f"{metric}_{letter}/{layer_type}", []).append(value)
            spec = layer.rotation_specs[adapter][side]
            v = _probe_vector(layer, adapter, side, spec.dim)
            blocks = rotations[side][1].cpu()
            cosine = float(spec.matmul_right(v[None], layer.index_buffer(adapter, side).cpu(), blocks)[0] @ v)
            per_type.setdefault(f"probe_cos_{letter}", []).append(cosine)
    stats = {"poet/merge_count": merge_count, "poet/q_norm": q_norm, "poet/block_orth_error": block_error}
    averages: dict[str, list[float]] = {}
    for key, values in per_type.items():
        stats[f"poet/{key}"] = sum(values) / len(values)
        if "/" in key:
            averages.setdefault(key.split("/")[0], []).extend(values)
    stats.update({f"poet/{key}": sum(values) / len(values) for key, values in averages.items()})
    return stats
