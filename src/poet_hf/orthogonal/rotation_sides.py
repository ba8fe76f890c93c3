"""The rotated sides of a layer and the block products both fused strategies share (POET eq. 3, torch orientation).

A `SideRotation` is one side's primitive (`SideSpec`) with its permutations; the products here apply its blocks to
activations or to ``W0`` in contiguous block coordinates. ``W0`` arrives as a `WeightSource`: a tensor, or a
`DenseWeight` that returns it dense or a block of its rows at a time (a quantised base dequantises itself).
`rotated_linear` (the weight strategy) and `activation_strategy` build on these.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .map_protocol import BlockEvaluation, OrthogonalMap
from .norm_cap import NormCap
from .spo import (
    BLOCK,
    FULL,
    Allocate,
    SideSpec,
    blockdiag_grad_left,
    blockdiag_grad_right,
    blockdiag_left,
    blockdiag_right,
    inverse_permutation,
    select_last,
)

__all__ = ["RotationCache", "SideRotation", "DenseWeight", "WeightSource", "side_blocks"]


def side_blocks(
    param: torch.Tensor, spec: SideSpec, orthogonal_map: OrthogonalMap, plain: bool = False
) -> torch.Tensor:
    """The ``(num_blocks, b, b)`` orthogonal blocks of one side from its parameters (POET eq. 6 for Cayley–Neumann).

    ``plain`` composes the map from its definition under plain autograd (`OrthogonalMap.reference_blocks`), the
    reference the fast path is tested against. A single row (one block shared by all) is expanded."""
    if plain:
        blocks = orthogonal_map.reference_blocks(param, spec.block)
    else:
        blocks = orthogonal_map.blocks(param, spec.block)
    if blocks.shape[0] != spec.num_blocks:  # one block shared by all
        blocks = blocks.expand(spec.num_blocks, -1, -1)
    return blocks


class RotationCache:
    """One side's rotation blocks, kept across the micro-batches of one optimizer step.

    Also the ``∂L/∂blocks`` those micro-batches accumulated while the map's vector-Jacobian product waits for the
    last one.

    The blocks depend only on the side's parameters (the skew vector of Cayley–Neumann), which change only at an
    optimizer step, and the map's VJP is linear in ``∂L/∂R``: ``Σ_i Jᵀ g_i = Jᵀ Σ_i g_i``. So the blocks are built
    once per step and the VJP runs once, on the sum, in the backward of the step's last micro-batch. Holds
    ``2·rows·b²`` entries at most (the blocks, in ``dtype``, and the pending gradient, in float32 or wider).

    Args:
        dtype: what the blocks are kept in: the compute dtype of the calls that read them, which cast them to it
            anyway (``None``: as built).
    """

    def __init__(self, dtype: torch.dtype | None = None) -> None:
        self.dtype = dtype
        self.blocks: torch.Tensor | None = None
        self.pending: torch.Tensor | None = None
        self.key: object = None  # what the owner checks the blocks against (the parameters' state)
        self.grad_version: int | None = None  # the owner's note of the gradient the pending sum belongs to
        self.anchor: weakref.ref[torch.Tensor] | None = None  # the owner's, to that gradient: clears the cache with it

    def accumulate(self, grad_blocks: torch.Tensor) -> None:
        """Add one micro-batch's ``∂L/∂blocks`` (a fresh tensor the cache may keep and write into)."""
        self.pending = grad_blocks if self.pending is None else self.pending.add_(grad_blocks)

    def __getstate__(self) -> dict:
        """Copied and pickled without the owner's weak reference (a copy's gradient is another tensor)."""
        return {**self.__dict__, "anchor": None}

    def clear(self) -> None:
        self.blocks = self.pending = self.key = self.grad_version = self.anchor = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.blocks, self.pending) if t is not None)


