"""poet_hf: orthogonal-equivalence training (POET, OFT, orthogonal layers) for the Hugging Face stack.

Importing this package registers the POET, OFT and orthogonal tuners with stock PEFT, so
``peft.get_peft_model(model, PoetConfig(...))`` and ``PeftModel.from_pretrained`` work unchanged. That and the
config classes are all it imports; the trainer, export and Hub helpers load on first use (PEP 562), and the
vision models register with the Auto classes when ``poet_hf.vision.lipconvnet`` is imported.
"""

from __future__ import annotations

import importlib
from typing import Any

from ._quiet_imports import quiet_optional_kernels

with quiet_optional_kernels():  # PEFT imports torchao and bitsandbytes where installed: see _quiet_imports
    from .tuners.registry import register_tuners

register_tuners()

from ._version import __version__ as __version__  # noqa: E402
from .tuners.oft import OftConfig  # noqa: E402
from .tuners.orthogonal_layers import OrthogonalConfig  # noqa: E402
from .tuners.poet import PoetConfig, merge_and_reinit  # noqa: E402
from .tuners.rotation.caches import defer_rotation_grads  # noqa: E402
from .tuners.rotation.layer import flush_rotation_caches  # noqa: E402

_LAZY_EXPORTS = {
    "PoetTrainer": "poet_hf.training",
    "PoetTrainingArguments": "poet_hf.training",
    "MergeReinitCallback": "poet_hf.training",
    "create_poet_optimizer": "poet_hf.training",
    "export_merged": "poet_hf.export",
    "export_peft_adapter": "poet_hf.export",
    "push_merged_to_hub": "poet_hf.export",
    "plan_memory": "poet_hf.recipes.memory_plan",
    "keep_quantized_layout": "poet_hf.tuners.rotation.quantization",
}

__all__ = [
    "PoetConfig",
    "OftConfig",
    "OrthogonalConfig",
    "merge_and_reinit",
    "defer_rotation_grads",
    "flush_rotation_caches",
    *_LAZY_EXPORTS,
]


def __getattr__(name: str) -> Any:
    if name not in _LAZY_EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
