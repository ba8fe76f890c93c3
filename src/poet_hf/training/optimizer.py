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


@torch.no_grad()
def reset_optimizer_state(optimizer: torch.optim.Optimizer, params: Iterable[nn.Parameter]) -> int:
    """Reset the state (moments, step count) of ``params`` to a fresh one; returns how many states were reset.

    After a merge the skew parameters are zero and the coordinates are re-permuted, so old moments refer to other
    directions (the POET code's ``POETAdamW`` does the same). The tensors are zeroed in place rather than dropped:
    for Adam-family optimizers step 0 with zero moments *is* the fresh state, and keeping the entries keeps one state
    layout, so a sharded checkpoint taken right after a merge resumes exactly (``torch.distributed.checkpoint``
    would otherwise fill missing entries by a zero-gradient step, leaving step 1). Works on DTensor states (FSDP2).
    """
    state = optimizer.state
    reset = 0
    for p in params:
        if p in state:
            for value in state[p].values():
                if torch.is_tensor(value):
                    value.zero_()
            reset += 1
    return reset
