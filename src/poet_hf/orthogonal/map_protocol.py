"""The protocol every orthogonal map of a rotation block follows, and the autograd evaluation a map may reuse.

An orthogonal map turns a parameter vector into a ``b × b`` orthogonal block (POET eq. 6 is one: the Cayley–Neumann
map). POET, OFT and the orthogonal-layers tuner see a map only through `OrthogonalMap`; `poet_hf.orthogonal.maps`
registers the maps by name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar, Protocol

import torch

from .norm_cap import NormCap

__all__ = ["BlockEvaluation", "OrthogonalMap", "AutogradEvaluation"]


class BlockEvaluation(Protocol):
    """The blocks of one evaluation and the vector-Jacobian product back to the parameters.

    ``rotation`` holds the ``(..., b, b)`` blocks (no autograd graph); `vector_vjp` maps ``dL/dblocks`` to
    ``dL/dvec`` once. The fused layers build one in the forward and call it in the backward."""

    rotation: torch.Tensor

    def vector_vjp(self, grad_r: torch.Tensor) -> torch.Tensor: ...


class OrthogonalMap(Protocol):
    """A map from parameter vectors ``(..., num_params(b))`` to orthogonal blocks ``(..., b, b)``.

    Implementations are frozen dataclasses that subclass this protocol, hold their own settings and are built from a
    tuner's config by ``from_config`` (`poet_hf.orthogonal.maps.map_from_config`); their methods are documented
    here.
    """

    name: ClassVar[str]
    zero_is_identity: ClassVar[bool]  # all-zero parameters are the identity (a merge's reset may zero them in place)

    def describe(self) -> str:
        """The map and its settings in words (model cards, logs).

        Returns:
            One line, e.g. ``"Cayley–Neumann series, 6 terms (the POET paper's k = 4)"``.
        """
        ...

    def num_params(self, block_size: int) -> int:
        """Parameters per block.

        Args:
            block_size: the block's side ``b``.

        Returns:
            The length of one block's parameter vector.
        """
        ...

    def blocks(self, vec: torch.Tensor, block_size: int) -> torch.Tensor:
        """The blocks, differentiable in ``vec`` (the fast path).

        Args:
            vec: parameters ``(..., num_params(b))``.
            block_size: the side ``b``.

        Returns:
            The orthogonal blocks ``(..., b, b)``.
        """
        ...

    def reference_blocks(self, vec: torch.Tensor, block_size: int) -> torch.Tensor:
        """The same blocks composed from the map's definition under plain autograd (what `blocks` is tested against).

        Args:
            vec: parameters ``(..., num_params(b))``.
            block_size: the side ``b``.

        Returns:
            The orthogonal blocks ``(..., b, b)``.
        """
        ...

    def evaluate(self, vec: torch.Tensor, block_size: int, norm_cap: NormCap | None = None) -> BlockEvaluation:
        """The blocks and their vector-Jacobian product, for the fused layers' own backward.

        Args:
            vec: parameters ``(..., num_params(b))``, float32 or wider.
            block_size: the side ``b``.
            norm_cap: the model's `NormCap`, for a map that caps its parameters (Cayley–Neumann); others ignore it.

        Returns:
            The evaluation.
        """
        ...

    def identity_params(self, shape: tuple[int, ...], block_size: int, generator: torch.Generator) -> torch.Tensor:
        """Parameters whose every block is the identity: an adapter's start and its reset at a merge.

        Args:
            shape: the parameter tensor's shape (last axis `num_params`).
            block_size: the side ``b``.
            generator: for a map whose identity is drawn (Householder pairs); seeded per layer, side and merge.

        Returns:
            The parameters, float32, on the CPU.
        """
        ...

    def random_params(
        self, shape: tuple[int, ...], block_size: int, generator: torch.Generator, op_norm: float
    ) -> torch.Tensor:
        """Parameters whose blocks turn vectors by about ``2·atan(op_norm)``: a non-identity adapter.

        Args:
            shape: the parameter tensor's shape (last axis `num_params`).
            block_size: the side ``b``.
            generator: the generator to draw from.
            op_norm: the size of the rotation, as a Cayley generator norm ``||Q||_2``.

        Returns:
            The parameters, float32, on the CPU.
        """
        ...

    def product_count(self, block_size: int) -> tuple[int, int]:
        """Batched ``b × b`` products of one evaluation, for the strategy chooser's cost.

        Args:
            block_size: the side ``b``.

        Returns:
            ``(forward, vector-Jacobian product)``.
        """
        ...

    def generator_norms(
        self,
        vec: torch.Tensor,
        block_size: int,
        blocks: torch.Tensor | None = None,
        estimate: bool = False,
        capped: bool = False,
    ) -> torch.Tensor:
        """Per block, the rotation's size as a Cayley generator norm ``||Q||_2``.

        A Cayley map reports its own ``Q`` (before any norm cap, unless ``capped``); another map ``tan`` of half the
        block's largest rotation angle, which is the same number for a Cayley block.

        Args:
            vec: parameters ``(..., num_params(b))``.
            block_size: the side ``b``.
            blocks: the blocks of ``vec``, where the caller has them (a map that reads the norms off the blocks
                builds them otherwise).
            estimate: a cheap estimate suffices (a warning's threshold, not a logged figure): Cayley–Neumann then
                skips the SVD per block (`skew_spectral_norm`, within 2 %).
            capped: the norm of the generator the blocks are built from, after the map's norm cap (Cayley–Neumann
                rescales a block past `MAX_SKEW_NORM` onto it); a map without a cap reports the same either way.

        Returns:
            The norms, shape ``vec.shape[:-1]``.
        """
        ...

    def domain_radius(self) -> float:
        """The generator norm ``||Q||_2`` (`generator_norms`) at which the map stops making rotations: a truncated
        series' radius of convergence. A merge refuses to fold a block at or past it.

        Returns:
            The radius; ``math.inf`` for a map whose blocks are orthogonal for any parameters.
        """
        ...

    def deviation_bound(self, generator_norm: torch.Tensor) -> torch.Tensor:
        """Per block, the bound on any singular value's relative change from 1 (0 for an exactly orthogonal map).

        Args:
            generator_norm: the blocks' `generator_norms`.

        Returns:
            The bounds, the shape of ``generator_norm``.
        """
        ...


class AutogradEvaluation:
    """A `BlockEvaluation` whose vector-Jacobian product is autograd's through ``build``.

    For a map without a hand-written backward: the blocks are built once under autograd from a detached copy of
    ``vec``; the graph lives until `vector_vjp` runs.

    Args:
        build: the differentiable map from parameters to blocks.
        vec: the parameters.
    """

    def __init__(self, build: Callable[[torch.Tensor], torch.Tensor], vec: torch.Tensor) -> None:
        with torch.enable_grad():
            self._leaf = vec.detach().requires_grad_()
            self._blocks = build(self._leaf)
        self.rotation = self._blocks.detach()

    def vector_vjp(self, grad_r: torch.Tensor) -> torch.Tensor:
        """``dL/dvec`` for ``dL/dblocks = grad_r``."""
        (grad,) = torch.autograd.grad(self._blocks, self._leaf, grad_r)
        return grad
