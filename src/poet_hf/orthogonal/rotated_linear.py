"""Fused forward and backward of a layer whose weight is used as ``Pᵀ · W0 · Rᵀ`` (POET eq. 3, torch orientation).

``R`` (input side) and ``P`` (output side) are each a block-stochastic, contiguous-block or fully stochastic
primitive (`SideSpec`) built by the Cayley–Neumann map from a skew vector; either may
be absent (OFT is the input side alone). Two strategies compute the same function:

- **weight**: ``W_eff = Pᵀ W0 Rᵀ`` is built, then the base op runs with it. Between forward and backward only the
  layer input and the skew vectors are kept; the backward rebuilds ``W_eff`` and takes the gradients of both
  rotations from ``∂L/∂W_eff = gᵀx``.
- **activation**: ``y = ((x R) W0ᵀ) P``. Kept: the input and, with an output side, the pre-rotation output ``h``
  (``T × d_out``), which the gradient of ``P`` needs; ``x R`` is recomputed. It skips ``∂L/∂W_eff`` entirely.

What each costs is in `strategy_costs`.

Both rebuild the rotation blocks in the backward (`SkewRotation`) instead of
keeping them, except across the micro-batches of one optimizer step, which share them through a
`RotationCache` and run the polynomial's VJP once. Every block product runs on contiguous blocks: the weight strategy
folds the block permutations into ``W0`` (one ``d_out × d_in`` gather per pass), the activation strategies
(`poet_hf.orthogonal.activation_strategy`) permute the activations instead and read ``W0`` as stored.

The frozen ``W0`` is a tensor, or a `DenseWeight`: a callable that returns it dense (a quantised base
dequantises itself), or a block of its rows at a time. A callable is called in the forward and again in the backward
and never saved, so at most one layer's dense ``W0`` (under the activation strategies, one block of its rows) exists
at a time and the backward keeps only the layer input, as for a tensor ``W0``.

These functions are the fast path of the POET and OFT layers; the plain autograd composition of
`spo` and `cayley` is the reference they are tested against.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .base_ops import Conv2dOp, LinearOp
from .cayley import SkewRotation
from .spo import (
    BLOCK,
    FULL,
    SideSpec,
    blockdiag_grad_left,
    blockdiag_grad_right,
    blockdiag_left,
    blockdiag_right,
    inverse_permutation,
    select_last,
)

__all__ = [
    "SideRotation",
    "RotationCache",
    "LinearOp",
    "Conv2dOp",
    "DenseWeight",
    "rotated_forward",
    "compute_dtypes",
]

WEIGHT, ACTIVATION = "weight", "activation"
ACTIVATION_RECOMPUTE = "activation-recompute"  # the activation strategy recomputing h: keeps the input only
STRATEGIES = (WEIGHT, ACTIVATION, ACTIVATION_RECOMPUTE)


class RotationCache:
    """One side's rotation blocks, kept across the micro-batches of one optimizer step.

    Also the ``∂L/∂blocks`` those micro-batches accumulated while the polynomial's vector-Jacobian product waits for
    the last one.

    The Cayley–Neumann polynomial depends only on the skew vector, which changes only at an optimizer step, and its
    VJP is linear in ``∂L/∂R``: ``Σ_i Jᵀ g_i = Jᵀ Σ_i g_i``. So the blocks are built once per step and the VJP runs
    once, on the sum, in the backward of the step's last micro-batch. Holds ``2·rows·b²`` entries at most (the blocks
    and the pending gradient).
    """

    def __init__(self) -> None:
        self.blocks: torch.Tensor | None = None
        self.pending: torch.Tensor | None = None
        self.key: Any = None  # what the owner checks the blocks against (the skew vector's state)
        self.grad_version: int | None = None  # the owner's note of the gradient the pending sum belongs to

    def accumulate(self, grad_blocks: torch.Tensor) -> None:
        """Add one micro-batch's ``∂L/∂blocks`` (a fresh tensor the cache may keep and write into)."""
        self.pending = grad_blocks if self.pending is None else self.pending.add_(grad_blocks)

    def clear(self) -> None:
        self.blocks = self.pending = self.key = self.grad_version = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.blocks, self.pending) if t is not None)


