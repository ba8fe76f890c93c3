"""A 4-bit ``W0`` read and written a block of rows at a time, so a rotated layer never holds it whole.

bitsandbytes stores a 4-bit weight as codes, two to a byte in row-major order, and one scale (absmax) per block of
``blocksize`` consecutive entries, itself quantised where the layer double-quantises. Rows ``start:stop`` are the
codes ``start·in … stop·in`` and their blocks' scales: where those ranges hold whole blocks and whole bytes,
dequantising them alone gives the same values as dequantising the whole weight (each entry is its code's value times
its block's scale), and quantising them alone gives the same codes and scales (`RequantizedRows`); only the double
quantisation of the scales (their mean and 8-bit codes) needs all of them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .storage_kinds import KINDS

ROW_BLOCK_ENTRIES = 1 << 22  # entries of a 4-bit W0 dequantised at once (16 MB in float32)


def rows_per_block(module: Any) -> int | None:
    """Rows per block: about `ROW_BLOCK_ENTRIES` entries, whole quantisation blocks and whole bytes; ``None`` where the
    weight is better dequantised whole (not 4-bit, or no larger than one block)."""
    weight = module.weight
    state = getattr(weight, "quant_state", None)
    cols, total = module.in_features, module.out_features * module.in_features
    if state is None or not getattr(KINDS.get(state.quant_type), "row_blocks", False) or total <= ROW_BLOCK_ENTRIES:
        return None
    if weight.data.numel() * 2 != total:  # not the packed layout this module reads
        return None
    unit = math.lcm(state.blocksize, 2)
    rows_unit = unit // math.gcd(cols, unit)  # the fewest rows of whole blocks and bytes
    wanted = -(-ROW_BLOCK_ENTRIES // cols)
    return -(-wanted // rows_unit) * rows_unit


def dequantized_row_blocks(
    module: Any, dtype: torch.dtype, whole: Callable[[], torch.Tensor]
) -> Iterator[tuple[int, int, torch.Tensor]]:
    """``(start, stop, W0[start:stop])`` of a bitsandbytes ``Linear4bit`` in ``dtype``, block by block; where
    `rows_per_block` says whole, one block from ``whole()``.

    Args:
        module: the ``bnb.nn.Linear4bit`` (in bitsandbytes' standard layout).
        dtype: the dtype of the blocks.
        whole: the whole dequantisation, for a weight that comes whole.
    """
    rows = rows_per_block(module)
    if rows is None:
        yield 0, module.out_features, whole()
        return
    import bitsandbytes.functional as functional

    state = module.weight.quant_state
    absmax = dequantized_scales(state)
    cols, codes = module.in_features, module.weight.data.reshape(-1)
    for start in range(0, module.out_features, rows):
        stop = min(start + rows, module.out_features)
        first, last = start * cols, stop * cols
        part = functional.QuantState(
            absmax=absmax[first // state.blocksize : -(-last // state.blocksize)],
            shape=torch.Size([stop - start, cols]),
            code=state.code,
            blocksize=state.blocksize,
            quant_type=state.quant_type,
            dtype=state.dtype,
        )
        yield start, stop, functional.dequantize_4bit(codes[first // 2 : last // 2], part).to(dtype)


def dequantized_scales(state: Any) -> torch.Tensor:
    """The float32 scale of every quantisation block of a 4-bit ``QuantState``, double-quantised ones dequantised."""
    if not state.nested:
        return state.absmax
    import bitsandbytes.functional as functional

    return functional.dequantize_blockwise(state.absmax, state.state2) + state.offset


def dequantize_rows(codes: torch.Tensor, scales: torch.Tensor, rows: torch.Tensor, state: Any) -> torch.Tensor:
    """Rows ``rows`` of a 4-bit weight, in ``state.dtype``: each entry its code's value times its block's scale.

    Args:
        codes: the packed codes as an ``out × in/2`` byte matrix (rows of whole bytes).
        scales: the dequantised scales as an ``out × in/blocksize`` matrix (rows of whole blocks).
        rows: the row indices, in the order wanted.
        state: the weight's ``QuantState`` (code book, block size, type, dtype).
    """
    import bitsandbytes.functional as functional

    part = functional.QuantState(
        absmax=scales[rows].reshape(-1),
        shape=torch.Size([rows.numel(), codes.shape[1] * 2]),
        code=state.code,
        blocksize=state.blocksize,
        quant_type=state.quant_type,
        dtype=state.dtype,
    )
    return functional.dequantize_4bit(codes[rows].reshape(-1), part)


class RequantizedRows:
    """A new 4-bit weight written a group of rows at a time, with the settings of ``like`` (a ``QuantState``).

    ``bitsandbytes.functional.quantize_4bit`` of the whole matrix, bit for bit, where rows are whole quantisation
    blocks: `write` quantises rows alone (codes and float32 scales), `finish` double-quantises the scales as it does
    (``offset = absmax.mean()``, 8-bit blocks of 256).

    Args:
        like: the ``QuantState`` whose block size, type and double quantisation to keep.
        shape: the weight's ``(out, in)``.
        dtype: the dtype rows are quantised from (the state's ``dtype``).
    """

    def __init__(self, like: Any, shape: tuple[int, int], dtype: torch.dtype) -> None:
        out, cols = shape
        self.like, self.shape, self.dtype = like, shape, dtype
        self.codes = torch.empty(out, cols // 2, dtype=torch.uint8, device=like.absmax.device)
        self.scales = torch.empty(out, cols // like.blocksize, dtype=torch.float32, device=like.absmax.device)

    def write(self, rows: torch.Tensor, matrix: torch.Tensor) -> None:
        """Quantise ``matrix`` (``len(rows) × in``) as rows ``rows`` of the weight."""
        import bitsandbytes.functional as functional

        codes, state = functional.quantize_4bit(
            matrix.to(self.dtype).contiguous(), blocksize=self.like.blocksize, quant_type=self.like.quant_type
        )
        self.codes[rows] = codes.view(rows.numel(), -1)
        self.scales[rows] = state.absmax.view(rows.numel(), -1)

    def finish(self) -> Any:
        """The ``QuantState`` of every row written, the scales double-quantised where ``like``'s are."""
        import bitsandbytes.functional as functional

        absmax = self.scales.reshape(-1)
        settings = {
            "shape": torch.Size(self.shape),
            "dtype": self.dtype,
            "blocksize": self.like.blocksize,
            "code": functional.get_4bit_type(self.like.quant_type, device=absmax.device),
            "quant_type": self.like.quant_type,
        }
        if not self.like.nested:
            return functional.QuantState(absmax=absmax, **settings)
        offset = absmax.mean()
        nested, state2 = functional.quantize_blockwise(absmax - offset, blocksize=256)
        return functional.QuantState(absmax=nested, offset=offset, state2=state2, **settings)
