"""POET: ``W = R·W0·P`` with block- or fully-stochastic Cayley–Neumann rotations (PEFT tuner)."""

from ..rotation.model import UntargetedWeightsWarning
from .config import POET_FINETUNE_RECIPES, PoetConfig, PoetFinetuneRecipe
from .layer import Conv1D, Conv2d, Linear, PoetLayer
from .model import PoetModel, merge_and_reinit

__all__ = [
    "PoetConfig",
    "PoetFinetuneRecipe",
    "POET_FINETUNE_RECIPES",
    "PoetModel",
    "PoetLayer",
    "Linear",
    "Conv1D",
    "Conv2d",
    "merge_and_reinit",
    "UntargetedWeightsWarning",
]
