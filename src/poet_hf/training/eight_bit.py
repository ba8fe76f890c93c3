"""bitsandbytes' 8-bit optimizer states: which tensors keep 32 bits, and CPU steps in bounded memory.

`weights_keeping_32bit_states` names the weights whose states stay 32-bit; `own_override_index` keeps bitsandbytes'
process-wide overrides by position from reaching another optimizer.

bitsandbytes' CPU kernel for blockwise 8-bit states (``optimizer_update_8bit_blockwise``) dequantises both states
to float32, copies the gradient and forms the update over the whole tensor: about five float32 copies of the
parameter at once. Its states are quantised in independent blocks of 256 entries, so updating consecutive chunks of
whole blocks, each with the same kernel, gives the same bits with temporaries of one chunk
(`chunked_cpu_updates`); its 32-bit kernel is elementwise and is chunked the same way. GPU kernels are fused and left
alone.
"""

from __future__ import annotations

import contextlib
import sys
import types
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

__all__ = [
    "CHUNK_ENTRIES",
    "chunked_cpu_updates",
    "own_override_index",
    "share_overrides",
    "weights_keeping_32bit_states",
]

STATE_BLOCK = 256  # entries per absmax of bitsandbytes' blockwise 8-bit optimizer states
CHUNK_ENTRIES = 1 << 22  # entries per chunk (16 MB of float32), a whole number of blocks


def _in_one_piece(
    chunk: int, g: torch.Tensor, p: torch.Tensor, state1: torch.Tensor, state2: torch.Tensor | None
) -> bool:
    """Whether a step runs as bitsandbytes runs it: off the CPU, small, or on tensors a flat view cannot split."""
    flat = (g, p, state1) + ((state2,) if state2 is not None else ())
    return (
        p.device.type != "cpu"
        or p.numel() <= chunk
        or state1.shape != p.shape
        or not all(t.is_contiguous() for t in flat)
    )


def _chunked(update: Callable[..., None], chunk: int) -> Callable[..., None]:
    def chunked_update(name: str, g: torch.Tensor, p: torch.Tensor, state1: torch.Tensor, state2, *args: Any, **kwargs):
        if _in_one_piece(chunk, g, p, state1, state2):
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


def _chunked_32bit(update: Callable[..., None], chunk: int) -> Callable[..., None]:
    def chunked_update(name: str, g, p, state1, beta1, eps, step, lr, state2=None, *args: Any, **kwargs: Any):
        # The update norm (max_unorm > 0) is a whole-tensor reduction.
        if _in_one_piece(chunk, g, p, state1, state2) or kwargs.get("max_unorm", 0.0) > 0:
            return update(name, g, p, state1, beta1, eps, step, lr, state2, *args, **kwargs)
        for start in range(0, p.numel(), chunk):
            part = slice(start, min(start + chunk, p.numel()))
            moment2 = None if state2 is None else state2.view(-1)[part]
            update(name, g.view(-1)[part], p.data.view(-1)[part], state1.view(-1)[part], beta1, eps, step, lr, moment2,
                   *args, **kwargs)  # fmt: skip
        return None

    return chunked_update


@contextlib.contextmanager
def chunked_cpu_updates(chunk: int = CHUNK_ENTRIES) -> Iterator[None]:
    """Within the block, bitsandbytes' steps update large CPU tensors ``chunk`` entries at a time: 8-bit states in
    whole blocks, 32-bit states (the embeddings', `weights_keeping_32bit_states`) entry by entry.

    The bits are the same (see the module docstring).

    Args:
        chunk: entries per chunk, a multiple of 256.
    """
    if chunk % STATE_BLOCK:
        raise ValueError(f"`chunk` must be a multiple of {STATE_BLOCK}, got {chunk}")
    import bitsandbytes.functional as functional

    originals = functional.optimizer_update_8bit_blockwise, functional.optimizer_update_32bit
    functional.optimizer_update_8bit_blockwise = _chunked(originals[0], chunk)
    functional.optimizer_update_32bit = _chunked_32bit(originals[1], chunk)
    try:
        yield
    finally:
        functional.optimizer_update_8bit_blockwise, functional.optimizer_update_32bit = originals


def own_override_index(optimizer: torch.optim.Optimizer) -> None:
    """Give a bitsandbytes optimizer its own table of overrides by position.

    bitsandbytes keeps the overrides of ``register_module_override`` by (group, index) in one process-wide table, so a
    ``Trainer`` that kept its embedding, at (0, 0), at 32 bits makes the (0, 0) parameter of every later bitsandbytes
    optimizer in the process 32-bit too (each one-parameter optimizer of `FusedStepOptimizer` among them). The
    overrides by parameter (``override_config``) and by module stay shared. Other optimizers are left alone.
    """
    manager = getattr(optimizer, "mng", None)
    if manager is None or not hasattr(manager, "index2config"):
        return
    optimizer.mng = types.SimpleNamespace(  # type: ignore[attr-defined]
        pid2config=manager.pid2config,
        index2config={},
        module_weight_config_triple=manager.module_weight_config_triple,
    )


def share_overrides(weight: torch.Tensor, parts: Sequence[torch.Tensor]) -> None:
    """Give each of ``parts`` (a weight trained as chunks, `poet_hf.training.row_gradients`) the bitsandbytes
    override by parameter that ``weight`` has (``override_config``, e.g. 32-bit states), for as long as it lives."""
    if "bitsandbytes" not in sys.modules:
        return
    from bitsandbytes.optim import GlobalOptimManager

    table = GlobalOptimManager.get_instance().pid2config
    config = table.get(id(weight))
    for part in parts if config is not None else []:
        table[id(part)] = dict(config)
        weakref.finalize(part, table.pop, id(part), None)


def weights_keeping_32bit_states(model: nn.Module) -> list[torch.Tensor]:
    """The weights that keep 32-bit states under bitsandbytes' 8-bit optimizers: every ``nn.Embedding``, as
    ``Trainer`` keeps them, and an output head whose rows are not a whole number of 8-bit state blocks (256 entries).

    An embedding's rows see a gradient only when their token occurs, and 8-bit states train it measurably worse
    (bitsandbytes' advice, and what ``Trainer`` does). A block of 8-bit states shares one scale: where a block of the
    head spans two tokens' rows, a frequent token's moments set the scale and a rare token's round to a few codes or
    to zero, which also trains worse. A head whose rows are a whole number of blocks (4096, 768 or 256 wide) keeps
    each block within one token and 8-bit states (docs/training-modes.md).

    Args:
        model: the model (its ``nn.Embedding`` modules and ``get_output_embeddings()``, where it has one).

    Returns:
        The weights, each once (tied ones are one tensor).
    """
    weights: dict[int, torch.Tensor] = {id(m.weight): m.weight for m in model.modules() if isinstance(m, nn.Embedding)}
    output = getattr(model, "get_output_embeddings", lambda: None)()
    head = getattr(output, "weight", None)
    if head is not None and head.dim() == 2 and head.shape[-1] % STATE_BLOCK:
        weights.setdefault(id(head), head)
    return list(weights.values())
