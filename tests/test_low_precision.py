"""Training the way GPU users do, on this CPU: 16-bit bases, bf16/fp16 autocast, gradient checkpointing.

References: float64 dense rotations (tests/helpers/reference.py) for the merges, the float64 run without checkpointing
for the recomputed gradients, the float32 run for mixed precision, and the rounding bounds of
tests/helpers/tolerances.py."""

from __future__ import annotations

import math

import pytest
import torch
from layer_reference import dense_side
from models import tiny_llama
from peft import PeftModel, get_peft_model
from testbed_runs import run_on_testbed
from tolerances import gamma, tiny_model_tolerance, unit_roundoff
from torch import nn
from transformers import AutoModelForCausalLM

import poet_hf  # noqa: F401
from poet_hf import OftConfig, PoetConfig, merge_and_reinit
from poet_hf.orthogonal import random_skew_params
from poet_hf.tuners.rotation import residual_store
from poet_hf.tuners.rotation.layer import rotation_layers
from poet_hf.tuners.rotation.low_precision import ROUNDING_RESIDUAL

HALF_DTYPES = [torch.bfloat16, torch.float16]
IDS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(2))


def residual_codes(layer) -> torch.Tensor:
    """The int8 rounding-residual codes kept for ``layer``'s base, wherever they are stored."""
    return residual_store.read(layer.get_base_layer(), (ROUNDING_RESIDUAL,))[ROUNDING_RESIDUAL]


# --- merges into a 16-bit W0 ------------------------------------------------------------------------------------------
def merge_drift(dtype: torch.dtype, requantize: str, merges: int = 50, dim: int = 64) -> float:
    """``‖W0 − W_exact‖_F / ‖fl(W_exact) − W_exact‖_F`` after ``merges`` folds of rotations of the size measured in
    training (‖Q‖₂ = 0.17 per side), ``W_exact`` the float64 path from the same start: the error in units of one
    rounding of the exact weight to ``dtype``."""
    torch.manual_seed(0)
    holder = nn.Module()
    holder.proj = nn.Linear(dim, dim, bias=False).to(dtype)
    model = get_peft_model(holder, PoetConfig(target_modules=["proj"], block_size=16, requantize=requantize))
    layer = rotation_layers(model)[0][1]
    exact = layer.weight_matrix().double()
    generator = torch.Generator().manual_seed(1)
    for _ in range(merges):
        with torch.no_grad():
            for side, spec in layer.sides("default").items():
                param = layer.rotation_parameter("default", side)
                param.copy_(random_skew_params(param.shape, spec.block, generator, 0.17))
            exact = dense_side(layer, "output").T @ exact @ dense_side(layer, "input").T
            merge_and_reinit(model)
    stored = layer.weight_matrix().double()
    return float((stored - exact).norm() / (exact.to(dtype).double() - exact).norm())


