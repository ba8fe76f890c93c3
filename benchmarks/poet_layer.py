"""One forward+backward of a POET Linear, by strategy, against the same ``nn.Linear`` trained plainly.

Square layers, both sides rotated (block-stochastic), the input requiring a gradient as inside a network. The three
fused strategies are timed (``weight``, ``activation`` which keeps ``h = x R W0ᵀ``, ``activation-recompute``);
``forward="auto"`` chooses among the two that keep nothing but the input by the multiply-add count of
``poet_hf.orthogonal.strategy_costs.strategy_costs``. The suite checks that the pick is the faster of those two.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from peft import get_peft_model
from torch import nn

import poet_hf  # noqa: F401  (registers the tuner)
from poet_hf import PoetConfig
from poet_hf.tuners.rotation.layer import rotation_layers

from .common import device, time_call

MEMORY_NEUTRAL = ("weight", "activation-recompute")


class OneLinear(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


def step_fn(model: nn.Module, x: torch.Tensor):
    def step():
        model.zero_grad(set_to_none=True)
        x.grad = None
        model(x).sum().backward()

    return step


def run(quick: bool = False) -> list[dict]:
    from poet_hf.orthogonal import rotated_linear

    dev, rows = device(), []
    for dim, tokens in ((512, 2048),) if quick else ((512, 2048), (1024, 2048), (2048, 2048), (2048, 256)):
        x = torch.randn(tokens, dim, device=dev, requires_grad=True)
        plain_time = time_call(step_fn(OneLinear(dim).to(dev), x))
        for block in (64, 256):
            model = get_peft_model(
                OneLinear(dim).to(dev), PoetConfig(target_modules=["proj"], block_size=block, init_weights=False)
            )
            layer = rotation_layers(model)[0][1]
            auto = layer.rotation_settings["default"]
            times = {}
            for strategy in rotated_linear.STRATEGIES:
                layer.rotation_settings["default"] = replace(auto, forward=strategy)
                times[strategy] = time_call(step_fn(model, x))
            layer.rotation_settings["default"] = auto
            pick = layer.choose_strategy("default", tokens, training=True)
            fastest = min(MEMORY_NEUTRAL, key=times.get)
            rows.append(
                {
                    "dim": dim,
                    "block": block,
                    "tokens": tokens,
                    **{f"{s} / plain": t / plain_time for s, t in times.items()},
                    "auto picks": pick,
                    "faster (memory-neutral)": fastest,
                    "pick within 10% of it": times[pick] <= 1.1 * times[fastest],
                }
            )
    return rows
