"""Dense float64 references of a live rotation layer's sides, built from its skew vectors with the explicit
constructions of tests/helpers/reference.py (loops, powers, permutation matrices), on the CPU whatever the layer's
device."""

from __future__ import annotations

import torch
from reference import block_rotation_dense, neumann_series, skew_dense


def dense_side(layer, side: str, adapter: str = "default") -> torch.Tensor:
    """The ``side`` rotation of ``layer`` (``"input"``/``"output"``) as a dense float64 matrix."""
    spec = layer.sides(adapter)[side]
    vec = layer.rotation_parameter(adapter, side).detach().cpu().double()
    terms = layer.rotation_settings[adapter].orthogonal_map.terms
    blocks = torch.stack([neumann_series(skew_dense(row, spec.block), terms) for row in vec])
    index = layer.index_buffer(adapter, side).cpu()
    return block_rotation_dense(index if spec.kind == "block" else None, blocks.expand(spec.num_blocks, -1, -1))
