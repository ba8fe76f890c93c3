"""ECO convolution: orthogonality of the materialised Jacobian (float64, torch.func.jacrev), truncation error,
build-time refusals, baking, and the SOC / MaxMin / LLN building blocks.

The references are independent of the code under test: dense Jacobians from ``jacrev`` and their SVDs,
``nn.Conv2d(padding_mode="circular")``, scalar complex Taylor sums, and sorting for MaxMin.
"""

from __future__ import annotations

import cmath
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tolerances import gamma
from torch.func import jacrev

from poet_hf.orthogonal.eco import (
    EcoConv2d,
    construct_index_map,
    eco_kernel,
    num_frequency_blocks,
    taylor_exp_error,
)
from poet_hf.orthogonal.linalg import taylor_exp
from poet_hf.orthogonal.lipschitz_layers import MaxMin, RowNormLinear, SocConv2d

pytestmark = pytest.mark.numerics  # float64 / dense references at tolerances from the math

F64 = torch.float64

# (in, out, kernel, stride, input_size): channel increase / decrease, stride 2 and 3, k = 1..5, rectangular, 1x1.
CONFIGS = [
    pytest.param(4, 4, 3, 1, 6, id="square-k3-n6"),
    pytest.param(3, 6, 3, 1, 9, id="increase-k3-n9"),
    pytest.param(6, 3, 3, 1, 6, id="decrease-k3-n6"),
    pytest.param(2, 8, 3, 2, 12, id="stride2-k3-n12"),
    pytest.param(2, 4, 3, 2, 12, id="stride2-decrease"),
    pytest.param(2, 12, 3, 2, 6, id="stride2-increase-n3"),
    pytest.param(3, 3, 2, 1, 4, id="k2-n4"),
    pytest.param(2, 5, 2, 1, 6, id="k2-n6-increase"),
    pytest.param(2, 2, 4, 1, 8, id="k4-n8"),
    pytest.param(2, 2, 5, 1, 5, id="k5-n5"),
    pytest.param(2, 3, 3, 1, (6, 3), id="rectangular-6x3"),
    pytest.param(3, 5, 3, 1, 1, id="k3-on-1x1"),
    pytest.param(2, 5, 3, 3, 3, id="stride3-to-1x1"),
    pytest.param(4, 4, 1, 1, 4, id="k1"),
]


def spatial(size: int | tuple[int, int]) -> tuple[int, int]:
    return (size, size) if isinstance(size, int) else size


def jacobian(layer: nn.Module, c_in: int, size: tuple[int, int]) -> torch.Tensor:
    """Dense float64 Jacobian ``[out_numel, in_numel]`` of a (linear) layer at a random point."""
    x = torch.randn(1, c_in, *size, dtype=F64)
    return jacrev(lambda z: layer(z).flatten())(x).reshape(-1, x.numel()).detach()


def make(c_in, c_out, k, s, n, **kwargs) -> EcoConv2d:
    layer = EcoConv2d(c_in, c_out, k, s, input_size=n, dtype=F64, **kwargs)
    layer.update_power_iteration = False  # torch.func refuses in-place buffer updates
    if layer.bias is not None:
        with torch.no_grad():
            layer.bias.normal_()  # a bias must not change the Jacobian
    return layer


# --------------------------------------------------------------------------------------------- index map, Taylor
@pytest.mark.parametrize("k", range(1, 7))
def test_index_map_is_mirror_symmetric_with_L_classes(k):
    index, count = construct_index_map(k)
    mirrored = index[(-torch.arange(k)) % k][:, (-torch.arange(k)) % k]
    assert torch.equal(index, mirrored)
    assert count == num_frequency_blocks(k) == len(torch.unique(index))
    expected = (k * k + 1) // 2 if k % 2 else (k * k + 4) // 2  # self-paired: 1 frequency (odd), 4 (even)
    assert count == expected


def test_index_map_k3_matches_paper_algorithm_2():
    index, _ = construct_index_map(3)
    assert index.tolist() == [[0, 1, 1], [2, 3, 4], [2, 4, 3]]


