"""Re-initialisation of ``W0`` for pretraining (POET §2, Table 3). Weights are torch ``out × in`` matrices."""

from __future__ import annotations

import torch

from .linalg import polar_factor

__all__ = ["BASE_INIT_SCHEMES", "init_base_weight"]

BASE_INIT_SCHEMES = ("normalized", "xavier", "standard", "uniform_spectrum")


def init_base_weight(
    shape: tuple[int, int], scheme: str, generator: torch.Generator, std: float = 0.02
) -> torch.Tensor:
    """Return a freshly drawn ``out × in`` matrix of ``shape`` for ``scheme``, in float32.

    - ``"standard"``: ``N(0, std²)``.
    - ``"xavier"``: Glorot normal, variance ``2 / (fan_in + fan_out)``.
    - ``"normalized"``: Gaussian, then every output neuron (torch row) scaled to unit L2 norm (the paper's default).
    - ``"uniform_spectrum"``: the polar factor ``U V^T`` of a Gaussian draw (all singular values 1).

    Args:
        shape: ``(out, in)``.
        scheme: one of ``BASE_INIT_SCHEMES``.
        generator: the generator to draw from.
        std: the standard deviation of ``"standard"``.

    Returns:
        The matrix, float32.

    Raises:
        ValueError: ``scheme`` is not one of ``BASE_INIT_SCHEMES``.
    """
    out_features, in_features = shape
    gaussian = torch.randn(out_features, in_features, generator=generator, dtype=torch.float32)
    if scheme == "standard":
        return gaussian * std
    if scheme == "xavier":
        return gaussian * (2.0 / (in_features + out_features)) ** 0.5
    if scheme == "normalized":
        return gaussian / gaussian.norm(dim=1, keepdim=True)
    if scheme == "uniform_spectrum":
        return polar_factor(gaussian).float()
    raise ValueError(f"`base_init` must be one of {BASE_INIT_SCHEMES} or None, got {scheme!r}")
