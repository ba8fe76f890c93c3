"""What a merge refuses to fold into ``W0`` (poet_hf.tuners.rotation.fold_checks): a non-finite rotation parameter, a
generator at or past the Cayley–Neumann series' radius, and a block less orthogonal than the truncation allows. A
refused merge folds no layer: every ``W0``, rotation and merge count stays as it was."""

from __future__ import annotations

import math

import pytest
import torch
from models import tiny_llama
from peft import get_peft_model

from poet_hf import PoetConfig, merge_and_reinit
from poet_hf.orthogonal import CayleyNeumann, skew_from_vector
from poet_hf.orthogonal.norm_cap import MAX_SKEW_NORM
from poet_hf.tuners.rotation.fold_checks import RotationFoldError
from poet_hf.tuners.rotation.layer import rotation_layers


def poet_model(**config: object) -> torch.nn.Module:
    model = get_peft_model(tiny_llama(), PoetConfig(block_size=16, init_weights=False, **config))
    return model


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_unchanged(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> None:
    after = model.state_dict()
    changed = [k for k, v in before.items() if not torch.allclose(v, after[k], rtol=0, atol=0, equal_nan=True)]
    assert changed == []


def test_a_nan_in_one_skew_vector_is_named_and_nothing_is_folded():
    model = poet_model()
    name, layer = rotation_layers(model)[5]
    with torch.no_grad():
        layer.poet_P["default"][3, 7] = float("nan")
    before = snapshot(model)
    with pytest.raises(RotationFoldError, match=rf"layer '{name}': the output side's .* 1 non-finite") as error:
        merge_and_reinit(model)
    assert "merge 1 of adapter 'default'" in str(error.value) and "Nothing was folded" in str(error.value)
    assert_unchanged(model, before)


def test_a_generator_past_the_series_radius_folds_at_the_norm_cap_as_the_forward_used_it():
    """A skew vector whose raw ``||Q||_2`` is 1.05, past the series' radius: the forward built its block from the
    generator rescaled onto the cap (`MAX_SKEW_NORM`), so the merge folds that block, and the model computes after the
    merge what it computed before. (The merge refused it, naming the raw norm: a run at a rate whose clip acted died
    at its next merge.)"""
    model = poet_model()
    name, layer = rotation_layers(model)[2]
    with torch.no_grad():
        vec = layer.poet_R["default"][1]
        theta = torch.linalg.matrix_norm(skew_from_vector(vec.double(), 16), ord=2)  # an independent SVD
        vec.mul_(1.05 / theta)
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(input_ids=ids).logits.double()
    summary = merge_and_reinit(model)
    with torch.no_grad():
        after = model(input_ids=ids).logits.double()
    # The fold is float32 arithmetic on W0 (one product per side) against the forward's float32 product: a few ε of
    # the logits' scale per layer.
    assert float((after - before).abs().max()) <= 64 * torch.finfo(torch.float32).eps * float(before.abs().max())
    # The cap rescales by its estimate of ||Q||_2, within 2 % below the norm: the folded generator is at most 2 % past.
    assert summary["merge_count"] == 1 and MAX_SKEW_NORM <= summary["max_q_norm"] <= 1.02 * MAX_SKEW_NORM


def test_a_block_past_a_map_s_radius_is_refused_naming_it_and_nothing_is_folded(monkeypatch):
    """The radius check reads the folded block's generator: a map whose radius were 0.5 refuses a block at 0.6 (below
    the norm cap, so the block is the series' own) and folds no layer."""
    model = poet_model()
    name, layer = rotation_layers(model)[2]
    with torch.no_grad():
        vec = layer.poet_R["default"][1]
        vec.mul_(0.6 / torch.linalg.matrix_norm(skew_from_vector(vec.double(), 16), ord=2))
    monkeypatch.setattr(CayleyNeumann, "domain_radius", lambda self: 0.5)
    before = snapshot(model)
    with pytest.raises(RotationFoldError, match=rf"layer '{name}', input side, block 1: .*0\.6 is at or past"):
        merge_and_reinit(model)
    assert_unchanged(model, before)


@pytest.mark.numerics
@pytest.mark.parametrize("theta", [0.05, 0.3, 0.7, 0.99])
def test_the_allowed_orthogonality_error_holds_every_block_the_series_makes(theta):
    """The check's allowance ``2δ + δ²`` (δ the truncation's singular-value deviation at ``||Q||_2``) against the
    series' float64 blocks, measured by an independent SVD and against the closed form: for ``n`` = 6 terms a block
    whose ``Q`` has norm θ has ``σ² = |1 − (iθ)⁵|² = 1 + θ¹⁰``. A block the map makes never exceeds the allowance, so
    a healthy merge is never refused."""
    generator = torch.Generator().manual_seed(0)
    vec = torch.randn(64, 120, generator=generator, dtype=torch.float64)
    vec = vec * (theta / torch.linalg.matrix_norm(skew_from_vector(vec, 16), ord=2))[:, None]
    cayley = CayleyNeumann(terms=6)
    sigma = torch.linalg.svdvals(cayley.blocks(vec, 16))
    measured = (sigma**2 - 1).abs().amax(-1)  # ||B Bᵀ − I||_2, which bounds e_orth = ||B Bᵀ − I||_F / √b
    deviation = cayley.deviation_bound(torch.full((64,), theta, dtype=torch.float64))
    rounding = 64 * 16 * torch.finfo(torch.float64).eps  # fold_checks.ROUNDING_MULTIPLE · b · ε
    assert bool((measured <= 2 * deviation + deviation**2 + rounding).all())
    if theta < 0.75:  # below the norm cap the blocks are the series' own
        assert float((measured - theta**10).abs().max()) <= rounding
    else:  # past it they are built at the cap, well inside the raw norm's deviation
        assert float(measured.max()) < 0.1 * theta**10


def test_a_healthy_merge_of_a_trained_sized_rotation_folds_every_layer():
    model = poet_model()
    summary = merge_and_reinit(model)
    assert summary["layers"] == len(rotation_layers(model)) and summary["merge_count"] == 1
    assert math.isfinite(summary["max_orth_error"])
