"""`OftModel`, the PEFT tuner that wraps target modules in OFT layers (registered with PEFT as ``"poet_oft"``)."""

from __future__ import annotations

from ..config_utils import DEFAULT_TARGET_MODULES
from ..rotation.model import RotationModel
from .layer import Conv1D, Conv2d, Linear, OftLayer


class OftModel(RotationModel):
    """Turns a model into an OFT model: every target weight ``W0`` is used as ``W0 · Rᵀ``.

    Use it through PEFT: ``get_peft_model(model, OftConfig(...))``. PEFT's ``merge_and_unload``, ``save_pretrained``,
    ``set_adapter``… and [`merge_and_reinit`][poet_hf.merge_and_reinit] all work.
    """

    prefix: str = "poet_oft_"
    tuner_layer_cls = OftLayer
    target_module_mapping = DEFAULT_TARGET_MODULES  # type: ignore[assignment]  # PEFT annotates lists; it matches regex strings too
    layer_classes = (Linear, Conv1D, Conv2d)
