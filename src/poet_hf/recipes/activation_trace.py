"""The activations one training forward saves, traced on the ``meta`` device by shapes alone (`poet_hf.plan_memory`).

Every tensor autograd saves is recorded through ``torch.autograd.graph.saved_tensors_hooks`` (distinct storages,
parameters left out), by the transformer block that saved it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["float_size", "trace_activations"]


class _FusedAttentionShapes(torch.autograd.Function):
    """Scaled dot-product attention as the fused kernels keep it for the backward.

    The flash and memory-efficient kernels (GPU and CPU) keep the query, key, value, output and the row log-sum-exp,
    never the ``T × T`` probabilities that the meta device's decomposed attention would save."""

    @staticmethod
    def forward(ctx, query, key, value):
        output = query.new_empty(*query.shape[:-1], value.shape[-1])
        ctx.save_for_backward(query, key, value, output, query.new_empty(query.shape[:-1]))
        return output

    @staticmethod
    def backward(ctx, grad_output):
        query, key, value = ctx.saved_tensors[:3]
        return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


def _fused_attention(query, key, value, *args, **kwargs):
    return _FusedAttentionShapes.apply(query, key, value)


def trace_activations(
    model: nn.Module, batch_size: int, seq_len: int, dtype: torch.dtype, blocks: tuple[type[nn.Module], ...]
) -> tuple[int, int, int, int]:
    """The activation bytes of one meta forward of the training loss.

    ``(saved outside the blocks, saved by the largest block, all saved, one block's input)``, with ``dtype`` the
    activations' float type."""
    parameters = {p.untyped_storage()._cdata for p in model.parameters()}
    saved: dict[int, tuple[int, int | None]] = {}
    current: list[int | None] = [None]
    block_input = [0]
    hooks = []

    def leave(*_: Any) -> None:
        current[0] = None

    for index, module in enumerate(m for m in model.modules() if isinstance(m, blocks)):

        def enter(_, args, index=index):
            current[0] = index
            block_input[0] = max(block_input[0], args[0].numel() * float_size(args[0], dtype) if args else 0)

        hooks += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage._cdata not in parameters:
            saved[storage._cdata] = (storage.nbytes() // tensor.element_size() * float_size(tensor, dtype), current[0])
        return tensor

    ids = torch.zeros(batch_size, seq_len, dtype=torch.long, device="meta")
    sdpa = torch.nn.functional.scaled_dot_product_attention
    torch.nn.functional.scaled_dot_product_attention = _fused_attention
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(input_ids=ids, labels=ids)
    finally:
        torch.nn.functional.scaled_dot_product_attention = sdpa
        for hook in hooks:
            hook.remove()
    per_block: dict[int, int] = {}
    for nbytes, block in saved.values():
        if block is not None:
            per_block[block] = per_block.get(block, 0) + nbytes
    outside = sum(nbytes for nbytes, block in saved.values() if block is None)
    return outside, max(per_block.values(), default=0), sum(size for size, _ in saved.values()), block_input[0]


def float_size(tensor: torch.Tensor, dtype: torch.dtype) -> int:
    """Bytes per entry of an activation in a run of ``dtype`` (the meta trace runs in float32)."""
    return torch.finfo(dtype).bits // 8 if tensor.is_floating_point() else tensor.element_size()
