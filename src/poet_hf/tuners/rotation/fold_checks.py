"""What a merge checks before it folds any rotation into ``W0``: finite parameters, generators inside the map's domain,
and blocks as orthogonal as the map's truncation allows.

A fold is permanent: a non-finite value folded into ``W0`` stays there, and a block that is not a rotation changes
``W0``'s singular values, which POET exists to keep. `merge_and_reinit` checks every layer first and folds none when
one fails, so the model, its merge counts and its checkpoints stay as they were.

The orthogonality a block may lack comes from the map's truncation and float64's rounding. A block whose generator
has norm ``θ`` has its singular values within ``1 ± δ(θ)`` (`OrthogonalMap.deviation_bound`), so
``||B Bᵀ − I||_2 ≤ 2δ + δ²``; the merge's float64 blocks add at most a few ``b·ε`` of rounding (`ROUNDING_MULTIPLE`).
The paper's ``e_orth = ||B Bᵀ − I||_F / √b`` is at most that spectral bound.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ...orthogonal.linalg import orthogonality_error
from ...sharded import full_tensor

if TYPE_CHECKING:
    from .layer import RotationLayer, SideRotations

ROUNDING_MULTIPLE = 64  # float64 rounding allowed in a block's e_orth, in units of b·ε (one Gram product is ~b·ε)


class RotationFoldError(ValueError):
    """A rotation that a merge refuses to fold into ``W0``; nothing was folded."""


def check_finite_rotations(name: str, layer: RotationLayer, adapter_name: str) -> None:
    """Raise `RotationFoldError` naming the layer and side where a rotation parameter holds a non-finite value.

    Args:
        name: the layer's module name, for the message.
        layer: the rotation layer.
        adapter_name: the adapter about to be merged.
    """
    for side in layer.sides(adapter_name):
        param = full_tensor(layer.rotation_parameter(adapter_name, side))
        bad = int((~torch.isfinite(param)).sum())
        if bad:
            raise RotationFoldError(
                f"layer '{name}': the {side} side's rotation parameters hold {bad} non-finite value(s) (merge "
                f"{int(layer.merge_counts[adapter_name]) + 1} of adapter '{adapter_name}'); folding them would make "
                "W0 non-finite for good. Nothing was folded: resume from the last checkpoint with a lower rotation "
                "learning rate (poet_learning_rate)"
            )


def check_foldable_blocks(name: str, layer: RotationLayer, adapter_name: str, rotations: SideRotations) -> None:
    """Raise `RotationFoldError` naming the layer, side and block whose generator is at or past the map's domain
    radius, or whose orthogonality error exceeds what the map's truncation and float64 rounding allow.

    Args:
        name: the layer's module name, for the message.
        layer: the rotation layer.
        adapter_name: the adapter about to be merged.
        rotations: the layer's `float64_rotations` (per side, the generator norms and the blocks).
    """
    orthogonal_map = layer.rotation_settings[adapter_name].orthogonal_map
    radius = orthogonal_map.domain_radius()
    for side, (norms, blocks) in rotations.items():
        where = f"layer '{name}', {side} side"
        block = int(norms.argmax())
        theta = float(norms.flatten()[block])
        if theta >= radius:
            raise RotationFoldError(
                f"{where}, block {block}: the generator's norm ||Q||_2 = {theta:.3g} is at or past the "
                f"{orthogonal_map.describe()}'s radius {radius:g}, where its blocks are no longer rotations; folding "
                "one would change W0's singular values. Nothing was folded: lower the rotation learning rate "
                "(poet_learning_rate) or merge more often (merge_every), and resume from the last checkpoint"
            )
        deviation = orthogonal_map.deviation_bound(norms).to(torch.float64)
        allowed = 2 * deviation + deviation**2 + ROUNDING_MULTIPLE * blocks.shape[-1] * torch.finfo(torch.float64).eps
        errors = orthogonality_error(blocks)
        excess = errors - allowed.reshape(errors.shape)
        if bool((excess > 0).any()):
            worst = int(excess.argmax())
            raise RotationFoldError(
                f"{where}, block {worst}: its orthogonality error {float(errors.flatten()[worst]):.3g} exceeds the "
                f"{float(allowed.flatten()[worst]):.3g} that the {orthogonal_map.describe()} allows at its norm "
                f"{float(norms.flatten()[worst]):.3g}; the block is not the map's rotation. Nothing was folded"
            )
