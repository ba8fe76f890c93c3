"""Orthogonal layers as a PEFT tuner (``"orthogonal"``): Cayley, Householder, auxiliary reflection, FGD, ECO."""

from .config import OrthogonalConfig
from .layer import Conv2d, Linear, OrthogonalLayer, polar_factor
from .model import OrthogonalModel

__all__ = ["OrthogonalConfig", "OrthogonalModel", "OrthogonalLayer", "Linear", "Conv2d", "polar_factor"]
