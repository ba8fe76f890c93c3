"""OFT's rotation overhead: ours (``OftConfig``) against PEFT's OFTv2 (``OFTConfig``), same config, same process.

Each method wraps the same float32 ``nn.Linear(d, d)`` with bias; contiguous blocks of size b, 5 Cayley–Neumann terms,
2048 tokens that require a gradient (as inside a network). One timed step is ``y = layer(x)`` then ``y.backward(g)``.
The baseline is the frozen plain ``nn.Linear`` (the base matmul and ``∂L/∂x``, which both methods also pay), and a
method's *overhead* is its step time minus the baseline's: the rotation (blocks from the skew parameters, ``x ↦ x·R``
and its backward). The three are timed round-robin, so slow phases of a shared machine hit all alike; the table
gives medians. ``overhead ours / PEFT`` below 1 means our rotation costs less.
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn


class _OneLinear(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def _build(dim: int, block: int, kind: str, device: torch.device) -> nn.Module:
    from peft import OFTConfig, get_peft_model

    import poet_hf  # noqa: F401
    from poet_hf.tuners.oft import OftConfig

    torch.manual_seed(0)
    base = _OneLinear(dim)
    if kind == "plain":
        return base.requires_grad_(False).to(device)
    if kind == "peft":
        config = OFTConfig(oft_block_size=block, target_modules=["lin"], num_cayley_neumann_terms=5)
    else:
        config = OftConfig(block_size=block, target_modules=["lin"], neumann_terms=5)
    model = get_peft_model(base, config).to(device)
    with torch.no_grad():  # a live rotation, the same for both (small, as in training)
        generator = torch.Generator().manual_seed(1)
        for param in model.parameters():
            if param.requires_grad:
                param.copy_(torch.randn(param.shape, generator=generator).to(device) * 1e-3)
    return model


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run(quick: bool = False) -> list[dict]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    repeats = 3 if quick else (15 if device.type == "cpu" else 50)
    tokens, rows = 2048, []
    for dim in (1024,) if quick else (1024, 4096):
        for block in (32, 128):
            models = {k: _build(dim, block, k, device) for k in ("plain", "peft", "ours")}
            generator = torch.Generator().manual_seed(2)
            x = torch.randn(tokens, dim, generator=generator).to(device).requires_grad_(True)
            grad = torch.randn(tokens, dim, generator=generator).to(device)
            with torch.no_grad():
                diff = float((models["peft"](x) - models["ours"](x)).abs().max())

            def step(model: nn.Module, x: torch.Tensor = x, grad: torch.Tensor = grad) -> None:
                model.zero_grad(set_to_none=True)
                x.grad = None
                model(x).backward(grad)

            times: dict[str, list[float]] = {k: [] for k in models}
            for model in models.values():
                step(model)
            for _ in range(repeats):
                for name, model in models.items():
                    _sync(device)
                    start = time.perf_counter()
                    step(model)
                    _sync(device)
                    times[name].append(time.perf_counter() - start)
            median = {k: 1e3 * statistics.median(v) for k, v in times.items()}
            overhead = {k: median[k] - median["plain"] for k in ("peft", "ours")}
            rows.append(
                {
                    "in=out": dim,
                    "tokens": tokens,
                    "block": block,
                    "frozen Linear ms": median["plain"],
                    "PEFT ms": median["peft"],
                    "ours ms": median["ours"],
                    "PEFT overhead ms": overhead["peft"],
                    "ours overhead ms": overhead["ours"],
                    "overhead ours / PEFT": overhead["ours"] / overhead["peft"],
                    "max |Δy|": diff,
                }
            )
            del models
    return rows
