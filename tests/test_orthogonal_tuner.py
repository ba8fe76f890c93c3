"""OrthogonalConfig on a tiny BERT and a small CNN: orthogonality by SVD / Jacobian, training, merge, save/load."""

from __future__ import annotations

import pytest
import torch
from models import tiny_bert
from peft import PeftModel, get_peft_model
from torch import nn
from transformers import BertModel

import poet_hf  # noqa: F401  (registers the tuners with PEFT)
from poet_hf.orthogonal import FeedbackGD, stiefel_deviation
from poet_hf.tuners.orthogonal_layers import OrthogonalConfig, OrthogonalLayer
from poet_hf.tuners.orthogonal_layers.layer import Conv2d as OrthConv2d
from poet_hf.tuners.orthogonal_layers.layer import Linear as OrthLinear

pytestmark = pytest.mark.numerics  # float64 / dense references at tolerances from the math


F64 = torch.float64
LINEAR_KINDS = ["cayley_neumann", "householder", "reflection", "fgd"]


def small_bert(seed: int = 0) -> BertModel:
    """A one-layer BERT without dropout, small enough for every parameterization's exact checks."""
    return tiny_bert(
        hidden=16,
        layers=1,
        vocab=64,
        heads=2,
        intermediate=24,
        seed=seed,
        max_position_embeddings=16,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )


def layers(model) -> list[tuple[str, OrthogonalLayer]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, OrthogonalLayer)]


def svd_polar(weight: torch.Tensor) -> torch.Tensor:
    u, _, vh = torch.linalg.svd(weight.double(), full_matrices=False)
    return u @ vh


def reflection_matrix(layer: OrthLinear, x: torch.Tensor) -> torch.Tensor:
    """The per-input matrix -O0 H(W x) of the reflection layer, built explicitly from its definition."""
    w = layer.orthogonal_weight["default"].detach().double()
    u = w @ x
    h = torch.eye(len(x), dtype=F64) - 2 * torch.outer(u, u) / u.dot(u)
    return -layer.orthogonal_polar["default"].double() @ h


def assert_orthogonal(model, tol: float) -> None:
    gen = torch.Generator().manual_seed(0)
    for name, layer in layers(model):
        if layer.orthogonal_settings["default"].parameterization == "reflection":
            for _ in range(3):
                x = torch.randn(layer.in_features, generator=gen, dtype=F64)
                sv = torch.linalg.svdvals(reflection_matrix(layer, x))
                assert (sv - 1).abs().max() <= tol, name
        else:
            sv = torch.linalg.svdvals(layer.orthogonal_matrix("default").detach().double())
            assert (sv - 1).abs().max() <= tol, name


@pytest.mark.parametrize("kind", LINEAR_KINDS)
def test_bert_starts_at_polar_factor_and_reports_change(kind):
    base = small_bert()
    weights = {n: m.weight.detach().clone() for n, m in base.named_modules() if isinstance(m, nn.Linear)}
    model = get_peft_model(base, OrthogonalConfig(parameterization=kind))
    found = layers(model)
    assert len(found) == 6  # query, key, value, attention.output.dense, intermediate.dense, output.dense
    assert_orthogonal(model, 1e-5)
    report = model.base_model.init_change_report()
    gen = torch.Generator().manual_seed(1)
    for name, layer in found:
        w0 = weights[name.removeprefix("base_model.model.")]
        polar = svd_polar(w0)
        if kind == "reflection":
            x = torch.randn(layer.in_features, generator=gen, dtype=F64)
            # -O0 H(x) x = O0 x: the map starts at O0 (the per-input matrix -O0 H(x) itself is not O0).
            assert (reflection_matrix(layer, x) @ x - polar @ x).abs().max() <= 1e-5
        else:
            assert (layer.orthogonal_matrix("default").detach().double() - polar).abs().max() <= 1e-5
        expected = float(torch.linalg.norm(polar - w0.double()) / torch.linalg.norm(w0.double()))
        assert abs(report[name.removeprefix("base_model.model.")] - expected) <= 1e-4 * expected


def _bert_loss(model, gen):
    ids = torch.randint(0, 64, (4, 8), generator=gen)
    target = torch.randn(4, 8, 16, generator=gen)
    return nn.functional.mse_loss(model(input_ids=ids).last_hidden_state, target)