@dataclass(frozen=True)
class SideRotation:
    """One side of a layer's rotation, as the fused functions see it (the skew vector is passed beside it).

    ``index`` is the permutation (block), the sorted index subset (full) or empty (contiguous). ``keep`` (optional,
    one flag per block) replaces the blocks flagged ``False`` by the identity (OFT's multiplicative dropout). A skew
    vector with one row and ``spec.num_blocks > 1`` is shared by every block (OFT's ``block_share``).

    With a ``cache`` the blocks are read from it (built and stored there by the forward if it is empty); with
    ``defer`` the backward adds ``∂L/∂blocks`` to the cache and returns a zero gradient for the skew vector, and
    without it the backward runs the VJP of the cached sum plus its own and empties the cache.
    """

    spec: SideSpec
    index: torch.Tensor
    terms: int
    keep: torch.Tensor | None = None
    cache: RotationCache | None = None
    defer: bool = False

    def _evaluate(self, vec: torch.Tensor) -> SkewRotation:
        polynomial_dtype = torch.promote_types(vec.dtype, torch.float32)
        return SkewRotation.from_vector(vec.to(polynomial_dtype), self.spec.block, self.terms)

    def blocks(self, vec: torch.Tensor, store: bool = False) -> tuple[torch.Tensor, SkewRotation | None]:
        """The ``(nb, b, b)`` rotation blocks (float32 or wider) and the evaluation that gives their VJP.

        The evaluation is ``None`` when the blocks came from the cache; ``store`` puts freshly built blocks there."""
        evaluation = None
        blocks = None if self.cache is None else self.cache.blocks
        if blocks is None:
            evaluation = self._evaluate(vec)
            blocks = evaluation.rotation
            if store and self.cache is not None:
                self.cache.blocks = blocks
        if blocks.shape[0] != self.spec.num_blocks:
            blocks = blocks.expand(self.spec.num_blocks, -1, -1)
        if self.keep is not None:
            eye = torch.eye(self.spec.block, dtype=blocks.dtype, device=blocks.device)
            blocks = torch.where(self.keep[:, None, None], blocks, eye)
        return blocks, evaluation

    def vector_grad(
        self, evaluation: SkewRotation | None, grad_blocks: torch.Tensor, vec: torch.Tensor
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


def _save_weight(ctx: Any, weight: WeightSource) -> torch.Tensor | None:
    """What to save of ``weight`` for the backward.

    The tensor itself, or nothing for a `DenseWeight` (kept on ``ctx`` and called again)."""
    ctx.weight_source = None if isinstance(weight, torch.Tensor) else weight
    return weight if isinstance(weight, torch.Tensor) else None


def _source(weight: WeightSource | None, ctx: Any = None) -> WeightSource:
    """``W0`` as the forward got it: a saved tensor, or the `DenseWeight` kept on ``ctx``."""
    source = getattr(ctx, "weight_source", None) if weight is None else weight
    assert source is not None  # the forward kept a tensor or a callable
    return source


def _dense(weight: WeightSource | None, ctx: Any = None) -> torch.Tensor:
    """The dense ``W0``: a saved tensor, or a fresh call of the `DenseWeight` (``ctx.weight_source``)."""
    source = _source(weight, ctx)
    return source if isinstance(source, torch.Tensor) else source()


def _row_blocks(weight: WeightSource) -> Iterator[tuple[int, int, torch.Tensor]]:
    """``(start, stop, W0[start:stop])``: a tensor whole, a `DenseWeight` by its row blocks (whole, called, where it
    has none)."""
    blocks = getattr(weight, "row_blocks", None)
    if blocks is not None:
        yield from blocks()
    else:
        dense = _dense(weight)
        yield 0, dense.shape[0], dense


# --- coordinates: a block side works in permuted coordinates, folded into W0 --------------------------------------
def _permutation(side: SideRotation | None) -> torch.Tensor | None:
    return side.index if side is not None and side.spec.kind == BLOCK else None


def weight_in_block_coordinates(
    weight: torch.Tensor, input_side: SideRotation | None, output_side: SideRotation | None
) -> torch.Tensor:
    """``Ψ_P · W · Ψ_Rᵀ``: rows gathered by the output permutation, columns by the input one (where block)."""
    rows, cols = _permutation(output_side), _permutation(input_side)
    if rows is not None:
        weight = weight.index_select(0, rows)
    if cols is not None:
        weight = select_last(weight, cols)
    return weight


def weight_from_block_coordinates(
    weight: torch.Tensor, input_side: SideRotation | None, output_side: SideRotation | None
) -> torch.Tensor:
    """The inverse of `weight_in_block_coordinates`."""
    rows, cols = _permutation(output_side), _permutation(input_side)
    if rows is not None:
        weight = weight.index_select(0, inverse_permutation(rows))
    if cols is not None:
        weight = select_last(weight, inverse_permutation(cols))
    return weight


def _right(x: torch.Tensor, side: SideRotation, blocks: torch.Tensor) -> torch.Tensor:
    """``x @ G`` on the last dimension, ``x`` in the side's coordinates (natural ones for FS)."""
    if side.spec.kind == FULL:
        return x.index_copy(-1, side.index, select_last(x, side.index) @ blocks[0])
    return blockdiag_right(x, blocks)


def _left(m: torch.Tensor, side: SideRotation, blocks: torch.Tensor) -> torch.Tensor:
    """``G @ m`` on the first dimension."""
    if side.spec.kind == FULL:
        return m.index_copy(0, side.index, blocks[0] @ m.index_select(0, side.index))
    return blockdiag_left(m, blocks)


def _grad_right(x: torch.Tensor, grad_y: torch.Tensor, side: SideRotation) -> torch.Tensor:
    """``dL/dblocks`` for ``y = x @ G`` (both ``(T, d)``, in the side's coordinates)."""
    if side.spec.kind == FULL:
        return (select_last(x, side.index).T @ select_last(grad_y, side.index))[None]
    return blockdiag_grad_right(x, grad_y, side.spec.num_blocks)


def _grad_left(grad_y: torch.Tensor, m: torch.Tensor, side: SideRotation) -> torch.Tensor:
    """``dL/dblocks`` for ``y = G @ m``."""
    if side.spec.kind == FULL:
        return (grad_y.index_select(0, side.index) @ m.index_select(0, side.index).T)[None]
    return blockdiag_grad_left(grad_y, m, side.spec.num_blocks)


def _transpose(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.transpose(-1, -2)


def _given(blocks: torch.Tensor | None) -> torch.Tensor:
    """A side's rotation blocks, which always come with the side."""
    assert blocks is not None
    return blocks


# --- the weight strategy ----------------------------------------------------------------------------------------------
def _effective_weight(
    weight: torch.Tensor,
    input_side: SideRotation | None,
    r_blocks: torch.Tensor | None,
    output_side: SideRotation | None,
    p_blocks: torch.Tensor | None,
) -> tuple:
    """``Pᵀ W Rᵀ`` and the intermediates its backward needs.

    ``(W_eff, W', A')`` with ``W' = Ψ_P W Ψ_Rᵀ`` and ``A' = W' Diag(R)ᵀ`` (FS sides stay in natural coordinates)."""
    gathered = weight_in_block_coordinates(weight, input_side, output_side)
    rotated_in = gathered if input_side is None else _right(gathered, input_side, _transpose(_given(r_blocks)))
    rotated = rotated_in if output_side is None else _left(rotated_in, output_side, _transpose(_given(p_blocks)))
    return weight_from_block_coordinates(rotated, input_side, output_side), gathered, rotated_in


class _WeightStrategy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, x, weight, bias, r_vec, p_vec, input_side, output_side, op, rotation_dtype, base_dtype, keep_output=False
    ):
        with _autocast_off(x.device.type):
            r_blocks = None if input_side is None else input_side.blocks(r_vec, store=True)[0].to(rotation_dtype)
            p_blocks = None if output_side is None else output_side.blocks(p_vec, store=True)[0].to(rotation_dtype)
            effective = _effective_weight(
                _dense(weight).to(rotation_dtype), input_side, r_blocks, output_side, p_blocks
            )[0]
            y = op.forward(x.to(base_dtype), effective.to(base_dtype), None if bias is None else bias.to(base_dtype))
        ctx.save_for_backward(x, _save_weight(ctx, weight), bias, r_vec, p_vec)
        ctx.sides, ctx.op, ctx.dtypes = (input_side, output_side), op, (rotation_dtype, base_dtype)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, weight, bias, r_vec, p_vec = ctx.saved_tensors
        (input_side, output_side), op, (rotation_dtype, base_dtype) = ctx.sides, ctx.op, ctx.dtypes
        grads: list[Any] = [None] * 11
        with _autocast_off(grad_y.device.type):
            r_blocks = r_eval = p_blocks = p_eval = None
            if input_side is not None:
                r_blocks, r_eval = input_side.blocks(r_vec)
            if output_side is not None:
                p_blocks, p_eval = output_side.blocks(p_vec)

            def cast(t):
                return None if t is None else t.to(rotation_dtype)

            effective, gathered, rotated_in = _effective_weight(
                _dense(weight, ctx).to(rotation_dtype), input_side, cast(r_blocks), output_side, cast(p_blocks)
            )
            need_skew = r_vec is not None and ctx.needs_input_grad[3] or p_vec is not None and ctx.needs_input_grad[4]
            grad_y = grad_y.to(base_dtype)
            grad_x, grad_w = op.backward(
                grad_y, x.to(base_dtype), effective.to(base_dtype), ctx.needs_input_grad[0], need_skew
            )
            grads[0] = None if grad_x is None else grad_x.to(x.dtype)
            if bias is not None and ctx.needs_input_grad[2]:
                grads[2] = op.bias_grad(grad_y).to(bias.dtype)
            if need_skew:
                grad_w = weight_in_block_coordinates(grad_w.to(rotation_dtype), input_side, output_side)
                if output_side is not None:  # W_eff' = Diag(P)ᵀ A'
                    grads[4] = output_side.vector_grad(
                        p_eval, _transpose(_grad_left(grad_w, rotated_in, output_side)), p_vec
                    )
                    grad_w = _left(grad_w, output_side, cast(p_blocks))
                if input_side is not None:  # A' = W' Diag(R)ᵀ
                    grads[3] = input_side.vector_grad(
                        r_eval, _transpose(_grad_right(gathered, grad_w, input_side)), r_vec
                    )
        return tuple(grads)


# --- entry points -----------------------------------------------------------------------------------------------------
def _autocast_off(device_type: str) -> contextlib.AbstractContextManager:
    """``torch.autocast(device_type, enabled=False)``, or nothing on the meta device.

    There is no autocast on the meta device, where the memory planner traces a model's forward and backward by shapes
    alone."""
    return contextlib.nullcontext() if device_type == "meta" else torch.autocast(device_type, enabled=False)


def compute_dtypes(x: torch.Tensor, weight: WeightSource) -> tuple[torch.dtype, torch.dtype]:
    """``(rotation_dtype, base_dtype)`` of one call.

    Under ``torch.autocast`` both are the autocast dtype; otherwise the base op runs in the weight's dtype and the
    rotations in at least float32 (CPU half-precision kernels are slow or absent)."""
    device_type = x.device.type
    if device_type != "meta" and torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        return dtype, dtype
    return torch.promote_types(weight.dtype, torch.float32), weight.dtype


def rotated_forward(
    strategy: str,
    x: torch.Tensor,
    weight: WeightSource,
    bias: torch.Tensor | None,
    input_side: SideRotation | None,
    r_vec: torch.Tensor | None,
    output_side: SideRotation | None,
    p_vec: torch.Tensor | None,
    op: Any = None,
) -> torch.Tensor:
    """``op(x, Pᵀ W Rᵀ, bias)`` by the fused ``strategy``: one of `STRATEGIES`.

    ``weight`` is the ``out × in`` matrix (a view of the base layer's weight) or a `DenseWeight` that returns
    it (a quantised base: dequantised in the forward and again in the backward, never kept); ``r_vec`` / ``p_vec``
    are the skew vectors of the input / output side (``None`` with the side). ``op`` defaults to `LinearOp`; the
    activation strategies support it only.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"`strategy` must be one of {STRATEGIES}, got {strategy!r}")
    op = op or LinearOp()
    if strategy != WEIGHT and not isinstance(op, LinearOp):
        raise ValueError(f"the {strategy} strategy needs a linear base op, got {type(op).__name__}")
    rotation_dtype, base_dtype = compute_dtypes(x, weight)
    from .activation_strategy import ActivationStrategy  # it builds on this module's sides and coordinates

    function = _WeightStrategy if strategy == WEIGHT else ActivationStrategy
    return function.apply(
        x, weight, bias, r_vec, p_vec, input_side, output_side, op, rotation_dtype, base_dtype, strategy == ACTIVATION
    )
