"""POET: ``W = R·W0·P`` with block- or fully-stochastic Cayley–Neumann rotations (PEFT tuner)."""

from .config import PoetConfig
from .layer import Conv1D, Conv2d, Linear, PoetLayer
from .model import PoetModel, merge_and_reinit, poet_layers

__all__ = ["PoetConfig", "PoetModel", "PoetLayer", "Linear", "Conv1D", "Conv2d", "merge_and_reinit", "poet_layers"]
