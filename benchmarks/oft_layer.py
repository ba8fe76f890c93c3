"""OFT Linear forward+backward: ours (``OftConfig``) vs PEFT's OFTv2 (``OFTConfig``), same config, same process.

Both use contiguous blocks of size b, 5 Cayley–Neumann terms, a float32 ``nn.Linear(d, d)`` with bias, and an input
of 2048 tokens that requires a gradient (as inside a network). One timed step is ``y = layer(x)`` then
``y.backward(g)``, which computes the gradients of the skew parameters and of ``x``. The two implementations are
timed alternately, so slow phases of a shared machine hit both. The table reports the best (least disturbed) and
the median time of each, ``speedup = peft / ours`` from the best times and ``speedup_median`` from the medians
(> 1: ours is faster). ``*_rotation_ms`` times, alone, the part the two differ in (rotation blocks from the
skew parameters and ``x ↦ x·R``, forward and backward); the base matmul is the same call in both. ``ours`` uses ``forward="auto"`` (in training it picks the activation path, like PEFT,
because the weight path would need an extra ``tokens·in·out`` matmul for ``dL/dW_eff``).
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
    if kind == "peft":
        config = OFTConfig(oft_block_size=block, target_modules=["lin"], num_cayley_neumann_terms=5)
    else:
        forward = {"ours": "auto", "ours_activation": "activation"}[kind]
        config = OftConfig(block_size=block, target_modules=["lin"], neumann_terms=5, forward=forward)
    model = get_peft_model(base, config).to(device)
    with torch.no_grad():  # a live rotation, the same for both (small, as in training)
        generator = torch.Generator().manual_seed(1)
        for name, param in model.named_parameters():
            if param.requires_grad:
                param.copy_(torch.randn(param.shape, generator=generator).to(device) * 1e-3)
    return model


def _step(model: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    x.grad = None
    model(x).backward(grad)


def _adapter_op(model: nn.Module, kind: str):
    """Only the part the two implementations differ in: rotation blocks (Cayley–Neumann) and ``x ↦ x·R``."""
    layer = model.base_model.model.lin
    if kind == "peft":
        return layer.oft_R["default"]
    spec = layer.poet_specs["default"]["input"]
    return lambda x: spec.matmul_right(x, layer.poet_oft_R_index["default"], layer.rotation_blocks("default", "input"))


def _time_alternating(ops: dict, x: torch.Tensor, grad: torch.Tensor, repeats: int, device: torch.device,
                      step) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {k: [] for k in ops}
    for k, op in ops.items():  # warm-up
        step(op, x, grad)
    for _ in range(repeats):
        for k, op in ops.items():
            _sync(device)
            start = time.perf_counter()
            step(op, x, grad)
            _sync(device)
            times[k].append(time.perf_counter() - start)
    return times


def _rotation_step(op, x: torch.Tensor, grad: torch.Tensor) -> None:
    x.grad = None
    op(x).backward(grad)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run(quick: bool) -> list[dict]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dims = (1024,) if quick else (1024, 4096)
    repeats = 3 if quick else (9 if device.type == "cpu" else 30)
    tokens = 2048
    rows = []
    for dim in dims:
        for block in (32, 128):
            kinds = ("peft", "ours", "ours_activation")
            models = {k: _build(dim, block, k, device) for k in kinds}
            generator = torch.Generator().manual_seed(2)
            x = torch.randn(tokens, dim, generator=generator).to(device).requires_grad_(True)
            grad = torch.randn(tokens, dim, generator=generator).to(device)
            with torch.no_grad():
                diff = float((models["peft"](x) - models["ours"](x)).abs().max())
            times = _time_alternating(models, x, grad, repeats, device, _step)
            rotation = _time_alternating({k: _adapter_op(models[k], k) for k in ("peft", "ours")}, x, grad,
                                         2 * repeats, device, _rotation_step)
            rotation_best = {k: 1e3 * min(v) for k, v in rotation.items()}
            best = {k: 1e3 * min(v) for k, v in times.items()}
            median = {k: 1e3 * statistics.median(v) for k, v in times.items()}
            rows.append({
                "in=out": dim, "tokens": tokens, "block": block,
                "peft_ms": best["peft"], "ours_ms": best["ours"], "speedup": best["peft"] / best["ours"],
                "peft_median_ms": median["peft"], "ours_median_ms": median["ours"],
                "speedup_median": median["peft"] / median["ours"],
                "speedup_forced_activation": best["peft"] / best["ours_activation"],
                "peft_rotation_ms": rotation_best["peft"], "ours_rotation_ms": rotation_best["ours"],
                "speedup_rotation": rotation_best["peft"] / rotation_best["ours"],
                "max_abs_diff": diff,
            })
            del models
    return rows
