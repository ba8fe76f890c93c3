"""Default configs on any width: a block size that does not divide a side becomes its nearest divisor, with one warning,
recorded in the config so that save / reload is exact; on the real all-MiniLM-L6-v2 weights and a 576-wide LLaMA."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from models import tiny_llama
from peft import PeftModel, get_peft_model
from peft.tuners.oft.layer import OFTLayer
from transformers import AutoModel, LlamaForCausalLM

import poet_hf  # noqa: F401  (registers the tuners)
from poet_hf import OftConfig, PoetConfig
from poet_hf.orthogonal.spo import nearest_divisor
from poet_hf.tuners.rotation.block_sizes import BlockSizeAdjustedWarning
from poet_hf.tuners.rotation.layer import rotation_layers


def brute_force_nearest_divisor(dim: int, size: int) -> int:
    """The divisor d >= 2 of ``dim`` minimising (|d - size|, d); ``dim`` when ``size >= dim``."""
    if size >= dim:
        return dim
    return min((d for d in range(2, dim + 1) if dim % d == 0), key=lambda d: (abs(d - size), d))


def test_nearest_divisor_is_the_closest_divisor_above_one_and_agrees_with_peft():
    peft_rule = OFTLayer.adjust_oft_parameters
    for dim in range(2, 300):
        for size in range(2, dim + 8):
            got = nearest_divisor(dim, size)
            assert got == brute_force_nearest_divisor(dim, size), (dim, size)
            theirs = peft_rule(None, dim, size)
            if theirs > 1:  # PEFT may pick a 1-block (a 1×1 "rotation"), which we never do
                assert got == theirs, (dim, size)
    assert [nearest_divisor(d, 256) for d in (576, 384, 896, 1536)] == [288, 192, 224, 256]


def build(model_factory, config, *, expect_warning: bool):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = get_peft_model(model_factory(), config)
    adjusted = [w for w in caught if issubclass(w.category, BlockSizeAdjustedWarning)]
    assert len(adjusted) == (1 if expect_warning else 0)
    return model, (str(adjusted[0].message) if adjusted else "")


def train_steps(model, batches, steps: int = 5) -> None:
    """A few AdamW steps towards random targets of the first output (logits or hidden states)."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    for step in range(steps):
        output = model(**batches[step % len(batches)])[0]
        loss = (output - torch.linspace(-1, 1, output.shape[-1])).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()


def check_exact_round_trip(model, model_factory, batches, tmp_path) -> None:
    """Saved and loaded onto a fresh base: the same block sizes, no warning, bit-identical outputs; and the trained
    adapter is not the identity (so an unused adapter could not pass)."""
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "adapter_config.json").read_text())["block_size_pattern"]
    assert saved == model.peft_config["default"].block_size_pattern
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reloaded = PeftModel.from_pretrained(model_factory(), tmp_path).eval()
    assert not [w for w in caught if issubclass(w.category, BlockSizeAdjustedWarning)]
    for (name, a), (_, b) in zip(rotation_layers(model), rotation_layers(reloaded), strict=True):
        assert {s: (x.kind, x.block) for s, x in a.sides("default").items()} == {
            s: (x.kind, x.block) for s, x in b.sides("default").items()
        }, name
    base = model_factory().eval()
    with torch.no_grad():
        for batch in batches:
            ours, theirs = model(**batch)[0], reloaded(**batch)[0]
            assert torch.equal(ours, theirs)
            assert (ours - base(**batch)[0]).abs().max() > 1e-4


@pytest.fixture(scope="module")
def minilm_dir():
    from benchmarks import testbed

    return testbed.ensure_encoder()


def text_batches(vocab: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, vocab, (2, 16), generator=generator)} for _ in range(2)]


