"""Vision models built from orthogonal layers, shipped as Hugging Face ``PreTrainedModel`` classes.

Names are resolved lazily so that importing one model does not import every other.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "EcoConv2d": "poet_hf.orthogonal.eco",
    "AuxiliaryReflection": "poet_hf.orthogonal.reflection",
    "LipConvNetConfig": "poet_hf.vision.lipconvnet",
    "LipConvNetForImageClassification": "poet_hf.vision.lipconvnet",
    "certified_accuracy": "poet_hf.vision.certify",
    "ReflectionFlowConfig": "poet_hf.vision.flow",
    "ReflectionFlowModel": "poet_hf.vision.flow",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
