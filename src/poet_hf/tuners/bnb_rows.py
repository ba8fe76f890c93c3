"""A 4-bit ``W0`` dequantised a block of rows at a time, so a rotated layer never holds it whole.

bitsandbytes stores a 4-bit weight as codes, two to a byte in row-major order, and one scale (absmax) per block of
``blocksize`` consecutive entries, itself quantised where the layer double-quantises. Rows ``start:stop`` are the
codes ``start·in … stop·in`` and their blocks' scales: where those ranges hold whole blocks and whole bytes,
dequantising them alone gives the same values as dequantising the whole weight (each entry is its code's value times
its block's scale).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import torch

ROW_BLOCK_ENTRIES = 1 << 22  # entries of a 4-bit W0 dequantised at once (16 MB in float32)


def rows_per_block(module: Any) -> int | None:
    """Rows per block: about `ROW_BLOCK_ENTRIES` entries, whole quantisation blocks and whole bytes; ``None`` where the
    weight is better dequantised whole (not 4-bit, or no larger than one block)."""
    weight = module.weight
    state = getattr(weight, "quant_state", None)
    cols, total = module.in_features, module.out_features * module.in_features
    if state is None or state.quant_type not in ("nf4", "fp4") or total <= ROW_BLOCK_ENTRIES:
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
    absmax = state.absmax
    if state.nested:
        absmax = functional.dequantize_blockwise(state.absmax, state.state2) + state.offset
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
