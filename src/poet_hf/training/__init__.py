"""Training with merge-then-reinitialize: `PoetTrainer`, `PoetTrainingArguments`, `MergeReinitCallback`."""

from .arguments import PoetTrainingArguments
from .callback import MergeReinitCallback, clip_threshold
from .fused_step import FusedStepOptimizer
from .optimizer import create_poet_optimizer, poet_param_groups, poet_parameters, reset_optimizer_state
from .spectrum import SpectrumCallback
from .trainer import PoetTrainer

__all__ = [
    "PoetTrainer",
    "PoetTrainingArguments",
    "MergeReinitCallback",
    "SpectrumCallback",
    "clip_threshold",
    "create_poet_optimizer",
    "FusedStepOptimizer",
    "poet_param_groups",
    "poet_parameters",
    "reset_optimizer_state",
]
