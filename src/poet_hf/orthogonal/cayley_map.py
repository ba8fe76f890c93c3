"""The Cayley–Neumann map (POET eq. 6) as an `OrthogonalMap`; ``terms=0`` is the exact Cayley transform."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch

from .cayley import (
    SkewRotation,
    cayley_neumann,
    check_terms,
    neumann_error_bound_at_norm,
    neumann_product_count,
    num_skew_params,
    orthogonal_from_vector,
    random_skew_params,
    skew_from_vector,
)
from .map_protocol import OrthogonalMap
from .norm_cap import NormCap, skew_norm_scale, skew_spectral_norm

__all__ = ["CayleyNeumann"]


class _CayleySettings(Protocol):
    neumann_terms: int


@dataclass(frozen=True)
class CayleyNeumann(OrthogonalMap):
    """``R = I + 2Q + … + 2Q^(n−2) + Q^(n−1)`` of the skew ``Q`` on a block's strict upper triangle.

    POET eq. 6 with PEFT's term count ``n`` (the paper's ``k = n − 2``); ``terms=0`` is the exact Cayley transform
    ``(I + Q)(I − Q)^{-1}``. Blocks past the series' domain are rescaled onto `MAX_SKEW_NORM` (`NormCap`).

    Args:
        terms: the number of terms ``n`` (0, or at least 2), PEFT's ``num_cayley_neumann_terms``.
    """

    terms: int = 6
    zero_is_identity: ClassVar[bool] = True
    name: ClassVar[str] = "cayley_neumann"

    def __post_init__(self) -> None:
        check_terms(self.terms, "neumann_terms")

    @classmethod
    def from_config(cls, config: _CayleySettings) -> CayleyNeumann:
        """The map a tuner's config asks for.

        Args:
            config: a tuner's config; its ``neumann_terms`` is the term count.

        Returns:
            The map.
        """
        return cls(config.neumann_terms)

    def describe(self) -> str:
        if self.terms == 0:
            return "exact Cayley transform"
        return f"Cayley–Neumann series, {self.terms} terms (the POET paper's k = {self.terms - 2})"

    def num_params(self, block_size: int) -> int:
        return num_skew_params(block_size)

    def blocks(self, vec: torch.Tensor, block_size: int) -> torch.Tensor:
        return orthogonal_from_vector(vec, block_size, self.terms)

    def reference_blocks(self, vec: torch.Tensor, block_size: int) -> torch.Tensor:
        q = skew_from_vector(vec, block_size)
        scale = skew_norm_scale(q, self.terms)
        return cayley_neumann(q if scale is None else q * scale, self.terms)

    def evaluate(self, vec: torch.Tensor, block_size: int, norm_cap: NormCap | None = None) -> SkewRotation:
        return SkewRotation.from_vector(vec, block_size, self.terms, norm_cap)

    def identity_params(self, shape: tuple[int, ...], block_size: int, generator: torch.Generator) -> torch.Tensor:
        return torch.zeros(shape)  # Q = 0 is R = I

    def random_params(
        self, shape: tuple[int, ...], block_size: int, generator: torch.Generator, op_norm: float
    ) -> torch.Tensor:
        return random_skew_params(shape, block_size, generator, op_norm)

    def product_count(self, block_size: int) -> tuple[int, int]:
        return neumann_product_count(self.terms)

    def generator_norms(
        self,
        vec: torch.Tensor,
        block_size: int,
        blocks: torch.Tensor | None = None,
        estimate: bool = False,
        capped: bool = False,
    ) -> torch.Tensor:
        q = skew_from_vector(vec, block_size)
        scale = skew_norm_scale(q, self.terms) if capped else None  # the factor the blocks are built with
        q = q if scale is None else q * scale
        return skew_spectral_norm(q) if estimate else torch.linalg.matrix_norm(q, ord=2)

    def domain_radius(self) -> float:
        return math.inf if self.terms == 0 else 1.0  # (I − Q)^{-1} = Σ Q^j converges for ||Q||_2 < 1

    def deviation_bound(self, generator_norm: torch.Tensor) -> torch.Tensor:
        return neumann_error_bound_at_norm(generator_norm, self.terms)
