"""A rotation layer's base: its frozen weight (`frozen_weight`, one class per storage kind) and its operation.

The bias is never rotated.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn.functional as F
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn

from ...orthogonal import spo_generator
from ...orthogonal.base_ops import Conv2dOp, LinearOp
from ...orthogonal.rotation_sides import WeightSource
from . import quantization, residual_store
from .caches import RotationStepState
from .frozen_weight import FrozenWeight, frozen_weight
from .quantization import HoldsBaseLayer
from .shardable_quantized import ShardableQuantizedLinear, ShardableQuantizedWeight, stored_quantization
from .storage_kinds import storage_kind


class QuantizedMergeWarning(UserWarning):
    """A merge or unmerge requantised a quantised ``W0``; the message gives the measured error."""


class BaseWeightMixin:
    """The layer's face over its frozen weight (`frozen_weight`) and its base operation (the host is a PEFT layer).

    What depends on how ``W0`` is stored is the frozen weight's; here are what the adapter's settings add to it (the
    residual store, the rounding mode of a fold, the requantisation warning) and the base operation."""

    get_base_layer: Callable[[], nn.Module]
    base_layer: nn.Module
    rotation_settings: dict[str, Any]
    step_state: RotationStepState
    requantization_error: float | None
    pending_quantization: str | None

    def _init_weight_access(self, base_layer: nn.Module) -> None:
        inner = base_layer.get_base_layer() if isinstance(base_layer, BaseTunerLayer) else base_layer
        self._weight_transposed = _is_conv1d(inner)
        self.requantization_error = None  # relative error of the last fold into a quantised W0
        self.pending_quantization = None  # base_quantization of a meta base, for materialize_model

    @property
    def frozen(self) -> FrozenWeight:
        """The frozen ``W0``, as the class of the way its base stores it now (a cast or a quantisation changes it)."""
        base = self.get_base_layer()
        if isinstance(base, ShardableQuantizedLinear):
            return ShardableQuantizedWeight(base)
        return frozen_weight(cast(HoldsBaseLayer, self), self._weight_transposed)

    @property
    def base_quantization(self) -> str | None:
        """The storage kind's name (`storage_kinds.KINDS`) when the base is quantised, else ``None``."""
        return stored_quantization(self.get_base_layer())

    def base_weight(self) -> torch.Tensor:
        """The stored weight of a float base (``Linear``, ``Conv1D``, ``Conv2d``)."""
        return cast(torch.Tensor, self.get_base_layer().weight)

    def base_bias(self) -> torch.Tensor | None:
        return cast("torch.Tensor | None", self.get_base_layer().bias)

    @property
    def weight_shape(self) -> tuple[int, int]:
        """The logical ``(out, in)`` shape of the base weight (never a quantised layer's packed storage)."""
        return self.frozen.shape

    def weight_matrix(self) -> torch.Tensor:
        """The out × in base weight: a view of the stored weight, or a quantised base dequantised (a new tensor)."""
        return self.frozen.matrix()

    def dense_weight(self) -> WeightSource:
        """``W0`` as the fused forward takes it: no dequantised copy is kept between forward and backward."""
        return self.frozen.dense()

    def set_weight_matrix(
        self, matrix: torch.Tensor, requantize: str = "nearest", generator: torch.Generator | None = None
    ) -> None:
        """Write the whole out × in ``matrix`` into the base weight (`FrozenWeight.write`); a requantisation's
        relative error is kept in `requantization_error`."""
        error = self.frozen.write(matrix, requantize, generator)
        if error is not None:
            self.requantization_error = error

    def check_quantizable(self, base_quantization: str, layer_name: str) -> None:
        """Raise a ``ValueError`` naming the layer unless its base can be quantised as ``base_quantization``.

        It can when it is an ``nn.Linear``, or a bitsandbytes layer already quantised the same way."""
        current = self.base_quantization
        base = self.get_base_layer()
        if current is None and type(base) is not nn.Linear:
            raise ValueError(
                f"`base_quantization`={base_quantization!r} quantises nn.Linear targets with bitsandbytes; "
                f"target '{layer_name}' is a {type(base).__name__}"
            )
        if current is not None and current != base_quantization:
            raise ValueError(
                f"`base_quantization`={base_quantization!r}, but target '{layer_name}' is already quantised as "
                f"{current!r}"
            )

    def quantize_base(self, base_quantization: str) -> None:
        """Replace an ``nn.Linear`` base by its quantisation (a kind of `storage_kinds.KINDS`): a bitsandbytes layer,
        or a `ShardableQuantizedLinear`."""
        if self.base_quantization is None:
            linear = cast(nn.Linear, self.get_base_layer())
            if storage_kind(base_quantization).shardable:
                self.base_layer = ShardableQuantizedLinear.from_linear(linear, base_quantization)
            else:
                self.base_layer = quantization.quantize_linear(linear, base_quantization)
        self.pending_quantization = None

    def base_weight_bytes(self) -> int:
        """Bytes the stored ``W0`` occupies: the weight, or a quantised base's codes, statistics and residual."""
        return self.frozen.nbytes()

    def _load_base_state(self, state_dict: dict[str, torch.Tensor], prefix: str, *args: Any) -> None:
        """``load_state_dict`` pre-hook: the base's residual store, then what its storage takes of the saved base.

        A quantised base installs its codes with their statistics, which ``nn.Module``'s loader would drop; a dense
        one takes what it can of a saved quantised ``W0`` (`dense_reload`) and room for a saved rounding residual."""
        if self.rotation_settings:
            self.attach_residual_store(next(iter(self.rotation_settings)))
        base_init = any(settings.base_init for settings in self.rotation_settings.values())
        self.frozen.load(state_dict, f"{prefix}base_layer.", prefix, base_init)

    def attach_residual_store(self, adapter_name: str) -> None:
        """Keep the base's error-feedback residual where ``residual_storage`` says (`residual_store`), and count what
        it will take for the free-space check of the residual files."""
        settings = self.rotation_settings[adapter_name]
        frozen = self.frozen
        expected = frozen.expected_residual_bytes() if settings.requantize == "feedback" else 0
        residual_store.attach(
            self.get_base_layer(),
            settings.residual_storage,
            frozen.residual_names(),
            self.step_state.residual_folder,
            expected,
        )

    @property
    def is_conv2d(self) -> bool:
        return isinstance(self.get_base_layer(), nn.Conv2d)

    def _pads_input(self) -> bool:
        """Whether the input is padded before an unpadded convolution.

        So it is for a ``padding_mode`` other than zeros (as ``nn.Conv2d`` does), and for ``padding="same"`` or
        ``"valid"``, which ``convolution_backward`` does not take."""
        base = self.get_base_layer()
        return isinstance(base, nn.Conv2d) and (base.padding_mode != "zeros" or isinstance(base.padding, str))

    def base_operation(self) -> LinearOp | Conv2dOp:
        """The base layer's operation with its weight given as the out × in matrix."""
        base = self.get_base_layer()
        if not isinstance(base, nn.Conv2d):
            return LinearOp()
        padding = (0, 0) if self._pads_input() else cast(tuple[int, ...], base.padding)
        return Conv2dOp(tuple(base.weight.shape), base.stride, padding, base.dilation, base.groups)

    def pad_input(self, x: torch.Tensor) -> torch.Tensor:
        """Pad ``x`` as the base convolution would (`_pads_input`), with ``nn.Conv2d``'s own left/right split."""
        if not self._pads_input():
            return x
        base = cast(nn.Conv2d, self.get_base_layer())
        mode = "constant" if base.padding_mode == "zeros" else base.padding_mode
        return F.pad(x, base._reversed_padding_repeated_twice, mode=mode)

    def _weight_for_folding(self, adapter_name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The base weight matrix to fold, in float32 (float64 for a float64 base), or ``dtype``.

        When the adapter folds by error feedback, the residual of the last requantisation is added back."""
        frozen = self.frozen
        matrix = frozen.full_matrix()
        matrix = matrix.to(dtype or at_least_float32(matrix.dtype))
        if self.rotation_settings[adapter_name].requantize == "feedback":
            residual = frozen.residual()
            if residual is not None:
                matrix = matrix + residual.to(matrix.dtype)
        return matrix

    def _fold_into_base(self, matrix: torch.Tensor, adapter_name: str, merge_count: int) -> None:
        """Write a folded weight back, requantised by the adapter's ``requantize`` mode.

        A stochastic mode draws from a generator seeded by (seed, merge count, layer): the same on every rank."""
        settings = self.rotation_settings[adapter_name]
        generator = spo_generator(settings.seed, merge_count, settings.layer_name, "requantize", adapter_name)
        self.attach_residual_store(adapter_name)
        self.set_weight_matrix(matrix, settings.requantize, generator)

    def warn_requantized(self, action: str, adapter_name: str) -> None:
        """A fold into a quantised base changes the weight by a requantisation: say by how much (measured)."""
        if self.base_quantization is not None:
            warnings.warn(
                f"{action} adapter '{adapter_name}' into the {self.base_quantization} base of "
                f"'{self.rotation_settings[adapter_name].layer_name}' requantised W0: relative error "
                f"{self.requantization_error:.2e} (||dequant(Q(W)) - W||_F / ||W||_F, measured)",
                QuantizedMergeWarning,
                stacklevel=3,
            )


def _is_conv1d(module: nn.Module) -> bool:
    from transformers.pytorch_utils import Conv1D

    return isinstance(module, Conv1D)


def at_least_float32(dtype: torch.dtype) -> torch.dtype:
    """The dtype a fold or the reference forward computes in: float32, or wider when the weight is."""
    return torch.promote_types(dtype, torch.float32)
