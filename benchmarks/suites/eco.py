"""ECO vs SOC vs a plain dilated convolution at the ECO paper's block-3 shape (Table 4), evaluation time per batch.

Shapes (LipConvNet, ``init_channels = 32``, 24x24 inputs): block 3 sees 6x6 maps with 128 channels; its stride-1
layers are 128 -> 128 (ECO dilation 2), its last layer 6x6x128 -> pixel-unshuffle -> 3x3x512 -> 256 channels. The
paper times the whole block with batch 128: ``depth/5 - 1`` stride-1 layers plus the downsampling layer.

- ``eco_baked``: the stored kernel, one circular-padded dilated ``F.conv2d`` per layer.
- ``soc``: ``eval_terms = 10`` sequential convolutions per layer (the SOC code's evaluation setting).
- ``plain_dilated``: ``nn.Conv2d`` of the same shape (dilation, zero padding), the floor for any conv layer.

Every ratio is against ``eco_baked`` measured in the same process. A training-step row (forward + backward,
kernel construction included) is added for reference.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn as nn

from benchmarks.common import device as bench_device
from poet_hf.orthogonal.eco import EcoConv2d
from poet_hf.orthogonal.lipschitz_layers import SocConv2d


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _interleaved_medians(fns: dict[str, callable], repeats: int, warmup: int = 2) -> dict[str, float]:
    """Median seconds per callable, timed round-robin so load changes on a shared machine hit all alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    _sync()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            _sync()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _block(kind: str, depth: int, channels: int) -> nn.Sequential:
    """Block 3 of LipConvNet-``depth``: ``depth/5 - 1`` stride-1 layers, then the stride-2 layer to ``2·channels``."""
    layers: list[nn.Module] = []
    for _ in range(depth // 5 - 1):
        layers.append(_layer(kind, channels, channels, 1))
    layers.append(_layer(kind, channels, 2 * channels, 2))
    return nn.Sequential(*layers)


def _layer(kind: str, c_in: int, c_out: int, stride: int) -> nn.Module:
    if kind == "eco_baked":
        return EcoConv2d(c_in, c_out, 3, stride, input_size=6).eval().bake()
    if kind == "soc":
        return SocConv2d(c_in, c_out, 3, stride, input_size=6, eval_terms=10).eval()
    # Same shape as the baked ECO layer: dilation n/k on the (unshuffled) map, zero padding.
    dilation = 2 if stride == 1 else 1
    conv = nn.Conv2d(c_in * stride * stride, c_out, 3, dilation=dilation, padding=dilation)
    return nn.Sequential(nn.PixelUnshuffle(stride), conv) if stride > 1 else conv


def run(quick: bool = False) -> list[dict]:
    torch.manual_seed(0)
    batch, channels = 128, (32 if quick else 128)
    depths = (5, 10) if quick else (5, 10, 20, 40)
    repeats = 3 if quick else 7
    dev = bench_device()
    x = torch.randn(batch, channels, 6, 6, device=dev)
    rows: list[dict] = []
    for depth in depths:
        blocks = {kind: _block(kind, depth, channels).to(dev) for kind in ("eco_baked", "soc", "plain_dilated")}
        with torch.inference_mode():
            timings = _interleaved_medians({k: (lambda b=b: b(x)) for k, b in blocks.items()}, repeats)
        for kind, seconds in timings.items():
            rows.append(
                {
                    "what": f"eval, block 3 of LipConvNet-{depth}",
                    "shape": f"B{batch} C{channels} 6x6 k3",
                    "layer": kind,
                    "ms_per_batch": 1e3 * seconds,
                    "ratio_vs_eco_baked": seconds / timings["eco_baked"],
                }
            )
    # One training step of a single stride-1 layer: ECO builds its kernel (Taylor T=5), SOC runs 5 convs.
    layers = {
        "eco_train": EcoConv2d(channels, channels, 3, input_size=6).to(dev).train(),
        "soc_train": SocConv2d(channels, channels, 3, input_size=6).to(dev).train(),
    }
    xg = x.clone().requires_grad_(True)
    steps = {k: (lambda m=m: m(xg).square().mean().backward()) for k, m in layers.items()}
    train_times = _interleaved_medians(steps, repeats)
    for kind, seconds in train_times.items():
        rows.append(
            {
                "what": "train fwd+bwd, one stride-1 layer",
                "shape": f"B{batch} C{channels} 6x6 k3",
                "layer": kind,
                "ms_per_batch": 1e3 * seconds,
                "ratio_vs_eco_baked": seconds / train_times["eco_train"],  # here: vs eco_train
            }
        )
    return rows
