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

Both rebuild the rotation blocks in the backward (the map's `BlockEvaluation`) instead of
keeping them, except across the micro-batches of one optimizer step, which share them through a
`RotationCache` and run the polynomial's VJP once. Every block product runs on contiguous blocks: the weight strategy
folds the block permutations into ``W0`` (one ``d_out × d_in`` gather per pass), the activation strategies
(`poet_hf.orthogonal.activation_strategy`) permute the activations instead and read ``W0`` as stored.

The frozen ``W0`` is a tensor, or a `DenseWeight`: a callable that returns it dense (a quantised base
dequantises itself), or a block of its rows at a time. A callable is called in the forward and again in the backward
and never saved, so at most one layer's dense ``W0`` (under the activation strategies, one block of its rows) exists
at a time and the backward keeps only the layer input, as for a tensor ``W0``.

With ``block_coordinates`` the caller hands ``W0`` as ``Ψ_P · W0 · Ψ_Rᵀ`` (its block sides' permutations applied
once, as POET-X does once per merge interval), and no pass gathers ``W0`` or its products: only the input and
output. The rotation layers pass ``W0`` in natural coordinates.

A `RotatedPass` holds what one call computes (the strategy, the sides, the base operation, the coordinates ``W0``
is stored in); calling it with the tensors runs the fused function. These functions are the fast path of the POET
and OFT layers; the plain autograd composition of `spo` and `cayley` is the reference they are tested against.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from .activation_strategy import ActivationStrategy
from .base_ops import Conv2dOp, LinearOp
from .rotation_sides import (
    DenseWeight,
    RotationCache,
    SideRotation,
    WeightSource,
    autocast_off,
    dense_weight,
    given_blocks,
    grad_left,
    grad_right,
    left_product,
    right_product,
    save_weight,
    transpose_blocks,
    weight_from_block_coordinates,
    weight_in_block_coordinates,
)

__all__ = [
    "SideRotation",
    "RotationCache",
    "LinearOp",
    "Conv2dOp",
    "DenseWeight",
    "RotatedPass",
    "ComputeDtypes",
    "compute_dtypes",
]

WEIGHT, ACTIVATION = "weight", "activation"
ACTIVATION_RECOMPUTE = "activation-recompute"  # the activation strategy recomputing h: keeps the input only
STRATEGIES = (WEIGHT, ACTIVATION, ACTIVATION_RECOMPUTE)


class ComputeDtypes(NamedTuple):
    """The dtypes of one call (`compute_dtypes`): the rotations' and the base operation's."""

    rotation: torch.dtype
    base: torch.dtype


@dataclass(frozen=True)
class RotatedPass:
    """One call of a rotated layer: ``op(x, Pᵀ · W0 · Rᵀ, bias)`` by one fused strategy (POET eq. 3, torch
    orientation).

    Args:
        strategy: one of `STRATEGIES`.
        input_side: the rotation ``R`` of the input (in × in), or ``None``.
        output_side: the rotation ``P`` of the output (out × out), or ``None``.
        op: the base operation: `LinearOp`, or `Conv2dOp` (the weight strategy only).
        block_coordinates: ``W0`` is given as ``Ψ_P · W0 · Ψ_Rᵀ``, its rows and columns in the block sides'
            coordinates (a side that is not block-stochastic leaves its dimension as it is).
    """

    strategy: str
    input_side: SideRotation | None = None
    output_side: SideRotation | None = None
    op: LinearOp | Conv2dOp = field(default_factory=LinearOp)
    block_coordinates: bool = False

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"`strategy` must be one of {STRATEGIES}, got {self.strategy!r}")
        if self.strategy != WEIGHT and not isinstance(self.op, LinearOp):
            raise ValueError(f"the {self.strategy} strategy needs a linear base op, got {type(self.op).__name__}")

    @property
    def keeps_output(self) -> bool:
        """Whether the backward keeps the pre-rotation output ``h`` (`ACTIVATION`) instead of recomputing it."""
        return self.strategy == ACTIVATION

    def __call__(
        self,
        x: torch.Tensor,
        weight: WeightSource,
        bias: torch.Tensor | None = None,
        r_vec: torch.Tensor | None = None,
        p_vec: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The layer's output.

        Args:
            x: the input (the last dimension ``in``; ``N × C × H × W`` for `Conv2dOp`).
            weight: the ``out × in`` matrix, or a `DenseWeight` that returns it (a quantised base, dequantised in
                the forward and again in the backward, never kept), in the coordinates ``block_coordinates`` says.
            bias: added to the output, never rotated.
            r_vec: the input side's parameters (``None`` with the side).
            p_vec: the output side's parameters (``None`` with the side).
        """
        function = _WeightStrategy if self.strategy == WEIGHT else ActivationStrategy
        return function.apply(x, weight, bias, r_vec, p_vec, self, compute_dtypes(x, weight))


def _effective_weight(
    weight: torch.Tensor, spec: RotatedPass, r_blocks: torch.Tensor | None, p_blocks: torch.Tensor | None
) -> tuple:
    """``Pᵀ W Rᵀ`` and the intermediates its backward needs.

    ``(W_eff, W', A')`` with ``W' = Ψ_P W Ψ_Rᵀ`` (as given, with ``block_coordinates``) and ``A' = W' Diag(R)ᵀ``
    (FS sides stay in natural coordinates)."""
    input_side, output_side = spec.input_side, spec.output_side
    gathered = weight if spec.block_coordinates else weight_in_block_coordinates(weight, input_side, output_side)
    rotated_in = (
        gathered
        if input_side is None
        else right_product(gathered, input_side, transpose_blocks(given_blocks(r_blocks)))
    )
    rotated = (
        rotated_in
        if output_side is None
        else left_product(rotated_in, output_side, transpose_blocks(given_blocks(p_blocks)))
    )
    return weight_from_block_coordinates(rotated, input_side, output_side), gathered, rotated_in


class _WeightStrategy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, r_vec, p_vec, spec: RotatedPass, dtypes: ComputeDtypes):
        input_side, output_side = spec.input_side, spec.output_side
        with autocast_off(x.device.type):
            r_blocks = None if input_side is None else input_side.blocks(r_vec, store=True)[0].to(dtypes.rotation)
            p_blocks = None if output_side is None else output_side.blocks(p_vec, store=True)[0].to(dtypes.rotation)
            effective = _effective_weight(dense_weight(weight).to(dtypes.rotation), spec, r_blocks, p_blocks)[0]
            base_bias = None if bias is None else bias.to(dtypes.base)
            y = spec.op.forward(x.to(dtypes.base), effective.to(dtypes.base), base_bias)
        ctx.save_for_backward(x, save_weight(ctx, weight), bias, r_vec, p_vec)
        ctx.spec, ctx.dtypes = spec, dtypes
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, weight, bias, r_vec, p_vec = ctx.saved_tensors
        spec, (rotation_dtype, base_dtype) = ctx.spec, ctx.dtypes
        input_side, output_side, op = spec.input_side, spec.output_side, spec.op
        grads: list[Any] = [None] * 7
        with autocast_off(grad_y.device.type):
            r_blocks = r_eval = p_blocks = p_eval = None
            if input_side is not None:
                r_blocks, r_eval = input_side.blocks(r_vec)
            if output_side is not None:
                p_blocks, p_eval = output_side.blocks(p_vec)

            def cast(t):
                return None if t is None else t.to(rotation_dtype)

            effective, gathered, rotated_in = _effective_weight(
                dense_weight(weight, ctx).to(rotation_dtype), spec, cast(r_blocks), cast(p_blocks)
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
                        p_eval, transpose_blocks(grad_left(grad_w, rotated_in, output_side)), p_vec
                    )
                    grad_w = left_product(grad_w, output_side, cast(p_blocks))
                if input_side is not None:  # A' = W' Diag(R)ᵀ
                    grads[3] = input_side.vector_grad(
                        r_eval, transpose_blocks(grad_right(gathered, grad_w, input_side)), r_vec
                    )
        return tuple(grads)


def compute_dtypes(x: torch.Tensor, weight: WeightSource) -> ComputeDtypes:
    """The rotations' and the base operation's dtypes for one call.

    Under ``torch.autocast`` both are the autocast dtype; otherwise the base op runs in the weight's dtype and the
    rotations in at least float32 (CPU half-precision kernels are slow or absent)."""
    device_type = x.device.type
    if device_type != "meta" and torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        return ComputeDtypes(dtype, dtype)
    return ComputeDtypes(torch.promote_types(weight.dtype, torch.float32), weight.dtype)
