"""The activation strategy of `poet_hf.orthogonal.rotated_linear`: ``y = ((x R) W0ᵀ) P``, ``W0`` read as stored.

The block permutations act on the activations (``T × d`` gathers) rather than on ``W0``, so ``W0`` is never copied,
and a `DenseWeight` is read a block of its rows at a time: a quantised ``W0`` is never dense whole. Kept for the
backward: the input and, for `ACTIVATION` with an output side, the pre-rotation output ``h``; without it
(`ACTIVATION_RECOMPUTE`) the backward recomputes ``h``.

A ``W0`` in natural coordinates takes its products in natural order, so each rotated activation is gathered back and
forth around them (four ``T × d`` gathers in the forward, up to nine in the backward); a ``W0`` stored in its block
coordinates (``RotatedPass.block_coordinates``) takes them in the sides' coordinates: the input is gathered once
and the output scattered once. Each activation-sized result takes the memory of an operand that died just before it
(`Scratch`), and the last rotation of each direction writes row-major, as the layer's output and input gradient are.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch

from .base_ops import LinearOp
from .rotation_sides import (
    SideRotation,
    WeightSource,
    autocast_off,
    given_blocks,
    grad_right,
    right_product,
    row_blocks,
    save_weight,
    side_permutation,
    transpose_blocks,
    weight_source,
)
from .scratch import Scratch
from .spo import inverse_permutation, select_last

if TYPE_CHECKING:
    from .rotated_linear import ComputeDtypes, RotatedPass

__all__ = ["ActivationStrategy"]


def _base_input(
    x2: torch.Tensor, spec: RotatedPass, r_blocks: torch.Tensor | None, dtypes: ComputeDtypes, scratch: Scratch
) -> torch.Tensor:
    """``x R`` in the coordinates of ``W0``'s columns: ``x R Ψ_R`` (natural) or ``x Ψ_Rᵀ Diag(R)`` (block)."""
    side = spec.input_side
    if side is None:
        return x2.to(dtypes.base)
    gathered = _side_columns(x2.to(dtypes.rotation), side, scratch)  # x in R's coordinates
    u = right_product(gathered, side, given_blocks(r_blocks).to(dtypes.rotation), empty=scratch.allocate)
    scratch.release(gathered, u)
    u_base = u.to(dtypes.base)
    scratch.release(u, u_base)
    return _base_columns(u_base, spec, side, scratch)  # u_base is freed, not released: the base products come next


