"""Optimizers for orthogonality-constrained parameters."""

from .feedback_gd import FeedbackGD, stiefel_deviation

__all__ = ["FeedbackGD", "stiefel_deviation"]
