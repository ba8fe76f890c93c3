"""Float64 statistics of live block rotations: the norms, errors and angles that training logs and merges record."""

from __future__ import annotations

import math

import torch

from .cayley import neumann_error_bound_at_norm, skew_from_vector
from .linalg import orthogonality_error
from .norm_cap import skew_spectral_norm
from .spo import SideSpec

__all__ = ["block_statistics", "rotation_metrics", "largest_rotation_angle"]


@torch.no_grad()
def block_statistics(rotations: dict[str, tuple[torch.Tensor, torch.Tensor]], neumann_terms: int) -> dict[str, float]:
    """The largest ``||Q||_2``, orthogonality error and Cayley–Neumann bound over every block of every side.

    ``q_norm`` is the largest ``||Q||_2``, ``orth_error`` the largest ``||B Bᵀ − I||_F/√b``, and ``neumann_bound`` the
    bound on any singular value's relative change the rotations cause (POET §5).

    Args:
        rotations: per side, ``(Q, blocks)``: the skew blocks and their ``(num_blocks, b, b)`` rotations.
        neumann_terms: the Cayley–Neumann terms the rotations were built with.
    """
    stats = {"q_norm": 0.0, "orth_error": 0.0}
    bound = 1.0
    for q, blocks in rotations.values():
        largest_norm = torch.linalg.matrix_norm(q, ord=2).max()
        stats["q_norm"] = max(stats["q_norm"], float(largest_norm))
        stats["orth_error"] = max(stats["orth_error"], float(orthogonality_error(blocks).max()))
        # The bound grows with ||Q||_2, so the block with the largest norm has the largest bound.
        bound *= 1 + float(neumann_error_bound_at_norm(largest_norm, neumann_terms))
    stats["neumann_bound"] = bound - 1
    return stats


@torch.no_grad()
def rotation_metrics(blocks: torch.Tensor, spec: SideSpec) -> dict[str, float]:
    """The POET paper's ``e_orth`` and ``Tr(R)/m`` of one side's whole ``m × m`` rotation, from its blocks.

    ``e_orth = ||R Rᵀ − I||_F / ||I||_F`` and the trace metric are those of appendices A, G and J. A permutation
    changes neither, and the identity outside a fully stochastic block adds nothing to the error and ``m − b`` to the
    trace.

    Args:
        blocks: the side's ``(num_blocks, b, b)`` rotations.
        spec: the side's layout.
    """
    # ||RRᵀ − I||_F² is the sum over blocks of ||BBᵀ − I||_F² = b · orthogonality_error(B)².
    squared_error = float((orthogonality_error(blocks) ** 2).sum()) * spec.block
    trace = float(blocks.diagonal(dim1=-2, dim2=-1).sum()) + (spec.dim - spec.block * blocks.shape[0])
    return {"e_orth": math.sqrt(squared_error / spec.dim), "trace": trace / spec.dim}


@torch.no_grad()
def largest_rotation_angle(skews: dict[str, tuple[torch.Tensor, SideSpec]]) -> float:
    """How far, in degrees, the rotations of all sides together can turn a vector.

    Over sides, the sum of ``2·atan(||Q||_2)``: the largest angle of a Cayley rotation, whose eigenvalues are
    ``e^{±2i·atan θ}``.

    Args:
        skews: per side, the skew parameter (one row per block) and the side's layout.
    """
    angle = 0.0
    for vector, spec in skews.values():
        norm = float(skew_spectral_norm(skew_from_vector(vector.float(), spec.block)).max())
        angle += math.degrees(2 * math.atan(norm))
    return angle
