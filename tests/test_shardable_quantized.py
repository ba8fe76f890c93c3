"""The shardable storage kinds of a quantised ``W0`` (poet_hf.tuners.rotation.shardable_quantized).

References, computed here in float64: rounding every entry to the nearest level of its row's block (nf4: QLoRA's
code book times the block's absmax; int8: 127 levels each way of the row's absmax), and a layer's effective weight
read off its forward on the identity. FSDP2's sharded folds are tested in tests/test_fsdp.py."""

from __future__ import annotations

import bitsandbytes.functional as bnb_functional
import pytest
import torch
from peft import get_peft_model
from tolerances import gamma
from torch import nn

from poet_hf import PoetConfig, merge_and_reinit
from poet_hf.tuners.rotation.shardable_quantized import ShardableQuantizedLinear, decode, encode
from poet_hf.tuners.rotation.storage_kinds import storage_kind

NF4, INT8 = storage_kind("nf4-shardable"), storage_kind("int8-shardable")


def nearest_levels(matrix: torch.Tensor, kind_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Each entry rounded to its nearest level, in float64, and its distance from the nearest rounding boundary
    (relative to its block's scale): where that distance is within float32 rounding, either level is right."""
    work = matrix.double()
    rows, columns = work.shape
    if kind_name == "int8":
        scale = work.abs().amax(dim=1, keepdim=True) / 127
        normalized = work / scale
        boundary = (normalized - normalized.floor() - 0.5).abs()
        return normalized.round() * scale, boundary
    padded = torch.nn.functional.pad(work, (0, -columns % 64)).reshape(rows, -1, 64)
    scale = padded.abs().amax(dim=2, keepdim=True)
    normalized = padded / scale
    levels = bnb_functional.get_4bit_type("nf4", device="cpu").double().sort().values
    chosen = levels[(normalized[..., None] - levels).abs().argmin(dim=-1)]
    midpoints = (levels[1:] + levels[:-1]) / 2
    boundary = (normalized[..., None] - midpoints).abs().amin(dim=-1)
    unpad = lambda t: t.reshape(rows, -1)[:, :columns]  # noqa: E731
    return unpad(chosen * scale), unpad(boundary)


@pytest.mark.parametrize("kind", [NF4, INT8])
@pytest.mark.parametrize("shape", [(48, 128), (40, 100)])
def test_codes_hold_every_entry_rounded_to_the_nearest_level_of_its_row(kind, shape):
    torch.manual_seed(0)
    matrix = torch.randn(shape) * torch.logspace(-2, 1, shape[0])[:, None]  # rows of very different scales
    codes, scales = encode(kind, matrix)
    restored = decode(kind, codes, scales, shape[1])
    expected, boundary = nearest_levels(matrix, kind.code_book)
    decided = boundary > 1e-5  # float32 division lands an entry this close to a boundary on either side
    assert decided.float().mean() > 0.999
    scale = expected.abs().amax(dim=1, keepdim=True)
    error = (restored.double() - expected).abs()[decided] / scale.expand_as(expected)[decided]
    assert error.max() <= 2 * torch.finfo(torch.float32).eps  # the level times a float32 scale
    assert codes.shape[0] == scales.shape[0] == shape[0]  # every statistic in its row: any split by rows keeps it


def test_a_row_split_encodes_as_the_whole():
    """What a process holding rows a:b computes alone is the whole matrix's rows a:b."""
    torch.manual_seed(1)
    matrix = torch.randn(30, 96)
    codes, scales = encode(NF4, matrix)
    top, bottom = encode(NF4, matrix[:17]), encode(NF4, matrix[17:])
    assert torch.equal(torch.cat([top[0], bottom[0]]), codes) and torch.equal(torch.cat([top[1], bottom[1]]), scales)


def _poet(kind: str, requantize: str = "nearest") -> nn.Module:
    torch.manual_seed(2)
    base = nn.Sequential(nn.Linear(96, 128), nn.Tanh(), nn.Linear(128, 64))
    config = PoetConfig(
        target_modules=["0", "2"], block_size=32, base_quantization=kind, requantize=requantize, merge_every=1
    )
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "poet_" in name:
                parameter.normal_(0, 0.05)  # rotations well away from the identity
    return model


def _effective_weight(layer: nn.Module, columns: int) -> torch.Tensor:
    """The weight a layer applies, read off its forward on the identity (bias removed)."""
    with torch.no_grad():
        eye = torch.eye(columns)
        return (layer(eye) - layer(torch.zeros(1, columns))).T


@pytest.mark.parametrize("kind", ["nf4-shardable", "int8-shardable"])
def test_a_merge_stores_the_rotated_weight_rounded_to_nearest(kind):
    model = _poet(kind)
    layer = model.base_model.model[0]
    rotated = _effective_weight(layer, 96)
    merge_and_reinit(model)
    expected, boundary = nearest_levels(rotated, storage_kind(kind).code_book)
    decided = boundary > 1e-4  # the forward and the fold associate R·W0·P's float32 products differently
    stored = layer.weight_matrix().double()
    scale = expected.abs().amax(dim=1, keepdim=True).expand_as(expected)
    # A level times the fold's scale, which is an entry of R·W0·P: off the forward's by the two 32-term products'
    # rounding each (orthogonal factors: relative to the row's largest entry), then a float32 product.
    bound = 2 * gamma(2 * 32, torch.float32) + 2 * torch.finfo(torch.float32).eps
    assert ((stored - expected).abs()[decided] / scale[decided]).max() <= bound
    assert 0 < layer.requantization_error < (0.12 if kind.startswith("nf4") else 0.01)


def test_a_state_dict_round_trip_gives_the_same_outputs():
    model = _poet("nf4-shardable", requantize="feedback")
    merge_and_reinit(model)  # a residual is kept
    x = torch.randn(5, 96)
    with torch.no_grad():
        expected = model(x)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert any(k.endswith("poet_residual_codes") for k in state)
    fresh = _poet("nf4-shardable", requantize="feedback")
    fresh.load_state_dict(state)
    with torch.no_grad():
        assert torch.equal(fresh(x), expected)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in state.items())


def test_error_feedback_keeps_the_error_at_one_rounding_over_many_merges():
    """With the residual added back, W0 after n identity merges stays one rounding from the exact float64 product
    of the rotations; rounding to nearest each time drifts further."""
    errors = {}
    for mode in ("feedback", "nearest"):
        model = _poet("int8-shardable", requantize=mode)
        layer = model.base_model.model[0]
        exact = layer.weight_matrix().double()
        for _ in range(6):
            rotated = _effective_weight(layer, 96).double()
            exact = rotated - layer.weight_matrix().double() + exact  # the float64 product, one rotation on
            merge_and_reinit(model)
            with torch.no_grad():
                for name, parameter in model.named_parameters():
                    if "poet_" in name:
                        parameter.normal_(0, 0.05)
        errors[mode] = float((layer.weight_matrix().double() - exact).norm() / exact.norm())
    assert errors["feedback"] < errors["nearest"]


def test_the_layer_forward_and_export_read_the_dequantized_weight():
    torch.manual_seed(3)
    linear = nn.Linear(100, 40)
    layer = ShardableQuantizedLinear.from_linear(linear, "nf4-shardable")
    x = torch.randn(3, 100)
    expected = x @ layer.dequantize().T + linear.bias
    assert torch.allclose(layer(x), expected, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="ShardableQuantizedLinear stores a shardable kind; 'nf4'"):
        ShardableQuantizedLinear(8, 8, "nf4")
