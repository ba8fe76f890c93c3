"""Optimizer parameter groups for POET and the per-merge state reset."""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from ..tuners.rotation_layer import RotationLayer


def poet_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The trainable skew parameters of every POET layer (found structurally, not by name)."""
    return [p for module in model.modules() if isinstance(module, RotationLayer)
            for p in module.skew_parameters() if p.requires_grad]


def poet_param_groups(model: nn.Module, learning_rate: float, poet_learning_rate: float, weight_decay: float,
                      decay_parameter_names: Iterable[str]) -> list[dict]:
    """Three groups: the non-POET trainable parameters with and without decay (``learning_rate``; first, so
    Trainer logs it as ``learning_rate``), then the POET parameters (``poet_learning_rate``, no weight decay,
    as the POET code). Empty groups are dropped."""
    poet = {id(p) for p in poet_parameters(model)}
    decay = set(decay_parameter_names)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad and id(p) not in poet]
    groups = [
        {"params": [p for n, p in named if n in decay], "lr": learning_rate, "weight_decay": weight_decay},
        {"params": [p for n, p in named if n not in decay], "lr": learning_rate, "weight_decay": 0.0},
        {"params": poet_parameters(model), "lr": poet_learning_rate, "weight_decay": 0.0, "poet": True},
    ]
    return [g for g in groups if g["params"]]


def reset_optimizer_state(optimizer: torch.optim.Optimizer, params: Iterable[nn.Parameter]) -> int:
    """Forget the state (moments, step count) of ``params``; Adam re-initialises it lazily at the next step.

    After a merge the skew parameters are zero and the coordinates are re-permuted, so old moments refer to
    other directions (POET code's ``POETAdamW`` does the same). Returns how many entries were dropped.
    """
    state = optimizer.state
    dropped = 0
    for p in params:
        if p in state:
            del state[p]
            dropped += 1
    return dropped