@pytest.mark.numerics
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_error_feedback_keeps_50_merges_into_a_16bit_w0_within_one_rounding(dtype):
    merges = 50
    feedback, nearest = merge_drift(dtype, "feedback", merges), merge_drift(dtype, "nearest", merges)
    # Feedback: the stored weight is one rounding of the exact path, plus what the int8 residual codes dropped, at
    # most ulp/508 per entry per fold, against a rounding error of ulp/√12 per entry in the mean: ≤ 1 + K·√12/508;
    # 0.05 more for the sampling of 64² roundings (a relative spread of about 1/64).
    assert feedback <= 1 + merges * math.sqrt(12) / 508 + 0.05
    # Nearest: K independent roundings add up like a random walk, √K roundings (measured: 7.1 at 512² in the suite).
    assert nearest > 0.5 * math.sqrt(merges)


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_a_16bit_base_trains_in_float32_skews_merges_reloads_exactly_and_exports(dtype, tmp_path):
    from poet_hf.export import export_merged

    tiny_llama().save_pretrained(tmp_path / "base")

    def load_base():
        return AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=dtype)

    model = get_peft_model(load_base(), PoetConfig(block_size=16))
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert {p.dtype for p in trainable} == {torch.float32}  # as PEFT's autocast_adapter_dtype
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    model.train()
    losses = []
    for step in range(6):
        loss = model(input_ids=IDS, labels=IDS).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
        if step == 2:
            merge_and_reinit(model)
    assert losses[-1] < losses[0] - 0.05
    assert {s.dtype for state in optimizer.state.values() for s in state.values() if s.ndim} == {torch.float32}
    layers = rotation_layers(model)
    assert all(layer.get_base_layer().weight.dtype == dtype for _, layer in layers)
    assert all(residual_codes(layer).dtype == torch.int8 for _, layer in layers)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=IDS).logits
    model.save_pretrained(tmp_path / "adapter")
    reloaded = PeftModel.from_pretrained(load_base(), tmp_path / "adapter")
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=IDS).logits, logits)  # W0, its residual and the skews all travel
    for (name, layer), (_, again) in zip(layers, rotation_layers(reloaded), strict=True):
        assert torch.equal(residual_codes(again), residual_codes(layer)), name

    export_merged(model, tmp_path / "export", spectrum=False)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    exported = dict(plain.named_parameters())
    for name, layer in layers:
        key = name.removeprefix("base_model.model.") + ".weight"
        weight = layer.weight_matrix().double() + layer.frozen.residual().double()
        folded = dense_side(layer, "output").T @ weight @ dense_side(layer, "input").T
        got = exported[key].double()
        assert exported[key].dtype == dtype
        # One rounding to `dtype` of a fold computed in float32: half a step of the larger neighbour, plus the
        # float32 sums of the fold (two 16-term block products).
        slack = (
            2
            * gamma(33, torch.float32)
            * (dense_side(layer, "output").abs().T @ weight.abs() @ dense_side(layer, "input").abs().T)
        )
        bound = unit_roundoff(dtype) * 2 * folded.abs() + slack + torch.finfo(dtype).smallest_normal
        assert bool(((got - folded).abs() <= bound).all()), key


# --- gradient checkpointing -------------------------------------------------------------------------------------------
@pytest.mark.numerics
@pytest.mark.parametrize("config_cls", [PoetConfig, OftConfig], ids=["poet", "oft"])
def test_gradient_checkpointing_gives_the_gradients_of_the_run_without_it_in_float64(config_cls):
    results = []
    for checkpointing in (False, True):
        model = get_peft_model(tiny_llama().double(), config_cls(block_size=16, init_weights=False))
        model.train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        loss = model(input_ids=IDS, labels=IDS).loss
        loss.backward()
        results.append((loss, {n: p.grad for n, p in model.named_parameters() if p.requires_grad}))
    (loss, grads), (loss_checkpointed, grads_checkpointed) = results
    assert grads.keys() == grads_checkpointed.keys() and len(grads) > 0
    # The recomputed forward is the same float64 arithmetic, at worst in another summation order.
    tolerance = tiny_model_tolerance(torch.float64, backward=True)
    assert abs(float(loss - loss_checkpointed)) <= tolerance * abs(float(loss))
    for name, grad in grads.items():
        scale = float(grad.abs().max())
        torch.testing.assert_close(grads_checkpointed[name], grad, rtol=0, atol=tolerance * scale)


