"""The reflection flow: trains on sklearn's offline digits, exact change of variables, invertible round trips."""

from __future__ import annotations

import math

import pytest
import torch
from tolerances import gamma
from torch.autograd.functional import jacobian
from transformers import PreTrainedModel

from poet_hf.vision import ReflectionFlowConfig, ReflectionFlowModel
from poet_hf.vision.flow import squeeze, unsqueeze

# One xdist worker runs every test here (pyproject: --dist loadgroup), so the module's flow is trained once.
pytestmark = pytest.mark.xdist_group("flow")

F64 = torch.float64


@pytest.fixture(scope="module")
def digits() -> torch.Tensor:
    datasets = pytest.importorskip("sklearn.datasets")
    images = datasets.load_digits().images  # 1797 x 8 x 8, integers 0..16
    return torch.tensor(images, dtype=torch.float32).unsqueeze(1) / 17


def held_out_bpd(model: ReflectionFlowModel, images: torch.Tensor) -> float:
    model.eval()
    gen = torch.Generator().manual_seed(123)
    dequantised = images + torch.rand(images.shape, generator=gen) / model.config.num_bins
    with torch.no_grad():
        return float(model(dequantised).loss)


@pytest.fixture(scope="module")
def trained(digits):
    torch.manual_seed(0)
    config = ReflectionFlowConfig(image_size=8, num_bins=17, num_levels=2, steps_per_level=3, hidden_channels=32)
    model = ReflectionFlowModel(config)
    train, test = digits[:1500], digits[1500:]
    model.train()
    with torch.no_grad():
        model(train[:256])  # ActNorm data-dependent init, as Glow does before training
    before = held_out_bpd(model, test)
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(120):
        batch = train[torch.randint(0, len(train), (64,), generator=gen)]
        loss = model(batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model, before, held_out_bpd(model, test), test


def test_bits_per_dim_falls_on_digits(trained):
    _, before, after, _ = trained
    assert math.isfinite(before) and math.isfinite(after)
    assert after < before - 0.5  # observed 4.45 -> 2.98 bits/dim on held-out digits


@pytest.mark.numerics
def test_round_trips_after_training(trained):
    model, _, _, test = trained
    model = ReflectionFlowModel(model.config)  # fresh copy, float64, same trained weights
    model.load_state_dict(trained[0].state_dict())
    model = model.double().eval()
    x = test[:32].double() + torch.rand(32, 1, 8, 8, generator=torch.Generator().manual_seed(1), dtype=F64) / 17
    with torch.no_grad():
        z, _ = model.encode(x)
        assert (model.inverse(z) - x).abs().max() <= 1e-5
        samples = model.sample(16, generator=torch.Generator().manual_seed(2))
        z_ref = torch.randn(16, model.num_dims, generator=torch.Generator().manual_seed(2), dtype=F64)
        assert (model.encode(samples)[0] - z_ref).abs().max() <= 1e-5
    assert samples.shape == (16, 1, 8, 8)


@pytest.mark.numerics
def test_float32_round_trip_is_within_its_rounding_bound(trained):
    model, _, _, test = trained
    model.eval()
    x = test[:32] + torch.rand(32, 1, 8, 8, generator=torch.Generator().manual_seed(1)) / 17
    with torch.no_grad():
        z, _ = model.encode(x)
        error = float((model.inverse(z) - x).abs().max())
    # Encoding and inverting each chain six steps of sums no longer than 400 terms (the coupling's 3×3×32
    # convolution and 1×1s, a Newton solve within 100 ulp), on activations ActNorm keeps at the latents' scale: each
    # pass leaves z within γ_2400·max|z| of exact, and the inverse amplifies an error in z by at most its ∞-norm
    # Lipschitz constant, measured here from its float64 Jacobian at every latent.
    exact = ReflectionFlowModel(model.config)
    exact.load_state_dict(model.state_dict())
    exact = exact.double().eval()
    with torch.no_grad():
        latents = exact.encode(x.double())[0]
    lipschitz = max(
        float(jacobian(lambda v: exact.inverse(v[None])[0].flatten(), row).abs().sum(1).max()) for row in latents
    )
    assert error <= 2 * lipschitz * gamma(2400, torch.float32) * float(z.abs().max())


@pytest.mark.numerics
def test_logdet_matches_jacobian_of_whole_flow():
    torch.manual_seed(0)
    for invertible in (True, False):
        config = ReflectionFlowConfig(
            image_size=4,
            num_channels=1,
            num_levels=2,
            steps_per_level=2,
            hidden_channels=8,
            invertible=invertible,
            seed=3,
        )
        model = ReflectionFlowModel(config).double()
        with torch.no_grad():  # move every layer off its identity-like start
            for p in model.parameters():
                p.add_(0.1 * torch.randn_like(p))
        model.eval()
        x = torch.rand(1, 1, 4, 4, dtype=F64)
        jac = torch.autograd.functional.jacobian(
            lambda v, model=model: model.encode(v.reshape(1, 1, 4, 4))[0].reshape(-1), x.reshape(-1)
        )
        _, logdet = model.encode(x)
        assert abs(float(logdet.detach()) - float(torch.linalg.slogdet(jac)[1])) <= 1e-8


def test_bits_per_dim_formula():
    torch.manual_seed(0)
    model = (
        ReflectionFlowModel(ReflectionFlowConfig(image_size=4, num_levels=1, steps_per_level=1, num_bins=17))
        .double()
        .eval()
    )
    x = torch.randint(0, 17, (3, 1, 4, 4), generator=torch.Generator().manual_seed(1)).double() / 17
    out = model(x)
    # Glow's evaluation: uniform dequantisation noise u / num_bins, here drawn from the fixed evaluation seed.
    noise = torch.rand(x.shape, generator=torch.Generator().manual_seed(0), dtype=F64) / 17
    bits = {}
    for name, inputs in (("dequantised", x + noise), ("raw", x)):
        z, logdet = model.encode(inputs)
        log_p = torch.distributions.Normal(0.0, 1.0).log_prob(z).sum(-1) + logdet
        bits[name] = (-log_p + 16 * math.log(17)) / (16 * math.log(2))
    assert torch.allclose(out.bits_per_dim, bits["dequantised"], atol=1e-12)
    assert not torch.allclose(out.bits_per_dim, bits["raw"], atol=1e-6)  # the noise is really there
    assert torch.equal(model(x).bits_per_dim, out.bits_per_dim)  # and evaluation is deterministic


def test_squeeze_round_trip_and_save_load(tmp_path):
    x = torch.randn(2, 3, 8, 8)
    assert torch.equal(unsqueeze(squeeze(x)), x)
    torch.manual_seed(0)
    model = ReflectionFlowModel(ReflectionFlowConfig(image_size=8, steps_per_level=1))
    model.train()
    model(torch.rand(8, 1, 8, 8))  # initialises ActNorm
    model.save_pretrained(tmp_path)
    loaded = ReflectionFlowModel.from_pretrained(tmp_path)
    model.eval(), loaded.eval()
    x = torch.rand(4, 1, 8, 8)
    assert torch.equal(model(x).bits_per_dim, loaded(x).bits_per_dim)


def test_config_validation():
    with pytest.raises(ValueError, match="image_size"):
        ReflectionFlowConfig(image_size=6, num_levels=2)
    with pytest.raises(ValueError, match="num_bins"):
        ReflectionFlowConfig(num_bins=1)
    with pytest.raises(ValueError, match="newton_on_fail"):
        ReflectionFlowConfig(newton_on_fail="skip")


def test_the_flow_keeps_the_module_and_pretrained_model_methods_it_inherits():
    # The coupling's channel split and the pixel dequantisation once shadowed nn.Module.half() and
    # PreTrainedModel.dequantize() (an int attribute and a method with another signature).
    config = ReflectionFlowConfig(image_size=4, num_levels=1, steps_per_level=1, num_bins=17, hidden_channels=8)
    model = ReflectionFlowModel(config).half()
    assert {p.dtype for p in model.parameters()} == {torch.float16}
    assert ReflectionFlowModel.dequantize is PreTrainedModel.dequantize
    pixels = torch.full((2, 1, 4, 4), 0.5)
    model.float().eval()
    noisy = model.dequantize_pixels(pixels)
    assert ((noisy - pixels) >= 0).all() and ((noisy - pixels) < 1 / 17).all()
    assert torch.equal(noisy, model.dequantize_pixels(pixels))  # a fixed seed in evaluation
