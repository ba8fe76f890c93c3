"""A 4-bit ``W0`` that does not depend on bitsandbytes' storage layout.

On a CPU with AVX512-BF16, bitsandbytes repacks a ``Linear4bit`` for its CPU kernels at the first forward in eval mode
without gradients, and rounds the layer's scales to bfloat16 while doing so. The references here are a fresh load of
the same checkpoint, dequantised by bitsandbytes' own function (``peft.utils.integrations.dequantize_bnb_weight``), and
the rounding bound of one bfloat16 rounding of each block's scale (2⁻⁸ of it).
"""

from __future__ import annotations

import bitsandbytes  # noqa: F401  (the `quant` extra, part of `dev`: these tests run, they never skip)
import pytest
import torch
from bitsandbytes.functional import _convert_weight_packed_for_cpu
from models import tiny_llama
from peft import PeftModel, get_peft_model
from peft.utils.integrations import dequantize_bnb_weight
from tolerances import tiny_model_tolerance, unit_roundoff
from transformers import AutoModelForCausalLM

from poet_hf import PoetConfig, keep_quantized_layout, merge_and_reinit
from poet_hf.tuners.rotation import dense_reload
from poet_hf.tuners.rotation import quantization as quant
from poet_hf.tuners.rotation.layer import rotation_layers

IDS = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("base")
    tiny_llama().save_pretrained(folder)
    return folder


def load_nf4(folder, double_quant: bool = True):
    config = quant.bits_and_bytes_config("nf4", double_quant=double_quant)
    return AutoModelForCausalLM.from_pretrained(folder, quantization_config=config).eval()


def fresh_weights(folder, double_quant: bool = True) -> dict[str, torch.Tensor]:
    """Every 4-bit layer's weight as a fresh load holds it, dequantised by bitsandbytes, float64."""
    model = load_nf4(folder, double_quant)
    return {
        name: dequantize_bnb_weight(m.weight, state=m.weight.quant_state).double()
        for name, m in model.named_modules()
        if quant.is_bnb_module(m)
    }


def adapter_weights(model) -> dict[str, torch.Tensor]:
    return {
        name.removeprefix("base_model.model."): layer.weight_matrix().double() for name, layer in rotation_layers(model)
    }


def train_a_little(model) -> None:
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    for _ in range(3):
        model(input_ids=IDS, labels=IDS).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()


@pytest.mark.parametrize("double_quant", [True, False])
def test_an_inference_forward_before_wrapping_leaves_w0_the_checkpoints(checkpoint, double_quant):
    model = load_nf4(checkpoint, double_quant)
    assert keep_quantized_layout(model) == 14  # 7 projections in each of the 2 blocks
    for module in model.modules():
        if quant.is_bnb_module(module):
            assert not module.support_avx512bf16_for_cpu
    with torch.no_grad():
        plain = model(input_ids=IDS).logits  # would repack every layer on an AVX512-BF16 CPU
    assert not any(
        getattr(m.weight, "quant_state", None).packing_format_for_cpu
        for m in model.modules()
        if quant.is_bnb_module(m) and hasattr(m.weight.quant_state, "packing_format_for_cpu")
    )
    wrapped = get_peft_model(model, PoetConfig(block_size=16))
    expected = fresh_weights(checkpoint, double_quant)
    got = adapter_weights(wrapped)
    assert got.keys() == expected.keys()
    for name, weight in got.items():
        assert torch.equal(weight, expected[name]), name  # the same codes and scales: bit for bit
    with torch.no_grad():
        identity = wrapped(input_ids=IDS).logits
    # The identity adapter computes the base's products in another order (its fused kernel).
    scale = float(plain.abs().max())
    torch.testing.assert_close(identity, plain, rtol=0, atol=tiny_model_tolerance(torch.float32) * scale)


@pytest.mark.parametrize("double_quant", [True, False])
def test_a_base_repacked_before_wrapping_warns_keeps_its_layout_and_reloads_exactly(checkpoint, tmp_path, double_quant):
    model = load_nf4(checkpoint, double_quant)
    for module in model.modules():  # what bitsandbytes' CPU inference forward does on an AVX512-BF16 machine
        if quant.is_bnb_module(module):
            module.weight.data, module.weight.quant_state = _convert_weight_packed_for_cpu(
                module.weight.data, module.weight.quant_state
            )
    with pytest.warns(quant.QuantizedBaseRepackedWarning, match="keep_quantized_layout"):
        wrapped = get_peft_model(model, PoetConfig(block_size=16))
    expected = fresh_weights(checkpoint, double_quant)
    gaps = []
    for name, weight in adapter_weights(wrapped).items():
        truth = expected[name]
        block_scale = truth.reshape(-1, 64).abs().amax(dim=1, keepdim=True)
        gap = (weight - truth).reshape(-1, 64).abs()
        # One bfloat16 rounding of each block scale: |Δs| ≤ u·s (u = 2⁻⁸), and every code is at most 1 in size.
        assert bool((gap <= unit_roundoff(torch.bfloat16) * block_scale * (1 + 1e-6)).all()), name
        gaps.append(float(gap.max()))
    assert max(gaps) > 0  # the repacking did round: this is the case the warning is for
    train_a_little(wrapped)
    with torch.no_grad():
        logits = wrapped(input_ids=IDS).logits
    wrapped.save_pretrained(tmp_path / "adapter")
    reloaded = PeftModel.from_pretrained(load_nf4(checkpoint, double_quant), tmp_path / "adapter")
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=IDS).logits, logits)  # the W0 it trained on travels with it


