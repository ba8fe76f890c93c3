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

These functions are the fast path of the POET and OFT layers; the plain autograd composition of
`spo` and `cayley` is the reference they are tested against.
"""

from __future__ import annotations

from typing import Any

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
    "rotated_forward",
    "compute_dtypes",
]

WEIGHT, ACTIVATION = "weight", "activation"
ACTIVATION_RECOMPUTE = "activation-recompute"  # the activation strategy recomputing h: keeps the input only
STRATEGIES = (WEIGHT, ACTIVATION, ACTIVATION_RECOMPUTE)


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
    def forward(
        ctx, x, weight, bias, r_vec, p_vec, input_side, output_side, op, rotation_dtype, base_dtype, keep_output=False
    ):
        with autocast_off(x.device.type):
            r_blocks = None if input_side is None else input_side.blocks(r_vec, store=True)[0].to(rotation_dtype)
            p_blocks = None if output_side is None else output_side.blocks(p_vec, store=True)[0].to(rotation_dtype)
            effective = _effective_weight(
                dense_weight(weight).to(rotation_dtype), input_side, r_blocks, output_side, p_blocks
            )[0]
            y = op.forward(x.to(base_dtype), effective.to(base_dtype), None if bias is None else bias.to(base_dtype))
        ctx.save_for_backward(x, save_weight(ctx, weight), bias, r_vec, p_vec)
        ctx.sides, ctx.op, ctx.dtypes = (input_side, output_side), op, (rotation_dtype, base_dtype)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, weight, bias, r_vec, p_vec = ctx.saved_tensors
        (input_side, output_side), op, (rotation_dtype, base_dtype) = ctx.sides, ctx.op, ctx.dtypes
        grads: list[Any] = [None] * 11
        with autocast_off(grad_y.device.type):
            r_blocks = r_eval = p_blocks = p_eval = None
            if input_side is not None:
                r_blocks, r_eval = input_side.blocks(r_vec)
            if output_side is not None:
                p_blocks, p_eval = output_side.blocks(p_vec)

            def cast(t):
                return None if t is None else t.to(rotation_dtype)

            effective, gathered, rotated_in = _effective_weight(
                dense_weight(weight, ctx).to(rotation_dtype), input_side, cast(r_blocks), output_side, cast(p_blocks)
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


# --- entry points -----------------------------------------------------------------------------------------------------
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
    function = _WeightStrategy if strategy == WEIGHT else ActivationStrategy
    return function.apply(
        x, weight, bias, r_vec, p_vec, input_side, output_side, op, rotation_dtype, base_dtype, strategy == ACTIVATION
    )
