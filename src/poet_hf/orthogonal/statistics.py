"""Float64 statistics of live block rotations: the norms, errors and angles that training logs and merges record."""

from __future__ import annotations

import math

import torch

from .linalg import orthogonality_error
from .map_protocol import OrthogonalMap
from .spo import SideSpec

__all__ = ["block_statistics", "rotation_metrics", "largest_rotation_angle"]


@torch.no_grad()
def block_statistics(
    rotations: dict[str, tuple[torch.Tensor, torch.Tensor]], orthogonal_map: OrthogonalMap
) -> dict[str, float]:
    """The largest ``||Q||_2``, orthogonality error and truncation bound over every block of every side.

    ``q_norm`` is the largest generator norm ``||Q||_2`` (`OrthogonalMap.generator_norms`), ``orth_error`` the
    largest ``||B Bᵀ − I||_F/√b``, and ``neumann_bound`` the bound on any singular value's relative change the
    rotations cause (POET §5; 0 for a map that is orthogonal for any parameters).

    Args:
        rotations: per side, ``(norms, blocks)``: the blocks' generator norms and their ``(num_blocks, b, b)``
            rotations.
        orthogonal_map: the map the rotations were built with.

    Returns:
        ``{"q_norm", "orth_error", "neumann_bound"}``.
    """
    stats = {"q_norm": 0.0, "orth_error": 0.0}
    bound = 1.0
    for norms, blocks in rotations.values():
        largest_norm = norms.max()
        stats["q_norm"] = max(stats["q_norm"], float(largest_norm))
        stats["orth_error"] = max(stats["orth_error"], float(orthogonality_error(blocks).max()))
        # The bound grows with ||Q||_2, so the block with the largest norm has the largest bound.
        bound *= 1 + float(orthogonal_map.deviation_bound(largest_norm))
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


def largest_rotation_angle(norms: dict[str, torch.Tensor]) -> float:
    """How far, in degrees, the rotations of all sides together can turn a vector.

    Over sides, the sum of ``2·atan(||Q||_2)``: the largest angle of a Cayley rotation, whose eigenvalues are
    ``e^{±2i·atan θ}``.

    Args:
        norms: per side, the blocks' generator norms (`OrthogonalMap.generator_norms`).

    Returns:
        The angle in degrees.
    """
    return sum((math.degrees(2 * math.atan(float(side_norms.max()))) for side_norms in norms.values()), 0.0)
