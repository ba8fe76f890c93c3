"""Auxiliary reflections against independent float64 references: explicit reflection products, jacrev+slogdet."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from poet_hf.orthogonal.reflection import (
    AuxiliaryReflection,
    NewtonConvergenceError,
    auxiliary_reflection,
    auxiliary_reflection_inverse,
    auxiliary_reflection_jacobian,
    auxiliary_reflection_logabsdet,
    invertible_weight,
)

pytestmark = pytest.mark.numerics  # float64 / dense references at tolerances from the math


F64 = torch.float64


def explicit_product(vectors: torch.Tensor) -> torch.Tensor:
    d = vectors.shape[1]
    out = torch.eye(d, dtype=vectors.dtype)
    for v in vectors:
        out = out @ (torch.eye(d, dtype=v.dtype) - 2 * torch.outer(v, v) / v.dot(v))
    return out


def away_from_fixed_subspace(u: torch.Tensor, n: int, gen: torch.Generator) -> torch.Tensor:
    """Random x with ||(I - U) x|| >= 0.1 ||x||, i.e. bounded away from the fixed subspace of U."""
    x = torch.randn(4 * n, u.shape[0], generator=gen, dtype=F64)
    ok = (x @ (torch.eye(u.shape[0], dtype=F64) - u).T).norm(dim=-1) >= 0.1 * x.norm(dim=-1)
    assert ok.sum() >= n
    return x[ok][:n]


def reference_logabsdet(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    jac = torch.func.vmap(torch.func.jacrev(lambda row: auxiliary_reflection(row, weight)))(x)
    return torch.linalg.slogdet(jac)[1]


# --- Theorem 1 -------------------------------------------------------------------------------


@pytest.mark.parametrize("d, k", [(6, 1), (6, 3), (16, 5), (16, 15), (7, 7)])
def test_theorem1_w_equals_identity_minus_u(d, k):
    gen = torch.Generator().manual_seed(10 * d + k)
    u = explicit_product(torch.randn(k, d, generator=gen, dtype=F64))
    w = torch.eye(d, dtype=F64) - u
    assert torch.linalg.matrix_rank(w) == k  # the fixed subspace has dimension d - k
    x = away_from_fixed_subspace(u, 200, gen)
    err = (auxiliary_reflection(x, w) - x @ u.T).abs().max()
    assert err <= 1e-6
    assert err <= 1e-12  # observed ~1e-15: the identity is exact, not approximate


def test_theorem1_any_orthogonal_including_odd_rotation():
    gen = torch.Generator().manual_seed(5)
    q, _ = torch.linalg.qr(torch.randn(5, 5, generator=gen, dtype=F64))
    if torch.linalg.det(q) < 0:
        q[:, 0] = -q[:, 0]  # a rotation in odd dimension always fixes a line
    x = away_from_fixed_subspace(q, 100, gen)
    assert (auxiliary_reflection(x, torch.eye(5, dtype=F64) - q) - x @ q.T).abs().max() <= 1e-12


def test_guard_on_fixed_subspace_gives_x_and_finite_gradients():
    gen = torch.Generator().manual_seed(6)
    vectors = torch.randn(2, 6, generator=gen, dtype=F64)
    u = explicit_product(vectors)
    # x orthogonal to both reflection vectors is fixed by U, so W x = 0 there.
    basis = torch.linalg.svd(vectors).Vh[2:]
    x = torch.cat([torch.randn(3, 4, generator=gen, dtype=F64) @ basis, torch.zeros(1, 6, dtype=F64)])
    w = (torch.eye(6, dtype=F64) - u).requires_grad_()
    x = x.requires_grad_()
    y = auxiliary_reflection(x, w)
    assert (y - x @ u.T).abs().max() <= 1e-12
    gw, gx = torch.autograd.grad(y.sum(), (w, x))
    assert torch.isfinite(gw).all() and torch.isfinite(gx).all()


def test_norm_homogeneity_and_euler_identity():
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(8, 8, generator=gen, dtype=F64)
    x = torch.randn(50, 8, generator=gen, dtype=F64)
    y = auxiliary_reflection(x, w)
    assert (y.norm(dim=-1) - x.norm(dim=-1)).abs().max() <= 1e-12
    for c in (-2.5, 0.3):
        assert (auxiliary_reflection(c * x, w) - c * y).abs().max() <= 1e-12
    jac = auxiliary_reflection_jacobian(x, w)
    assert (torch.einsum("nij,nj->ni", jac, x) - y).abs().max() <= 1e-12


def test_theorem3_jacobian_matches_jacrev():
    gen = torch.Generator().manual_seed(8)
    w = torch.randn(6, 6, generator=gen, dtype=F64)
    x = torch.randn(30, 6, generator=gen, dtype=F64)
    ref = torch.func.vmap(torch.func.jacrev(lambda row: auxiliary_reflection(row, w)))(x)
    assert (auxiliary_reflection_jacobian(x, w) - ref).abs().max() <= 1e-12


# --- log-determinant and Newton inverse ------------------------------------------------------


def _weights(d: int, gen: torch.Generator) -> dict[str, tuple[torch.Tensor, bool]]:
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=F64))
    return {
        "free": (torch.randn(d, d, generator=gen, dtype=F64), False),
        "perturbed_glow": (torch.eye(d, dtype=F64) - q + 0.1 * torch.randn(d, d, generator=gen, dtype=F64), False),
        "invertible": (invertible_weight(torch.randn(d, d, generator=gen, dtype=F64)), True),
        "negative_identity": (invertible_weight(torch.eye(d, dtype=F64)), True),  # W = c I: repeated eigenvalues
    }


@pytest.mark.parametrize("d", [3, 6, 12])
@pytest.mark.parametrize("kind", ["free", "perturbed_glow", "invertible", "negative_identity"])
def test_logdet_matches_slogdet_of_jacrev(d, kind):
    gen = torch.Generator().manual_seed(d)
    w, symmetric = _weights(d, gen)[kind]
    x = torch.randn(64, d, generator=gen, dtype=F64)
    ref = reference_logabsdet(x, w)
    assert (auxiliary_reflection_logabsdet(x, w, symmetric=symmetric) - ref).abs().max() <= 1e-6
    assert (auxiliary_reflection_logabsdet(x, w, symmetric=symmetric) - ref).abs().max() <= 1e-10


@pytest.mark.parametrize("kind", ["free", "invertible", "negative_identity"])
def test_logdet_gradients_match_autograd_of_slogdet(kind):
    gen = torch.Generator().manual_seed(11)
    d = 5
    factor = torch.randn(d, d, generator=gen, dtype=F64) if kind != "negative_identity" else torch.eye(d, dtype=F64)
    factor.requires_grad_()
    x = torch.randn(9, d, generator=gen, dtype=F64, requires_grad=True)
    cot = torch.randn(9, generator=gen, dtype=F64)
    symmetric = kind != "free"

    def build(p):
        return invertible_weight(p) if symmetric else p

    got = torch.autograd.grad((auxiliary_reflection_logabsdet(x, build(factor), symmetric) * cot).sum(), (factor, x))
    ref = torch.autograd.grad((reference_logabsdet(x, build(factor)) * cot).sum(), (factor, x))
    for g, r in zip(got, ref, strict=True):
        assert torch.isfinite(g).all()
        assert (g - r).abs().max() <= 1e-9


def test_linear_case_logdet_is_zero():
    gen = torch.Generator().manual_seed(12)
    u = explicit_product(torch.randn(4, 8, generator=gen, dtype=F64))  # k < d: W singular, repeated eigenvalue 0
    x = away_from_fixed_subspace(u, 50, gen)
    w = torch.eye(8, dtype=F64) - u
    assert (auxiliary_reflection_jacobian(x, w) - u).abs().max() <= 1e-12
    assert auxiliary_reflection_logabsdet(x, w).abs().max() <= 1e-9


@pytest.mark.parametrize("d", [2, 3, 5, 6, 7])
def test_theorem2_invariants(d):
    gen = torch.Generator().manual_seed(20 + d)
    w = invertible_weight(torch.randn(d, d, generator=gen, dtype=F64))
    lam = torch.linalg.eigvalsh(w)
    assert 1.5 * lam[0] > lam[-1]
    x = torch.randn(2000, d, generator=gen, dtype=F64)
    sign, logabs = torch.linalg.slogdet(auxiliary_reflection_jacobian(x, w))
    assert (sign == (-1) ** d).all()
    assert torch.isfinite(logabs).all()


@pytest.mark.parametrize("d", [4, 12, 48])
def test_newton_inverse_under_invertible_construction(d):
    gen = torch.Generator().manual_seed(30 + d)
    w = invertible_weight(torch.randn(d, d, generator=gen, dtype=F64))
    x = torch.randn(500, d, generator=gen, dtype=F64)
    rec = auxiliary_reflection_inverse(auxiliary_reflection(x, w), w)
    assert (rec - x).abs().max() <= 1e-6
    assert (rec - x).abs().max() <= 1e-10


def test_newton_inverse_linear_case():
    gen = torch.Generator().manual_seed(40)
    q, _ = torch.linalg.qr(torch.randn(6, 6, generator=gen, dtype=F64))
    w = torch.eye(6, dtype=F64) - q
    x = away_from_fixed_subspace(q, 200, gen)
    assert (auxiliary_reflection_inverse(x @ q.T, w) - x).abs().max() <= 1e-10


def test_newton_residual_check_raises_or_warns():
    gen = torch.Generator().manual_seed(41)
    w = invertible_weight(torch.randn(6, 6, generator=gen, dtype=F64))
    y = auxiliary_reflection(torch.randn(20, 6, generator=gen, dtype=F64), w)
    with pytest.raises(NewtonConvergenceError, match="did not converge"):
        auxiliary_reflection_inverse(y, w, max_iter=1)
    with pytest.warns(RuntimeWarning, match="did not converge"):
        auxiliary_reflection_inverse(y, w, max_iter=1, on_fail="warn")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        auxiliary_reflection_inverse(y, w, max_iter=1, on_fail="ignore")
    with pytest.raises(ValueError, match="on_fail"):
        auxiliary_reflection_inverse(y, w, on_fail="silent")


def test_newton_inverse_gradient_is_implicit_function_gradient():
    gen = torch.Generator().manual_seed(42)
    factor = torch.randn(4, 4, generator=gen, dtype=F64, requires_grad=True)
    y = torch.randn(3, 4, generator=gen, dtype=F64, requires_grad=True)
    x = auxiliary_reflection_inverse(y, invertible_weight(factor))
    # d x / d y = J(x)^{-1}: compare with the inverse of the jacrev Jacobian at the solution.
    gy = torch.autograd.grad(x[0].sum(), y)[0]
    jac = torch.func.jacrev(lambda row: auxiliary_reflection(row, invertible_weight(factor.detach())))(x[0].detach())
    assert (gy[0] - torch.linalg.inv(jac).sum(0)).abs().max() <= 1e-10


# --- the nn.Module ------------------------------------------------------------------------------------------


def test_module_orthogonal_init_is_glow_1x1_conv():
    layer = AuxiliaryReflection(6, conv1x1=True, seed=3, dtype=F64)
    q = torch.eye(6, dtype=F64) - layer.weight.detach()
    assert (q @ q.T - torch.eye(6, dtype=F64)).abs().max() <= 1e-12
    x = torch.randn(2, 6, 5, 4, dtype=F64)
    y, logdet = layer.forward_and_logdet(x)
    assert (y - F.conv2d(x, q[:, :, None, None])).abs().max() <= 1e-12
    assert logdet.abs().max() <= 1e-9
    assert (layer.inverse(y) - x).abs().max() <= 1e-10


@pytest.mark.parametrize("invertible", [False, True])
def test_module_conv_logdet_is_sum_of_pixel_slogdets(invertible):
    gen = torch.Generator().manual_seed(50)
    layer = AuxiliaryReflection(4, conv1x1=True, invertible=invertible, init="random", seed=1, dtype=F64)
    x = torch.randn(3, 4, 5, 2, generator=gen, dtype=F64)
    y, logdet = layer.forward_and_logdet(x)
    pixels = x.permute(0, 2, 3, 1).reshape(-1, 4)
    ref = reference_logabsdet(pixels, layer.matrix().detach()).reshape(3, -1).sum(-1)
    assert (logdet - ref).abs().max() <= 1e-9
    assert (layer.log_abs_det_jacobian(x) - ref).abs().max() <= 1e-9
    if invertible:
        assert (layer.inverse(y) - x).abs().max() <= 1e-6


def test_module_negative_identity_and_matrix_init():
    x = torch.randn(10, 5, dtype=F64)
    for invertible in (False, True):
        layer = AuxiliaryReflection(5, invertible=invertible, init="negative_identity", dtype=F64)
        assert (layer(x) + x).abs().max() <= 1e-12
    q, _ = torch.linalg.qr(torch.randn(5, 5, dtype=F64))
    layer = AuxiliaryReflection(5, init=q, dtype=F64)
    x = away_from_fixed_subspace(q, 10, torch.Generator().manual_seed(0))
    assert (layer(x) - x @ q.T).abs().max() <= 1e-12


def test_module_state_dict_round_trip_and_seeding():
    a = AuxiliaryReflection(6, invertible=True, init="random", seed=7)
    b = AuxiliaryReflection(6, invertible=True, init="random", seed=8)
    assert not torch.equal(a.factor, b.factor)
    b.load_state_dict(a.state_dict())
    x = torch.randn(4, 6)
    assert torch.equal(a(x), b(x))
    assert torch.equal(AuxiliaryReflection(6, seed=7).weight, AuxiliaryReflection(6, seed=7).weight)


def test_module_validation():
    with pytest.raises(ValueError, match="init"):
        AuxiliaryReflection(4, invertible=True, init="orthogonal")
    with pytest.raises(ValueError, match="init"):
        AuxiliaryReflection(4, init="zeros")
    with pytest.raises(ValueError, match="features"):
        AuxiliaryReflection(1)
    with pytest.raises(ValueError, match="on_fail"):
        AuxiliaryReflection(4, on_fail="never")
    with pytest.raises(ValueError, match="margin"):
        AuxiliaryReflection(4, invertible=True, margin=0.0)
    with pytest.raises(ValueError, match=r"\(B, 4, H, W\)"):
        AuxiliaryReflection(4, conv1x1=True)(torch.randn(2, 3, 2, 2))


def test_vision_export_path():
    from poet_hf.vision import AuxiliaryReflection as exported

    assert exported is AuxiliaryReflection


def test_every_returned_inverse_is_a_verified_preimage_and_unique_only_under_the_invertible_construction():
    gen = torch.Generator().manual_seed(11)
    tol = 100 * torch.finfo(F64).eps
    other_preimages = 0
    for _ in range(300):
        q, _ = torch.linalg.qr(torch.randn(6, 6, generator=gen, dtype=F64))
        unconstrained = torch.eye(6, dtype=F64) - q + 0.1 * torch.randn(6, 6, generator=gen, dtype=F64)
        x = torch.randn(1, 6, generator=gen, dtype=F64)
        y = auxiliary_reflection(x, unconstrained)
        try:
            found = auxiliary_reflection_inverse(y, unconstrained)
        except NewtonConvergenceError:
            continue
        assert float((auxiliary_reflection(found, unconstrained) - y).norm() / y.norm()) <= tol
        other_preimages += int(float((found - x).norm()) > 1e-6 * float(x.norm()))
        constrained = invertible_weight(unconstrained)
        y = auxiliary_reflection(x, constrained)
        torch.testing.assert_close(auxiliary_reflection_inverse(y, constrained), x, rtol=0, atol=1e-10)
    assert other_preimages > 0  # the unconstrained map is not injective: the uniqueness claim needs the construction
