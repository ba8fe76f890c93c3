"""Small dense linear-algebra helpers shared by the orthogonal maps (pure PyTorch)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["power_iteration", "spectral_norm_estimate"]


@torch.no_grad()
def power_iteration(a: torch.Tensor, u: torch.Tensor, iterations: int) -> torch.Tensor:
    """``iterations`` steps of ``u <- normalize(A Aᵀ u)`` per matrix of the batch ``a``; returns the new left vectors.

    ``u`` (``(..., rows)``) converges to the top left singular vector where the top singular value is separated; the
    estimate ``||Aᵀ u||`` approaches ``||A||_2`` from below. Computed in ``a``'s dtype (no gradient).
    """
    a = a.detach()
    u = u.to(a.dtype)
    for _ in range(iterations):
        v = F.normalize(torch.einsum("...ij,...i->...j", a, u), dim=-1)
        u = F.normalize(torch.einsum("...ij,...j->...i", a, v), dim=-1)
    return u


def spectral_norm_estimate(a: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``||Aᵀ u||``: the spectral norm estimate of :func:`power_iteration`'s vectors (differentiable through ``a``)."""
    return torch.einsum("...ij,...i->...j", a, u.to(a.dtype)).norm(dim=-1)
