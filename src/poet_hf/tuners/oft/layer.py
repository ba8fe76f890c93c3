"""OFT layers: the POET layers with the input side only (``W_eff = W0 · R^T``) plus OFT's own options.

All the math (skew parameters, Cayley–Neumann, block application, weight-side Conv2d, merge, unmerge,
merge-then-reinitialize) is :class:`poet_hf.tuners.poet.PoetLayer`'s. This module adds what OFT has and POET has
not: a block size given per layer by ``r``, ``block_share``, the COFT projection and multiplicative block dropout,
and stores its state under the ``poet_oft_`` prefix it is registered with in PEFT.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any, Optional

import torch
from peft.tuners._buffer_dict import BufferDict
from torch import nn

from ..poet import layer as poet_layer
from ..poet.layer import SIDE_INPUT, PoetLayer, SideSpec


def block_dropout(blocks: torch.Tensor, p: float) -> torch.Tensor:
    """Replace ``int(p · num_blocks)`` randomly chosen blocks by the identity (PEFT's multiplicative dropout).

    Uses the global RNG of the blocks' device, so activation checkpointing (which restores the RNG state) draws
    the same blocks again when it recomputes the forward.
    """
    num_blocks, b, _ = blocks.shape
    dropped = int(p * num_blocks)
    if dropped == 0:
        return blocks
    mask = torch.zeros(num_blocks, dtype=torch.bool, device=blocks.device)
    mask[torch.randperm(num_blocks, device=blocks.device)[:dropped]] = True
    eye = torch.eye(b, dtype=blocks.dtype, device=blocks.device)
    return torch.where(mask[:, None, None], eye, blocks)


class OftLayer(PoetLayer):
    """Adapter state of one OFT-wrapped module: one input-side rotation ``R`` per adapter."""

    adapter_layer_names = ("poet_oft_R",)
    other_param_names = ("poet_oft_R_index", "poet_oft_merge_count", "poet_specs", "poet_settings", "oft_settings")

    def _init_adapter_state(self) -> None:
        # Names start with the PEFT prefix "poet_oft_", so PEFT's prefix-based code paths find them.
        self.poet_oft_R = nn.ParameterDict({})
        self.poet_oft_R_index = BufferDict({}, persistent=True)  # empty for contiguous blocks
        self.poet_oft_merge_count = BufferDict({}, persistent=True)
        self.oft_settings: dict[str, dict[str, Any]] = {}
        self._oft_in_forward = False

    @property
    def merge_counts(self) -> BufferDict:
        return self.poet_oft_merge_count

    def _side_containers(self, side: str) -> tuple[nn.ParameterDict, BufferDict]:
        if side != SIDE_INPUT:
            raise ValueError(f"OFT rotates the input side only, asked for side {side!r}")
        return self.poet_oft_R, self.poet_oft_R_index

    def _num_param_rows(self, adapter_name: str, side: str, spec: SideSpec) -> int:
        return 1 if self.oft_settings[adapter_name]["block_share"] else spec.num_blocks

    def update_layer(self, adapter_name: str, config: Any, layer_name: str, spo: Optional[str] = None) -> None:
        """Add adapter ``adapter_name`` described by an ``OftConfig``."""
        block_size = config.resolve_block_size(self.in_features, layer_name)
        self.oft_settings[adapter_name] = {
            "block_share": config.block_share,
            "coft": config.coft,
            "eps": config.eps,
            "module_dropout": config.module_dropout,
        }
        # The POET core reads a PoetConfig-like object: OFT is its input side only.
        core = SimpleNamespace(spo=config.spo, sides="input", block_size=block_size, budget=1.0,
                               neumann_terms=config.neumann_terms, forward=config.forward, seed=config.seed,
                               init_weights=config.init_weights, base_init=None)
        super().update_layer(adapter_name, core, layer_name, spo=config.spo)

    @torch.no_grad()
    def project_coft(self, adapter_name: str) -> None:
        """COFT: pull every skew block ``Q`` back onto the Frobenius ball of radius ``eps/√rows`` (as PEFT does).

        Written into the parameter only where a block lies outside, so a second forward before ``backward`` does
        not bump the parameter's version under an existing graph.
        """
        param = self.poet_oft_R[adapter_name]
        radius = self.oft_settings[adapter_name]["eps"] / math.sqrt(param.shape[0])
        norm = param.norm(dim=-1, keepdim=True) * math.sqrt(2)  # ||Q||_F: each entry appears twice in Q
        outside = norm > radius
        if bool(outside.any()):
            param.copy_(torch.where(outside, param * (radius / norm), param))

    def rotation_blocks(self, adapter_name: str, side: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        settings = self.oft_settings[adapter_name]
        if settings["coft"]:
            self.project_coft(adapter_name)
        blocks = super().rotation_blocks(adapter_name, side, dtype)
        num_blocks = self.poet_specs[adapter_name][side].num_blocks
        if blocks.shape[0] != num_blocks:  # block_share: one block for all
            blocks = blocks.expand(num_blocks, -1, -1)
        elif settings["module_dropout"] > 0 and self.training and self._oft_in_forward:
            blocks = block_dropout(blocks, settings["module_dropout"])
        return blocks

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        # Module dropout applies to the forward only, never to merge / unmerge.
        self._oft_in_forward = True
        try:
            return PoetLayer.forward(self, x, *args, **kwargs)
        finally:
            self._oft_in_forward = False


class Linear(poet_layer.Linear, OftLayer):
    """OFT around an ``nn.Linear``."""

    forward = OftLayer.forward

    def __repr__(self) -> str:
        return "poet_oft." + nn.Module.__repr__(self)


class Conv1D(poet_layer.Conv1D, OftLayer):
    """OFT around a ``transformers`` ``Conv1D`` (GPT-2), whose weight is stored in × out."""

    forward = OftLayer.forward

    def __repr__(self) -> str:
        return "poet_oft." + nn.Module.__repr__(self)


class Conv2d(poet_layer.Conv2d, OftLayer):
    """OFT around an ``nn.Conv2d``: ``R`` rotates the ``in·kh·kw`` axis of the weight (``in/groups·kh·kw``).

    The layer calls the base convolution with ``W_flat · R^T``, so it is exactly the base conv at init and exactly
    its merged form later, for every kernel size, stride, padding, dilation and grouping. (PEFT's OFT instead
    rotates unfolded input patches and folds them back by summation, which is neither.)
    """

    def __init__(self, base_layer: nn.Module, adapter_name: str, config: Any, layer_name: str, **kwargs: Any) -> None:
        # Grouped convolutions are fine here, unlike in POET: R rotates each filter alone; only POET's output-side
        # P would mix channels across groups. So skip poet's Conv2d check and initialise as the Linear does.
        poet_layer.Linear.__init__(self, base_layer, adapter_name, config, layer_name, **kwargs)

    forward = OftLayer.forward

    def __repr__(self) -> str:
        return "poet_oft." + nn.Module.__repr__(self)
