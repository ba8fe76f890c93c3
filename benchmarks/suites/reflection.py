"""Forward+backward of one auxiliary reflection against other orthogonal maps and a plain Linear.

At each width ``d`` (batch 512) every method maps ``x (512, d)`` to ``(512, d)`` with trainable parameters and is
timed for ``loss = y.sum(); loss.backward()``:

- ``aux_reflection``: ``H(W x) x`` with a free ``W`` (one GEMM plus O(d) per row);
- ``householder_seq``: ``d`` Householder reflections applied one after another;
- ``householder_wy``: the same ``d`` reflections in compact-WY blocks of 32 (FastH-style);
- ``param_matrix_exp`` / ``param_cayley``: ``torch.nn.utils.parametrizations.orthogonal`` on an ``nn.Linear``;
- ``linear``: a plain ``nn.Linear`` (the baseline of every ratio).

The paper (seed-002 §7) reports one auxiliary reflection 2-6x faster end to end than FastH reflections, the
matrix exponential and the Cayley map; ``speedup_vs_*`` columns check that claim at the layer level.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn.utils import parametrizations

from poet_hf.orthogonal import apply_householder_sequence, auxiliary_reflection

from ..common import device, time_call

BATCH = 512
WY_BLOCK = 32


def _step(forward: Callable[[], torch.Tensor], params: list[torch.Tensor]) -> Callable[[], None]:
    def step() -> None:
        for p in params:
            p.grad = None
        forward().sum().backward()

    return step


def _methods(d: int, x: torch.Tensor) -> dict[str, Callable[[], None]]:
    dev = x.device
    gen = torch.Generator(device="cpu").manual_seed(d)
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=gen))
    w = (torch.eye(d) - q).to(dev).requires_grad_()
    vectors = torch.randn(d, d, generator=gen).to(dev).requires_grad_()
    linear = nn.Linear(d, d, bias=False).to(dev)
    exp_layer = parametrizations.orthogonal(nn.Linear(d, d, bias=False), orthogonal_map="matrix_exp").to(dev)
    cayley_layer = parametrizations.orthogonal(nn.Linear(d, d, bias=False), orthogonal_map="cayley").to(dev)
    return {
        "linear": _step(lambda: linear(x), list(linear.parameters())),
        "aux_reflection": _step(lambda: auxiliary_reflection(x, w), [w]),
        "householder_seq": _step(lambda: apply_householder_sequence(vectors, x), [vectors]),
        "householder_wy": _step(lambda: apply_householder_sequence(vectors, x, block_size=WY_BLOCK), [vectors]),
        "param_matrix_exp": _step(lambda: exp_layer(x), list(exp_layer.parameters())),
        "param_cayley": _step(lambda: cayley_layer(x), list(cayley_layer.parameters())),
    }


def run(quick: bool = False) -> list[dict]:
    dev = device()
    rows = []
    for d in (256,) if quick else (256, 512, 1024):
        x = torch.randn(BATCH, d, generator=torch.Generator().manual_seed(0)).to(dev)
        times = {name: time_call(fn, min_run_time=0.2 if quick else 1.0) for name, fn in _methods(d, x).items()}
        row: dict = {"d": d, "batch": BATCH, "linear_ms": 1e3 * times["linear"]}
        for name in ("aux_reflection", "householder_seq", "householder_wy", "param_matrix_exp", "param_cayley"):
            row[f"{name}/linear"] = times[name] / times["linear"]
        for name in ("householder_seq", "householder_wy", "param_matrix_exp", "param_cayley"):
            row[f"speedup_vs_{name}"] = times[name] / times["aux_reflection"]
        rows.append(row)
    return rows
