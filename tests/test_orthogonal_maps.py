"""The orthogonal-map seam: every registered map against dense float64 references, and POET and OFT on the
Householder-product map (HRA's), the proof that a map is one file and one registry line."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import pytest
import torch
from models import tiny_llama
from peft import PeftModel, get_peft_model
from reference import block_rotation_dense, cayley_inverse, householder_dense, neumann_series, skew_dense
from tolerances import gamma, tiny_model_tolerance

from poet_hf import OftConfig, PoetConfig, merge_and_reinit
from poet_hf.diagnostics import rotation_stats
from poet_hf.export import export_peft_adapter
from poet_hf.export.source import ExportError
from poet_hf.orthogonal import MAPS, CayleyNeumann, HouseholderProduct, OrthogonalMap, map_from_config
from poet_hf.orthogonal import maps as map_registry
from poet_hf.orthogonal.cayley import skew_from_vector
from poet_hf.orthogonal.map_protocol import AutogradEvaluation
from poet_hf.training.zero import check_zero_resettable
from poet_hf.tuners.rotation.layer import rotation_layers
from poet_hf.tuners.rotation.model import plain_autograd

pytestmark = pytest.mark.numerics

B = 6  # block side of the map-level checks
MAPS_UNDER_TEST = [CayleyNeumann(0), CayleyNeumann(6), HouseholderProduct(), HouseholderProduct(4, wy_block=2)]
IDS = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))


def block_tolerance(b: int) -> float:
    """A block is a chain of at most ``b`` products of ``b × b`` matrices (reflections, polynomial terms or an LU
    solve), each entry a sum of ``b`` terms: within ``γ_{b·b}`` per product of unit-size factors."""
    return 4 * b * gamma(b * b, torch.float64)


def dense_block(orthogonal_map: OrthogonalMap, row: torch.Tensor, b: int) -> torch.Tensor:
    """One block from the map's definition: reflection matrices multiplied in order, an explicit inverse, or the
    series by explicit powers (tests/helpers/reference.py)."""
    if isinstance(orthogonal_map, HouseholderProduct):
        return householder_dense(row, b)
    q = skew_dense(row, b)
    return cayley_inverse(q) if orthogonal_map.terms == 0 else neumann_series(q, orthogonal_map.terms)


def params(orthogonal_map: OrthogonalMap, rows: int, op_norm: float = 0.3, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    shape = (rows, orthogonal_map.num_params(B))
    return orthogonal_map.random_params(shape, B, generator, op_norm).double()


@pytest.mark.parametrize("orthogonal_map", MAPS_UNDER_TEST, ids=str)
def test_blocks_equal_the_dense_float64_definition_on_both_paths(orthogonal_map):
    vec = params(orthogonal_map, 3)
    dense = torch.stack([dense_block(orthogonal_map, row, B) for row in vec])
    tolerance = block_tolerance(B)
    torch.testing.assert_close(orthogonal_map.blocks(vec, B), dense, rtol=0, atol=tolerance)
    torch.testing.assert_close(orthogonal_map.reference_blocks(vec, B), dense, rtol=0, atol=tolerance)
    torch.testing.assert_close(orthogonal_map.evaluate(vec, B).rotation, dense, rtol=0, atol=tolerance)


@pytest.mark.parametrize("orthogonal_map", MAPS_UNDER_TEST, ids=str)
def test_the_vector_jacobian_product_is_the_transposed_jacobian_of_the_definition(orthogonal_map):
    vec = params(orthogonal_map, 2, seed=1)
    grad_r = torch.randn(2, B, B, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    jacobian = torch.autograd.functional.jacobian(
        lambda v: torch.stack([dense_block(orthogonal_map, row, B) for row in v]), vec
    )  # (2, B, B, 2, n), materialized from the definition
    expected = torch.einsum("ijk,ijkmn->mn", grad_r, jacobian)
    got = orthogonal_map.evaluate(vec, B).vector_vjp(grad_r)
    torch.testing.assert_close(got, expected, rtol=0, atol=block_tolerance(B) * float(expected.abs().max()))
    (through_blocks,) = torch.autograd.grad(orthogonal_map.blocks(vec.requires_grad_(), B), vec, grad_r)
    torch.testing.assert_close(through_blocks, expected, rtol=0, atol=block_tolerance(B) * float(expected.abs().max()))


@pytest.mark.parametrize("orthogonal_map", MAPS_UNDER_TEST, ids=str)
def test_identity_parameters_give_the_identity_and_random_ones_do_not(orthogonal_map):
    shape = (3, orthogonal_map.num_params(B))
    for seed in (0, 1):
        start = orthogonal_map.identity_params(shape, B, torch.Generator().manual_seed(seed)).double()
        blocks = orthogonal_map.blocks(start, B)
        torch.testing.assert_close(blocks, torch.eye(B, dtype=torch.float64).expand(3, B, B), rtol=0, atol=1e-14)
        assert bool((start == 0).all()) == orthogonal_map.zero_is_identity
    moved = orthogonal_map.blocks(params(orthogonal_map, 3), B)
    assert float((moved - torch.eye(B, dtype=torch.float64)).abs().amax((-2, -1)).min()) > 1e-2


@pytest.mark.parametrize("orthogonal_map", MAPS_UNDER_TEST, ids=str)
def test_generator_norms_are_the_cayley_generators_of_the_blocks_and_bound_the_singular_values(orthogonal_map):
    vec = params(orthogonal_map, 3, op_norm=0.5, seed=3)
    blocks = torch.stack([dense_block(orthogonal_map, row, B) for row in vec])
    eye = torch.eye(B, dtype=torch.float64)
    if isinstance(orthogonal_map, HouseholderProduct):
        # Q = (B − I)(B + I)^{-1} is the skew matrix whose exact Cayley transform is B.
        expected = torch.linalg.matrix_norm((blocks - eye) @ torch.linalg.inv(blocks + eye), ord=2)
    else:
        expected = torch.linalg.matrix_norm(torch.stack([skew_dense(row, B) for row in vec]), ord=2)
    norms = orthogonal_map.generator_norms(vec, B, orthogonal_map.blocks(vec, B))
    torch.testing.assert_close(norms, expected, rtol=1e-10, atol=0)
    estimated = orthogonal_map.generator_norms(vec, B, estimate=True)  # the warning's cheap path: within 2 %
    assert bool(((estimated - expected).abs() <= 0.02 * expected).all())
    deviation = (torch.linalg.svdvals(blocks) - 1).abs().amax(-1)
    bound = orthogonal_map.deviation_bound(norms)
    assert bool((deviation <= bound + block_tolerance(B)).all())
    if orthogonal_map.zero_is_identity and orthogonal_map.terms:  # a truncated series is not exactly orthogonal
        assert float(deviation.max()) > 1e-6


def test_the_registry_names_its_maps_and_a_config_picks_one():
    assert sorted(MAPS) == ["cayley_neumann", "householder"]
    assert map_from_config(PoetConfig()) == CayleyNeumann(6)
    assert map_from_config(OftConfig(block_size=8)) == CayleyNeumann(5)
    assert map_from_config(PoetConfig(orthogonal_map="householder")) == HouseholderProduct()
    with pytest.raises(ValueError, match=r"`orthogonal_map` must be one of \['cayley_neumann', 'householder'\]"):
        PoetConfig(orthogonal_map="qr")
    with pytest.raises(ValueError, match="`coft`=True .* needs orthogonal_map='cayley_neumann'"):
        OftConfig(block_size=8, coft=True, orthogonal_map="householder")


def poet_householder(**fields) -> torch.nn.Module:
    config = {"block_size": 16, "orthogonal_map": "householder", **fields}
    return get_peft_model(tiny_llama().double(), PoetConfig(**config))


def dense_effective_weight(layer) -> torch.Tensor:
    """Pᵀ W0 Rᵀ in float64 from reflection matrices and explicit permutation matrices."""
    w = layer.weight_matrix().detach().double()
    rotations = {}
    for side, spec in layer.sides("default").items():
        vec = layer.rotation_parameter("default", side).detach().double()
        blocks = torch.stack([householder_dense(row, spec.block) for row in vec])
        rotations[side] = block_rotation_dense(layer.index_buffer("default", side), blocks)
    return rotations["output"].T @ w @ rotations["input"].T


def test_poet_on_householder_products_starts_as_the_base_and_rotates_as_the_dense_reference():
    with torch.no_grad():
        reference = tiny_llama().double()(input_ids=IDS).logits
        model = poet_householder()
        assert (model(input_ids=IDS).logits - reference).abs().max() <= tiny_model_tolerance(
            torch.float64
        ) * reference.abs().max()
        model = poet_householder(init_weights=False)
        for _, layer in rotation_layers(model):
            effective = layer.effective_weight_matrix(dtype=torch.float64)
            torch.testing.assert_close(effective, dense_effective_weight(layer), rtol=0, atol=1e-12)
            spec = layer.sides("default")["input"]
            assert layer.rotation_parameter("default", "input").shape == (spec.num_blocks, 16 * 16)


def test_the_fused_householder_path_has_the_plain_autograd_gradients():
    model = poet_householder(init_weights=False)
    losses, grads = [], []
    for plain in (False, True):
        model.zero_grad(set_to_none=True)
        with plain_autograd(model) if plain else torch.enable_grad():
            loss = model(input_ids=IDS, labels=IDS).loss
            loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    torch.testing.assert_close(losses[0], losses[1], rtol=tiny_model_tolerance(torch.float64), atol=0)
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == 2 * len(rotation_layers(model))
    for name, grad in grads[0].items():
        scale = float(grads[1][name].abs().max())
        assert float((grad - grads[1][name]).abs().max()) <= tiny_model_tolerance(torch.float64, True) * scale, name


def test_a_merge_keeps_the_function_and_resets_to_fresh_identity_pairs():
    model = poet_householder(init_weights=False)
    with torch.no_grad():
        before = model(input_ids=IDS).logits
        old = {n: p.clone() for n, p in model.named_parameters() if p.requires_grad}
        summary = merge_and_reinit(model)
        after = model(input_ids=IDS).logits
    assert summary["max_neumann_bound"] == 0 and summary["max_orth_error"] < block_tolerance(16)
    assert (after - before).abs().max() <= 8 * tiny_model_tolerance(torch.float64) * before.abs().max()
    for _, layer in rotation_layers(model):
        for side, spec in layer.sides("default").items():
            blocks = layer.rotation_blocks("default", side, dtype=torch.float64)
            eye = torch.eye(spec.block, dtype=torch.float64).expand_as(blocks)
            torch.testing.assert_close(blocks, eye, rtol=0, atol=1e-13)
    assert all(not torch.equal(p, old[n]) for n, p in model.named_parameters() if n in old)
    assert rotation_stats(rotation_layers(model)[0][1])["q_norm"] < 1e-6


def test_oft_on_householder_products_saves_loads_and_unmerges_exactly(tmp_path):
    config = OftConfig(block_size=16, orthogonal_map="householder", init_weights=False)
    model = get_peft_model(tiny_llama().double(), config)
    with torch.no_grad():
        expected = model(input_ids=IDS).logits
        model.save_pretrained(tmp_path)
        loaded = PeftModel.from_pretrained(tiny_llama().double(), tmp_path)
        torch.testing.assert_close(loaded(input_ids=IDS).logits, expected, rtol=0, atol=0)
        layer = rotation_layers(model)[0][1]
        base = layer.weight_matrix().detach().clone()
        layer.merge()
        layer.unmerge()
        torch.testing.assert_close(layer.weight_matrix(), base, rtol=0, atol=block_tolerance(16) * base.abs().max())
    with pytest.raises(ExportError, match="`orthogonal_map`='householder'"):
        export_peft_adapter(model, tmp_path / "peft")
    with pytest.raises(ValueError, match="DeepSpeed ZeRO"):
        check_zero_resettable(model)


@dataclasses.dataclass(frozen=True)
class MatrixExponential(OrthogonalMap):
    """A map written in a test: ``exp(Q)`` of the skew ``Q``; this class and one registry entry are all it takes."""

    zero_is_identity: ClassVar[bool] = True
    name: ClassVar[str] = "matrix_exp"

    @classmethod
    def from_config(cls, config):
        return cls()

    def describe(self):
        return "matrix exponential"

    def num_params(self, block_size):
        return block_size * (block_size - 1) // 2

    def blocks(self, vec, block_size):
        return torch.linalg.matrix_exp(skew_from_vector(vec, block_size))

    reference_blocks = blocks

    def evaluate(self, vec, block_size, norm_cap=None):
        return AutogradEvaluation(lambda leaf: self.blocks(leaf, block_size), vec)

    def identity_params(self, shape, block_size, generator):
        return torch.zeros(shape)

    def random_params(self, shape, block_size, generator, op_norm):
        return torch.randn(shape, generator=generator) * op_norm / block_size**0.5

    def product_count(self, block_size):
        return 8, 16

    def generator_norms(self, vec, block_size, blocks=None, estimate=False, capped=False):
        return torch.tan(torch.linalg.matrix_norm(skew_from_vector(vec, block_size), ord=2) / 2)

    def deviation_bound(self, generator_norm):
        return torch.zeros_like(generator_norm)


def test_a_new_map_is_one_class_and_one_registry_line(monkeypatch):
    monkeypatch.setitem(map_registry.MAPS, MatrixExponential.name, MatrixExponential.from_config)
    model = get_peft_model(tiny_llama().double(), PoetConfig(block_size=16, orthogonal_map="matrix_exp"))
    layer = rotation_layers(model)[0][1]
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        layer.randomize_adapter("default", generator, op_norm=0.3)
    vec = layer.rotation_parameter("default", "input").detach()
    expected = torch.stack([torch.linalg.matrix_exp(skew_dense(row, 16)) for row in vec])
    blocks = layer.rotation_blocks("default", "input", dtype=torch.float64)
    torch.testing.assert_close(blocks, expected, rtol=0, atol=block_tolerance(16))
    model(input_ids=IDS, labels=IDS).loss.backward()
    assert layer.rotation_parameter("default", "input").grad.abs().max() > 0


def test_both_scripts_take_the_map_flags_and_the_pretraining_recipe_applies_and_prints_them():
    from poet_hf.recipes.finetune import FinetuneArguments, method_config
    from poet_hf.recipes.presets import apply_recipe
    from poet_hf.recipes.pretrain import PretrainArguments, resolve_recipe

    recipe = resolve_recipe(PretrainArguments(preset="tiny", orthogonal_map="householder"))
    printed = recipe.as_dict()
    assert (printed["orthogonal_map"], printed["paper_neumann_k"], printed["block_size"]) == ("householder", None, 32)
    default = resolve_recipe(PretrainArguments(preset="tiny")).as_dict()
    assert (default["orthogonal_map"], default["neumann_terms"], default["paper_neumann_k"]) == ("cayley_neumann", 6, 4)
    model = apply_recipe(tiny_llama(), recipe, base_init=None, seed=3)
    layer = rotation_layers(model)[0][1]
    assert layer.rotation_settings["default"].orthogonal_map == HouseholderProduct()
    assert model.peft_config["default"].seed == 3 and model.peft_config["default"].block_size == 32
    base = tiny_llama()  # the fine-tuning config reads its targets
    for method in ("poet", "oft"):
        args = FinetuneArguments(model_name_or_path="x", method=method, orthogonal_map="householder", neumann_terms=0)
        config = method_config(args, base)
        assert (config.orthogonal_map, config.neumann_terms) == ("householder", 0)
