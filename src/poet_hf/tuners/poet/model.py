"""`PoetModel`, the PEFT tuner that wraps target modules in POET layers."""

from __future__ import annotations

from ..config_utils import DEFAULT_TARGET_MODULES
from ..rotation.model import RotationModel, merge_and_reinit
from .layer import Conv1D, Conv2d, Linear, PoetLayer

__all__ = ["PoetModel", "merge_and_reinit"]


class PoetModel(RotationModel):
    """Turns a model into a POET model: every target weight ``W0`` is used as ``Pᵀ W0 Rᵀ`` (POET eq. 3).

    Use it through PEFT: ``get_peft_model(model, PoetConfig(...))``. Beyond PEFT's usual calls (``merge_and_unload``,
    ``save_pretrained``, ``set_adapter``…) it offers [`merge_and_reinit`][poet_hf.merge_and_reinit], the training-time
    POET step.
    """

    prefix: str = "poet_"
    tuner_layer_cls = PoetLayer
    target_module_mapping = DEFAULT_TARGET_MODULES  # type: ignore[assignment]  # PEFT annotates lists; it matches regex strings too
    layer_classes = (Linear, Conv1D, Conv2d)
