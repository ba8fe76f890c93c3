"""Products of Householder reflections as an `OrthogonalMap`: each block is ``H(v_1) ⋯ H(v_k)``.

HRA (Yuan et al., 2024, "Bridging the gap between low-rank and orthogonal adaptation via Householder reflection
adaptation"; not among this project's source papers) adapts a weight by such a product, ``H(v) = I − 2 v vᵀ / (vᵀ v)``,
and starts it at the identity with the reflections in equal pairs (``H(v) H(v) = I``). Here the product is one block of
POET's or OFT's rotation; it is orthogonal for any parameters, so nothing is truncated and no norm cap applies. The fast
path is the compact-WY product of [`householder_matrix`][poet_hf.orthogonal.householder_matrix], its backward
autograd's."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from .householder import householder_matrix
from .map_protocol import AutogradEvaluation, OrthogonalMap
from .norm_cap import NormCap

__all__ = ["HouseholderProduct"]


@dataclass(frozen=True)
class HouseholderProduct(OrthogonalMap):
    """``B = H(v_1) ⋯ H(v_k)`` per ``b × b`` block from ``k`` dense reflection vectors (HRA's map).

    Args:
        reflections: reflections per block (``num_reflections``), even (pairs start at the identity); ``None``: ``b``
            rounded down to even, which reaches every rotation of the block.
        wy_block: reflections per compact-WY product in the fast path (``householder_block_size``).
    """

    reflections: int | None = None
    wy_block: int = 32
    zero_is_identity: ClassVar[bool] = False
    name: ClassVar[str] = "householder"

    def __post_init__(self) -> None:
        k = self.reflections
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 2 or k % 2):
            raise ValueError(
                f"`num_reflections` must be an even integer >= 2 (the identity start pairs equal reflections, "
                f"H(v) H(v) = I), got {k!r}"
            )
        if not isinstance(self.wy_block, int) or isinstance(self.wy_block, bool) or self.wy_block < 1:
            raise ValueError(f"`householder_block_size` must be a positive integer, got {self.wy_block!r}")

    @classmethod
    def from_config(cls, config: object) -> HouseholderProduct:
        """The map a tuner's config asks for.

        Args:
            config: a tuner's config; its ``num_reflections`` and ``householder_block_size`` where it has them (the
                orthogonal-layers tuner), ``b`` reflections in WY blocks of 32 otherwise (POET, OFT).

        Returns:
            The map.
        """
        return cls(getattr(config, "num_reflections", None), getattr(config, "householder_block_size", 32))

    def describe(self) -> str:
        reflections = "b" if self.reflections is None else str(self.reflections)
        return f"products of {reflections} Householder reflections per block"

    def count(self, block_size: int) -> int:
        """Reflections per block.

        Args:
            block_size: the side ``b``.

        Returns:
            ``reflections``, or ``b`` rounded down to even.
        """
        return self.reflections if self.reflections is not None else block_size - block_size % 2

    def num_params(self, block_size: int) -> int:
        return self.count(block_size) * block_size

    def _vectors(self, vec: torch.Tensor, block_size: int) -> torch.Tensor:
        return vec.reshape(*vec.shape[:-1], self.count(block_size), block_size)

    def blocks(self, vec: torch.Tensor, block_size: int) -> torch.Tensor:
        vectors = self._vectors(vec, block_size)
        return householder_matrix(vectors, block_size=min(self.wy_block, vectors.shape[-2]))

    def reference_blocks(self, vec: torch.Tensor, block_size: int) -> torch.Tensor:
        return householder_matrix(self._vectors(vec, block_size))  # one reflection at a time

    def evaluate(self, vec: torch.Tensor, block_size: int, norm_cap: NormCap | None = None) -> AutogradEvaluation:
        return AutogradEvaluation(lambda leaf: self.blocks(leaf, block_size), vec)

    def identity_params(self, shape: tuple[int, ...], block_size: int, generator: torch.Generator) -> torch.Tensor:
        pairs = torch.randn(*shape[:-1], self.count(block_size) // 2, 1, block_size, generator=generator)
        return pairs.expand(*pairs.shape[:-2], 2, block_size).reshape(shape)

    def random_params(
        self, shape: tuple[int, ...], block_size: int, generator: torch.Generator, op_norm: float
    ) -> torch.Tensor:
        """Each pair ``(v, v')`` turns its plane by ``2·∠(v, v') = 2·atan(op_norm) / √(k/2)``."""
        k = self.count(block_size)
        first = torch.randn(*shape[:-1], k // 2, block_size, generator=generator)
        first = first / first.norm(dim=-1, keepdim=True)
        other = torch.randn(first.shape, generator=generator)
        other = other - (other * first).sum(-1, keepdim=True) * first
        other = other / other.norm(dim=-1, keepdim=True)
        half_angle = math.atan(op_norm) / math.sqrt(k / 2)
        second = math.cos(half_angle) * first + math.sin(half_angle) * other
        return torch.stack([first, second], dim=-2).reshape(shape)

    def product_count(self, block_size: int) -> tuple[int, int]:
        forward = math.ceil(2 * self.count(block_size) / block_size)  # 2·b²·k multiply-adds, b³ per product
        return forward, 2 * forward

    def generator_norms(
        self,
        vec: torch.Tensor,
        block_size: int,
        blocks: torch.Tensor | None = None,
        estimate: bool = False,
        capped: bool = False,
    ) -> torch.Tensor:
        blocks = self.blocks(vec, block_size).detach() if blocks is None else blocks
        angles = torch.linalg.eigvals(blocks).angle().abs().amax(-1)
        return torch.tan(angles / 2).to(blocks.dtype)

    def domain_radius(self) -> float:
        return math.inf  # a product of reflections is orthogonal for any vectors

    def deviation_bound(self, generator_norm: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(generator_norm)
