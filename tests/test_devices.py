"""The fused layers and a mixed-precision training step on every device this machine has: the CPU here, and CUDA on a
GPU machine (``scripts/gpu_check.py`` runs this file there). References: dense float64 rotations on the CPU
(tests/helpers/reference.py) and the rounding bounds of tests/helpers/tolerances.py."""

from __future__ import annotations

import pytest
import torch
from layer_reference import dense_side
from models import tiny_llama
from peft import get_peft_model
from tolerances import gamma
from torch import nn

import poet_hf  # noqa: F401
from poet_hf import OftConfig, PoetConfig
from poet_hf.tuners.rotation.layer import rotation_layers

DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


@pytest.mark.numerics
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("config_cls", [PoetConfig, OftConfig], ids=["poet", "oft"])
def test_the_fused_layer_on_the_device_is_the_dense_float64_math(device, config_cls):
    torch.manual_seed(0)
    holder = nn.Module()
    holder.proj = nn.Linear(96, 64)
    model = get_peft_model(holder, config_cls(target_modules=["proj"], block_size=32, init_weights=False)).to(device)
    layer = rotation_layers(model)[0][1]
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(1))
    h = model.base_model.model.proj(x.to(device))
    sides = layer.sides("default")
    output = dense_side(layer, "output") if "output" in sides else torch.eye(64, dtype=torch.float64)
    weight = layer.get_base_layer().weight.detach().cpu().double()
    effective = output.T @ weight @ dense_side(layer, "input").T
    bias = layer.get_base_layer().bias.detach().cpu().double()
    expected = x.double() @ effective.T + bias
    # float32 on the device: a 96-term product and two 32-term block rotations, each within γ_n of exact.
    bound = 2 * gamma(96 + 64 + 1, torch.float32) * (x.double().abs() @ effective.abs().T + bias.abs() + 1)
    gap = (h.detach().cpu().double() - expected).abs()
    assert bool((gap <= bound).all()), float((gap / bound).max())
    h.square().sum().backward()
    assert all(p.grad is not None and bool(torch.isfinite(p.grad).all()) for p in layer.rotation_parameters())


@pytest.mark.parametrize("device", DEVICES)
def test_a_bf16_autocast_training_step_on_the_device_lowers_the_loss(device):
    if device == "cpu" and not torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        pytest.skip("torch's bf16 attention kernels for CPUs need AVX-512")
    model = get_peft_model(tiny_llama(), PoetConfig(block_size=16)).to(device).train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(2)).to(device)
    losses = []
    for _ in range(5):
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    assert losses[-1] < losses[0] - 0.05
    assert all(p.dtype == torch.float32 for p in trainable)
