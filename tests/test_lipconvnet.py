"""LipConvNet as a Hugging Face model: config checks, Auto registration, exact save/load, the network's
Lipschitz constant against materialised Jacobians, and certificates against a direct check and a PGD attack."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch.func import jacrev
from transformers import AutoConfig, AutoModelForImageClassification

from poet_hf.orthogonal.eco import EcoConv2d, circular_conv_symbol
from poet_hf.orthogonal.lipschitz_layers import SocConv2d
from poet_hf.vision import LipConvNetConfig, LipConvNetForImageClassification, certified_accuracy
from poet_hf.vision.certify import certified_radius, pgd_l2_attack
from poet_hf.vision.lipconvnet import LIPCONVNET_DEPTHS

F64 = torch.float64
SMALL = {"init_channels": 4, "num_labels": 10}
# A 12x12 layout (12 -> 6 -> 3 -> 1 -> 1 -> 1) for the tests that need many forwards.
TINY = dict(
    image_size=12,
    strides=[2, 2, 3, 1, 1],
    kernel_sizes=[3, 3, 3, 1, 1],
    num_channels=1,
    image_mean=[0.3],
    image_std=[0.3],
    **SMALL,
)


def small_model(**overrides) -> LipConvNetForImageClassification:
    torch.manual_seed(0)
    return LipConvNetForImageClassification(LipConvNetConfig(**{**SMALL, **overrides}))


def freeze_power_iteration(model):
    for module in model.modules():
        if hasattr(module, "update_power_iteration"):
            module.update_power_iteration = False
    return model


# ------------------------------------------------------------------------------------------------ config, Auto
@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"depth": 6}, "`depth` must be one of"),
        ({"init_channels": 3}, "`init_channels` must be an even int"),
        ({"conv_types": ["eco"] * 4}, "`conv_types` needs one entry per block"),
        ({"conv_types": ["eco", "soc", "eco", "eco", "bcop"]}, "`conv_types` entries must be in"),
        ({"last_layer": "linear"}, "`last_layer` must be one of"),
        ({"image_std": [0.2, 0.2]}, "need num_channels=3 entries"),
        ({"image_size": 28}, "block 3 stride 2 does not divide its 7x7 input"),
        ({"eco_orthogonal_map": "qr"}, "`eco_orthogonal_map`"),
    ],
)
def test_config_rejects_bad_values(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        LipConvNetConfig(**kwargs)


def test_model_refuses_a_size_eco_cannot_make_orthogonal():
    # 32x32 CIFAR without resizing: block 3 sees 8x8, unshuffled to 4x4, and k=3 does not divide 4.
    with pytest.raises(ValueError, match="4, which kernel_size=3 does not divide"):
        LipConvNetForImageClassification(LipConvNetConfig(image_size=32, strides=[2, 2, 2, 2, 2], **SMALL))


def test_auto_classes_resolve_the_model_type():
    config = AutoConfig.for_model("poet-lipconvnet", **TINY)
    assert isinstance(config, LipConvNetConfig)
    model = AutoModelForImageClassification.from_config(config)
    assert isinstance(model, LipConvNetForImageClassification)


@pytest.mark.parametrize("depth", LIPCONVNET_DEPTHS)
def test_every_paper_depth_builds_five_blocks_of_depth_over_five_conv_layers(depth):
    model = small_model(depth=depth, init_channels=2, num_labels=3, **{k: v for k, v in TINY.items() if k not in SMALL})
    assert len(model.conv_layers()) == depth
    kinds = [type(layer).__name__ for layer in model.conv_layers()]
    per_block = depth // 5
    assert kinds == ["SocConv2d"] * (2 * per_block) + ["EcoConv2d"] * (3 * per_block)
    with torch.no_grad():
        assert model.eval()(torch.rand(2, 1, 12, 12)).logits.shape == (2, 3)


# ---------------------------------------------------------------------------------------------- save and load
@pytest.mark.parametrize("bake", [False, True])
def test_save_pretrained_then_from_pretrained_reproduces_logits_exactly(tmp_path, bake):
    model = small_model()
    model.train()(torch.rand(4, 3, 24, 24), labels=torch.arange(4)).loss.backward()  # move u off its init
    model.eval()
    if bake:
        model.bake()
    x = torch.rand(5, 3, 24, 24)
    with torch.no_grad():
        expected = model(x).logits
    model.save_pretrained(tmp_path)
    loaded, info = AutoModelForImageClassification.from_pretrained(tmp_path, output_loading_info=True)
    assert isinstance(loaded, LipConvNetForImageClassification)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert loaded.config.baked is bake
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(x).logits, expected, rtol=0, atol=0)


def test_baked_checkpoint_has_no_parametrization_state(tmp_path):
    from safetensors.torch import load_file

    model = small_model().eval()
    with torch.no_grad():
        x = torch.rand(3, 3, 24, 24)
        before = model(x).logits
        model.bake()
        torch.testing.assert_close(model(x).logits, before, rtol=0, atol=0)
    model.save_pretrained(tmp_path)
    keys = load_file(tmp_path / "model.safetensors").keys()
    eco_names = [n for n, m in model.named_modules() if isinstance(m, EcoConv2d)]
    for name in eco_names:
        assert {k for k in keys if k.startswith(name + ".")} == {f"{name}.weight", f"{name}.bias"}


# ------------------------------------------------------------------------------------ Lipschitz
def empirical_lipschitz(model, x: torch.Tensor, pairs: int = 64) -> tuple[float, float]:
    """(largest σ of the materialised Jacobian over the points, largest ||f(a)-f(b)||/||a-b|| over random pairs)."""
    jac_max = 0.0
    for point in x:
        jac = jacrev(lambda z: model(z[None]).logits[0])(point).reshape(model.config.num_labels, -1).detach()
        jac_max = max(jac_max, float(torch.linalg.svdvals(jac).max()))
    generator = torch.Generator().manual_seed(1)
    a = torch.rand(pairs, *x.shape[1:], dtype=F64, generator=generator)
    scale = torch.logspace(-4, 0, pairs, dtype=F64).view(-1, 1, 1, 1)  # near and far pairs
    b = a + scale * torch.randn(a.shape, dtype=F64, generator=generator)
    with torch.no_grad():
        ratio = (model(a).logits - model(b).logits).norm(dim=1) / (a - b).flatten(1).norm(dim=1)
    return jac_max, float(ratio.max())


@pytest.mark.numerics
@pytest.mark.parametrize("mode", ["eval", "train"])
def test_lipconvnet5_empirical_lipschitz_is_at_most_the_claimed_constant(mode, record_property):
    model = small_model(image_std=[0.2, 0.25, 0.3]).double()
    freeze_power_iteration(model).train(mode == "train")
    claimed = model.lipschitz_constant()
    # Orthogonal layers: the claim is 1/min(std) times, per SOC layer, at most 1 + its Taylor remainder at
    # ||J_L|| (ECO's eval kernel is the exact matrix exponential).
    assert claimed >= 1 / 0.2 * (1 - 1e-9)
    if mode == "eval":
        growth = 1.0
        for layer in (m for m in model.modules() if isinstance(m, SocConv2d)):
            symbol = circular_conv_symbol(layer.skew_kernel().detach(), layer.conv_size, (1, 1), layer.padding)
            theta = float(torch.linalg.matrix_norm(symbol, ord=2).max())
            growth *= 1 + math.exp(theta) - sum(theta**i / math.factorial(i) for i in range(layer.eval_terms + 1))
        assert claimed <= 1 / 0.2 * growth * (1 + 1e-12)
    x = torch.rand(3, 3, 24, 24, dtype=F64)
    jac_max, pair_max = empirical_lipschitz(model, x)
    record_property(f"{mode}_claimed_L", claimed)
    record_property(f"{mode}_jacobian_sigma_max", jac_max)
    record_property(f"{mode}_pair_ratio_max", pair_max)
    # float64 rounding of the forward is ~1e-14 relative; the claim must hold beyond that.
    assert jac_max <= claimed * (1 + 1e-9)
    assert pair_max <= claimed * (1 + 1e-9)
    assert jac_max >= 0.5 * claimed  # the estimate is not vacuous: gradient-norm-preserving layers


@pytest.mark.numerics
def test_lln_head_margins_are_bounded_by_pairwise_row_distances():
    model = small_model(**{**TINY, "last_layer": "lln"}).double().eval()
    L_feat = model.lipschitz_constant(include_head=False)
    w = model.head_weight().double()
    x = torch.rand(1, 12, 12, dtype=F64)
    jac = jacrev(lambda z: model(z[None]).logits[0])(x).reshape(10, -1).detach()
    for i in range(10):
        for j in range(i + 1, 10):
            bound = float((w[i] - w[j]).norm()) * L_feat
            assert float((jac[i] - jac[j]).norm()) <= bound * (1 + 1e-9)


# ------------------------------------------------------------------------------- certification
def test_certified_radius_on_hand_made_logits():
    model = SimpleNamespace(
        config=SimpleNamespace(last_layer="orthogonal"), lipschitz_constant=lambda include_head=True: 2.0
    )
    logits = torch.tensor([[3.0, 1.0, 0.0], [0.0, 2.0, 1.0], [1.0, 1.0, 0.0]])
    radius = certified_radius(model, logits, torch.tensor([0, 0, 2]))
    # margin 2 -> 2/(√2·2); misclassified -> 0; wrong label on a tie -> 0
    torch.testing.assert_close(radius, torch.tensor([1 / math.sqrt(2), 0.0, 0.0], dtype=F64), rtol=0, atol=1e-15)


def test_lln_certified_radius_matches_brute_force():
    model = small_model(**{**TINY, "last_layer": "lln"}).eval()
    x = torch.rand(16, 1, 12, 12)
    with torch.no_grad():
        logits = model(x).logits.double()
    labels = logits.argmax(dim=1)
    radius = certified_radius(model, logits, labels)
    L_feat, w = model.lipschitz_constant(include_head=False), model.head_weight().double()
    for n in range(16):
        y = int(labels[n])
        expected = min(
            float(logits[n, y] - logits[n, j]) / (float((w[y] - w[j]).norm()) * L_feat) for j in range(10) if j != y
        )
        assert float(radius[n]) == pytest.approx(expected, rel=1e-12)


@pytest.fixture(scope="module")
def digits():
    from poet_hf.vision.data import iterate_batches, load_digits_dataset

    data = load_digits_dataset()
    return data, next(iterate_batches(data["test"], 1, 12, 4096))


@pytest.fixture(scope="module")
def digits_model(digits):
    """A tiny LipConvNet-5 trained for 20 Adam steps on the offline digits (12x12), baked."""
    torch.manual_seed(0)
    from poet_hf.vision.data import iterate_batches

    train_x, train_y = next(iterate_batches(digits[0]["train"], 1, 12, 4096))
    model = LipConvNetForImageClassification(LipConvNetConfig(**TINY))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        idx = torch.randint(0, len(train_y), (32,), generator=generator)
        optimizer.zero_grad()
        model(train_x[idx], labels=train_y[idx]).loss.backward()
        optimizer.step()
    return model.eval().bake()


def test_certified_accuracy_agrees_with_a_direct_check(digits, digits_model, record_property):
    data, (x, y) = digits
    eps = 36 / 255
    result = certified_accuracy(digits_model, data["test"], eps=eps, return_radii=True)  # the HF img/label path
    with torch.no_grad():
        logits = digits_model(x).logits.double()
    # Independent L: 1/std times each layer's spectral norm from its materialised Jacobian.
    L = 1 / 0.3
    for layer in digits_model.conv_layers() + [digits_model.head]:
        x0 = torch.rand(1, layer.in_channels, *layer.input_size)
        jac = jacrev(layer)(x0).reshape(-1, x0.numel()).detach().double()
        L *= float(torch.linalg.matrix_norm(jac, ord=2))
    assert result["lipschitz_constant"] == pytest.approx(L, rel=1e-6)
    top2 = logits.topk(2, dim=1)
    correct = top2.indices[:, 0] == y
    radius = (top2.values[:, 0] - top2.values[:, 1]) / (math.sqrt(2) * L)
    certified = correct & (radius >= eps)
    assert result["num_examples"] == len(y)
    assert torch.equal(result["correct"], correct)
    # Batching differs (256 vs all), so float32 logits may differ in the last bits: only a point whose radius is
    # that close to eps may disagree.
    disagree = certified != (result["correct"] & (result["radii"] >= eps))
    assert bool(((radius - eps).abs()[disagree] < 1e-5 * eps).all())
    torch.testing.assert_close(
        result["radii"], torch.where(correct, radius, torch.zeros_like(radius)), rtol=1e-5, atol=1e-6
    )
    assert result["clean_accuracy"] == pytest.approx(float(correct.double().mean()), abs=1e-12)
    record_property("clean_accuracy", result["clean_accuracy"])
    record_property("certified_accuracy", result["certified_accuracy"])
    assert result["clean_accuracy"] > 0.5 and result["certified_accuracy"] > 0.2  # well above chance (0.1)


def test_pgd_at_eps_never_flips_a_certified_point(digits, digits_model, record_property):
    _, (x, y) = digits
    eps = 36 / 255
    result = certified_accuracy(digits_model, (x, y), eps=eps, return_radii=True)
    certified = result["correct"] & (result["radii"] >= eps)
    idx = certified.nonzero()[:, 0][:24]
    assert len(idx) >= 10
    adversarial = pgd_l2_attack(digits_model, x[idx], y[idx], eps)
    with torch.no_grad():
        before = digits_model(x[idx]).logits
        after = digits_model(adversarial).logits
    assert bool((after.argmax(dim=1) == y[idx]).all())
    # The attack is real: it spends its budget, and the margin drops, but never by more than √2·L·eps.
    margin = lambda logits: logits.topk(2, dim=1).values.diff(dim=1).neg()[:, 0]  # noqa: E731
    drop = margin(before) - margin(after)
    bound = math.sqrt(2) * result["lipschitz_constant"] * eps
    record_property("pgd_mean_margin_drop_over_bound", float(drop.mean() / bound))
    assert float(drop.max()) <= bound * (1 + 1e-5)
    assert float(drop.mean()) > 0.2 * bound
    # A larger radius flips some of the same points, so the attack can succeed where no certificate exists.
    far = pgd_l2_attack(digits_model, x[idx], y[idx], 4 * float(result["radii"][idx].max()), steps=10)
    with torch.no_grad():
        assert bool((digits_model(far).logits.argmax(dim=1) != y[idx]).any())
