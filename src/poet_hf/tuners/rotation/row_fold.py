"""Merge-then-reinitialize into a 4-bit ``W0`` a group of rows at a time, never holding the dense ``W0`` whole.

A fold computes ``Pᵀ (W0 + E) Rᵀ`` (``E``: the error-feedback residual of the last fold) and requantises it. Done whole
(`RotationLayer.rotate_weight`, `poet_hf.tuners.rotation.quantization.requantize`), it holds several dense float32
copies of ``W0`` at once: the dequantised ``W0``, the residual, the rotated products, the requantisation's round trip
and the new residual.

The output side ``P`` mixes rows only within its blocks (rows ``perm[k·b:(k+1)·b]``; fully stochastic: its subset,
one group however large), and the input side ``R`` mixes entries within each row, so a set of whole output blocks is
folded from its own rows.
Rows that are whole quantisation blocks quantise alone to the codes and scales the whole matrix would get
(`poet_hf.tuners.rotation.quantized_rows.RequantizedRows`); only the double quantisation of the scales needs every row.

Two passes over groups of about `poet_hf.tuners.rotation.quantized_rows.ROW_BLOCK_ENTRIES` entries: the first rotates
each group and quantises it; the second rotates it again and measures it against the new weight (its double-quantised
scales known only now), which gives the new residual and the requantisation error. The old codes and residual are read
by both passes and replaced at the end.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch

from ...orthogonal.spo import BLOCK, FULL, SideSpec
from ..config_utils import SIDE_INPUT, SIDE_OUTPUT
from . import quantization, residual_store
from .quantized_rows import RequantizedRows, dequantize_rows, dequantized_scales, rows_per_block
from .storage_kinds import storage_kind
from .view import RotatedLayerView

__all__ = ["RowGroup", "fold_by_rows", "foldable_by_rows", "output_row_groups"]

ROW_FOLD_MODES = ("feedback", "nearest")  # "stochastic" draws over the whole matrix: it folds whole


@dataclass(frozen=True)
class RowGroup:
    """Rows of ``W0`` that the output side maps onto themselves, with the blocks it applies to them.

    ``blocks`` is ``(k, b, b)`` for ``k·b`` rows taken in block order, or ``None`` where the output side leaves the
    rows as they are."""

    rows: torch.Tensor
    blocks: torch.Tensor | None


def output_row_groups(
    spec: SideSpec | None,
    index: torch.Tensor | None,
    blocks: torch.Tensor | None,
    out: int,
    rows: int,
    device: torch.device | None = None,
) -> Iterator[RowGroup]:
    """Groups of about ``rows`` rows covering ``range(out)`` once, each closed under the output side.

    Args:
        spec: the output side, or ``None`` without one.
        index: its permutation (block) or subset (full); ignored for contiguous blocks.
        blocks: its ``(num_blocks, b, b)`` blocks as applied from the left (``G`` in ``G @ W``).
        out: the number of rows.
        rows: about how many rows per group.
        device: where the row indices go (the weight's device).
    """
    if spec is None or blocks is None:
        yield from _untouched(torch.arange(out, device=device), rows)
        return
    if spec.kind == FULL:
        assert index is not None
        yield RowGroup(index, blocks)
        untouched = torch.ones(out, dtype=torch.bool, device=device)
        untouched[index] = False
        yield from _untouched(untouched.nonzero().squeeze(1), rows)
        return
    order = index if spec.kind == BLOCK and index is not None else torch.arange(out, device=device)
    per = max(1, rows // spec.block)
    for first in range(0, spec.num_blocks, per):
        last = min(first + per, spec.num_blocks)
        yield RowGroup(order[first * spec.block : last * spec.block], blocks[first:last])


def _untouched(rows: torch.Tensor, per: int) -> Iterator[RowGroup]:
    for start in range(0, rows.numel(), per):
        yield RowGroup(rows[start : start + per], None)


def foldable_by_rows(layer: RotatedLayerView, adapter_name: str) -> bool:
    """Whether `fold_by_rows` folds this layer: a 4-bit ``W0`` in bitsandbytes' byte layout, larger than one group,
    rows of whole quantisation and residual blocks, requantised to nearest (with or without error feedback)."""
    if layer.base_quantization is None or not storage_kind(layer.base_quantization).row_blocks:
        return False
    if layer.rotation_settings[adapter_name].requantize not in ROW_FOLD_MODES:
        return False
    module: Any = layer.get_base_layer()  # a bitsandbytes Linear4bit (untyped)
    quantization.adopt_base(module)  # a repacked weight back in the standard layout first
    weight, cols = module.weight, module.in_features
    state = weight.quant_state
    whole_rows = cols % math.lcm(state.blocksize, quantization.RESIDUAL_BLOCK, 2) == 0
    return whole_rows and weight.quant_storage == torch.uint8 and rows_per_block(module) is not None


@torch.no_grad()
def fold_by_rows(layer: RotatedLayerView, adapter_name: str) -> float:
    """Fold ``adapter_name``'s rotations into ``layer``'s 4-bit ``W0`` group by group (the module's two passes).

    The result is `poet_hf.tuners.rotation.quantization.requantize`'s for the whole matrix: the same codes and scales
    for the same rotated values, the residual ``M − dequant(Q(M))`` kept in the layer's residual store under
    ``"feedback"``. The caller checks `foldable_by_rows`.

    Returns:
        The requantisation's relative error ``‖dequant(Q(M)) − M‖_F / ‖M‖_F``.
    """
    module: Any = layer.get_base_layer()  # a bitsandbytes Linear4bit (untyped)
    feedback = layer.rotation_settings[adapter_name].requantize == "feedback"
    dtype = torch.promote_types(module.weight.quant_state.dtype, torch.float32)
    source = _RotatedRows(layer, adapter_name, dtype, feedback)
    groups = list(source.groups(cast(int, rows_per_block(module))))
    new = RequantizedRows(source.state, source.shape, quantization.compute_dtype(module))
    for group in groups:
        new.write(group.rows, source.rotated(group))
    new_state = new.finish()
    error, residual = _measure(source, groups, new.codes, new_state, feedback)
    del source, groups  # the old residual and W0 go before the new residual is written
    _install(module, new.codes, new_state)
    if residual is not None:
        residual_store.keep(module, residual)
    return error


def _measure(
    source: _RotatedRows, groups: list[RowGroup], codes: torch.Tensor, state: Any, feedback: bool
) -> tuple[float, dict[str, torch.Tensor] | None]:
    """The second pass: each group rotated again against the new weight (``codes``, ``state``).

    Returns the relative requantisation error and, under error feedback, the new residual's tensors."""
    out, cols = source.shape
    scales = dequantized_scales(state).view(out, -1)
    device = codes.device
    residual_codes = torch.empty((out, cols) if feedback else (0, 0), dtype=torch.int8, device=device)
    residual_scales = torch.empty(out if feedback else 0, cols // quantization.RESIDUAL_BLOCK, device=device)
    error, norm = 0.0, 0.0  # squared Frobenius norms, summed over the groups
    for group in groups:
        matrix = source.rotated(group)
        difference = matrix.float() - dequantize_rows(codes, scales, group.rows, state).to(source.dtype).float()
        error += float(difference.norm()) ** 2
        norm += float(matrix.norm()) ** 2
        if feedback:
            residual_codes[group.rows], group_scales = quantization.encode_residual(difference)
            residual_scales[group.rows] = group_scales.view(group.rows.numel(), -1)
    relative = math.sqrt(error) / max(math.sqrt(norm), torch.finfo(source.dtype).tiny)
    if not feedback:
        return relative, None
    return relative, {
        quantization.RESIDUAL_CODES: residual_codes,
        quantization.RESIDUAL_SCALES: residual_scales.view(-1),
    }


class _RotatedRows:
    """``(Pᵀ (W0 + E) Rᵀ)[rows]`` of a layer's 4-bit ``W0`` for one group of rows at a time."""

    def __init__(self, layer: RotatedLayerView, adapter_name: str, dtype: torch.dtype, feedback: bool) -> None:
        module: Any = layer.get_base_layer()  # a bitsandbytes Linear4bit (untyped)
        weight = module.weight
        self.shape = (module.out_features, module.in_features)
        self.state = weight.quant_state
        self.codes = weight.data.view(self.shape[0], -1)
        self.scales = dequantized_scales(self.state).view(self.shape[0], -1)
        self.dtype = dtype
        kept = residual_store.read(module, quantization.RESIDUAL_NAMES) if feedback else None
        self.residual = (
            None if kept is None else (kept[quantization.RESIDUAL_CODES], kept[quantization.RESIDUAL_SCALES])
        )
        self.sides: dict[str, tuple[SideSpec, torch.Tensor, torch.Tensor]] = {
            side: (
                spec,
                layer.index_buffer(adapter_name, side),
                layer.rotation_blocks(adapter_name, side, dtype=dtype).transpose(-1, -2),
            )
            for side, spec in layer.sides(adapter_name).items()
        }

    def groups(self, rows: int) -> Iterator[RowGroup]:
        spec, index, blocks = self.sides.get(SIDE_OUTPUT, (None, None, None))
        return output_row_groups(spec, index, blocks, self.shape[0], rows, self.codes.device)

    def rotated(self, group: RowGroup) -> torch.Tensor:
        matrix = dequantize_rows(self.codes, self.scales, group.rows, self.state).to(self.dtype)
        if self.residual is not None:  # rows of whole residual blocks: their codes and their blocks' scales
            codes, scales = self.residual
            kept = quantization.decode_residual(
                codes[group.rows], scales.view(self.shape[0], -1)[group.rows].reshape(-1)
            )
            matrix = matrix + kept.to(self.dtype)
        for side, (spec, index, blocks) in self.sides.items():
            if side == SIDE_INPUT:
                matrix = spec.matmul_right(matrix, index, blocks)
            elif group.blocks is not None:
                count = group.blocks.shape[0]
                matrix = torch.bmm(group.blocks, matrix.view(count, -1, matrix.shape[1])).view(matrix.shape)
        return matrix


def _install(module: Any, codes: torch.Tensor, state: Any) -> None:
    """Give ``module`` the 4-bit weight ``codes`` (``out × in/2`` bytes) with ``state``, as quantising would."""
    import bitsandbytes

    old = module.weight
    module.weight = bitsandbytes.nn.Params4bit(
        data=codes.reshape(-1, 1),
        requires_grad=False,
        quant_state=state,
        blocksize=state.blocksize,
        compress_statistics=state.nested,
        quant_type=state.quant_type,
        quant_storage=old.quant_storage,
        module=module,
        bnb_quantized=True,
    )
    module.quant_state = state