@dataclass(frozen=True)
class SideRotation:
    """One side of a layer's rotation, as the fused functions see it (its parameter vector is passed beside it).

    ``index`` is the permutation (block), the sorted index subset (full) or empty (contiguous). ``keep`` (optional,
    one flag per block) replaces the blocks flagged ``False`` by the identity (OFT's multiplicative dropout). A skew
    vector with one row and ``spec.num_blocks > 1`` is shared by every block (OFT's ``block_share``).

    With a ``cache`` the blocks are read from it (built and stored there by the forward if it is empty); with
    ``defer`` the backward adds ``∂L/∂blocks`` to the cache and returns a zero gradient for the parameters, and
    without it the backward runs the VJP of the cached sum plus its own and empties the cache. ``norm_cap`` keeps
    the Cayley–Neumann norm cap's factor of the parameters between the forward and the backward (`NormCap`).
    """

    spec: SideSpec
    index: torch.Tensor
    orthogonal_map: OrthogonalMap
    keep: torch.Tensor | None = None
    cache: RotationCache | None = None
    defer: bool = False
    norm_cap: NormCap | None = None

    def _evaluate(self, vec: torch.Tensor) -> BlockEvaluation:
        map_dtype = torch.promote_types(vec.dtype, torch.float32)
        return self.orthogonal_map.evaluate(vec.to(map_dtype), self.spec.block, self.norm_cap)

    def blocks(self, vec: torch.Tensor, store: bool = False) -> tuple[torch.Tensor, BlockEvaluation | None]:
        """The ``(nb, b, b)`` rotation blocks (float32 or wider) and the evaluation that gives their VJP.

        The evaluation is ``None`` when the blocks came from the cache; ``store`` puts freshly built blocks there."""
        evaluation = None
        blocks = None if self.cache is None else self.cache.blocks
        if blocks is None:
            evaluation = self._evaluate(vec)
            blocks = evaluation.rotation
            if store and self.cache is not None:
                self.cache.blocks = blocks if self.cache.dtype is None else blocks.to(self.cache.dtype)
        if blocks.shape[0] != self.spec.num_blocks:
            blocks = blocks.expand(self.spec.num_blocks, -1, -1)
        if self.keep is not None:
            eye = torch.eye(self.spec.block, dtype=blocks.dtype, device=blocks.device)
            blocks = torch.where(self.keep[:, None, None], blocks, eye)
        return blocks, evaluation

    def vector_grad(
        self, evaluation: BlockEvaluation | None, grad_blocks: torch.Tensor, vec: torch.Tensor
    ) -> torch.Tensor:
        """``dL/dvec`` from ``dL/dblocks`` (deferred into the cache, or with the cache's pending sum added)."""
        grad_blocks = grad_blocks.to(torch.promote_types(vec.dtype, torch.float32))
        if self.keep is not None:
            grad_blocks = grad_blocks * self.keep[:, None, None]
        if grad_blocks.shape[0] != vec.shape[0]:  # one block shared by all
            grad_blocks = grad_blocks.sum(0, keepdim=True)
        if self.cache is not None:
            if self.defer:
                self.cache.accumulate(grad_blocks)
                return torch.zeros_like(vec)
            if self.cache.pending is not None:
                grad_blocks = grad_blocks + self.cache.pending
            self.cache.clear()
        return (evaluation or self._evaluate(vec)).vector_vjp(grad_blocks).to(vec.dtype)


class DenseWeight(Protocol):
    """A frozen ``W0`` stored in another form (quantised) that returns the dense matrix when called.

    Called, it returns the dense ``out × in`` matrix in ``dtype``; ``row_blocks()``, where it has one, yields
    ``(start, stop, W0[start:stop])`` for consecutive blocks of rows, so the activation strategies never hold it whole;
    ``dequantize_cost`` is the multiply-add equivalent of one call per weight entry (cost model)."""

    dtype: torch.dtype
    dequantize_cost: float

    def __call__(self) -> torch.Tensor: ...


WeightSource = torch.Tensor | DenseWeight


def save_weight(ctx: Any, weight: WeightSource) -> torch.Tensor | None:
    """What to save of ``weight`` for the backward.

    The tensor itself, or nothing for a `DenseWeight` (kept on ``ctx`` and called again)."""
    ctx.weight_source = None if isinstance(weight, torch.Tensor) else weight
    return weight if isinstance(weight, torch.Tensor) else None


def weight_source(weight: WeightSource | None, ctx: Any = None) -> WeightSource:
    """``W0`` as the forward got it: a saved tensor, or the `DenseWeight` kept on ``ctx``."""
    source = getattr(ctx, "weight_source", None) if weight is None else weight
    assert source is not None  # the forward kept a tensor or a callable
    return source


