"""bitsandbytes' 8-bit optimizer steps on the CPU in bounded memory: a large tensor is updated a chunk at a time.

bitsandbytes' CPU kernel for blockwise 8-bit states (``optimizer_update_8bit_blockwise``) dequantises both states
to float32, copies the gradient and forms the update over the whole tensor: about five float32 copies of the
parameter at once. Its states are quantised in independent
blocks of 256 entries, so updating consecutive chunks of whole blocks, each with the same kernel, gives the same
bits with temporaries of one chunk. GPU kernels are fused and left alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["CHUNK_ENTRIES", "chunked_cpu_updates"]

STATE_BLOCK = 256  # entries per absmax of bitsandbytes' blockwise 8-bit optimizer states
CHUNK_ENTRIES = 1 << 22  # entries per chunk (16 MB of float32), a whole number of blocks


def _chunked(update: Any, chunk: int) -> Any:
    def chunked_update(name: str, g: torch.Tensor, p: torch.Tensor, state1: torch.Tensor, state2, *args: Any, **kwargs):
        flat = (g, p, state1) + ((state2,) if state2 is not None else ())
        whole = (
            p.device.type != "cpu"
            or p.numel() <= chunk
            or state1.shape != p.shape
            or not all(t.is_contiguous() for t in flat)
        )
        if whole:
            return update(name, g, p, state1, state2, *args, **kwargs)
        beta1, beta2, beta3, alpha, eps, step, lr, qmap1, qmap2, absmax1, absmax2, *rest = args
        for start in range(0, p.numel(), chunk):
            stop = min(start + chunk, p.numel())
            blocks = slice(start // STATE_BLOCK, -(-stop // STATE_BLOCK))
            update(
                name,
                g.view(-1)[start:stop],
                p.data.view(-1)[start:stop],
                state1.view(-1)[start:stop],
                None if state2 is None else state2.view(-1)[start:stop],
                beta1, beta2, beta3, alpha, eps, step, lr, qmap1, qmap2,
                absmax1[blocks],
                None if absmax2 is None else absmax2[blocks],
                *rest,
                **kwargs,
            )  # fmt: skip
        return None

    return chunked_update


@contextlib.contextmanager
def chunked_cpu_updates(chunk: int = CHUNK_ENTRIES) -> Iterator[None]:
    """Within the block, bitsandbytes' 8-bit steps update large CPU tensors ``chunk`` entries at a time.

    The bits are the same (see the module docstring).

    Args:
        chunk: entries per chunk, a multiple of 256.
    """
    if chunk % STATE_BLOCK:
        raise ValueError(f"`chunk` must be a multiple of {STATE_BLOCK}, got {chunk}")
    import bitsandbytes.functional as functional

    original = functional.optimizer_update_8bit_blockwise
    functional.optimizer_update_8bit_blockwise = _chunked(original, chunk)
    try:
        yield
    finally:
        functional.optimizer_update_8bit_blockwise = original
