"""What the fused forward, the rotation caches and the row-wise fold read of a rotation layer.

`RotatedLayerView` is the typed view those collaborators take instead of the layer itself: the adapter's sides and
rotation parameters, how to build their blocks, and the frozen ``W0`` as the base operation uses it. `RotationLayer`
satisfies it; a test double or another layer class can too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from .caches import CachingLayer

if TYPE_CHECKING:
    from peft.tuners._buffer_dict import BufferDict

    from ...orthogonal.base_ops import Conv2dOp, LinearOp
    from ...orthogonal.rotation_sides import WeightSource
    from ...orthogonal.spo import SideSpec
    from .caches import RotationStepState
    from .settings import RotationSettings


class RotatedLayerView(CachingLayer, Protocol):
    """The rotation layer as its forward and folds read it: sides, rotation parameters, blocks and the frozen weight."""

    @property
    def rotation_settings(self) -> dict[str, RotationSettings]: ...

    @property
    def merge_counts(self) -> BufferDict: ...

    @property
    def step_state(self) -> RotationStepState: ...

    @property
    def is_conv2d(self) -> bool: ...

    @property
    def in_features(self) -> int: ...

    @property
    def out_features(self) -> int: ...

    @property
    def base_quantization(self) -> str | None: ...

    def sides(self, adapter_name: str) -> dict[str, SideSpec]: ...

    def rotation_parameter(self, adapter_name: str, side: str) -> nn.Parameter: ...

    def index_buffer(self, adapter_name: str, side: str) -> torch.Tensor: ...

    def rotation_blocks(
        self,
        adapter_name: str,
        side: str,
        dtype: torch.dtype = torch.float32,
        keep: torch.Tensor | None = None,
        plain: bool = False,
    ) -> torch.Tensor: ...

    def get_base_layer(self) -> nn.Module: ...

    def pad_input(self, x: torch.Tensor) -> torch.Tensor: ...

    def weight_matrix(self) -> torch.Tensor: ...

    def dense_weight(self) -> WeightSource: ...

    def base_bias(self) -> torch.Tensor | None: ...

    def base_operation(self) -> LinearOp | Conv2dOp: ...
