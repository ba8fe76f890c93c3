"""The storage kinds of a quantised frozen ``W0``: each kind's name, bytes, costs and what it supports.

A kind is one entry of `KINDS`; everything that depends on how ``W0`` is stored (the memory planner's bytes, the cost
model's dequantisation, the row-by-row fold and dequantisation, bitsandbytes' layer and loading config in
`poet_hf.tuners.rotation.quantization`) asks the kind, so a new kind is one class (or instance) and one registry
line. The kinds are bitsandbytes' layers (QLoRA's 4-bit NormalFloat and FP4, and LLM.int8()'s 8-bit rows), and the
same codes held as plain tensors a row at a time (``nf4-shardable``, ``int8-shardable``:
`poet_hf.tuners.rotation.shardable_quantized`), which FSDP2 and ZeRO-3 shard like any other parameter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["BASE_QUANTIZATIONS", "EIGHT_BIT", "KINDS", "StorageKind", "storage_kind"]

FOUR_BIT_BLOCK = 64  # entries per absmax of bitsandbytes' 4-bit quantisation
NESTED_BLOCK = 256  # absmax values per float32 scale of its double quantisation
FOUR_BIT_LAYER_BYTES = 16 * 4 + 256 * 4 + 170  # code book, nested code book, packed quant-state header


@dataclass(frozen=True)
class StorageKind:
    """How a frozen ``W0`` is stored, and what follows from it.

    Args:
        name: the ``base_quantization`` value that selects it; for a 4-bit kind, bitsandbytes' ``quant_type``.
        bits: bits per code: 4 (``bnb.nn.Linear4bit``) or 8 (``bnb.nn.Linear8bitLt``).
        dequantize_cost: multiply-add equivalents per entry of one dequantisation (the strategy chooser's cost
            model): a table look-up and a scale for 4-bit, a scale for 8-bit.
        row_blocks: whether ``W0`` is dequantised, and folded at a merge, a block of rows at a time (bitsandbytes'
            packed 4-bit byte layout: `poet_hf.tuners.rotation.quantized_rows`, `poet_hf.tuners.rotation.row_fold`).
        shardable: whether the codes are plain tensors, a row's codes and scales in one row of each
            (`poet_hf.tuners.rotation.shardable_quantized`), which FSDP2 and ZeRO-3 shard; else a bitsandbytes layer,
            whose quantisation state rides on its parameter and is lost when an engine shards it.
    """

    name: str
    bits: int
    dequantize_cost: float
    row_blocks: bool
    shardable: bool = False

    @property
    def code_book(self) -> str:
        """bitsandbytes' ``quant_type`` of a 4-bit kind ("nf4", "fp4"); "int8" for an 8-bit one."""
        return self.name.split("-")[0]

    def stored_bytes(self, rows: int, entries: int) -> int:
        """Bytes of a ``W0`` of ``entries`` entries in ``rows`` rows: its codes and scales.

        4-bit: half a byte per entry, an int8 absmax per 64 entries and a float32 scale per 256 of those (double
        quantisation), and the layer's code books and state header; 8-bit: a byte per entry and a float32 scale per
        row. A shardable 4-bit kind keeps a float32 scale per 64 entries of each row (rows padded to whole blocks),
        no double quantisation: its statistics are a row's own, so any split by rows keeps them whole."""
        if self.bits == 8:
            return entries + 4 * rows
        if self.shardable:
            row = entries // max(rows, 1)
            padded = rows * math.ceil(row / FOUR_BIT_BLOCK) * FOUR_BIT_BLOCK
            return padded // 2 + 4 * padded // FOUR_BIT_BLOCK
        absmax = math.ceil(entries / FOUR_BIT_BLOCK)
        return entries // 2 + absmax + 4 * math.ceil(absmax / NESTED_BLOCK) + FOUR_BIT_LAYER_BYTES


KINDS: dict[str, StorageKind] = {
    kind.name: kind
    for kind in (
        StorageKind("nf4", bits=4, dequantize_cost=2.0, row_blocks=True),
        StorageKind("fp4", bits=4, dequantize_cost=2.0, row_blocks=True),
        StorageKind("int8", bits=8, dequantize_cost=1.0, row_blocks=False),
        StorageKind("nf4-shardable", bits=4, dequantize_cost=2.0, row_blocks=False, shardable=True),
        StorageKind("int8-shardable", bits=8, dequantize_cost=1.0, row_blocks=False, shardable=True),
    )
}
BASE_QUANTIZATIONS = tuple(KINDS)
EIGHT_BIT = KINDS["int8"]  # the kind of every bnb.nn.Linear8bitLt (bitsandbytes names no quant_type for it)


def storage_kind(name: str) -> StorageKind:
    """The kind named ``name`` (a ``base_quantization`` value).

    Raises:
        ValueError: ``name`` is no kind's; the message lists the allowed values.
    """
    if name not in KINDS:
        raise ValueError(f"`base_quantization` must be one of {(None, *BASE_QUANTIZATIONS)}, got {name!r}")
    return KINDS[name]