@pytest.mark.parametrize("terms", [1, 2, 3, 4, 5, 10])
def test_taylor_truncation_error_matches_scalar_series(terms):
    # For skew A with ||A||_2 = 1 the error is max_θ |e^{iθ} - S_T(iθ)| over the spectrum, reached at θ = 1.
    torch.manual_seed(terms)
    a = torch.randn(6, 6, dtype=F64)
    a = a - a.T
    a = a / torch.linalg.matrix_norm(a, ord=2)
    scalar = abs(cmath.exp(1j) - sum((1j) ** i / math.factorial(i) for i in range(terms + 1)))
    assert float(taylor_exp_error(a, terms)) == pytest.approx(scalar, rel=1e-9)
    powers = sum(torch.linalg.matrix_power(a, i) / math.factorial(i) for i in range(terms + 1))
    torch.testing.assert_close(taylor_exp(a, terms), powers, rtol=0, atol=1e-14)


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_kernel_is_the_real_inverse_dft_of_the_frequency_blocks(k):
    # Paper Eq. 13-14 literally: P0[i, j] = Q[I[i, j]], W0 = ifft2(P0) (1/k² normalisation), imaginary part 0.
    index, count = construct_index_map(k)
    blocks = torch.linalg.qr(torch.randn(count, 4, 4, dtype=F64)).Q
    p0 = blocks[index].to(torch.complex128)
    w0 = torch.fft.ifft2(p0, dim=(0, 1))
    assert float(w0.imag.abs().max()) < 1e-15
    expected = torch.fft.fftshift(w0.real, dim=(0, 1)).permute(2, 3, 0, 1)
    # Both sides sum k² terms of magnitude ≤ 1 (orthogonal blocks) with rounded twiddle factors: γ_(k²+2) each.
    torch.testing.assert_close(eco_kernel(blocks, index), expected, rtol=0, atol=2 * gamma(k * k + 2, F64))
    # And the DFT of the kernel gives back the orthogonal blocks at every frequency.
    spectrum = torch.fft.fft2(torch.fft.ifftshift(eco_kernel(blocks, index), dim=(2, 3)), dim=(2, 3))
    torch.testing.assert_close(spectrum.permute(2, 3, 0, 1), p0, rtol=0, atol=1e-13)


# ------------------------------------------------------------------------------------- orthogonality
@pytest.mark.parametrize("orthogonal_map", ["matrix_exp"])
@pytest.mark.parametrize("c_in, c_out, k, s, n", CONFIGS)
def test_jacobian_is_orthogonal_with_the_exact_map(c_in, c_out, k, s, n, orthogonal_map):
    size = spatial(n)
    layer = make(c_in, c_out, k, s, n, orthogonal_map=orthogonal_map)
    for mode in (True, False):  # training forward with matrix_exp, and the cached eval kernel
        layer.train(mode)
        jac = jacobian(layer, c_in, size)
        sv = torch.linalg.svdvals(jac)
        assert sv.numel() == min(jac.shape)
        assert float((sv - 1).abs().max()) <= 1e-6, f"σ range [{float(sv.min())}, {float(sv.max())}]"
        # Which side is orthonormal: columns for c_out >= c_in·s² (isometry), rows otherwise.
        if c_out >= c_in * s * s:
            gram = jac.T @ jac
        else:
            gram = jac @ jac.T
        torch.testing.assert_close(gram, torch.eye(gram.shape[0], dtype=F64), rtol=0, atol=1e-10)


@pytest.mark.parametrize("c_in, c_out, k, s, n", CONFIGS)
def test_norm_preserving_or_non_increasing_as_the_channels_imply(c_in, c_out, k, s, n):
    layer = make(c_in, c_out, k, s, n, bias=False).eval()
    x = torch.randn(16, c_in, *spatial(n), dtype=F64)
    with torch.no_grad():
        ratio = layer(x).flatten(1).norm(dim=1) / x.flatten(1).norm(dim=1)
    if c_out >= c_in * s * s:
        torch.testing.assert_close(ratio, torch.ones_like(ratio), rtol=0, atol=1e-12)
    else:  # keeping c_out of c_in·s² channels drops energy: strictly below 1 for generic inputs, never above
        assert float(ratio.max()) <= 1 + 1e-12
        assert float(ratio.min()) < 0.99