# --- mixed precision --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_an_autocast_loop_with_a_loss_scaler_trains_like_float32(dtype):
    """A hand-written loop: ``torch.autocast`` and (for float16) ``torch.amp.GradScaler``, as a GPU user writes it."""
    final = {}
    for precision in (torch.float32, dtype):
        base = tiny_llama()
        base.set_attn_implementation("eager")  # torch's bf16 SDPA kernels for CPUs need AVX-512; eager runs anywhere
        model = get_peft_model(base, PoetConfig(block_size=16))
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=1e-2)
        scaler = torch.amp.GradScaler("cpu", enabled=precision == torch.float16)
        model.train()
        for _ in range(8):
            with torch.autocast("cpu", dtype=precision, enabled=precision != torch.float32):
                loss = model(input_ids=IDS, labels=IDS).loss
            scaler.scale(loss).backward()
            assert all(p.grad.dtype == torch.float32 for p in trainable)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
        with torch.no_grad():
            final[precision] = float(model(input_ids=IDS, labels=IDS).loss)
        assert {p.dtype for p in trainable} == {torch.float32}
    start = float(get_peft_model(tiny_llama(), PoetConfig(block_size=16))(input_ids=IDS, labels=IDS).loss)
    gain = start - final[torch.float32]
    assert gain > 0.1
    # Measured: the 16-bit runs end within 0.01 % of the float32 run's gain (the skews, their Adam states and the
    # rotation polynomial stay float32; only the products round); 1 % allowed.
    assert abs(final[dtype] - final[torch.float32]) <= 0.01 * gain


@pytest.mark.testbed
@pytest.mark.skipif(
    not torch.backends.cpu.get_cpu_capability().startswith("AVX512"),
    reason="--bf16 on a CPU needs AVX-512 (check_cpu_mixed_precision refuses it otherwise)",
)
@pytest.mark.parametrize("method", ["poet", "oft"])
def test_trainer_bf16_fine_tunes_the_testbed_like_float32(testbed, tmp_path, method):
    results = {}
    for bf16 in (False, True):
        results[bf16], _ = run_on_testbed(testbed, tmp_path / str(bf16), method=method, max_steps=20, bf16=bf16)
    gain = results[False]["before"]["loss"] - results[False]["after"]["loss"]
    assert gain > 0.1
    # The evaluation before training already runs in bf16: the autocast is on, not silently float32.
    assert results[True]["before"]["loss"] != results[False]["before"]["loss"]
    # Measured on this testbed: bf16 ends within 0.1 % of the float32 gain (POET 0.03 %, OFT 0.09 %); 1 % allowed.
    assert abs(results[True]["after"]["loss"] - results[False]["after"]["loss"]) <= 0.01 * gain


@pytest.mark.testbed
def test_an_fp16_autocast_loop_with_a_scaler_fine_tunes_the_testbed_like_float32(testbed):
    """Trainer's --fp16 needs a GPU; a hand-written loop runs fp16 autocast with a GradScaler on the CPU too."""
    from poet_hf.data import load_corpus, load_tokenizer, pack_sequences

    model_path, corpus_path = testbed
    tokenizer = load_tokenizer(str(model_path))
    rows = pack_sequences(load_corpus(str(corpus_path))["train"], tokenizer, seq_len=128)
    ids = torch.tensor(rows[:8]["input_ids"])
    final = {}
    for precision in (torch.float32, torch.float16):
        base = AutoModelForCausalLM.from_pretrained(model_path, attn_implementation="eager")
        model = get_peft_model(base, PoetConfig.for_finetuning()).train()
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-4)
        scaler = torch.amp.GradScaler("cpu", enabled=precision == torch.float16)
        for step in range(10):
            batch = ids[(step % 2) * 4 : (step % 2) * 4 + 4]
            with torch.autocast("cpu", dtype=precision, enabled=precision != torch.float32):
                loss = model(input_ids=batch, labels=batch).loss
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
        with torch.no_grad():
            final[precision] = float(model(input_ids=ids, labels=ids).loss)
    start = float(
        get_peft_model(AutoModelForCausalLM.from_pretrained(model_path), PoetConfig.for_finetuning())(
            input_ids=ids, labels=ids
        ).loss
    )
    gain = start - final[torch.float32]
    assert gain > 0.05
    # Measured: fp16 ends within 0.02 % of the float32 gain (0.30); 1 % allowed.
    assert abs(final[torch.float16] - final[torch.float32]) <= 0.01 * gain