@pytest.mark.parametrize("kind", LINEAR_KINDS)
def test_bert_training_keeps_layers_orthogonal(kind):
    model = get_peft_model(small_bert(), OrthogonalConfig(parameterization=kind))
    model.train()
    start = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert start and all("orthogonal_weight" in n for n in start)
    if kind == "fgd":
        stiefel = model.base_model.stiefel_parameters()
        assert len(stiefel) == 6
        opt = FeedbackGD([p for p in model.parameters() if p.requires_grad], lr=0.02, stiefel_params=stiefel)
    else:
        opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        opt.zero_grad()
        _bert_loss(model, gen).backward()
        opt.step()
    moved = max(float((p.detach() - start[n]).abs().max()) for n, p in model.named_parameters() if n in start)
    assert moved > 1e-3
    if kind != "fgd":
        assert_orthogonal(model, 1e-5)
        return
    # FGD keeps the weights in a band around the manifold while training (seed-001 §7: ~lr^1.5 deviation) ...
    deviations = [stiefel_deviation(p) for p in stiefel]
    assert 0 < max(deviations) <= 0.02
    # ... and the feedback pulls them back once the gradient stops: contraction by (1 - 2 beta) per step.
    for _ in range(100):
        for p in stiefel:
            p.grad = torch.zeros_like(p)
        opt.step()
    assert_orthogonal(model, 1e-5)


@pytest.mark.parametrize("kind", ["cayley_neumann", "householder", "fgd"])
def test_bert_merge_and_unload_round_trip(kind):
    model = get_peft_model(small_bert(), OrthogonalConfig(parameterization=kind, init_weights=False))
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(input_ids=ids).last_hidden_state
        with model.disable_adapter():
            original = model(input_ids=ids).last_hidden_state
    assert (expected - original).abs().max() > 1e-2  # the adapter changes the model
    merged = model.merge_and_unload()
    assert not layers(merged)
    assert all(type(m) is nn.Linear for n, m in merged.named_modules() if n.endswith(("query", "key", "value")))
    with torch.no_grad():
        assert (merged(input_ids=ids).last_hidden_state - expected).abs().max() <= 1e-5
    sv = torch.linalg.svdvals(merged.encoder.layer[0].intermediate.dense.weight.double())
    assert (sv - 1).abs().max() <= 1e-5


def test_merge_unmerge_restores_base_exactly():
    model = get_peft_model(small_bert(), OrthogonalConfig(parameterization="cayley_neumann", init_weights=False))
    layer = dict(layers(model))["base_model.model.encoder.layer.0.attention.self.query"]
    before = layer.get_base_layer().weight.detach().clone()
    layer.merge()
    assert not torch.equal(layer.get_base_layer().weight, before)
    layer.unmerge()
    assert torch.equal(layer.get_base_layer().weight, before)


def test_reflection_cannot_merge():
    model = get_peft_model(small_bert(), OrthogonalConfig(parameterization="reflection"))
    with pytest.raises(ValueError, match="input-dependent"):
        model.merge_and_unload()


@pytest.mark.parametrize("kind", ["householder", "reflection"])
def test_save_load_round_trip(tmp_path, kind):
    model = get_peft_model(small_bert(), OrthogonalConfig(parameterization=kind, init_weights=False))
    model.save_pretrained(tmp_path)
    loaded = PeftModel.from_pretrained(small_bert(), tmp_path)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).last_hidden_state, loaded(input_ids=ids).last_hidden_state)


def test_several_adapters_switch_disable_delete():
    model = get_peft_model(small_bert(), OrthogonalConfig(parameterization="cayley_neumann", init_weights=False))
    model.add_adapter("second", OrthogonalConfig(parameterization="householder", init_weights=False, seed=1))
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        first = model(input_ids=ids).last_hidden_state
        model.set_adapter("second")
        second = model(input_ids=ids).last_hidden_state
        with model.disable_adapter():
            base = model(input_ids=ids).last_hidden_state
        reference = small_bert()(input_ids=ids).last_hidden_state
        model.set_adapter("default")
        assert torch.equal(model(input_ids=ids).last_hidden_state, first)
        assert (first - second).abs().max() > 1e-2
        assert torch.equal(base, reference)
        model.delete_adapter("second")
        assert list(model.peft_config) == ["default"]
        assert torch.equal(model(input_ids=ids).last_hidden_state, first)