def dense_weight(weight: WeightSource | None, ctx: Any = None) -> torch.Tensor:
    """The dense ``W0``: a saved tensor, or a fresh call of the `DenseWeight` (``ctx.weight_source``)."""
    source = weight_source(weight, ctx)
    return source if isinstance(source, torch.Tensor) else source()


def row_blocks(weight: WeightSource) -> Iterator[tuple[int, int, torch.Tensor]]:
    """``(start, stop, W0[start:stop])``: a tensor whole, a `DenseWeight` by its row blocks (whole, called, where it
    has none)."""
    blocks = getattr(weight, "row_blocks", None)
    if blocks is not None:
        yield from blocks()
    else:
        dense = dense_weight(weight)
        yield 0, dense.shape[0], dense


# --- coordinates: a block side works in permuted coordinates, folded into W0 --------------------------------------
def side_permutation(side: SideRotation | None) -> torch.Tensor | None:
    return side.index if side is not None and side.spec.kind == BLOCK else None


def weight_in_block_coordinates(
    weight: torch.Tensor, input_side: SideRotation | None, output_side: SideRotation | None
) -> torch.Tensor:
    """``Ψ_P · W · Ψ_Rᵀ``: rows gathered by the output permutation, columns by the input one (where block)."""
    rows, cols = side_permutation(output_side), side_permutation(input_side)
    if rows is not None:
        weight = weight.index_select(0, rows)
    if cols is not None:
        weight = select_last(weight, cols)
    return weight


def weight_from_block_coordinates(
    weight: torch.Tensor, input_side: SideRotation | None, output_side: SideRotation | None
) -> torch.Tensor:
    """The inverse of `weight_in_block_coordinates`."""
    rows, cols = side_permutation(output_side), side_permutation(input_side)
    if rows is not None:
        weight = weight.index_select(0, inverse_permutation(rows))
    if cols is not None:
        weight = select_last(weight, inverse_permutation(cols))
    return weight


def right_product(
    x: torch.Tensor, side: SideRotation, blocks: torch.Tensor, row_major: bool = False, empty: Allocate | None = None
) -> torch.Tensor:
    """``x @ G`` on the last dimension, ``x`` in the side's coordinates (natural ones for FS); ``row_major`` and
    ``empty`` as in `blockdiag_right` (block sides)."""
    if side.spec.kind == FULL:
        return x.index_copy(-1, side.index, select_last(x, side.index) @ blocks[0])
    return blockdiag_right(x, blocks, row_major, empty)


def left_product(m: torch.Tensor, side: SideRotation, blocks: torch.Tensor) -> torch.Tensor:
    """``G @ m`` on the first dimension."""
    if side.spec.kind == FULL:
        return m.index_copy(0, side.index, blocks[0] @ m.index_select(0, side.index))
    return blockdiag_left(m, blocks)


def grad_right(x: torch.Tensor, grad_y: torch.Tensor, side: SideRotation) -> torch.Tensor:
    """``dL/dblocks`` for ``y = x @ G`` (both ``(T, d)``, in the side's coordinates)."""
    if side.spec.kind == FULL:
        return (select_last(x, side.index).T @ select_last(grad_y, side.index))[None]
    return blockdiag_grad_right(x, grad_y, side.spec.num_blocks)


def grad_left(grad_y: torch.Tensor, m: torch.Tensor, side: SideRotation) -> torch.Tensor:
    """``dL/dblocks`` for ``y = G @ m``."""
    if side.spec.kind == FULL:
        return (grad_y.index_select(0, side.index) @ m.index_select(0, side.index).T)[None]
    return blockdiag_grad_left(grad_y, m, side.spec.num_blocks)


def transpose_blocks(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.transpose(-1, -2)


def given_blocks(blocks: torch.Tensor | None) -> torch.Tensor:
    """A side's rotation blocks, which always come with the side."""
    assert blocks is not None
    return blocks


# --- the weight strategy ----------------------------------------------------------------------------------------------


def autocast_off(device_type: str) -> contextlib.AbstractContextManager:
    """``torch.autocast(device_type, enabled=False)``, or nothing on the meta device.

    There is no autocast on the meta device, where the memory planner traces a model's forward and backward by shapes
    alone."""
    return contextlib.nullcontext() if device_type == "meta" else torch.autocast(device_type, enabled=False)
