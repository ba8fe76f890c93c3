"""Folding: PEFT's own ``merge_and_unload`` turns every tuner layer into a plain weight (``R·W0·P`` for POET)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import torch

from ..tuners.rotation.layer import RotationLayer
from ..tuners.rotation.quantization import dequantize_modules
from ..tuners.rotation.shardable_quantized import dequantize_shardable_modules
from .source import ExportError

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel


def tuner_layer_names(model: PeftModel) -> list[str]:
    """Names (relative to the plain model) of every PEFT tuner layer that the fold will replace."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [name for name, module in model.get_base_model().named_modules() if isinstance(module, BaseTunerLayer)]


def max_merge_count(model: PeftModel) -> int | None:
    """The most merge-then-reinitialize cycles any rotation layer has done; ``None`` without rotation layers."""
    counts = [int(count) for m in model.modules() if isinstance(m, RotationLayer) for count in m.merge_counts.values()]
    return max(counts) if counts else None


def fold(model: PeftModel, progress: bool | None) -> tuple[PreTrainedModel, dict | None]:
    """``merge_and_unload`` in float32: every tuner layer's ``merge`` folds its factors into the base weight.

    Quantised layers (bitsandbytes', and `ShardableQuantizedLinear`) are dequantised first, so the fold is
    ``R·dequant(W0)·P`` in full precision, the function the adapter model computes, and the result is a plain model.
    Returns it and the quantisation config the source had (``None`` if none)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    with torch.no_grad():
        quantization_config = dequantize_modules(model)
        dequantize_shardable_modules(model)
        try:
            plain = model.merge_and_unload(progressbar=show_progress(progress))
        except ValueError as error:  # e.g. an input-dependent orthogonal layer, which has no single weight
            raise ExportError(f"this model cannot be folded into plain weights: {error}") from error
    left = [name for name, m in plain.named_modules() if isinstance(m, BaseTunerLayer)]
    if left:
        raise ExportError(
            f"folding left {len(left)} adapter layers in place (e.g. {left[0]}); export_merged cannot "
            "produce a plain model from this source"
        )
    return plain.eval(), quantization_config


def show_progress(progress: bool | None) -> bool:
    """Progress bars on when asked, or (``None``) when stderr is a terminal."""
    return bool(progress) if progress is not None else sys.stderr.isatty()
