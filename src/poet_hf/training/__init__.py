"""Training with merge-then-reinitialize: `PoetTrainer`, `PoetTrainingArguments`, `MergeReinitCallback`.

Each name loads its module on first use (PEP 562), so reading a command line (`PoetTrainingArguments`) does not import
the trainer, and with it the data libraries.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._quiet_imports import lazy_attributes

if TYPE_CHECKING:  # what the names below resolve to, for type checkers and editors
    from .arguments import PoetTrainingArguments as PoetTrainingArguments
    from .callback import MergeReinitCallback as MergeReinitCallback
    from .callback import clip_threshold as clip_threshold
    from .fused_step import FusedStepOptimizer as FusedStepOptimizer
    from .optimizer import create_poet_optimizer as create_poet_optimizer
    from .optimizer import poet_param_groups as poet_param_groups
    from .optimizer import poet_parameters as poet_parameters
    from .optimizer import reset_optimizer_state as reset_optimizer_state
    from .spectrum import SpectrumCallback as SpectrumCallback
    from .trainer import PoetTrainer as PoetTrainer

_LAZY_EXPORTS = {
    "PoetTrainer": "poet_hf.training.trainer",
    "PoetTrainingArguments": "poet_hf.training.arguments",
    "MergeReinitCallback": "poet_hf.training.callback",
    "SpectrumCallback": "poet_hf.training.spectrum",
    "clip_threshold": "poet_hf.training.callback",
    "create_poet_optimizer": "poet_hf.training.optimizer",
    "FusedStepOptimizer": "poet_hf.training.fused_step",
    "poet_param_groups": "poet_hf.training.optimizer",
    "poet_parameters": "poet_hf.training.optimizer",
    "reset_optimizer_state": "poet_hf.training.optimizer",
}

__all__ = list(_LAZY_EXPORTS)
__getattr__, __dir__ = lazy_attributes(__name__, _LAZY_EXPORTS)