def test_half_precision_base_keeps_float32_adapter():
    model = get_peft_model(small_bert().to(torch.bfloat16), OrthogonalConfig(parameterization="cayley_neumann"))
    assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if "orthogonal_weight" in n)
    out = model(input_ids=torch.randint(0, 64, (2, 8))).last_hidden_state
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()


# --- a small CNN: Conv2d through ECO -----------------------------------------------------------------------


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Linear(8 * 6 * 6, 4)

    def forward(self, x):
        x = torch.relu(self.conv1(x))
        x = torch.relu(self.conv2(x))
        return self.head(x.flatten(1))


def conv_jacobian_singular_values(layer: OrthConv2d, channels: int) -> torch.Tensor:
    """Singular values of the layer's Jacobian (minus its bias), by autograd on a 6x6 input, float64."""
    x = torch.randn(1, channels, 6, 6, dtype=F64)
    jac = torch.autograd.functional.jacobian(lambda v: layer(v.reshape(1, channels, 6, 6)).reshape(-1), x.reshape(-1))
    return torch.linalg.svdvals(jac)


def cnn_model():
    torch.manual_seed(0)
    config = OrthogonalConfig(
        target_modules=["conv1", "conv2", "head"], conv_input_size=6, parameterization="cayley_neumann"
    )
    return get_peft_model(SmallCNN(), config)


def test_cnn_conv_layers_are_orthogonal_and_stay_so():
    model = cnn_model().double()
    convs = {n.split(".")[-1]: m for n, m in layers(model) if isinstance(m, OrthConv2d)}
    assert set(convs) == {"conv1", "conv2"}

    def check():
        for name, layer in convs.items():
            sv = conv_jacobian_singular_values(layer, layer.get_base_layer().in_channels)
            # conv1 maps 3 -> 8 channels: an isometry, so all 108 singular values are 1.
            assert len(sv) == layer.get_base_layer().in_channels * 36
            assert (sv - 1).abs().max() <= 1e-5, name

    check()
    model.train()
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = torch.randn(4, 3, 6, 6, generator=gen, dtype=F64)
        opt.zero_grad()
        model(x).pow(2).sum().backward()
        opt.step()
    check()
    head = dict(layers(model))["base_model.model.head"]
    sv = torch.linalg.svdvals(head.orthogonal_matrix("default").detach())
    assert (sv - 1).abs().max() <= 1e-5


def test_repr_names_each_layer_once_as_peft_names_its_own():
    modules = dict(cnn_model().named_modules())
    assert repr(modules["base_model.model.conv1"]).startswith("orthogonal.Conv2d(\n")
    assert repr(modules["base_model.model.head"]).startswith("orthogonal.Linear(\n")


def test_cnn_merge_and_unload_round_trip():
    model = cnn_model().double().eval()
    x = torch.randn(2, 3, 6, 6, dtype=F64)
    with torch.no_grad():
        expected = model(x)
        merged = model.merge_and_unload()
        assert type(merged.conv1) is nn.Conv2d and type(merged.head) is nn.Linear
        assert (merged(x) - expected).abs().max() <= 1e-10


def test_conv_errors_are_clear():
    with pytest.raises(ValueError, match="conv_input_size"):
        get_peft_model(SmallCNN(), OrthogonalConfig(target_modules=["conv1"]))
    with pytest.raises(ValueError, match="divide"):
        get_peft_model(SmallCNN(), OrthogonalConfig(target_modules=["conv1"], conv_input_size=8))


def test_config_validation():
    with pytest.raises(ValueError, match="parameterization"):
        OrthogonalConfig(parameterization="qr")
    with pytest.raises(ValueError, match="num_reflections"):
        OrthogonalConfig(parameterization="householder", num_reflections=3)
    with pytest.raises(ValueError, match="neumann_terms"):
        OrthogonalConfig(neumann_terms=1)
    with pytest.raises(ValueError, match="bias"):
        OrthogonalConfig(bias="lora_only")
    with pytest.raises(ValueError, match="eco_orthogonal_map"):
        OrthogonalConfig(eco_orthogonal_map="cayley")