@pytest.mark.parametrize("c_in, c_out, k, s, n", CONFIGS)
def test_training_taylor_truncation_is_bounded_and_reported(c_in, c_out, k, s, n, record_property):
    layer = make(c_in, c_out, k, s, n, orthogonal_map="taylor", train_terms=5).train()
    sv = torch.linalg.svdvals(jacobian(layer, c_in, spatial(n)))
    err = layer.truncation_error()
    # Every per-frequency block is S_T(A_l) = exp(A_l) + R_l, so each σ is within ||R_l||_2 of 1.
    deviation = float((sv - 1).abs().max())
    record_property("taylor_T5_max_sigma_deviation", deviation)
    record_property("taylor_T5_truncation_error", err)
    assert deviation <= err + 1e-12
    assert 1e-5 < err < 2e-3  # T=5 with ||A|| ≈ 1: paper Table 8 reports 0.001; the scalar bound is 0.0014
    # The FFT (Sedghi) spectrum the layer reports is the Jacobian's.
    torch.testing.assert_close(
        layer.singular_values().sort().values[-sv.numel() :], sv.sort().values, rtol=0, atol=1e-12
    )


def test_zero_padding_negative_control_is_not_orthogonal():
    # The same ECO kernel with zero instead of circular padding: the Jacobian test must see it.
    layer = make(4, 4, 3, 1, 6).eval()
    kernel = layer.kernel()
    pl, pr, pt, pb = layer.padding

    def zero_padded(x):
        return F.conv2d(F.pad(x, (pl, pr, pt, pb)), kernel, dilation=layer.dilation).flatten()

    x = torch.randn(1, 4, 6, 6, dtype=F64)
    sv = torch.linalg.svdvals(jacrev(zero_padded)(x).reshape(-1, x.numel()).detach())
    assert float((sv - 1).abs().max()) > 0.05


def test_gradient_reaches_the_skew_parameters():
    layer = EcoConv2d(4, 4, 3, input_size=6).train()
    layer(torch.randn(2, 4, 6, 6)).square().sum().backward()
    assert layer.skew.grad is not None and float(layer.skew.grad.abs().max()) > 0


def test_power_iteration_converges_to_the_spectral_norm():
    layer = make(5, 5, 3, 1, 3)
    a = layer.skew_matrices().detach()
    sigma = (a.transpose(-1, -2) @ layer.u[..., None]).norm(dim=(-2, -1))
    torch.testing.assert_close(sigma, torch.linalg.matrix_norm(a, ord=2), rtol=1e-4, atol=0)


