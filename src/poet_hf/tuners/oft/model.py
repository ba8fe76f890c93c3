"""`OftModel`, the PEFT tuner that wraps target modules in OFT layers (registered with PEFT as ``"poet_oft"``)."""

from __future__ import annotations

from typing import Any

from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn

from ..constants import DEFAULT_TARGET_MODULES
from ..poet.model import PoetModel
from .layer import Conv1D, Conv2d, Linear, OftLayer


def _tuner_layer_class(base_layer: nn.Module) -> type[OftLayer] | None:
    from transformers.pytorch_utils import Conv1D as HFConv1D

    if isinstance(base_layer, nn.Linear):
        return Linear
    if isinstance(base_layer, HFConv1D):
        return Conv1D
    if isinstance(base_layer, nn.Conv2d):
        return Conv2d
    return None


def create_oft_module(config: Any, adapter_name: str, target: nn.Module, layer_name: str, **kwargs: Any) -> OftLayer:
    """Wrap ``target`` in the OFT layer class for its type, or raise a ``ValueError`` naming the type."""
    base_layer = target.get_base_layer() if isinstance(target, BaseTunerLayer) else target
    layer_cls = _tuner_layer_class(base_layer)
    if layer_cls is None:
        raise ValueError(
            f"`target_modules` matched '{layer_name}', a {type(base_layer).__name__}; supported module types are "
            "torch.nn.Linear, transformers Conv1D and torch.nn.Conv2d"
        )
    return layer_cls(target, adapter_name, config=config, layer_name=layer_name, **kwargs)


class OftModel(PoetModel):
    """Turns a model into an OFT model: every target weight ``W0`` is used as ``W0 · R^T``.

    Use it through PEFT: ``get_peft_model(model, OftConfig(...))``. It is :class:`PoetModel` with the OFT layers,
    so PEFT's ``merge_and_unload``, ``save_pretrained``, ``set_adapter``… and :meth:`merge_and_reinit` all work.
    """

    prefix: str = "poet_oft_"
    tuner_layer_cls = OftLayer
    target_module_mapping = DEFAULT_TARGET_MODULES
    layer_factory = staticmethod(create_oft_module)
