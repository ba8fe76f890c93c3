"""Quantised frozen bases (QOFT, QPOET): bitsandbytes 4-bit and 8-bit W0, against independent references.

References: bitsandbytes' own layer forward and dequantisation (``peft.utils.integrations.dequantize_bnb_weight``),
dense float64 rotations from explicit loops and powers (tests/helpers/reference.py), and float32 models whose W0 is the
dequantised weight.
"""

from __future__ import annotations

import copy
import json
import math
import sys

import bitsandbytes  # noqa: F401  (the `quant` extra, part of `dev`: these tests run, they never skip)
import pytest
import torch
from layer_reference import dense_side
from peft import PeftModel, get_peft_model
from peft.utils.integrations import dequantize_bnb_weight
from reference import block_rotation_dense, neumann_series, skew_dense
from tolerances import gamma
from torch import nn

import poet_hf  # noqa: F401
from poet_hf import OftConfig, PoetConfig, merge_and_reinit
from poet_hf.orthogonal import CayleyNeumann
from poet_hf.orthogonal.rotated_linear import RotatedPass, SideRotation
from poet_hf.orthogonal.spo import SideSpec
from poet_hf.tuners.rotation import layer as rotation_layer_module
from poet_hf.tuners.rotation import quantization as quant
from poet_hf.tuners.rotation import quantized_rows as bnb_rows
from poet_hf.tuners.rotation.layer import QuantizedMergeWarning, rotation_layers

QUANTIZATIONS = ["nf4", "fp4", "int8"]
TARGETS = ["up", "down"]


class TwoLayers(nn.Module):
    def __init__(self, d: int = 128, hidden: int = 256) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(d, hidden), nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x)))


def quantized_base(quantization: str, double_quant: bool = True, seed: int = 0) -> TwoLayers:
    torch.manual_seed(seed)
    model = TwoLayers()
    model.up = quant.quantize_linear(model.up, quantization, double_quant=double_quant)
    model.down = quant.quantize_linear(model.down, quantization, double_quant=double_quant)
    return model


def bnb_dense(module: nn.Module) -> torch.Tensor:
    """bitsandbytes' own dequantisation of a layer's weight, float64."""
    state = getattr(module.weight, "quant_state", None) or module.state
    return dequantize_bnb_weight(module.weight, state=state).double()


def code_values(module: nn.Module) -> torch.Tensor:
    """The value each stored code stands for, before scaling: 4-bit codes through the code book (so that fp4's two
    zeros compare equal), int8 codes as they are."""
    weight = module.weight
    if module.weight.dtype == torch.int8:
        return weight.data.clone()
    packed = weight.data.reshape(-1)
    codes = torch.stack([packed >> 4, packed & 15], dim=1).reshape(-1).long()
    return weight.quant_state.code[codes]


def quant_step(module: nn.Module) -> torch.Tensor:
    """An upper bound on one quantisation step of every entry, out × in: the widest gap of the code book times the
    block's absmax (4-bit), or the row's scale / 127 (int8)."""
    dense = bnb_dense(module)
    if module.weight.dtype == torch.int8:
        return dense.abs().amax(dim=1, keepdim=True).expand_as(dense) / 127
    code = module.weight.quant_state.code.double().sort().values
    gap = float((code[1:] - code[:-1]).max())
    block = module.weight.quant_state.blocksize
    absmax = dense.reshape(-1, block).abs().amax(dim=1, keepdim=True)
    return (gap * absmax).expand(-1, block).reshape(dense.shape)


def two_layer_rounding_bound(base: TwoLayers, x: torch.Tensor) -> torch.Tensor:
    """Elementwise bound on the gap between two float32 evaluations of ``base`` that sum the same products in
    different orders: ``2·γ_n·(|x|·|W|ᵀ + |b|)`` per layer, the first layer's gap carried through tanh (1-Lipschitz)
    by ``|W2|``."""
    w1, w2 = bnb_dense(base.up), bnb_dense(base.down)
    b1, b2 = base.up.bias.double(), base.down.bias.double()
    x = x.double()
    h = torch.tanh(x @ w1.T + b1)
    first = 2 * gamma(w1.shape[1] + 1, torch.float32) * (x.abs() @ w1.abs().T + b1.abs())
    return first @ w2.abs().T + 2 * gamma(w2.shape[1] + 1, torch.float32) * (h.abs() @ w2.abs().T + b2.abs())


