"""The frozen ``W0`` of a rotation layer as the torch matrix ``W_t`` (out × in), one class per way it is stored.

`FloatWeight` reads ``nn.Linear.weight``, ``Conv1D.weight.T`` (GPT-2 stores in × out) or ``nn.Conv2d.weight`` viewed
as out × (in/groups·kh·kw); `SixteenBitWeight` is the same storage in bfloat16 or float16, which a fold rounds
(`low_precision`: nearest, stochastic, or with its rounding residual kept for error feedback); `QuantizedWeight4or8`
is a bitsandbytes ``Linear4bit`` / ``Linear8bitLt`` (`quantization`: QOFT, QPOET), which a fold requantises and
whose residual the residual store keeps. `frozen_weight` picks the class from what the base layer stores now (a cast
or a quantisation changes it); every class answers the same small interface.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import cast

import torch
from torch import nn

from ...orthogonal.rotation_sides import WeightSource
from ...sharded import full_tensor, is_dtensor, write_full
from . import dense_reload, low_precision, quantization


class FrozenWeight(ABC):
    """The interface of every storage kind: read ``W0`` as the out × in matrix, write a folded one back.

    Args:
        module: the base layer that stores it.
    """

    quantization: str | None = None  # the storage kind's name (storage_kinds.KINDS) for a bitsandbytes base

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    @property
    @abstractmethod
    def shape(self) -> tuple[int, int]:
        """The logical ``(out, in)`` shape (never a quantised layer's packed storage)."""

    @property
    @abstractmethod
    def dtype(self) -> torch.dtype:
        """The dtype ``W0`` is used in (a quantised base's compute dtype)."""

    @abstractmethod
    def matrix(self) -> torch.Tensor:
        """The out × in matrix: a view of the stored weight, or a dequantised copy."""

    @abstractmethod
    def dense(self) -> WeightSource:
        """``W0`` as the fused forward takes it (`RotatedPass`)."""

    @abstractmethod
    def full_matrix(self) -> torch.Tensor:
        """The whole out × in matrix; under FSDP2 only this weight is gathered, a collective every rank calls."""

    @abstractmethod
    def write(self, matrix: torch.Tensor, requantize: str, generator: torch.Generator | None) -> float | None:
        """Store the whole out × in ``matrix``, rounded by ``requantize`` ("feedback", "nearest", "stochastic" drawing
        from ``generator``) where the storage rounds; under FSDP2 each rank keeps its own shard.

        Returns the relative error a requantisation caused, ``None`` where nothing is requantised."""

    @abstractmethod
    def nbytes(self) -> int:
        """Bytes the stored ``W0`` occupies, with the residual kept on the module."""

    @abstractmethod
    def residual(self) -> torch.Tensor | None:
        """What the last fold's rounding dropped (error feedback), as an out × in matrix, or ``None``."""

    @abstractmethod
    def residual_names(self) -> tuple[str, ...]:
        """The names the residual store keeps this weight's residual under."""

    @abstractmethod
    def expected_residual_bytes(self) -> int:
        """Bytes the residual of error feedback will take."""

    @abstractmethod
    def load(self, state_dict: dict[str, torch.Tensor], prefix: str, layer_prefix: str, base_init: bool) -> None:
        """``load_state_dict`` pre-hook part: what this storage takes of a saved base (keys under ``prefix``)."""


class FloatWeight(FrozenWeight):
    """A float32 (or wider) ``W0`` of an ``nn.Linear``, a ``Conv1D`` (``transposed``) or an ``nn.Conv2d``.

    Args:
        module: the base layer that stores it.
        transposed: whether the stored weight is in × out (``transformers``' ``Conv1D``).
    """

    def __init__(self, module: nn.Module, transposed: bool) -> None:
        super().__init__(module)
        self.transposed = transposed

    @property
    def stored(self) -> torch.Tensor:
        """The weight as the module stores it."""
        return cast(torch.Tensor, self.module.weight)

    @property
    def shape(self) -> tuple[int, int]:
        shape = self.stored.shape
        return (shape[1], shape[0]) if self.transposed else (shape[0], math.prod(shape[1:]))

    @property
    def dtype(self) -> torch.dtype:
        return self.stored.dtype

    def matrix(self) -> torch.Tensor:
        return self._out_by_in(self.stored)

    def dense(self) -> WeightSource:
        return self.matrix()

    def full_matrix(self) -> torch.Tensor:
        return self._out_by_in(full_tensor(self.stored))

    def _out_by_in(self, stored: torch.Tensor) -> torch.Tensor:
        """A tensor in the weight's storage layout as the out × in matrix (a view)."""
        return stored.T if self.transposed else stored.reshape(stored.shape[0], -1)

    def write(self, matrix: torch.Tensor, requantize: str, generator: torch.Generator | None) -> float | None:
        write_full(self.stored, self._in_storage_layout(matrix))
        return None

    def _in_storage_layout(self, matrix: torch.Tensor) -> torch.Tensor:
        return matrix.T if self.transposed else matrix.reshape(self.stored.shape)

    def nbytes(self) -> int:
        """Bytes the stored ``W0`` occupies, with the rounding residual kept on the module."""
        weight = self.stored
        return weight.numel() * weight.element_size() + low_precision.residual_bytes(self.module)

    def residual(self) -> torch.Tensor | None:
        kept = low_precision.residual(self.module)
        return None if kept is None else self._out_by_in(kept)

    def residual_names(self) -> tuple[str, ...]:
        return (low_precision.ROUNDING_RESIDUAL,)

    def expected_residual_bytes(self) -> int:
        return low_precision.expected_residual_bytes(self.stored)

    def load(self, state_dict: dict[str, torch.Tensor], prefix: str, layer_prefix: str, base_init: bool) -> None:
        """``load_state_dict`` pre-hook part: what this storage takes of a saved base (``prefix``).

        A dense base takes what it can of a saved quantised ``W0`` (`dense_reload`) and room for a saved rounding
        residual."""
        if dense_reload.holds_quantized_weight(state_dict, prefix):
            dense_reload.load_onto_dense_base(cast(nn.Linear, self.module), state_dict, layer_prefix, prefix, base_init)
        low_precision.load_residual(self.module, state_dict, prefix)


class SixteenBitWeight(FloatWeight):
    """A bfloat16 or float16 ``W0``: a fold rounds it, to nearest, stochastically, or keeping the rounding residual
    for the next fold (`low_precision`); nearest when FSDP2 shards it."""

    def write(self, matrix: torch.Tensor, requantize: str, generator: torch.Generator | None) -> float | None:
        full = self._in_storage_layout(matrix)
        if not is_dtensor(self.stored):
            full = low_precision.store(self.module, full, requantize, generator)
        write_full(self.stored, full)
        return None


class QuantizedWeight4or8(FrozenWeight):
    """The ``W0`` of a bitsandbytes ``Linear4bit`` or ``Linear8bitLt``, dequantised to read and requantised to write.

    Args:
        module: the bitsandbytes layer.
        holder: the PEFT layer around it, which a write needs (PEFT's backends replace its ``base_layer``).
    """

    def __init__(self, module: nn.Module, holder: quantization.HoldsBaseLayer) -> None:
        super().__init__(module)
        self.holder = holder
        self.quantization = quantization.quantization_of(module)

    @property
    def shape(self) -> tuple[int, int]:
        return cast(int, self.module.out_features), cast(int, self.module.in_features)

    @property
    def dtype(self) -> torch.dtype:
        return quantization.compute_dtype(self.module)

    def matrix(self) -> torch.Tensor:
        return quantization.dequantize(self.module).to(self.dtype)

    def dense(self) -> WeightSource:
        """A dequantising callable: no dequantised copy is kept between forward and backward."""
        return quantization.QuantizedWeight(self.module, self.dtype)

    def full_matrix(self) -> torch.Tensor:
        return self.matrix()

    def write(self, matrix: torch.Tensor, requantize: str, generator: torch.Generator | None) -> float | None:
        return quantization.requantize(self.holder, matrix, requantize, generator)

    def nbytes(self) -> int:
        """Bytes of the codes, their statistics and the residual kept on the module."""
        return quantization.quantized_bytes(self.module)

    def residual(self) -> torch.Tensor | None:
        return quantization.residual(self.module)

    def residual_names(self) -> tuple[str, ...]:
        return quantization.RESIDUAL_NAMES

    def expected_residual_bytes(self) -> int:
        out_features, in_features = self.shape
        return quantization.residual_bytes(out_features * in_features)

    def load(self, state_dict: dict[str, torch.Tensor], prefix: str, layer_prefix: str, base_init: bool) -> None:
        """Install the saved codes together with their statistics, which ``nn.Module``'s loader would drop."""
        quantization.load_quantized_state(self.module, state_dict, prefix)


def frozen_weight(holder: quantization.HoldsBaseLayer, transposed: bool) -> FrozenWeight:
    """The frozen weight of ``holder``'s base layer, as the class of the way it is stored now.

    Args:
        holder: the PEFT layer around the base layer.
        transposed: whether a float base stores its weight in × out (``Conv1D``).
    """
    module = holder.get_base_layer()
    if quantization.quantization_of(module) is not None:
        return QuantizedWeight4or8(module, holder)
    if cast(torch.Tensor, module.weight).dtype in low_precision.LOW_PRECISION_DTYPES:
        return SixteenBitWeight(module, transposed)
    return FloatWeight(module, transposed)
