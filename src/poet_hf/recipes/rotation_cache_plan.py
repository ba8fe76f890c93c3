"""The memory planner's view of POET's rotation caches: which layers cache under accumulation, and what it costs.

The choice is the runtime's own (`rotation_cache_choice`, what ``cache_rotations="auto"`` runs), made from the plan's
shapes: ``batch·seq_len`` tokens per micro-batch, the sharding's processes, the planned dtype's block entries. Beside
it, the planner says where a POET-FS side is out of proportion: its Cayley–Neumann polynomial costs more multiply-adds
than the layer's own products.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..orthogonal.strategy_costs import CacheChoice, rotation_cache_choice
from ..tuners.config_utils import SIDE_INPUT, SIDE_OUTPUT
from ..tuners.rotation.forward import quantization_cost

if TYPE_CHECKING:
    from .plan_settings import PlanSettings

__all__ = ["CachePlan", "plan_rotation_caches"]


@dataclass
class CachePlan:
    """The rotation caches of a planned run.

    Args:
        bytes: what the caches hold together across an accumulation window, on one process.
        setting: ``cache_rotations`` as planned (``"auto"``, ``True`` or ``False``).
        cached: layers that cache.
        layers: rotation layers.
        example: one layer's `CacheChoice` reason (the first that caches, else the first).
        accumulation: micro-batches per optimizer step (1: nothing is cached, whatever the setting).
        notes: where a side's polynomial is out of proportion to its layer, and what to use instead.
    """

    bytes: int = 0
    setting: bool | str = "auto"
    cached: int = 0
    layers: int = 0
    example: str = ""
    accumulation: int = 1
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """One line for the plan's printout."""
        if not self.layers:
            return ""
        line = f"rotation caches (cache_rotations={self.setting!r}): {self.cached} of {self.layers} layers cache"
        if self.accumulation == 1:
            return f"{line} (no gradient accumulation)"
        return f"{line}; {self.example}" if self.example else line


def plan_rotation_caches(built: nn.Module, settings: PlanSettings) -> CachePlan:
    """Which rotation layers of the meta model ``built`` cache across the window, and the bytes they hold.

    Args:
        built: the wrapped model on the ``meta`` device.
        settings: the plan's settings (``cache_rotations``, ``accumulation``, ``batch_size``, ``seq_len``,
            ``sharding``, ``processes``, ``dtype``, ``base_quantization``).

    Returns:
        The [`CachePlan`][poet_hf.recipes.rotation_cache_plan.CachePlan].
    """
    from ..tuners.rotation.layer import rotation_layers

    plan = CachePlan(setting=settings.cache_rotations, accumulation=settings.accumulation)
    tokens = settings.batch_size * settings.seq_len
    block_bytes = torch.finfo(getattr(torch, settings.dtype)).bits // 8
    quantization = quantization_cost(settings.base_quantization)
    heavy: list[tuple[float, str]] = []
    for name, layer in rotation_layers(built):
        for adapter, specs in layer.rotation_specs.items():
            orthogonal_map = layer.rotation_settings[adapter].orthogonal_map
            sides = (specs.get(SIDE_INPUT), specs.get(SIDE_OUTPUT))
            dims = (layer.in_features, layer.out_features)
            choice = rotation_cache_choice(
                tokens, *dims, *sides, orthogonal_map, settings.shards, block_bytes, quantization
            )
            cached = _cached(plan.setting, choice, settings.accumulation)
            plan.layers += 1
            plan.cached += cached
            plan.bytes += choice.cache_bytes if cached else 0
            if not plan.example or (cached and plan.cached == 1):
                plan.example = f"{name}: {choice.reason}"
            ratio = choice.saving / (1 - choice.saving)  # the polynomial over the layer's other multiply-adds
            if ratio > 1:
                heavy.append((ratio, name))
    if heavy:
        ratio, name = max(heavy)
        plan.notes.append(
            f"{len(heavy)} layers' Cayley-Neumann polynomial costs more multiply-adds than the layer's own products "
            f"(up to {ratio:.1f}x, {name}): at these widths use POET-BS, or a smaller POET-FS budget "
            "(docs/choosing-a-method.md)"
        )
    return plan


def _cached(setting: bool | str, choice: CacheChoice, accumulation: int) -> bool:
    """Whether a layer holds a cache in the plan: only under accumulation, as ``setting`` says."""
    return accumulation > 1 and (choice.cache if setting == "auto" else bool(setting))