@pytest.fixture(params=["whole", "by rows"])
def fold_by(request, monkeypatch):
    """Merge-then-reinitialize into a 4-bit ``W0`` whole, or by groups of ~2048 entries
    (`poet_hf.tuners.rotation.row_fold`, which such a test then must have used)."""
    calls = []
    if request.param == "by rows":
        monkeypatch.setattr(bnb_rows, "ROW_BLOCK_ENTRIES", 2048)
        fold = rotation_layer_module.fold_by_rows
        monkeypatch.setattr(rotation_layer_module, "fold_by_rows", lambda *args: calls.append(1) or fold(*args))
    yield request.param
    quantization = getattr(request.node, "callspec", None) and request.node.callspec.params.get("quantization")
    assert request.param == "whole" or quantization == "int8" or calls, "no W0 was folded by rows"


# --- the fused function with a W0 that dequantises itself ---------------------------------------------------------
class CountingWeight:
    """A DenseWeight: a float64 matrix returned by a call, with the calls counted."""

    def __init__(self, matrix: torch.Tensor) -> None:
        self.matrix, self.dtype, self.dequantize_cost, self.calls = matrix, matrix.dtype, 1.0, 0

    def __call__(self) -> torch.Tensor:
        self.calls += 1
        return self.matrix.clone()


@pytest.mark.numerics
@pytest.mark.parametrize("strategy", ["weight", "activation", "activation-recompute"])
def test_a_dequantising_weight_gives_the_tensor_weights_function_and_gradients(strategy):
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(8, 12, dtype=torch.float64, generator=gen)
    sides = [SideRotation(SideSpec("block", d, 4), torch.randperm(d, generator=gen), CayleyNeumann(5)) for d in (12, 8)]
    vecs = [
        torch.randn(spec.spec.num_blocks, 6, dtype=torch.float64, generator=gen).mul(0.05).requires_grad_()
        for spec in sides
    ]
    x = torch.randn(3, 12, dtype=torch.float64, generator=gen, requires_grad=True)
    source = CountingWeight(weight)
    y = RotatedPass(strategy, *sides)(x, source, None, *vecs)
    assert source.calls == 1
    saved = [t for t in y.grad_fn.saved_tensors if t is not None]
    assert not [t for t in saved if t.shape == weight.shape]  # the dense W0 is not kept for the backward
    r, p = (dense_rotation_of(side, vec) for side, vec in zip(sides, vecs, strict=True))
    torch.testing.assert_close(y, x.detach() @ r @ weight.T @ p, rtol=0, atol=1e-12)
    y.sum().backward()
    assert source.calls == 2  # rebuilt in the backward, never kept
    assert torch.autograd.gradcheck(
        lambda x_, r_, p_: RotatedPass(strategy, *sides)(x_, CountingWeight(weight), None, r_, p_),
        (x.detach().requires_grad_(), *vecs),
    )


def test_the_cost_model_counts_each_dequantisation_of_w0():
    """A quantised W0 is dequantised in the forward and again in the backward (once without gradients): the cost
    model adds that many ``dequantize_cost · N`` to every strategy, and keeps what each strategy keeps."""
    from poet_hf.orthogonal.strategy_costs import strategy_costs

    sides = (SideSpec("block", 512, 64), SideSpec("block", 256, 64))
    for training, passes in ((True, 2), (False, 1)):
        dense = strategy_costs(1024, 512, 256, *sides, training=training)
        quantized = strategy_costs(1024, 512, 256, *sides, training=training, dequantize_cost=2.0)
        for name, cost in dense.items():
            assert quantized[name]["macs"] - cost["macs"] == passes * 2.0 * 512 * 256
            assert quantized[name]["kept"] == cost["kept"]


def dense_rotation_of(side: SideRotation, vec: torch.Tensor) -> torch.Tensor:
    blocks = torch.stack(
        [neumann_series(skew_dense(row, side.spec.block), side.orthogonal_map.terms) for row in vec.detach()]
    )
    return block_rotation_dense(side.index, blocks)


