"""A POET layer's ``W0`` kept in its block coordinates between merges: the fused forward reads ``Ψ_P · W0 · Ψ_Rᵀ``,
and every public path that reads ``W0`` sees the natural one (a copy taken before any forward, bit for bit)."""

import copy

import pytest
import torch
from models import tiny_llama
from peft import get_peft_model

import poet_hf  # noqa: F401
from poet_hf import PoetConfig, merge_and_reinit
from poet_hf.tuners.rotation import block_coordinates
from poet_hf.tuners.rotation.layer import restore_natural_coordinates, rotation_layers

pytestmark = pytest.mark.numerics


def _model(spo: str = "block", seed: int = 0) -> torch.nn.Module:
    """A float64 tiny LLaMA with non-identity POET rotations on three linear layers of each block."""
    targets = ["q_proj", "up_proj", "down_proj"]
    config = PoetConfig(spo=spo, block_size=8, init_weights=False, target_modules=targets, seed=seed)
    return get_peft_model(tiny_llama(seed=0).double(), config)


def _natural(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: layer.get_base_layer().weight.detach().clone() for name, layer in rotation_layers(model)}


def _stored_form(layer, natural: torch.Tensor) -> torch.Tensor:
    """``Ψ_P · W0 · Ψ_Rᵀ`` by plain indexing: rows by the output permutation, columns by the input one."""
    return natural[layer.index_buffer("default", "output")][:, layer.index_buffer("default", "input")]


def _loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


IDS = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))


def test_the_fused_forward_stores_w0_permuted_and_gives_the_natural_layers_loss_and_gradients():
    model = _model()
    natural = _natural(model)
    reference = copy.deepcopy(model)
    for _, layer in rotation_layers(reference):
        layer.stores_block_coordinates = False  # the same layer keeping W0 as it is
    loss = _loss(model, IDS)
    loss.backward()
    expected = _loss(reference, IDS)
    expected.backward()
    for name, layer in rotation_layers(model):
        assert layer.coordinates.adapter == "default"
        assert torch.equal(layer.get_base_layer().weight, _stored_form(layer, natural[name]))
        assert not torch.equal(layer.get_base_layer().weight, natural[name])
    # Another summation order: equal to float64 rounding, not bit for bit.
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=0)
    grads = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    for n, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(p.grad, grads[n], rtol=1e-10, atol=1e-13)


def test_every_public_path_reads_the_natural_w0(monkeypatch):
    monkeypatch.setattr(block_coordinates, "ROWS_PER_COPY", 5)  # the columns permuted a few rows at a time
    model = _model()
    natural = _natural(model)
    _loss(model, IDS)
    state = model.state_dict()
    for name, _ in rotation_layers(model):
        assert torch.equal(state[f"{name}.base_layer.weight"], natural[name])  # restored in place, bit for bit
    _loss(model, IDS)  # stored again
    for name, layer in rotation_layers(model):
        assert layer.coordinates.adapter == "default"
        assert torch.equal(layer.weight_matrix(), natural[name])
    _loss(model, IDS)
    with model.disable_adapter():
        plain = _loss(model, IDS)
    base = tiny_llama(seed=0).double()
    base_state = {
        n.replace("base_model.model.", "").replace(".base_layer", ""): t for n, t in model.state_dict().items()
    }
    base.load_state_dict({n: t for n, t in base_state.items() if n in base.state_dict()})
    assert torch.equal(plain, _loss(base, IDS))
    _loss(model, IDS)
    unloaded = copy.deepcopy(model).unload()
    for name, _ in rotation_layers(model):
        module = unloaded.get_submodule(name.replace("base_model.model.", ""))
        assert torch.equal(module.weight, natural[name])


def test_a_merge_folds_the_natural_w0_and_stores_the_next_permutations():
    model = _model()
    natural = _natural(model)
    _loss(model, IDS)
    folded = {name: layer.effective_weight_matrix(dtype=torch.float64) for name, layer in rotation_layers(model)}
    _loss(model, IDS)
    merge_and_reinit(model)
    for name, layer in rotation_layers(model):
        assert layer.coordinates.adapter is None
        assert torch.equal(layer.get_base_layer().weight, folded[name])
        assert not torch.equal(folded[name], natural[name])
    _loss(model, IDS)
    for name, layer in rotation_layers(model):  # the permutations drawn by the merge
        assert torch.equal(layer.get_base_layer().weight, _stored_form(layer, folded[name]))


def test_a_saved_and_loaded_model_and_a_deleted_adapter_see_the_natural_w0():
    model = _model()
    natural = _natural(model)
    _loss(model, IDS)
    other = _model(seed=1)
    _loss(other, IDS)  # stored in other permutations before the load overwrites them and W0
    other.load_state_dict(model.state_dict())
    for name, layer in rotation_layers(other):
        assert torch.equal(layer.weight_matrix(), natural[name])
    torch.testing.assert_close(_loss(other, IDS), _loss(model, IDS), rtol=0, atol=0)
    model.base_model.delete_adapter("default")
    for name, layer in rotation_layers(model):
        assert torch.equal(layer.get_base_layer().weight, natural[name])


def test_full_sides_and_explicit_restores_leave_w0_as_it_is():
    model = _model("full")
    natural = _natural(model)
    _loss(model, IDS)
    for name, layer in rotation_layers(model):  # a fully stochastic side works in natural coordinates
        assert layer.coordinates.adapter is None
        assert torch.equal(layer.get_base_layer().weight, natural[name])
    block = _model()
    block_natural = _natural(block)
    _loss(block, IDS)
    restore_natural_coordinates(block)
    for name, layer in rotation_layers(block):
        assert torch.equal(layer.get_base_layer().weight, block_natural[name])
