"""Skew-symmetric matrices and the Cayley / Cayley–Neumann maps onto orthogonal matrices.

Convention (shared with PEFT OFTv2 and the POET-X kernel, so adapters interoperate):

- ``Q = M - M^T`` where ``M`` holds the parameter vector on its strict upper triangle.
- Exact Cayley (``terms == 0``): ``R = (I + Q)(I - Q)^{-1}``.
- Cayley–Neumann with ``k`` terms (POET eq. 6 with the inverse replaced by its Neumann series):
  ``R = (I + Q)(I + Q + ... + Q^{k-2}) = I + 2Q + ... + 2Q^{k-2} + Q^{k-1}``.

The truncation error has a closed form: ``R_exact - R_k = R_exact Q^{k-1}`` (Q commutes with
``(I - Q)^{-1}``), so ``R_k = R_exact (I - Q^{k-1})`` and ``||R_k - R_exact||_2 = ||Q||_2^{k-1}``; see ``neumann_error_bound``.
"""

from __future__ import annotations

import torch

__all__ = [
    "num_skew_params",
    "skew_from_vector",
    "cayley",
    "cayley_neumann",
    "orthogonal_from_vector",
    "neumann_error_bound",
    "orthogonality_error",
    "check_neumann_terms",
]


def num_skew_params(block_size: int) -> int:
    """Number of free parameters of a ``block_size x block_size`` skew-symmetric matrix."""
    return block_size * (block_size - 1) // 2


def check_neumann_terms(terms: int, field: str = "neumann_terms") -> None:
    """Raise ``ValueError`` unless ``terms`` is 0 (exact Cayley) or at least 2."""
    if not isinstance(terms, int) or isinstance(terms, bool) or terms < 0 or terms == 1:
        raise ValueError(
            f"`{field}` must be 0 (exact Cayley transform) or an integer >= 2, got {terms!r}; "
            "1 term gives R = 2I, which is not a rotation."
        )


def _triu_indices(block_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = torch.triu_indices(block_size, block_size, offset=1, device=device)
    return rows, cols


def skew_from_vector(vec: torch.Tensor, block_size: int) -> torch.Tensor:
    """Batched skew-symmetric matrices from strict-upper-triangle vectors.

    Args:
        vec: ``(..., block_size * (block_size - 1) / 2)`` parameters, row-major over the upper triangle
            (the order of ``torch.triu_indices(b, b, 1)``, which PEFT OFT also uses).
        block_size: side ``b`` of each matrix.

    Returns:
        ``(..., b, b)`` tensor ``Q`` with ``Q = -Q^T``.
    """
    expected = num_skew_params(block_size)
    if vec.shape[-1] != expected:
        raise ValueError(f"skew vector has {vec.shape[-1]} entries, expected {expected} for block size {block_size}")
    rows, cols = _triu_indices(block_size, vec.device)
    upper = vec.new_zeros(*vec.shape[:-1], block_size, block_size)
    upper[..., rows, cols] = vec
    return upper - upper.transpose(-1, -2)


def cayley(q: torch.Tensor) -> torch.Tensor:
    """Exact Cayley transform ``(I + Q)(I - Q)^{-1}`` of a batch of skew-symmetric matrices."""
    eye = torch.eye(q.shape[-1], dtype=q.dtype, device=q.device)
    # X (I - Q) = (I + Q)  <=>  X = (I + Q)(I - Q)^{-1}; the two factors commute.
    return torch.linalg.solve(eye - q, eye + q, left=False)


def cayley_neumann(q: torch.Tensor, terms: int) -> torch.Tensor:
    """Cayley–Neumann approximation ``I + 2Q + ... + 2Q^{terms-2} + Q^{terms-1}``; ``terms == 0`` is exact."""
    check_neumann_terms(terms)
    if terms == 0:
        return cayley(q)
    eye = torch.eye(q.shape[-1], dtype=q.dtype, device=q.device)
    # Horner form of (I + Q)(I + Q + ... + Q^{k-2}), starting from I + Q: k - 2 matmuls, as many as PEFT's loop.
    series = eye + q
    if terms == 2:
        return series
    for _ in range(terms - 3):
        series = eye + q @ series
    return series + q @ series


def orthogonal_from_vector(vec: torch.Tensor, block_size: int, terms: int) -> torch.Tensor:
    """Rotation blocks ``(..., b, b)`` from skew parameter vectors ``(..., b(b-1)/2)``."""
    return cayley_neumann(skew_from_vector(vec, block_size), terms)


def neumann_error_bound(q: torch.Tensor, terms: int) -> torch.Tensor:
    """Largest deviation from 1 of any singular value of the Cayley–Neumann rotation of ``Q``, per block.

    ``R_k = R_exact (I - Q^{k-1})`` with ``R_exact`` orthogonal and ``Q`` normal, so the singular values of
    ``R_k`` are ``|1 - (iθ)^{k-1}|`` over the eigenvalues ``iθ`` of ``Q``. That distance from 1 grows with
    ``|θ|``, so the largest is reached at ``θ = ||Q||_2``: ``θ^{k-1}`` for odd ``k`` and
    ``sqrt(1 + θ^{2(k-1)}) - 1`` for even ``k``. Zero for the exact transform (``terms == 0``).
    """
    check_neumann_terms(terms)
    if terms == 0:
        return q.new_zeros(q.shape[:-2])
    theta = torch.linalg.matrix_norm(q, ord=2).to(torch.complex128)
    return ((1 - (1j * theta) ** (terms - 1)).abs() - 1).abs().to(q.dtype)


def orthogonality_error(r: torch.Tensor) -> torch.Tensor:
    """``||R R^T - I||_F / sqrt(d)`` per matrix (the POET digest's ``e_orth``)."""
    d = r.shape[-1]
    eye = torch.eye(d, dtype=r.dtype, device=r.device)
    return torch.linalg.matrix_norm(r @ r.transpose(-1, -2) - eye) / d**0.5