# --- wrapping quantised targets ------------------------------------------------------------------------------------
@pytest.mark.numerics
@pytest.mark.parametrize("quantization", QUANTIZATIONS)
@pytest.mark.parametrize("config_cls", [PoetConfig, OftConfig])
def test_an_identity_adapter_reproduces_the_quantised_bases_own_forward(quantization, config_cls):
    base = quantized_base(quantization, double_quant=quantization == "nf4")
    x = torch.randn(4, 7, 128, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = base(x)
        model = get_peft_model(copy.deepcopy(base), config_cls(target_modules=TARGETS, block_size=32))
        assert {layer.base_quantization for _, layer in rotation_layers(model)} == {quantization}
        assert [(layer.out_features, layer.in_features) for _, layer in rotation_layers(model)] == [
            (256, 128),
            (128, 256),
        ]
        got = model(x)
    # Identity rotations are exact and the permutations only move entries: both sides compute the same products of
    # the dequantised weights, in possibly different float32 summation orders.
    gap = (got.double() - expected.double()).abs()
    assert bool((gap <= two_layer_rounding_bound(base, x)).all()), float(gap.max())


@pytest.mark.numerics
@pytest.mark.parametrize("quantization", QUANTIZATIONS)
def test_a_live_adapter_is_the_dense_math_on_the_dequantised_weight(quantization):
    base = quantized_base(quantization)
    model = get_peft_model(copy.deepcopy(base), PoetConfig(target_modules=["up"], block_size=32, init_weights=False))
    layer = dict(rotation_layers(model))["base_model.model.up"]
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(2))
    h = model.base_model.model.up(x)
    effective = dense_side(layer, "output").T @ bnb_dense(layer.get_base_layer()) @ dense_side(layer, "input").T
    expected = x.double() @ effective.T + layer.get_base_layer().bias.double()
    # float32 forward: a 128-term product plus two 32-term block rotations, each within γ_n of exact.
    bound = 2 * gamma(128 + 64 + 1, torch.float32) * (x.double().abs() @ effective.abs().T + 1)
    gap = (h.double() - expected).abs()
    assert bool((gap <= bound).all()), float((gap / bound).max())
    h.square().sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in layer.rotation_parameters())
    assert all(not p.requires_grad for p in layer.get_base_layer().parameters() if p.dtype != torch.float32)


@pytest.mark.parametrize("quantization", QUANTIZATIONS)
def test_identity_rotations_requantise_to_the_same_codes(quantization):
    model = get_peft_model(
        quantized_base(quantization), PoetConfig(target_modules=TARGETS, block_size=32, requantize="nearest")
    )
    before = {name: code_values(layer.get_base_layer()) for name, layer in rotation_layers(model)}
    stats = merge_and_reinit(model)
    for name, layer in rotation_layers(model):
        assert torch.equal(code_values(layer.get_base_layer()), before[name]), name
    assert stats["max_requantization_error"] < 1e-3  # only the double-quantised block scales move (nf4/fp4)


@pytest.mark.parametrize("quantization", ["nf4", "int8"])
@pytest.mark.parametrize("requantize", ["nearest", "feedback"])
def test_unmerge_after_merge_is_off_by_at_most_one_quantisation_step(quantization, requantize):
    """Merge and unmerge each round to a code once (at most half a step per entry, measured on the weight they
    produce); the rotation between them is orthogonal, so in Frobenius norm the round trip is within one step."""
    model = get_peft_model(
        quantized_base(quantization),
        PoetConfig(target_modules=TARGETS, block_size=32, init_weights=False, requantize=requantize),
    )
    layers = dict(rotation_layers(model))
    before = {name: bnb_dense(layer.get_base_layer()) for name, layer in layers.items()}
    with pytest.warns(QuantizedMergeWarning, match=r"requantised W0: relative error \d\.\d\de-0\d"):
        model.merge_adapter()
    merged_steps = {name: quant_step(layer.get_base_layer()).norm() for name, layer in layers.items()}
    model.unmerge_adapter()
    for name, layer in layers.items():
        gap = float((bnb_dense(layer.get_base_layer()) - before[name]).norm())
        bound = 0.5 * float(merged_steps[name] + quant_step(layer.get_base_layer()).norm()) * (1 + 1e-6)
        assert 0 < gap <= bound or requantize == "feedback" and gap <= bound, (name, gap, bound)