# --------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (
            {"in_channels": 4, "out_channels": 4, "kernel_size": 3, "input_size": 4},
            "4, which kernel_size=3 does not divide",
        ),
        (
            {"in_channels": 4, "out_channels": 4, "kernel_size": 3, "input_size": (6, 8)},
            "width seen by the convolution is 8",
        ),
        (
            {"in_channels": 2, "out_channels": 8, "kernel_size": 3, "stride": 2, "input_size": 8},
            "is 4, which kernel_size=3",
        ),
        ({"in_channels": 2, "out_channels": 8, "kernel_size": 3, "stride": 2, "input_size": 9}, "stride=2 must divide"),
        ({"in_channels": 2, "out_channels": 2, "kernel_size": 2, "input_size": 5}, "5, which kernel_size=2"),
        ({"in_channels": 2, "out_channels": 2, "kernel_size": 0, "input_size": 4}, "`kernel_size` must be an int >= 1"),
        ({"in_channels": 2, "out_channels": 2, "kernel_size": 3, "input_size": 0}, "`input_size`"),
        (
            {"in_channels": 2, "out_channels": 2, "kernel_size": 3, "input_size": 6, "orthogonal_map": "cayley"},
            "`orthogonal_map`",
        ),
        ({"in_channels": 2, "out_channels": 2, "kernel_size": 3, "input_size": 6, "train_terms": 0}, "`train_terms`"),
    ],
)
def test_impossible_sizes_raise_at_construction(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        EcoConv2d(**kwargs)


def test_wrong_input_size_at_forward_raises():
    layer = EcoConv2d(2, 2, 3, input_size=6)
    with pytest.raises(ValueError, match=r"input_size=\(6, 6\)"):
        layer(torch.randn(1, 2, 9, 9))


# -------------------------------------------------------------------------------------------- bake
@pytest.mark.parametrize("c_in, c_out, k, s, n", CONFIGS)
def test_baked_layer_equals_training_forward(c_in, c_out, k, s, n):
    layer = make(c_in, c_out, k, s, n, orthogonal_map="matrix_exp").train()
    layer.update_power_iteration = True  # the real flow: the training forward refreshes u, bake reuses it
    x = torch.randn(3, c_in, *spatial(n), dtype=F64)
    y_train = layer(x).detach()
    layer.bake()
    y_baked = layer(x).detach()
    rel = float((y_baked - y_train).norm() / y_train.norm())
    assert rel <= 1e-6, rel
    assert set(layer.state_dict()) == {"weight", "bias"}
    assert not any(name == "skew" for name, _ in layer.named_parameters())


def test_baked_taylor_layer_differs_from_training_forward_by_the_truncation_only():
    layer = make(4, 4, 3, 1, 6, orthogonal_map="taylor").train()
    x = torch.randn(3, 4, 6, 6, dtype=F64)
    y_train = (layer(x) - layer.bias.view(1, -1, 1, 1)).detach()
    err = layer.truncation_error()
    y_baked = (layer.bake()(x) - layer.bias.view(1, -1, 1, 1)).detach()
    # y_train - y_baked = (S_T - exp) applied per frequency, so its norm is at most err·||x||.
    assert 0 < float((y_train - y_baked).norm()) <= err * float(x.norm()) * (1 + 1e-9)


def test_baked_forward_is_one_dilated_conv(monkeypatch):
    layer = make(4, 4, 3, 1, 6).bake()
    x = torch.randn(2, 4, 6, 6, dtype=F64)
    expected = layer(x)
    calls = []
    real_conv2d = F.conv2d
    monkeypatch.setattr(F, "conv2d", lambda *a, **kw: calls.append(kw) or real_conv2d(*a, **kw))
    monkeypatch.setattr(torch, "matrix_exp", lambda *a, **kw: pytest.fail("a baked layer must not orthogonalise"))
    torch.testing.assert_close(layer(x), expected, rtol=0, atol=0)
    assert len(calls) == 1 and calls[0]["dilation"] == (2, 2)
    # Independent reference: torch's own circular-padded dilated Conv2d with the stored kernel.
    reference = nn.Conv2d(4, 4, 3, dilation=2, padding=2, padding_mode="circular", dtype=F64)
    with torch.no_grad():
        reference.weight.copy_(layer.weight)
        reference.bias.copy_(layer.bias)
    monkeypatch.undo()
    torch.testing.assert_close(layer(x), reference(x), rtol=0, atol=1e-12)


def test_baked_weights_round_trip_through_safetensors(tmp_path):
    layer = make(2, 8, 3, 2, 12).bake()
    save_file(layer.state_dict(), tmp_path / "eco.safetensors")
    loaded = EcoConv2d(2, 8, 3, 2, input_size=12, baked=True, dtype=F64)
    loaded.load_state_dict(load_file(tmp_path / "eco.safetensors"))
    x = torch.randn(2, 2, 12, 12, dtype=F64)
    torch.testing.assert_close(loaded(x), layer(x), rtol=0, atol=0)


def test_eval_cache_follows_parameter_updates():
    layer = make(4, 4, 3, 1, 6).eval()
    x = torch.randn(1, 4, 6, 6, dtype=F64)
    with torch.no_grad():
        before = layer(x)
        layer.skew.add_(0.1)
        after = layer(x)
    assert float((after - before).abs().max()) > 1e-3


# ----------------------------------------------------------------------------------------------- building blocks
def taylor_remainder(theta: float, terms: int) -> float:
    """``Σ_{i>T} θ^i / i!``: how far the T-term series of exp can move a singular value of an orthogonal exp(J)."""
    return math.exp(theta) - sum(theta**i / math.factorial(i) for i in range(terms + 1))


@pytest.mark.parametrize(
    "c_in, c_out, s, n", [(4, 4, 1, 6), (3, 6, 1, 5), (6, 3, 1, 4), (2, 8, 2, 8), (3, 5, 1, 1), (16, 16, 1, 6)]
)
def test_soc_is_orthogonal_up_to_its_taylor_remainder_with_the_fantastic_four_scaling(
    c_in, c_out, s, n, record_property
):
    layer = SocConv2d(c_in, c_out, 3, s, input_size=n, dtype=F64)
    layer.update_power_iteration = False
    kernel = layer.skew_kernel().detach()
    # ||J_L||_2 from the materialised Jacobian of the convolution with the scaled kernel alone.
    size = layer.conv_size
    conv = lambda z: F.conv2d(F.pad(z, layer.padding, mode="circular"), kernel).flatten()  # noqa: E731
    theta = float(
        torch.linalg.svdvals(
            jacrev(conv)(torch.randn(1, layer.width, *size, dtype=F64)).reshape(-1, layer.width * size[0] * size[1])
        ).max()
    )
    record_property("soc_operator_norm_at_init", theta)
    assert theta <= layer.correction * layer.kernel_size * (1 + 1e-9)  # √(k²)·min σ bounds the operator
    if n > 1:
        assert theta > 1.0  # the SOC code's scaling (~1.2), not the old k·||R3|| one (~0.35)
    for mode in (True, False):  # T = 5 (train) and T = 10 (eval) terms
        layer.train(mode)
        sv = torch.linalg.svdvals(jacobian(layer, c_in, (n, n)))
        remainder = taylor_remainder(theta, layer.terms)
        assert float(sv.max()) <= 1 + remainder and float(sv.min()) >= 1 - remainder
        assert layer.lipschitz_constant() == pytest.approx(float(sv.max()), rel=1e-12)


def test_soc_rejects_even_kernels():
    with pytest.raises(ValueError, match="`kernel_size` must be odd"):
        SocConv2d(2, 2, 2, input_size=4)


def test_maxmin_is_a_pairwise_sort_and_1_lipschitz():
    x, y = torch.randn(64, 8, 3, 3, dtype=F64), torch.randn(64, 8, 3, 3, dtype=F64)
    pairs = torch.stack(x.chunk(2, dim=1), dim=-1).sort(dim=-1, descending=True).values
    torch.testing.assert_close(MaxMin()(x), torch.cat(pairs.unbind(-1), dim=1), rtol=0, atol=0)
    norms = x.flatten(1).norm(dim=1)  # the same 72 squares summed in another order: γ_72 apart, relative
    torch.testing.assert_close(MaxMin()(x).flatten(1).norm(dim=1), norms, rtol=2 * gamma(72, F64), atol=0)
    assert bool(((MaxMin()(x) - MaxMin()(y)).flatten(1).norm(dim=1) <= (x - y).flatten(1).norm(dim=1) + 1e-12).all())
    with pytest.raises(ValueError, match="even number of channels"):
        MaxMin()(torch.randn(1, 3, 2, 2))


def test_row_normalised_linear_has_unit_rows():
    layer = RowNormLinear(16, 5)
    # Normalising a float32 row of 16 and measuring it again each sum 16 squares: within γ_18 of 1 on both counts.
    torch.testing.assert_close(
        layer.normalized_weight().norm(dim=1), torch.ones(5), rtol=0, atol=2 * gamma(18, torch.float32)
    )
