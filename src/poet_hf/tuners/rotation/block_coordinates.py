"""``W0`` kept in its block coordinates between merges, as POET-X does: ``Ψ_P · W0 · Ψ_Rᵀ`` in the base's weight.

A block-stochastic side works in the coordinates its permutation ``Ψ`` gives (POET eq. 3 with ``R = Ψᵀ D Ψ``). With
``W0`` stored permuted once per merge interval, the fused forward gathers only its input and its output
(`RotatedPass.block_coordinates`), never ``W0`` or its products.

Nobody else sees the permuted weight: the layer's `frozen` weight (every read and write of ``W0``: merges, unmerges,
folds, the plain-autograd reference, exports), its ``state_dict`` and ``load_state_dict``, the disabled or merged
forward and an unload restore the natural ``W0`` first, in place; the next fused forward stores it again. A gather
is exact, so a restored ``W0`` is bit for bit the one stored. The permutations are the adapter's index buffers, which
only a merge, a reset or a load rewrites, each after restoring.

Only a float (32- or 16-bit) ``nn.Linear`` weight whole on this process is stored so (not a quantised base, not a
FSDP2 shard or a ZeRO-3 partition), by a layer class that opts in (POET; OFT's one side keeps ``W0`` as it is).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from ...orthogonal.rotation_sides import WeightSource
from ...orthogonal.spo import BLOCK, inverse_permutation, select_last
from ...sharded import is_dtensor
from ..config_utils import SIDE_INPUT, SIDE_OUTPUT

if TYPE_CHECKING:
    from .view import RotatedLayerView as RotationLayer

__all__ = ["BlockCoordinates"]

ROWS_PER_COPY = 256  # rows whose columns are permuted at once (the one copy a permutation makes)


class BlockCoordinates:
    """Which adapter's block permutations the layer's stored ``W0`` is in (``None``: natural coordinates)."""

    def __init__(self) -> None:
        self.adapter: str | None = None
        self.natural_only = False  # an engine shards the model (or it is unknown): W0 stays natural from then on

    def weight_for_pass(self, layer: RotationLayer, adapter_name: str) -> tuple[WeightSource, bool]:
        """``W0`` for a fused call of ``adapter_name``, and whether it is in the adapter's block coordinates.

        Stores it so first where it can (outside ``torch.compile``, which sees the state as it is)."""
        if self.adapter is not None and self.adapter != adapter_name:
            self.restore(layer)
        if self.adapter is None and not self.natural_only and not torch.compiler.is_compiling():
            if _can_store(layer, adapter_name):
                self.natural_only = not layer.step_state.whole_on_this_process()
                if not self.natural_only:
                    self._permute(layer, adapter_name, inverse=False)
                    self.adapter = adapter_name
        if self.adapter is None:
            return layer.dense_weight(), False
        return cast(torch.Tensor, layer.get_base_layer().weight), True

    def keep_natural(self, layer: RotationLayer) -> None:
        """Restore the natural ``W0`` and keep it so from now on (before an engine shards or partitions it)."""
        self.restore(layer)
        self.natural_only = True

    def restore(self, layer: RotationLayer) -> None:
        """Put the natural ``W0`` back (in place) if it is stored in block coordinates."""
        if self.adapter is None:
            return
        if torch.compiler.is_compiling():
            raise RuntimeError(
                "a POET layer's W0 is stored in block coordinates and something under torch.compile read it; "
                "restore it first with poet_hf.tuners.rotation.layer.restore_natural_coordinates(model)"
            )
        self._permute(layer, self.adapter, inverse=True)
        self.adapter = None

    @torch.no_grad()
    def _permute(self, layer: RotationLayer, adapter_name: str, inverse: bool) -> None:
        """``W ← Ψ_P W Ψ_Rᵀ`` (rows by the output permutation, columns by the input one), or its inverse."""
        weight = cast(torch.Tensor, layer.get_base_layer().weight)
        if is_dtensor(weight) or weight.dim() != 2:
            raise RuntimeError(
                f"the W0 of '{layer.rotation_settings[adapter_name].layer_name}' was stored in block coordinates "
                "and has since been sharded (fully_shard) or partitioned (DeepSpeed); call "
                "poet_hf.tuners.rotation.layer.restore_natural_coordinates(model, keep=True) first, as shard_model "
                "and PoetTrainer do"
            )
        rows, cols = (_permutation(layer, adapter_name, side) for side in (SIDE_OUTPUT, SIDE_INPUT))
        if inverse:
            rows = None if rows is None else inverse_permutation(rows)
            cols = None if cols is None else inverse_permutation(cols)
        # No weight-sized copy: a forward stores W0 while activations are alive (a row, then a group of rows, at once).
        if rows is not None:
            _permute_rows(weight, rows.tolist())
        if cols is not None:
            for start in range(0, weight.shape[0], ROWS_PER_COPY):
                stop = start + ROWS_PER_COPY
                weight[start:stop].copy_(select_last(weight[start:stop], cols))


def _permute_rows(weight: torch.Tensor, order: list[int]) -> None:
    """``weight ← weight[order]`` in place, one cycle of the permutation at a time with one row held aside."""
    done = bytearray(len(order))
    for start, source in enumerate(order):
        if done[start] or source == start:
            continue
        held, row = weight[start].clone(), start
        while order[row] != start:
            done[row] = 1
            weight[row].copy_(weight[order[row]])
            row = order[row]
        done[row] = 1
        weight[row].copy_(held)


def _permutation(layer: RotationLayer, adapter_name: str, side: str) -> torch.Tensor | None:
    spec = layer.sides(adapter_name).get(side)
    return layer.index_buffer(adapter_name, side) if spec is not None and spec.kind == BLOCK else None


def _can_store(layer: RotationLayer, adapter_name: str) -> bool:
    """Whether ``W0`` can be stored in the adapter's block coordinates (see the module docstring)."""
    if not layer.stores_block_coordinates or layer.base_quantization is not None:
        return False
    if all(_permutation(layer, adapter_name, side) is None for side in layer.sides(adapter_name)):
        return False
    base = layer.get_base_layer()
    weight = getattr(base, "weight", None)
    return (
        type(base) is nn.Linear
        and isinstance(weight, torch.Tensor)
        and weight.is_floating_point()
        and weight.device.type != "meta"
        and not is_dtensor(weight)
        and not hasattr(weight, "ds_id")  # a DeepSpeed ZeRO-3 partition
    )