def load_int8(folder):
    return AutoModelForCausalLM.from_pretrained(folder, quantization_config=quant.bits_and_bytes_config("int8")).eval()


def test_a_4bit_trained_adapter_without_merges_loads_onto_the_full_precision_base_as_qlora(checkpoint, tmp_path):
    """The QLoRA habit: train on 4-bit, serve on full precision. The adapter saved the repacked 4-bit ``W0``; with no
    merge folded in, the full-precision base keeps the checkpoint's ``W0`` and takes the trained rotations."""
    model = load_nf4(checkpoint)
    for module in model.modules():
        if quant.is_bnb_module(module):
            module.weight.data, module.weight.quant_state = _convert_weight_packed_for_cpu(
                module.weight.data, module.weight.quant_state
            )
    with pytest.warns(quant.QuantizedBaseRepackedWarning):
        wrapped = get_peft_model(model, PoetConfig(block_size=16))
    train_a_little(wrapped)
    wrapped.save_pretrained(tmp_path / "adapter")
    trained = {k: v.detach().clone() for k, v in wrapped.named_parameters() if v.requires_grad}
    assert any(float(v.abs().max()) > 0 for v in trained.values())
    full = AutoModelForCausalLM.from_pretrained(checkpoint)
    checkpoint_weights = {k: v.clone() for k, v in full.state_dict().items()}
    with pytest.warns(dense_reload.QuantizedAdapterBaseWarning, match="base-agnostic"):
        reloaded = PeftModel.from_pretrained(full, tmp_path / "adapter")
    for name, layer in rotation_layers(reloaded):
        key = name.removeprefix("base_model.model.") + ".weight"
        assert torch.equal(layer.get_base_layer().weight, checkpoint_weights[key]), key  # the checkpoint's own W0
    loaded = dict(reloaded.named_parameters())
    for name, value in trained.items():
        assert torch.equal(loaded[name], value), name  # the trained rotations, bit for bit


@pytest.mark.parametrize(
    "loader,fields",
    [(load_nf4, {"merge_every": 1}), (load_int8, {"merge_every": 1}), (load_int8, {"base_init": "normalized"})],
    ids=["nf4-merged", "int8-merged", "int8-base_init"],
)
def test_a_quantized_adapter_with_its_own_w0_loads_it_onto_the_full_precision_base(
    checkpoint, tmp_path, loader, fields
):
    """With merges folded into the quantised ``W0``, or a ``W0`` POET re-initialised, the adapter's ``W0`` is part of
    the training: the full-precision base takes it dequantised, and computes what the quantised model computed."""
    wrapped = get_peft_model(loader(checkpoint), PoetConfig(block_size=16, **fields))
    train_a_little(wrapped)
    if "merge_every" in fields:
        merge_and_reinit(wrapped)
        train_a_little(wrapped)
    with torch.no_grad():
        logits = wrapped(input_ids=IDS).logits
    dequantized = {
        name.removeprefix("base_model.model."): dequantize_bnb_weight(
            (base := layer.get_base_layer()).weight, state=getattr(base.weight, "quant_state", None) or base.state
        ).float()
        for name, layer in rotation_layers(wrapped)
    }
    wrapped.save_pretrained(tmp_path / "adapter")
    full = AutoModelForCausalLM.from_pretrained(checkpoint)
    with pytest.warns(dense_reload.QuantizedAdapterBaseWarning, match="carries its own W0"):
        reloaded = PeftModel.from_pretrained(full, tmp_path / "adapter")
    for name, layer in rotation_layers(reloaded):
        key = name.removeprefix("base_model.model.")
        assert torch.equal(layer.get_base_layer().weight, dequantized[key]), key
    with torch.no_grad():
        got = reloaded(input_ids=IDS).logits
    # The same W0 and rotations; the quantised forward dequantises in another order of the same products.
    scale = float(logits.abs().max())
    torch.testing.assert_close(got, logits, rtol=0, atol=tiny_model_tolerance(torch.float32) * scale)