@torch.no_grad()
def fold_training_sized_rotations(model, layer, exact: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Give ``layer`` random rotations of the size seen in training (‖Q‖₂ ≈ 0.17 per side), fold them into its
    ``W0`` (merge-then-reinitialise) and return ``exact`` rotated the same way in float64."""
    for side, spec in layer.sides("default").items():
        param = layer.rotation_parameter("default", side)
        param.copy_(torch.randn(param.shape, generator=generator) * 0.17 / (2 * spec.block**0.5))
    exact = dense_side(layer, "output").T @ exact @ dense_side(layer, "input").T
    merge_and_reinit(model)
    return exact


@pytest.mark.parametrize("quantization", ["nf4", "int8"])
def test_error_feedback_keeps_repeated_merges_within_one_step_of_the_exact_path(quantization, fold_by):
    """Ten folds of rotations of the size seen in training: the stored W0 stays within one quantisation step of the
    float64 path (each fold's rounding is carried to the next), and without the residual it does not."""
    gaps = {}
    for requantize in ("feedback", "nearest"):
        model = get_peft_model(
            quantized_base(quantization), PoetConfig(target_modules=["up"], block_size=32, requantize=requantize)
        )
        layer = rotation_layers(model)[0][1]
        exact = bnb_dense(layer.get_base_layer())
        generator = torch.Generator().manual_seed(3)
        for _ in range(10):
            exact = fold_training_sized_rotations(model, layer, exact, generator)
        step = quant_step(layer.get_base_layer())  # the block / row scales have moved with the rotations
        gaps[requantize] = float(((bnb_dense(layer.get_base_layer()) - exact).abs() / step).max())
    assert gaps["feedback"] <= 1.0 + 1e-3 < gaps["nearest"]


@pytest.mark.parametrize("storage", ["disk", "layer"])
def test_a_4bit_w0_holds_under_0_6_bytes_per_entry_and_stays_within_1_5_steps_after_50_merges(storage, fold_by):
    """Issue 42's target for a 4-bit W0: 50 folds of training-sized rotations leave the stored nf4 W0 within 1.5
    quantisation steps of the float64 path, while the layer holds at most 0.6 bytes per entry between folds when the
    residual is kept off it (the codes, 0.5 B, and the double-quantised block scales).

    Each fold's residual is stored as int8 codes of its block's absmax, off by at most ``step/508`` per entry, so 50
    folds add at most about ``50/508 ≈ 0.1`` step to the one step of the final rounding."""
    model = get_peft_model(
        quantized_base("nf4"), PoetConfig(target_modules=["up"], block_size=32, residual_storage=storage)
    )
    layer = rotation_layers(model)[0][1]
    exact = bnb_dense(layer.get_base_layer())
    generator = torch.Generator().manual_seed(3)
    held = []
    for _ in range(50):
        exact = fold_training_sized_rotations(model, layer, exact, generator)
        held.append(layer.base_weight_bytes() / exact.numel())
    step = quant_step(layer.get_base_layer())
    drift = float(((bnb_dense(layer.get_base_layer()) - exact).abs() / step).max())
    assert drift <= 1.5, drift
    if storage == "disk":
        assert max(held) <= 0.6, held
        assert quant.residual(layer.get_base_layer()) is not None  # the residual is kept, off the layer
    else:
        assert min(held) > 1.5, held  # codes, scales and the int8 residual with its block scales


def test_a_residual_kept_on_disk_travels_with_the_state_dict_and_loads_back_off_the_layer():
    """The residual of a ``"disk"`` store is part of the layer's ``state_dict`` and, loaded into a fresh model with
    the same storage, lands in that model's store (the layer holds only the codes), equal to what was saved."""
    config = PoetConfig(target_modules=TARGETS, block_size=32, residual_storage="disk")
    model = get_peft_model(quantized_base("nf4"), config)
    _train(model, 4, 2)
    state = model.state_dict()
    residual_keys = [key for key in state if key.endswith(quant.RESIDUAL_CODES)]
    assert len(residual_keys) == len(TARGETS)
    fresh = get_peft_model(quantized_base("nf4", seed=5), copy.deepcopy(config))
    fresh.load_state_dict(state)
    for (_, saved), (_, loaded) in zip(rotation_layers(model), rotation_layers(fresh), strict=True):
        assert torch.equal(quant.residual(saved.get_base_layer()), quant.residual(loaded.get_base_layer()))
        assert loaded.base_weight_bytes() / math.prod(saved.weight_shape) <= 0.6


# --- training, round trips, export ----------------------------------------------------------------------------------
def _train(model, steps: int, merge_every: int, seed: int = 0) -> list[float]:
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    data = torch.Generator().manual_seed(seed)
    errors = []
    for step in range(1, steps + 1):
        x = torch.randn(16, 128, generator=data)
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % merge_every == 0:
            errors.append(merge_and_reinit(model).get("max_requantization_error", 0.0))
    return errors


@pytest.mark.parametrize("quantization", ["nf4", "int8"])
def test_training_with_merges_stays_within_the_measured_requantisation_error(quantization):
    """20 steps with 2 merges on a quantised W0 against the same run on a float32 W0 that starts as its dequantised
    copy: the effective weights differ by no more than the requantisations the merges reported."""
    base = quantized_base(quantization)
    reference = TwoLayers()
    with torch.no_grad():
        for name in TARGETS:
            module = getattr(base, name)
            getattr(reference, name).weight.copy_(bnb_dense(module).float())
            getattr(reference, name).bias.copy_(module.bias)
    config = PoetConfig(target_modules=TARGETS, block_size=32)
    quantized, dense = get_peft_model(base, config), get_peft_model(reference, copy.deepcopy(config))
    errors = _train(quantized, 20, 10)
    assert _train(dense, 20, 10) == [0.0, 0.0] and len(errors) == 2 and errors[0] > 0
    for (name, q_layer), (_, d_layer) in zip(rotation_layers(quantized), rotation_layers(dense), strict=True):
        q_weight, d_weight = q_layer.effective_weight_matrix(), d_layer.effective_weight_matrix()
        relative = float((q_weight - d_weight).norm() / d_weight.norm())
        # Each merge moves W0 by its reported error; training after the first merge sees that perturbation
        # (lr·steps·‖∂²L‖ < 1 here), so the gap stays within the sum of the errors with as much again for its echo.
        assert relative <= 2 * sum(errors), (name, relative, errors)


@pytest.mark.parametrize("quantization", ["nf4", "int8"])
def test_save_and_load_on_a_quantised_base_is_exact_after_merges(tmp_path, quantization, fold_by):
    config = PoetConfig(
        target_modules=TARGETS,
        block_size=32,
        base_init="normalized",
        base_quantization=quantization,
        train_other_params=False,
    )
    torch.manual_seed(0)
    model = get_peft_model(TwoLayers(), config)
    _train(model, 4, 2)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(9))
    expected = model(x).detach()
    model.save_pretrained(tmp_path)
    torch.manual_seed(5)  # a different plain base: W0, its quantisation and the residuals must come from the file
    loaded = PeftModel.from_pretrained(TwoLayers(), tmp_path)
    assert torch.equal(loaded(x), expected)
    for (_, saved), (_, reloaded) in zip(rotation_layers(model), rotation_layers(loaded), strict=True):
        assert torch.equal(code_values(saved.get_base_layer()), code_values(reloaded.get_base_layer()))
        assert torch.equal(quant.residual(saved.get_base_layer()), quant.residual(reloaded.get_base_layer()))
        assert int(reloaded.merge_counts["default"]) == 2
    with pytest.warns(QuantizedMergeWarning):
        plain = loaded.merge_and_unload()
    assert all(quant.quantization_of(getattr(plain, name)) == quantization for name in TARGETS)
    assert not [name for name, _ in plain.named_buffers() if "poet_" in name]  # the residual leaves with the adapter
    assert all(quant.residual(getattr(plain, name)) is None for name in TARGETS)


def test_an_oft_adapter_on_a_transformers_4bit_model_round_trips_and_exports(tmp_path):
    from models import tiny_llama
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from poet_hf.export import export_merged

    tiny_llama().save_pretrained(tmp_path / "base")
    bnb_config = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32,
    )

    def load_base():
        return AutoModelForCausalLM.from_pretrained(tmp_path / "base", quantization_config=bnb_config)

    model = get_peft_model(load_base(), OftConfig(block_size=16, init_weights=False))
    assert len(rotation_layers(model)) == 14 and all(
        layer.base_quantization == "nf4" for _, layer in rotation_layers(model)
    )
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    model.save_pretrained(tmp_path / "adapter")
    reloaded = PeftModel.from_pretrained(load_base(), tmp_path / "adapter")
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids).logits, logits)

    export_merged(model, tmp_path / "recorded", spectrum=False, record_quantization=True)
    config = json.loads((tmp_path / "recorded" / "config.json").read_text())
    recorded = config["source_quantization_config"]
    assert "quantization_config" not in config  # still a full-precision checkpoint
    assert recorded["load_in_4bit"] and recorded["bnb_4bit_quant_type"] == "nf4"
    requantized = AutoModelForCausalLM.from_pretrained(
        tmp_path / "recorded", quantization_config=BitsAndBytesConfig.from_dict(recorded)
    )
    assert quant.quantization_of(requantized.model.layers[0].mlp.down_proj) == "nf4"

    export_merged(model, tmp_path / "export", spectrum=False)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "export")  # stock transformers, no bitsandbytes layer
    assert not any(quant.is_bnb_module(m) for m in plain.modules())
    assert getattr(plain.config, "quantization_config", None) is None
    with torch.no_grad():
        folded = plain(input_ids=ids).logits
    # The fold is R·dequant(W0) in float32 with the live model's factors; two 64-wide layers of float32 sums apart.
    torch.testing.assert_close(folded, logits, rtol=0, atol=1e-4)


