"""Independent dense float64 references for the tests: explicit permutation, selection and block-diagonal
matrices, the Cayley transform through an explicit inverse and
Householder products as explicit matrices. Nothing here calls poet_hf."""

from __future__ import annotations

import torch


def skew_dense(vec: torch.Tensor, b: int) -> torch.Tensor:
    """Q with Q[i, j] = vec[k], Q[j, i] = -vec[k] for the k-th (i < j) pair in row-major order, by loops."""
    q = torch.zeros(b, b, dtype=torch.float64)
    k = 0
    for i in range(b):
        for j in range(i + 1, b):
            q[i, j] = vec[k]
            q[j, i] = -vec[k]
            k += 1
    return q


def cayley_inverse(q: torch.Tensor) -> torch.Tensor:
    """(I + Q)(I - Q)^{-1} through an explicit float64 inverse."""
    eye = torch.eye(q.shape[-1], dtype=torch.float64)
    return (eye + q.double()) @ torch.linalg.inv(eye - q.double())


def neumann_series(q: torch.Tensor, k: int) -> torch.Tensor:
    """(I + Q) · Σ_{i=0}^{k-2} Q^i by explicit powers (POET eq. 6 truncated)."""
    eye = torch.eye(q.shape[-1], dtype=torch.float64)
    total = torch.zeros_like(eye)
    power = eye.clone()
    for _ in range(k - 1):
        total = total + power
        power = power @ q.double()
    return (eye + q.double()) @ total


def householder_dense(vec: torch.Tensor, b: int) -> torch.Tensor:
    """H(v_1) H(v_2) ⋯ H(v_k) for the k = len(vec) / b consecutive vectors of ``vec``, each
    H(v) = I − 2 v vᵀ / (vᵀ v) formed as a matrix and multiplied in order."""
    eye = torch.eye(b, dtype=torch.float64)
    product = eye.clone()
    for v in vec.double().reshape(-1, b):
        product = product @ (eye - 2 * torch.outer(v, v) / (v @ v))
    return product


def permutation_matrix(perm: torch.Tensor) -> torch.Tensor:
    """Ψ with Ψ x = x[perm]."""
    return torch.eye(perm.numel(), dtype=torch.float64)[perm]


def block_rotation_dense(perm: torch.Tensor | None, blocks: torch.Tensor) -> torch.Tensor:
    """G = Ψ^T Diag(blocks) Ψ (POET eq. 5); Ψ = I for perm=None."""
    diag = torch.block_diag(*blocks.double())
    if perm is None:
        return diag
    psi = permutation_matrix(perm)
    return psi.T @ diag @ psi


def subset_rotation_dense(index: torch.Tensor, block: torch.Tensor, dim: int) -> torch.Tensor:
    """G = I + D(S)(G̃ - I)D(S)^T (POET eq. 4) with D(S) = [e(s_1) … e(s_b)]."""
    selection = torch.eye(dim, dtype=torch.float64)[:, index]
    eye_b = torch.eye(index.numel(), dtype=torch.float64)
    return torch.eye(dim, dtype=torch.float64) + selection @ (block.double() - eye_b) @ selection.T