def _products(
    u: torch.Tensor | None,
    g: torch.Tensor | None,
    weight: WeightSource,
    op: LinearOp,
    bias: torch.Tensor | None,
    base_dtype: torch.dtype,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(u W0ᵀ (+ bias), g W0)`` (each where its operand is given, all in natural order) in one pass over ``W0``.

    ``W0`` is read as stored, never copied, and a `DenseWeight` a block of its rows at a time: the block's columns
    of ``u W0ᵀ`` and its share of ``g W0``."""
    outputs, grad = [], None
    for start, stop, rows in row_blocks(weight):
        rows = rows.to(base_dtype)
        if u is not None:
            outputs.append(op.forward(u, rows, None if bias is None else bias[start:stop].to(base_dtype)))
        if g is not None:
            part = g[..., start:stop] @ rows
            grad = part if grad is None else grad.add_(part)
        del rows  # before the next block is read: one block of W0 alive at a time
    output = None if u is None else outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-1)
    return output, grad


def _base_columns(t: torch.Tensor, spec: RotatedPass, side: SideRotation | None, scratch: Scratch) -> torch.Tensor:
    """A side's coordinates to those ``W0`` is stored in (the same with ``block_coordinates``)."""
    return t if spec.block_coordinates else _natural_columns(t, side, scratch)


def _coordinates_of_side(
    t: torch.Tensor, spec: RotatedPass, side: SideRotation | None, scratch: Scratch
) -> torch.Tensor:
    """The coordinates ``W0`` is stored in to a side's (the same with ``block_coordinates``)."""
    return t if spec.block_coordinates else _side_columns(t, side, scratch)


def _natural_columns(t: torch.Tensor, side: SideRotation | None, scratch: Scratch) -> torch.Tensor:
    """``t Ψ``: last-dimension entries from a block side's coordinates back to natural order."""
    index = side_permutation(side)
    return t if index is None else select_last(t, inverse_permutation(index), scratch.allocate)


def _side_columns(t: torch.Tensor, side: SideRotation | None, scratch: Scratch) -> torch.Tensor:
    """``t Ψᵀ``: last-dimension entries from natural order to a block side's coordinates."""
    index = side_permutation(side)
    return t if index is None else select_last(t, index, scratch.allocate)


class ActivationStrategy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, r_vec, p_vec, spec: RotatedPass, dtypes: ComputeDtypes):
        input_side, output_side = spec.input_side, spec.output_side
        scratch = Scratch()  # each T × d result takes the memory of one that died before it
        with autocast_off(x.device.type):
            r_blocks = None if input_side is None else input_side.blocks(r_vec, store=True)[0]
            # Without an output side the bias is fused into the base op (one addmm); with one it is added last.
            u = _base_input(x.reshape(-1, x.shape[-1]), spec, r_blocks, dtypes, scratch)
            op = cast(LinearOp, spec.op)  # what `RotatedPass` allows the activation strategies
            h_base = _products(u, None, weight, op, bias if output_side is None else None, dtypes.base)[0]
            scratch.release(u)
            h = _coordinates_of_side(cast(torch.Tensor, h_base), spec, output_side, scratch)  # in P's coordinates
            y = h
            if output_side is not None:
                p_blocks = output_side.blocks(p_vec, store=True)[0].to(dtypes.rotation)
                y = right_product(h.to(dtypes.rotation), output_side, p_blocks, row_major=True, empty=scratch.allocate)
                if not spec.keeps_output:
                    scratch.release(h, y)
                y = _natural_columns(y, output_side, scratch).to(dtypes.base)
                if bias is not None:
                    y = y.add_(bias.to(dtypes.base))  # y is this call's own
        kept_h = h if output_side is not None and spec.keeps_output else None
        ctx.save_for_backward(x, save_weight(ctx, weight), bias, r_vec, p_vec, kept_h)
        ctx.spec, ctx.dtypes = spec, dtypes
        # row-major, as a Linear's output: the next op may view it, or keep it (a column-major gather leaves it not)
        return y.contiguous().reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad_y):
        x, weight, bias, r_vec, p_vec, h = ctx.saved_tensors
        spec, dtypes = ctx.spec, ctx.dtypes
        input_side, output_side = spec.input_side, spec.output_side
        grads: list[Any] = [None] * 7
        scratch = Scratch()
        with autocast_off(grad_y.device.type):
            weight = weight_source(weight, ctx)
            x2 = x.reshape(-1, x.shape[-1])
            g = grad_y.reshape(-1, grad_y.shape[-1])
            r_blocks = r_eval = None
            if bias is not None and ctx.needs_input_grad[2]:
                grads[2] = spec.op.bias_grad(g.to(dtypes.base)).to(bias.dtype)
            g_h, need_h = g, False  # dL/dh, in P's coordinates; whether h must be recomputed
            if output_side is not None:  # y = (h Diag(P)) Ψ_P, h = H Ψ_Pᵀ
                p_blocks, p_eval = output_side.blocks(p_vec)
                g = _side_columns(g.to(dtypes.rotation), output_side, scratch)
                g_h = right_product(
                    g, output_side, transpose_blocks(p_blocks.to(dtypes.rotation)), empty=scratch.allocate
                )
                need_h = ctx.needs_input_grad[4] and h is None
            if input_side is not None and need_h:  # R's blocks are built when first needed: here for h, else after W0
                r_blocks, r_eval = input_side.blocks(r_vec)
            # One pass over W0: h recomputed where needed, and dL/du = g_h Ψ_P W0 Ψ_Rᵀ (in R's coordinates).
            u = _base_input(x2, spec, r_blocks, dtypes, scratch) if need_h else None
            g_base = _base_columns(g_h.to(dtypes.base), spec, output_side, scratch)
            del g_h  # freed before the products allocate theirs
            h_base, grad_base = _products(u, g_base, weight, spec.op, None, dtypes.base)
            scratch.release(u)
            scratch.release(g_base)
            del u, g_base
            grad_u = _coordinates_of_side(cast(torch.Tensor, grad_base), spec, input_side, scratch)
            # Each activation-sized operand is freed once used: the rotations' VJPs below set the backward's peak.
            del grad_base
            if output_side is not None and ctx.needs_input_grad[4]:
                h = h if h_base is None else _coordinates_of_side(h_base, spec, output_side, scratch)
                h_base = None
                grad_blocks = grad_right(h.to(dtypes.rotation), g, output_side)
                h = g = None  # freed, not released: the map's VJP allocates next
                grads[4] = output_side.vector_grad(p_eval, grad_blocks, p_vec)
                del grad_blocks
            del h, h_base
            if input_side is not None:
                if r_blocks is None:
                    r_blocks, r_eval = input_side.blocks(r_vec)
                grad_u = grad_u.to(dtypes.rotation)
                if ctx.needs_input_grad[3]:
                    x_r = _side_columns(x2.to(dtypes.rotation), input_side, scratch)
                    grad_blocks = grad_right(x_r, grad_u, input_side)
                    scratch.release(x_r)
                    del x_r
                    grads[3] = input_side.vector_grad(r_eval, grad_blocks, r_vec)
                    del grad_blocks
                r_transposed = transpose_blocks(r_blocks.to(dtypes.rotation))
                rotated = right_product(grad_u, input_side, r_transposed, row_major=True, empty=scratch.allocate)
                scratch.release(grad_u, rotated)
                grad_u = _natural_columns(rotated, input_side, scratch)
                del rotated
            if ctx.needs_input_grad[0]:
                grads[0] = grad_u.contiguous().reshape(x.shape).to(x.dtype)
        return tuple(grads)