# --- refusals ---------------------------------------------------------------------------------------------------------
def test_base_quantization_names_a_target_it_cannot_quantise():
    from models import tiny_gpt2

    with pytest.raises(ValueError, match=r"`base_quantization`='nf4' quantises nn.Linear targets.*c_attn.*Conv1D"):
        get_peft_model(tiny_gpt2(), PoetConfig(block_size=16, base_quantization="nf4", target_modules=["c_attn"]))


def test_config_fields_are_validated_with_their_allowed_values():
    with pytest.raises(
        ValueError,
        match=r"`base_quantization` must be one of \(None, 'nf4', 'fp4', 'int8', 'nf4-shardable', 'int8-shardable'\)",
    ):
        PoetConfig(base_quantization="int4")
    with pytest.raises(ValueError, match=r"`requantize` must be one of \('feedback', 'nearest', 'stochastic'\)"):
        OftConfig(requantize="round")


def test_orthogonal_layers_refuse_a_quantised_base():
    from poet_hf import OrthogonalConfig

    with pytest.raises(ValueError, match="quantised Linear4bit.*OrthogonalConfig replaces W0"):
        get_peft_model(quantized_base("nf4"), OrthogonalConfig(target_modules=["up"]))


def test_a_missing_bitsandbytes_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    with pytest.raises(ImportError, match=r"pip install 'poet_hf\[quant\]'"):
        quant.quantize_linear(nn.Linear(64, 64), "nf4")


