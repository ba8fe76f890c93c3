"""Singular-value spectra of weight matrices: what a merge or an export did to a model's weights."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["svdvals", "module_singular_values", "spectrum_summary"]


def svdvals(weight: torch.Tensor) -> torch.Tensor:
    """Singular values (descending, float64, on the CPU) of a weight viewed as ``out × (in·…)``."""
    return torch.linalg.svdvals(weight.detach().double().cpu().reshape(weight.shape[0], -1))


@torch.no_grad()
def module_singular_values(model: nn.Module, names: list[str], progress: bool = False) -> dict[str, torch.Tensor]:
    """Singular values (descending, float64) of the ``weight`` of each module named (exactly) in ``names``.

    Args:
        model: the model.
        names: the exact module names.
        progress: show a progress bar.

    Returns:
        ``{module name: singular values}`` for the modules that have a weight.
    """
    from tqdm.auto import tqdm

    modules = dict(model.named_modules())
    weights = {name: getattr(modules.get(name), "weight", None) for name in names}
    return {
        name: svdvals(weight)
        for name, weight in tqdm(weights.items(), desc="spectrum", disable=not progress)
        if weight is not None
    }


def spectrum_summary(spectra: dict[str, torch.Tensor]) -> list[dict]:
    """One row per module-name group of [`singular_values`][poet_hf.diagnostics.singular_values] output.

    A group is the name's last part (``q_proj``, for example); its row holds ``count``, the mean ``sigma_max`` and
    ``sigma_min``, and the worst ``condition`` number.

    Args:
        spectra: [`singular_values`][poet_hf.diagnostics.singular_values] output.

    Returns:
        One dict per group: ``group``, ``count``, ``sigma_max``, ``sigma_min``, ``condition``.
    """
    groups: dict[str, list[tuple[float, float]]] = {}
    for name, s in spectra.items():
        groups.setdefault(name.rsplit(".", 1)[-1], []).append((float(s.max()), float(s.min())))
    return [
        {
            "group": group,
            "count": len(values),
            "sigma_max": sum(v[0] for v in values) / len(values),
            "sigma_min": sum(v[1] for v in values) / len(values),
            "condition": max(v[0] / max(v[1], 1e-30) for v in values),
        }
        for group, values in groups.items()
    ]
