"""OFT layers: the input side alone, ``W_eff = W0 · R^T``, with OFT's own options.

R is block-diagonal (PEFT's contiguous blocks, or block-stochastic with a permutation resampled at each
merge-then-reinitialize); beyond POET, OFT offers a block size given per layer by ``r``, ``block_share`` (one skew
block for all), the COFT projection and multiplicative block dropout. State lives under the ``poet_oft_`` prefix it
is registered with in PEFT. The forward (`OftLayer.adapter_forward`) is all on this page.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, cast

import torch
from peft.tuners._buffer_dict import BufferDict
from torch import nn

from ...orthogonal.spo import make_side_spec
from ..config_utils import SIDE_INPUT
from ..rotation.block_sizes import is_adjusted
from ..rotation.config import RotationConfig
from ..rotation.layer import RotationLayer, RotationSettings
from .config import OftConfig


@dataclass(frozen=True)
class OftOptions:
    """OFT's options beyond the rotation itself (see `OftConfig`)."""

    block_share: bool
    coft: bool
    eps: float
    module_dropout: float


def dropout_keep_mask(num_blocks: int, p: float, device: torch.device) -> torch.Tensor | None:
    """Flags of the blocks kept when ``int(p · num_blocks)`` random blocks become the identity.

    This is PEFT's multiplicative dropout; ``None`` when no block is dropped.

    Uses the global RNG of ``device``, so activation checkpointing (which restores the RNG state) draws the same
    blocks again when it recomputes the forward.
    """
    dropped = int(p * num_blocks)
    if dropped == 0:
        return None
    keep = torch.ones(num_blocks, dtype=torch.bool, device=device)
    keep[torch.randperm(num_blocks, device=device)[:dropped]] = False
    return keep


class OftLayer(RotationLayer):
    """OFT state of one wrapped module: one input-side rotation ``poet_oft_R`` per adapter."""

    adapter_layer_names = ("poet_oft_R",)
    other_param_names = (
        "poet_oft_R_index",
        "poet_oft_merge_count",
        "rotation_specs",
        "rotation_settings",
        "oft_options",
    )

    def _init_containers(self) -> None:
        # Names start with the PEFT prefix "poet_oft_", so PEFT's prefix-based code paths find them.
        self.poet_oft_R = nn.ParameterDict({})
        self.poet_oft_R_index = BufferDict({}, persistent=True)  # empty for contiguous blocks
        self.poet_oft_merge_count = BufferDict({}, persistent=True)
        self.oft_options: dict[str, OftOptions] = {}

    def side_containers(self, side: str) -> tuple[nn.ParameterDict, BufferDict]:
        if side != SIDE_INPUT:
            raise ValueError(f"OFT rotates the input side only, asked for side {side!r}")
        return self.poet_oft_R, self.poet_oft_R_index

    @property
    def merge_counts(self) -> BufferDict:
        return self.poet_oft_merge_count

    def update_layer(self, adapter_name: str, config: RotationConfig, layer_name: str) -> None:
        """Add adapter ``adapter_name`` described by an ``OftConfig``."""
        config = cast(OftConfig, config)  # the OFT tuner builds OFT layers only
        block_size = config.resolve_block_size(self.in_features, layer_name)
        if is_adjusted(config, layer_name, SIDE_INPUT, self.in_features, config.r or config.side_block_size):
            self.adjusted_block_sizes[adapter_name] = {SIDE_INPUT: block_size}
        spec = make_side_spec(config.spo, self.in_features, block_size, 0, layer_name, "block_size")
        self.oft_options[adapter_name] = OftOptions(
            block_share=config.block_share, coft=config.coft, eps=config.eps, module_dropout=config.module_dropout
        )
        settings = RotationSettings.from_config(config, layer_name)
        rows = 1 if config.block_share else spec.num_blocks
        self.add_rotation_adapter(adapter_name, settings, {SIDE_INPUT: spec}, {SIDE_INPUT: rows})

    @torch.no_grad()
    def project_coft(self, adapter_name: str) -> None:
        """COFT: pull every skew block ``Q`` back onto the Frobenius ball of radius ``eps/√rows`` (as PEFT does).

        Written into the parameter only where a block lies outside, so a second forward before ``backward`` does
        not bump the parameter's version under an existing graph.
        """
        param = self.poet_oft_R[adapter_name]
        radius = self.oft_options[adapter_name].eps / math.sqrt(param.shape[0])
        norm = param.norm(dim=-1, keepdim=True) * math.sqrt(2)  # ||Q||_F: each entry appears twice in Q
        outside = norm > radius
        if bool(outside.any()):
            param.copy_(torch.where(outside, param * (radius / norm), param))

    def adapter_forward(
        self, x: torch.Tensor, adapter_names: list[str], keep: dict[str, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """``base(x, W0 · Rᵀ)``, with COFT's projection and, in training, module dropout.

        COFT projects the skew blocks first; module dropout replaces random blocks by the identity in the forward only
        (merges never drop blocks). ``keep`` is as for `RotationLayer.adapter_forward`; an adapter's dropout mask
        replaces its entry."""
        keep = dict(keep or {})
        for a in adapter_names:
            options = self.oft_options[a]
            if options.coft:
                self.project_coft(a)
            if self.training and options.module_dropout > 0:
                mask = dropout_keep_mask(
                    self.sides(a)[SIDE_INPUT].num_blocks, options.module_dropout, self.base_weight().device
                )
                if mask is not None:
                    keep[a] = mask
        return super().adapter_forward(x, adapter_names, keep)


class Linear(nn.Module, OftLayer):
    """OFT around an ``nn.Linear`` (and, through the subclasses, ``Conv1D`` and ``nn.Conv2d``)."""

    def __init__(
        self, base_layer: nn.Module, adapter_name: str, config: RotationConfig, layer_name: str, **kwargs: Any
    ) -> None:
        super().__init__()
        OftLayer.__init__(self, base_layer, **kwargs)
        self._active_adapter = adapter_name
        self.update_layer(adapter_name, config, layer_name)

    forward = OftLayer.forward
    train = OftLayer.train  # flushes deferred rotation gradients on eval()

    def __repr__(self) -> str:
        return "poet_oft." + super().__repr__()


class Conv1D(Linear):
    """OFT around a ``transformers`` ``Conv1D`` (GPT-2), whose weight is stored in × out."""


class Conv2d(Linear):
    """OFT around an ``nn.Conv2d``: ``R`` rotates the ``in·kh·kw`` axis of the weight (``in/groups·kh·kw``).

    The layer calls the base convolution with ``W_flat · R^T``, so it is exactly the base conv at init and exactly
    its merged form later, for every kernel size, stride, padding, dilation and grouping (only POET's output-side P
    would mix channels across groups). PEFT's OFT instead rotates unfolded input patches and folds them back by
    summation, which is neither.
    """
