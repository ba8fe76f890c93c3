"""Where one POET layer's time goes, part by part, against a trainable ``nn.Linear``: ``torch.profiler`` by operator.

The layers of `poet_layer` (POET-BS, both sides, ``forward="auto"``, float32, 2048 tokens), forward and backward as
there. Each CPU operator's own time is put in one part by its name and operand shapes:

- **base products**: the products of the layer's own size (``T · d_in · d_out``): with ``W0``, the two a frozen
  layer needs (a trainable ``nn.Linear`` three), and the weight strategy's ``∂L/∂W_eff``;
- **block products**: the rotations' block-diagonal products and their gradients (an operand with a ``b × b`` face
  and a token dimension);
- **polynomial**: the orthogonal map on the ``b × b`` blocks alone (the Cayley–Neumann series and its VJP);
- **gathers**: the permutation gathers and scatters (``gather``, ``index_select``, ``index_copy``);
- **other**: the rest (copies, elementwise work, the weight strategy's rebuilt ``W_eff``).

Beside them, the plain layer's time and the time at the pick's flop ratio (the plain time × that ratio,
`poet_layer`): an estimate, not a floor (the weight strategy's rotations of ``W0`` can run faster than the count says);
what the parts cost above it is where a row's measured ratio exceeds its flop ratio.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from peft import get_peft_model

import poet_hf  # noqa: F401  (registers the tuner)
from poet_hf import PoetConfig

from .poet_layer import OneLinear, step_fn

SHAPES = ((512, 512, 256), (1024, 1024, 64), (2048, 2048, 256), (4096, 4096, 256), (4096, 14336, 256))
QUICK_SHAPES = ((64, 64, 16),)
TOKENS = 2048
PROFILED_STEPS = 3
PARTS = ("base products", "block products", "polynomial", "gathers", "other")
GATHERS = {"aten::gather", "aten::index_select", "aten::index_copy", "aten::index_copy_", "aten::index"}
PRODUCTS = {"aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "aten::matmul", "aten::linear"}


def part_of(name: str, shapes: list, block: int) -> str:
    """The part an operator's own time belongs to, from its name and its operands' last two dimensions."""
    if name in GATHERS:
        return "gathers"
    if name not in PRODUCTS:
        return "other"
    faces = [tuple(shape[-2:]) for shape in shapes if isinstance(shape, list) and len(shape) >= 2]
    if faces and all(face == (block, block) for face in faces):
        return "polynomial"
    if any(block in face for face in faces):
        return "block products"
    return "base products"  # tokens, d_in and d_out only: a product with W0 or with the layer's whole gradient


def profile(step, block: int) -> tuple[dict[str, float], float]:
    """Milliseconds per step in each part, and the profiled step's wall time (ms)."""
    step()  # warm-up
    parts: dict[str, float] = defaultdict(float)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(PROFILED_STEPS):
            step()
    for event in prof.events():
        if (
            event.name.startswith("aten::")
            and event.cpu_parent is not None
            and event.cpu_parent.name.startswith("aten::")
        ):
            continue  # an operator called by another: its time is in the caller's own
        if event.name.startswith("aten::"):
            parts[part_of(event.name, event.input_shapes, block)] += event.cpu_time_total / 1000
    total = sum(parts.values())
    return {part: parts[part] / PROFILED_STEPS for part in PARTS}, total / PROFILED_STEPS


def measure(d_in: int, d_out: int, block: int, tokens: int = TOKENS) -> dict:
    """One row: each part's milliseconds per forward+backward, the plain layer's, and the time at the flop ratio."""
    from poet_hf.orthogonal.strategy_costs import polynomial_products, strategy_costs
    from poet_hf.tuners.config_utils import SIDE_INPUT, SIDE_OUTPUT
    from poet_hf.tuners.rotation.layer import rotation_layers

    x = torch.randn(tokens, d_in, requires_grad=True)
    grad_y = torch.randn(tokens, d_out)
    config = PoetConfig(target_modules=["proj"], block_size=block, init_weights=False)
    model = get_peft_model(OneLinear(d_in, d_out), config)
    layer = rotation_layers(model)[0][1]
    pick = layer.choose_strategy("default", tokens, training=True)
    sides = layer.sides("default")
    polynomial = polynomial_products(layer.rotation_settings["default"].orthogonal_map, block, "uncached")
    costs = strategy_costs(tokens, d_in, d_out, sides[SIDE_INPUT], sides[SIDE_OUTPUT], True, polynomial=polynomial)
    flop_ratio = costs[pick]["macs"] / (3 * tokens * d_in * d_out)
    parts, total = profile(step_fn(model, x, grad_y), block)
    plain = profile(step_fn(OneLinear(d_in, d_out), x, grad_y), block)[1]
    return {
        "d_in": d_in,
        "d_out": d_out,
        "block": block,
        "tokens": tokens,
        "strategy": pick,
        "plain_ms": plain,
        "poet_ms": total,
        "at flop ratio ms": plain * flop_ratio,
        **{f"{part} ms": ms for part, ms in parts.items()},
    }


def run(quick: bool = False) -> list[dict]:
    """Every row (``quick``: one tiny layer)."""
    return [measure(*shape, tokens=64 if quick else TOKENS) for shape in (QUICK_SHAPES if quick else SHAPES)]
