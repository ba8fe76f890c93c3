"""One forward+backward of a POET Linear against the same nn.Linear trained plainly (issue 2).

Both strategies are timed; the cost model's pick (``forward="auto"``) must be the faster one.
"""

from __future__ import annotations

import torch
from peft import get_peft_model
from torch import nn

import poet_hf  # noqa: F401  (registers the tuner)
from poet_hf import PoetConfig
from poet_hf.tuners.poet import poet_layers

from .common import device, time_call


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
    dev, tokens = device(), 2048
    rows = []
    for dim in (512,) if quick else (512, 1024, 2048):
        # Inside a network the input of a layer needs a gradient too, which the cost model takes into account.
        x = torch.randn(tokens, dim, device=dev, requires_grad=True)
        plain_time = time_call(step_fn(OneLinear(dim).to(dev), x))
        for block in (64, 256):
            times = {}
            for strategy in ("weight", "activation"):
                model = get_peft_model(OneLinear(dim).to(dev), PoetConfig(target_modules=["proj"], block_size=block,
                                                                         forward=strategy, init_weights=False))
                times[strategy] = time_call(step_fn(model, x))
            auto = get_peft_model(OneLinear(dim), PoetConfig(target_modules=["proj"], block_size=block))
            layer = poet_layers(auto)[0][1]
            activation = layer._use_activation_path(["default"], tokens, needs_grad=True, input_needs_grad=True)
            pick = "activation" if activation else "weight"
            fastest = min(times, key=times.get)
            rows.append({"dim": dim, "block": block, "tokens": tokens,
                         "weight/plain": times["weight"] / plain_time,
                         "activation/plain": times["activation"] / plain_time,
                         "auto picks": pick, "faster": fastest,
                         "pick within 10% of best": times[pick] <= 1.1 * times[fastest]})
    return rows