@pytest.mark.slow
def test_default_poet_config_fits_the_real_minilm_encoder_and_reloads_exactly(minilm_dir, tmp_path):
    def factory():
        return AutoModel.from_pretrained(minilm_dir)

    model, message = build(factory, PoetConfig(), expect_warning=True)
    # Width 384: 256 does not divide it, its nearest divisor 192 is used; the 1536-wide FFN side keeps 256.
    for name, layer in rotation_layers(model):
        for side, spec in layer.sides("default").items():
            assert spec.block == (192 if spec.dim == 384 else 256), (name, side)
    assert "encoder.layer.0.attention.self.query" in message and "encoder.layer.5.output.dense" in message
    assert "input side 384 -> block 192: 30 layer(s)" in message  # q, k, v, o and the FFN's first layer, × 6
    assert "output side 384 -> block 192: 30 layer(s)" in message  # q, k, v, o and the FFN's second layer, × 6
    pattern = model.peft_config["default"].block_size_pattern
    assert pattern["encoder.layer.0.intermediate.dense"] == {"input": 192}
    assert pattern["encoder.layer.0.output.dense"] == {"output": 192}
    batches = text_batches(model.config.vocab_size)
    train_steps(model, batches)
    check_exact_round_trip(model, factory, batches, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("block_size", [32, 256])
def test_oft_config_on_the_real_minilm_encoder(minilm_dir, tmp_path, block_size):
    """OftConfig()'s 32 divides every side (no warning); 256 is fitted to 192 on the 384-wide inputs."""

    def factory():
        return AutoModel.from_pretrained(minilm_dir)

    model, message = build(factory, OftConfig(block_size=block_size), expect_warning=block_size == 256)
    blocks = {spec.dim: spec.block for _, layer in rotation_layers(model) for spec in layer.sides("default").values()}
    assert blocks == ({384: 32, 1536: 32} if block_size == 32 else {384: 192, 1536: 256})
    if message:
        assert "encoder.layer.3.attention.output.dense" in message
    batches = text_batches(model.config.vocab_size)
    train_steps(model, batches)
    check_exact_round_trip(model, factory, batches, tmp_path)


def smollm_shaped_llama() -> LlamaForCausalLM:
    """SmolLM-135M's widths (hidden 576, 9 heads of 64, 3 KV heads: k/v project to 192; FFN 1536), two layers."""
    return tiny_llama(hidden=576, intermediate=1536, heads=9, kv_heads=3)


@pytest.mark.parametrize("config_cls", [PoetConfig, OftConfig])
def test_default_configs_fit_a_576_wide_llama_and_reload_exactly(tmp_path, config_cls):
    model, message = build(smollm_shaped_llama, config_cls(), expect_warning=config_cls is PoetConfig)
    if config_cls is PoetConfig:
        assert "output side 192 -> block 192: 4 layer(s)" in message  # k_proj, v_proj × 2 layers
        assert "model.layers.1.self_attn.k_proj" in message
        for name, layer in rotation_layers(model):
            for spec in layer.sides("default").values():
                assert spec.block == {576: 288, 192: 192, 1536: 256}[spec.dim], name
    batches = text_batches(128)
    train_steps(model, batches, steps=3)
    check_exact_round_trip(model, smollm_shaped_llama, batches, tmp_path)


def test_strict_block_size_and_a_bad_pattern_are_errors_naming_the_field():
    with pytest.raises(ValueError, match="`block_size`=256 does not divide the 576-dimensional input side.*strict"):
        get_peft_model(smollm_shaped_llama(), PoetConfig(strict_block_size=True))
    name = "model.layers.0.mlp.down_proj"
    with pytest.raises(ValueError, match=r"`block_size_pattern\['model.layers.0.mlp.down_proj'\]`=\{'input': 100\}"):
        get_peft_model(smollm_shaped_llama(), PoetConfig(block_size_pattern={name: {"input": 100}}))
    with pytest.raises(ValueError, match="`block_size_pattern"):
        OftConfig(block_size_pattern={name: 1})


def test_a_pattern_entry_sets_one_layer_and_r_is_fitted_as_a_number_of_blocks():
    name = "model.layers.0.mlp.down_proj"
    model, _ = build(smollm_shaped_llama, OftConfig(block_size_pattern={name: 64}), expect_warning=False)
    sizes = {
        n.removeprefix("base_model.model."): layer.sides("default")["input"].block
        for n, layer in rotation_layers(model)
    }
    assert sizes[name] == 64 and sizes["model.layers.1.mlp.down_proj"] == 32
    # r = 5 blocks of a 64-wide input: the nearest divisor of 64 to 5 is 4 (a tie with 8 goes to the smaller).
    model, message = build(tiny_llama, OftConfig(r=5, block_size=0), expect_warning=True)
    assert "`r`=5 does not divide" in message
    sizes = {
        layer.sides("default")["input"].dim: layer.sides("default")["input"].block
        for _, layer in rotation_layers(model)
    }
    assert sizes == {64: 16, 128: 32}  # 64/4 and 128/4


def test_an_adjusted_side_is_recorded_beside_the_size_given_for_the_other():
    name = "model.layers.0.mlp.down_proj"  # 1536 in, 576 out: 256 divides the input, not the output
    model, _ = build(smollm_shaped_llama, PoetConfig(block_size_pattern={name: {"input": 192}}), expect_warning=True)
    assert model.peft_config["default"].block_size_pattern[name] == {"input": 192, "output": 288}
    layer = dict(rotation_layers(model))[f"base_model.model.{name}"]
    assert {side: spec.block for side, spec in layer.sides("default").items()} == {"input": 192, "output": 288}
