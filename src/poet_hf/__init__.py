"""poet_hf: orthogonal-equivalence training (POET, OFT, orthogonal layers) for the Hugging Face stack.

The POET, OFT and orthogonal tuners register with stock PEFT as soon as PEFT is imported, by whom it does not matter,
so ``peft.get_peft_model(model, PoetConfig(...))`` and ``PeftModel.from_pretrained`` work unchanged after
``import poet_hf``. The import itself is light: every public name loads on first use (PEP 562), so it imports
neither PEFT nor transformers' models, nor through them bitsandbytes, torchao, DeepSpeed or kernels (see
``_quiet_imports``). The vision models register with the Auto classes when ``poet_hf.vision.lipconvnet`` is imported.
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING

from ._quiet_imports import lazy_attributes, run_after_peft_loads
from ._version import __version__ as __version__

if TYPE_CHECKING:  # what the names below resolve to, for type checkers and editors
    from .export import export_merged as export_merged
    from .export import export_peft_adapter as export_peft_adapter
    from .export import push_merged_to_hub as push_merged_to_hub
    from .recipes.memory_plan import plan_memory as plan_memory
    from .training import MergeReinitCallback as MergeReinitCallback
    from .training import PoetTrainer as PoetTrainer
    from .training import PoetTrainingArguments as PoetTrainingArguments
    from .training import create_poet_optimizer as create_poet_optimizer
    from .tuners.oft import OftConfig as OftConfig
    from .tuners.orthogonal_layers import OrthogonalConfig as OrthogonalConfig
    from .tuners.poet import PoetConfig as PoetConfig
    from .tuners.poet import merge_and_reinit as merge_and_reinit
    from .tuners.rotation.caches import defer_rotation_grads as defer_rotation_grads
    from .tuners.rotation.layer import flush_rotation_caches as flush_rotation_caches
    from .tuners.rotation.quantization import keep_quantized_layout as keep_quantized_layout


def _register_tuners() -> None:
    """Import ``poet_hf.tuners``, which registers the tuners with PEFT; a tuners package being imported already
    registers them itself when its import completes."""
    if "poet_hf.tuners" not in sys.modules:
        importlib.import_module("poet_hf.tuners")


run_after_peft_loads(_register_tuners)

_LAZY_EXPORTS = {
    "PoetConfig": "poet_hf.tuners.poet",
    "merge_and_reinit": "poet_hf.tuners.poet",
    "OftConfig": "poet_hf.tuners.oft",
    "OrthogonalConfig": "poet_hf.tuners.orthogonal_layers",
    "defer_rotation_grads": "poet_hf.tuners.rotation.caches",
    "flush_rotation_caches": "poet_hf.tuners.rotation.layer",
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

__all__ = list(_LAZY_EXPORTS)
__getattr__, __dir__ = lazy_attributes(__name__, _LAZY_EXPORTS)