def test_fsdp2_refuses_quantised_bases_and_says_why():
    from poet_hf.training.distributed import shard_model

    model = get_peft_model(quantized_base("nf4"), PoetConfig(target_modules=TARGETS, block_size=32))
    with pytest.raises(ValueError, match="bitsandbytes.*cannot be sharded by FSDP2.*DDP"):
        shard_model(model)


@pytest.mark.parametrize("quantization", ["nf4", "int8"])
def test_a_trainer_run_on_a_quantised_w0_resumes_bit_for_bit(tmp_path, quantization):
    """QPOET pretraining through PoetTrainer (merges every 2 steps, error feedback): resuming from the step-3
    checkpoint into a differently seeded model ends where the uninterrupted run ends, codes, scales and residuals
    included."""
    from training_utils import state_hash, tiny_dataset, tiny_poet_model, tiny_trainer

    dataset, tokenizer = tiny_dataset()
    model = tiny_poet_model(len(tokenizer), base_quantization=quantization)
    assert all(layer.base_quantization == quantization for _, layer in rotation_layers(model))
    tiny_trainer(tmp_path / "full", model, dataset, save_strategy="steps", save_steps=3).train()
    assert all(quant.residual(layer.get_base_layer()) is not None for _, layer in rotation_layers(model))
    resumed = tiny_poet_model(len(tokenizer), seed=1, base_quantization=quantization)
    tiny_trainer(tmp_path / "resumed", resumed, dataset).train(
        resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-3")
    )
    assert state_hash(resumed) == state_hash(model)


@pytest.mark.slow
@pytest.mark.xdist_group("tiny_pretraining")
def test_tiny_pretraining_on_an_int8_w0_reaches_the_float32_perplexity(tiny_pretraining):
    """The README's main job, shortened (tests/conftest.py): an int8 W0 ends within 5 % of the float32 run's
    validation perplexity."""
    int8, float32 = tiny_pretraining("int8"), tiny_pretraining()
    assert int8["merges"] == 4
    assert int8["val_perplexity"] < int8["initial_val_perplexity"] / 5  # it trained
    assert abs(int8["val_perplexity"] / float32["val_perplexity"] - 1) < 0.05
