"""Small dense linear-algebra helpers shared by the orthogonal maps (pure PyTorch)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

__all__ = [
    "invert_blocks",
    "orthogonality_error",
    "polar_factor",
    "power_iteration",
    "random_orthogonal",
    "spectral_norm_estimate",
    "taylor_exp",
]


@torch.no_grad()
def power_iteration(a: torch.Tensor, u: torch.Tensor, iterations: int) -> torch.Tensor:
    """``iterations`` steps of ``u <- normalize(A Aᵀ u)`` per matrix of the batch ``a``; returns the new left vectors.

    ``u`` (``(..., rows)``) converges to the top left singular vector where the top singular value is separated; the
    estimate ``||Aᵀ u||`` approaches ``||A||_2`` from below. Computed in ``a``'s dtype (no gradient).

    Args:
        a: matrices ``(..., m, n)``.
        u: start vectors ``(..., n)``.
        iterations: how many steps.

    Returns:
        The right singular vector estimates ``(..., n)``, normalized.
    """
    a = a.detach()
    u = u.to(a.dtype)
    for _ in range(iterations):
        v = F.normalize(torch.einsum("...ij,...i->...j", a, u), dim=-1)
        u = F.normalize(torch.einsum("...ij,...j->...i", a, v), dim=-1)
    return u


def spectral_norm_estimate(a: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``||Aᵀ u||``, the spectral norm estimate of [`power_iteration`][poet_hf.orthogonal.power_iteration]'s vectors.

    It is differentiable through ``a``."""
    return torch.einsum("...ij,...i->...j", a, u.to(a.dtype)).norm(dim=-1)


def taylor_exp(a: torch.Tensor, terms: int) -> torch.Tensor:
    """Truncated exponential ``Σ_{i=0}^{terms} A^i / i!`` of a batch of (real or complex) square matrices.

    ``terms + 1`` summands, as ECO's Table 8 counts them (ECO Eq. 15, SOC's series). Horner form
    ``I + A(I + A/2(I + A/3(...)))``: one fused multiply-add per term.

    Args:
        a: matrices ``(..., n, n)``.
        terms: how many terms of the series.

    Returns:
        ``Σ_{i<terms} Aⁱ/i!``.
    """
    n = a.shape[-1]
    eye = torch.eye(n, dtype=a.dtype, device=a.device)
    flat = a.reshape(-1, n, n)
    series = eye.expand_as(flat)
    for i in range(terms, 0, -1):
        series = torch.baddbmm(eye, flat, series, alpha=1.0 / i)
    return series.reshape(a.shape)


def random_orthogonal(d: int, generator: torch.Generator, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A Haar-distributed ``d × d`` orthogonal matrix: QR of a float64 Gaussian, signs fixed by ``diag(R) > 0``.

    Args:
        d: the side.
        generator: the generator to draw from.
        dtype: the dtype of the result.

    Returns:
        A Haar-random ``d × d`` orthogonal matrix.
    """
    q, r = torch.linalg.qr(torch.randn(d, d, generator=generator, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))).to(dtype)


def polar_factor(matrix: torch.Tensor) -> torch.Tensor:
    """``U Vᵀ`` for ``matrix = U S Vᵀ`` (thin SVD, in float64): the nearest matrix with orthonormal rows or columns.

    Args:
        matrix: a matrix ``(..., m, n)``.

    Returns:
        ``U Vᵀ`` of its SVD, the nearest matrix with orthonormal rows or columns.
    """
    u, _, vh = torch.linalg.svd(matrix.double(), full_matrices=False)
    return u @ vh


def orthogonality_error(r: torch.Tensor, ord: str | int = "fro") -> torch.Tensor:
    """``||G − I|| / ||I||`` per matrix, in the matrix norm ``ord``, with ``G`` the Gram matrix of the shorter side.

    ``G = R Rᵀ`` for a square or wide ``R`` (orthonormal rows), ``Rᵀ R`` for a tall one (orthonormal columns). With
    ``ord="fro"`` this is the POET paper's ``e_orth = ||R Rᵀ − I||_F / ||I||_F`` (appendix A); with ``ord=2`` it is
    ``max_i |σ_i² − 1|``, the bound a rounding-error analysis needs.

    Args:
        r: matrices ``(..., n, n)``.
        ord: ``"fro"`` (the paper's ``e_orth``) or ``2`` (spectral norm).

    Returns:
        ``||R Rᵀ − I|| / ||I||`` per matrix.
    """
    gram = r @ r.transpose(-1, -2) if r.shape[-2] <= r.shape[-1] else r.transpose(-1, -2) @ r
    eye = torch.eye(gram.shape[-1], dtype=r.dtype, device=r.device)
    identity_norm = gram.shape[-1] ** 0.5 if ord == "fro" else 1.0
    return torch.linalg.matrix_norm(gram - eye, ord=ord) / identity_norm


@torch.no_grad()
def invert_blocks(blocks: torch.Tensor, weight_dtype: torch.dtype) -> tuple[torch.Tensor, dict[str, Any]]:
    """Inverse of a batch of (nearly) orthogonal float64 blocks, and how exactly it restores a merged weight.

    Returns ``B^T`` or ``B^{-1}`` and a report ``{"method", "orth_error", "cond", "error_bound"}``.

    The transpose is used where ``||B^T B − I||_2`` is below the unit roundoff ``u`` of ``weight_dtype`` (then it
    is as exact as the stored weight can be), an exact inverse otherwise. The returned ``error_bound`` estimates
    the relative error ``||W_restored − W0||_F / ||W0||_F`` of one merge/unmerge round trip: the weight is stored
    rounded after the merge, an error the inverse amplifies by the condition number ``κ`` of the blocks
    (``u·(1 + κ)``), plus the float32 merge matmul (``√b·u32·κ``, the usual probabilistic rounding growth), plus,
    on the transpose path, the orthogonality error itself.
    """
    b = blocks.shape[-1]
    orth_error = float(orthogonality_error(blocks, ord=2).max()) if blocks.numel() else 0.0
    singular = torch.linalg.svdvals(blocks)
    cond = float(singular.max() / singular.min())
    u_store = torch.finfo(weight_dtype).eps / 2
    u_merge = torch.finfo(torch.float32).eps / 2
    bound = u_store * (1 + cond) + math.sqrt(b) * u_merge * cond
    if orth_error <= u_store:
        return blocks.transpose(-1, -2), {
            "method": "transpose",
            "orth_error": orth_error,
            "cond": cond,
            "error_bound": bound + orth_error,
        }
    return torch.linalg.inv(blocks), {"method": "solve", "orth_error": orth_error, "cond": cond, "error_bound": bound}
