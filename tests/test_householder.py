"""Householder products against ``torch.linalg.householder_product`` and explicit dense reflections (float64)."""

from __future__ import annotations

import pytest
import torch

from poet_hf.orthogonal.householder import (
    apply_householder_sequence,
    householder_decompose,
    householder_matrix,
    householder_product_blocked,
    householder_product_sequential,
    householder_reflect,
)

pytestmark = pytest.mark.numerics  # float64 / dense references at tolerances from the math


F64 = torch.float64


def dense_reflection(v: torch.Tensor) -> torch.Tensor:
    """Reference ``I - 2 v v^T / (v^T v)`` as an explicit matrix."""
    return torch.eye(v.shape[0], dtype=v.dtype) - 2 * torch.outer(v, v) / v.dot(v)


def dense_product(vectors: torch.Tensor) -> torch.Tensor:
    out = torch.eye(vectors.shape[1], dtype=vectors.dtype)
    for v in vectors:
        out = out @ dense_reflection(v)
    return out


@pytest.mark.parametrize(
    "batch, m, n, k",
    [((), 8, 8, 8), ((), 10, 7, 5), ((3,), 16, 12, 12), ((2, 2), 9, 4, 1), ((), 40, 40, 37)],
)
@pytest.mark.parametrize("block_size", [1, 3, 8, 32])
def test_products_match_torch_householder_product(batch, m, n, k, block_size):
    gen = torch.Generator().manual_seed(m * 100 + n * 10 + k)
    a = torch.randn(*batch, m, n, generator=gen, dtype=F64)
    # tau = 2 / ||v||^2 makes every H_i a true reflection, so the product is orthogonal (entries <= 1).
    tau = 2 / (1 + a[..., :, :k].tril(-1).pow(2).sum(-2))
    if k > 2:
        tau[..., 1] = 0  # an identity reflection inside a block
    ref = torch.linalg.householder_product(a, tau)
    seq = householder_product_sequential(a, tau)
    blk = householder_product_blocked(a, tau, block_size=block_size)
    assert (seq - ref).abs().max() <= 1e-12
    assert (blk - ref).abs().max() <= 1e-12


def test_products_match_for_arbitrary_tau():
    # Arbitrary tau gives non-orthogonal factors whose product grows, so compare relative to its size.
    gen = torch.Generator().manual_seed(7)
    a = torch.randn(2, 16, 12, generator=gen, dtype=F64)
    tau = torch.rand(2, 12, generator=gen, dtype=F64) * 2
    ref = torch.linalg.householder_product(a, tau)
    scale = ref.abs().max()
    assert scale > 10
    assert (householder_product_sequential(a, tau) - ref).abs().max() <= 1e-13 * scale
    assert (householder_product_blocked(a, tau, 5) - ref).abs().max() <= 1e-13 * scale


def test_gradients_match_torch_householder_product():
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(12, 9, generator=gen, dtype=F64, requires_grad=True)
    tau = (torch.rand(9, generator=gen, dtype=F64) * 2).requires_grad_()
    weight = torch.randn(12, 9, generator=gen, dtype=F64)
    ref = torch.autograd.grad((torch.linalg.householder_product(a, tau) * weight).sum(), (a, tau))
    for fn in (householder_product_sequential, lambda x, t: householder_product_blocked(x, t, 4)):
        got = torch.autograd.grad((fn(a, tau) * weight).sum(), (a, tau))
        for g, r in zip(got, ref, strict=True):
            assert (g - r).abs().max() <= 1e-10


def test_float32_products_within_1e6():
    gen = torch.Generator().manual_seed(2)
    a = torch.randn(64, 64, generator=gen)
    tau = 2 / (1 + a.tril(-1).pow(2).sum(0))  # the tau of a true reflection: orthogonal result
    ref = torch.linalg.householder_product(a.double(), tau.double())
    assert (householder_product_sequential(a, tau).double() - ref).abs().max() <= 1e-5
    assert (householder_product_blocked(a, tau, 16).double() - ref).abs().max() <= 1e-5


def test_reflection_basics():
    gen = torch.Generator().manual_seed(3)
    v = torch.randn(7, generator=gen, dtype=F64)
    h = householder_reflect(v, torch.eye(7, dtype=F64)).T
    eye = torch.eye(7, dtype=F64)
    assert (h - dense_reflection(v)).abs().max() <= 1e-14
    assert (h @ h - eye).abs().max() <= 1e-12
    assert abs(torch.linalg.det(h) + 1) <= 1e-12
    assert (householder_reflect(v, v) + v).abs().max() <= 1e-12
    assert (householder_reflect(-3.5 * v, eye) - householder_reflect(v, eye)).abs().max() <= 1e-14


@pytest.mark.parametrize("block_size", [None, 1, 4, 32])
def test_dense_vectors_match_explicit_product(block_size):
    gen = torch.Generator().manual_seed(4)
    vectors = torch.randn(11, 9, generator=gen, dtype=F64)
    ref = dense_product(vectors)
    assert (householder_matrix(vectors, block_size) - ref).abs().max() <= 1e-12
    x = torch.randn(5, 9, generator=gen, dtype=F64)
    assert (apply_householder_sequence(vectors, x, block_size) - x @ ref.T).abs().max() <= 1e-12


@pytest.mark.parametrize("d, det_sign", [(6, 1.0), (7, 1.0), (7, -1.0)])
def test_decompose_reconstructs_orthogonal(d, det_sign):
    gen = torch.Generator().manual_seed(d)
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=F64))
    if torch.sign(torch.linalg.det(q)) != det_sign:
        q[:, 0] = -q[:, 0]
    vectors = householder_decompose(q)
    assert vectors.shape[0] <= d
    assert (dense_product(vectors) - q).abs().max() <= 1e-12


def test_invalid_block_size():
    with pytest.raises(ValueError, match="block_size"):
        householder_product_blocked(torch.randn(4, 4), torch.rand(4), block_size=0)
    with pytest.raises(ValueError, match="m >= n >= k"):
        householder_product_sequential(torch.randn(4, 3), torch.rand(4))
