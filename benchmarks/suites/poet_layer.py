"""One forward+backward of a POET Linear, by strategy, against the same ``nn.Linear`` trained plainly.

Both sides rotated (block-stochastic), the input requiring a gradient as inside a network; square layers from 512 to
2048 wide, and one POET-BS 256 layer at Llama-2-7B's and Llama-3-8B's widths (4096 × 4096, 4096 × 14336) at
2048 tokens. The three fused strategies are timed (``weight``; ``activation``, which keeps ``h = x R W0ᵀ``;
``activation-recompute``), then ``forward="auto"``, which chooses by the multiply-add count
(`poet_hf.orthogonal.strategy_costs.auto_strategy`). Each row records the pick, the fastest strategy, the fastest
that ``auto``'s memory bound allows (`bounded_pick`), and the pick's counted multiply-adds against the plain layer's
``3·T·d_in·d_out`` (its flop ratio, beside the measured ratio).
Timed on every thread torch uses (``torch.utils.benchmark`` would time one), the plain layer and the three strategies
in turn over several rounds (`benchmarks.common.time_alternating`), so that a slow spell of the machine falls on all.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
from peft import get_peft_model
from torch import nn

import poet_hf  # noqa: F401  (registers the tuner)
from poet_hf import PoetConfig
from poet_hf.orthogonal.spo import SideSpec
from poet_hf.orthogonal.strategy_costs import admissible_strategies, polynomial_products, strategy_costs
from poet_hf.tuners.config_utils import SIDE_INPUT, SIDE_OUTPUT
from poet_hf.tuners.rotation.layer import rotation_layers

from ..common import device, time_alternating

SQUARE = ((512, 2048), (1024, 2048), (2048, 2048), (2048, 256))  # (width, tokens), blocks 64 and 256
WIDE = ((4096, 4096), (4096, 14336))  # (d_in, d_out) at 2048 tokens, block 256: the 7B-class widths
WIDE_MIN_RUN_S = 20.0  # a wide call takes seconds: at least this long per timing, for a median of several


class OneLinear(nn.Module):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d_in, d_out, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


def step_fn(model: nn.Module, x: torch.Tensor, grad_y: torch.Tensor, autocast: torch.dtype | None = None):
    """One forward and backward; ``grad_y`` is the output's gradient, dense as a network's is (a ``.sum()`` loss
    would hand the layer a broadcast one, which no network does); the forward under ``autocast`` where given."""

    def step():
        model.zero_grad(set_to_none=True)
        x.grad = None
        with torch.autocast(x.device.type, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            y = model(x)
        y.backward(grad_y.to(y.dtype))

    return step


def shapes(quick: bool, wide_only: bool = False) -> list[tuple[int, int, int, int]]:
    """``(d_in, d_out, tokens, block)`` of every row."""
    if quick:
        return [(512, 512, 2048, 64)]
    square = [] if wide_only else [(dim, dim, tokens, block) for dim, tokens in SQUARE for block in (64, 256)]
    return square + [(d_in, d_out, 2048, 256) for d_in, d_out in WIDE]


def measure(d_in: int, d_out: int, tokens: int, block: int, autocast: torch.dtype | None = None) -> dict:
    """One row: each strategy's time and ``auto``'s against the plain layer's (both under ``autocast`` if given)."""
    from poet_hf.orthogonal import rotated_linear

    dev = device()
    min_run = WIDE_MIN_RUN_S if d_in * d_out > 2048 * 2048 and dev.type == "cpu" else 1.0
    x = torch.randn(tokens, d_in, device=dev, requires_grad=True)
    grad_y = torch.randn(tokens, d_out, device=dev)
    threads = torch.get_num_threads()  # the machine's, as a training run uses them
    config = PoetConfig(target_modules=["proj"], block_size=block, init_weights=False)
    model = get_peft_model(OneLinear(d_in, d_out).to(dev), config)
    layer = rotation_layers(model)[0][1]
    auto = layer.rotation_settings["default"]
    poet_step = step_fn(model, x, grad_y, autocast)

    def with_strategy(strategy: str) -> Callable[[], None]:
        def step() -> None:
            layer.rotation_settings["default"] = replace(auto, forward=strategy)
            poet_step()

        return step

    steps = {"plain": step_fn(OneLinear(d_in, d_out).to(dev), x, grad_y, autocast)}
    steps |= {strategy: with_strategy(strategy) for strategy in rotated_linear.STRATEGIES}
    times = time_alternating(steps, (1 + len(rotated_linear.STRATEGIES)) * min_run, threads)
    plain_time = times.pop("plain")
    layer.rotation_settings["default"] = auto
    pick = layer.choose_strategy("default", tokens, training=True)
    sides = layer.sides("default")
    polynomial = polynomial_products(auto.orthogonal_map, block, "uncached")
    costs = strategy_costs(tokens, d_in, d_out, sides[SIDE_INPUT], sides[SIDE_OUTPUT], True, polynomial=polynomial)
    fastest = min(times, key=times.get)
    row = {
        **({"autocast": str(autocast).removeprefix("torch.")} if autocast is not None else {}),
        "d_in": d_in,
        "d_out": d_out,
        "block": block,
        "tokens": tokens,
        "plain_ms": 1000 * plain_time,
        **{f"{s} / plain": t / plain_time for s, t in times.items()},
        "auto picks": pick,
        "auto / plain": times[pick] / plain_time,
        "auto flop ratio": costs[pick]["macs"] / (3 * tokens * d_in * d_out),
        "fastest": fastest,
        "pick within 10% of it": times[pick] <= 1.1 * times[fastest],
    }
    return row | bounded_pick(row)


def bounded_pick(row: dict) -> dict:
    """The fastest strategy `auto` may take by what it keeps (`admissible_strategies`), and whether ``auto``'s pick
    is within 10 % of it: from a row's shape and times, so that a results file of any date gives it."""
    d_in, d_out, tokens = row["d_in"], row["d_out"], row["tokens"]
    sides = [SideSpec("block", d, row["block"]) for d in (d_in, d_out)]
    allowed = admissible_strategies(strategy_costs(tokens, d_in, d_out, *sides, True), d_in, d_out)
    fastest = min(allowed, key=lambda s: row[f"{s} / plain"])
    return {
        "fastest auto may take": fastest,
        "pick within 10% of that": row[f"{row['auto picks']} / plain"] <= 1.1 * row[f"{fastest} / plain"],
    }


def run(quick: bool = False, wide_only: bool = False, autocast: str | None = None) -> list[dict]:
    """Every row (``wide_only``: the 7B-class ones, as the GPU check runs them; ``autocast``: ``"bfloat16"``, as
    POET-X times its layer)."""
    dtype = None if autocast is None else getattr(torch, autocast)
    return [measure(*shape, autocast=dtype) for shape in shapes(quick, wide_only)]
