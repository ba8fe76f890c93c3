"""The two largest gradients of a language model, which a fused step never needs whole.

The output head's gradient and an input embedding's are vocabulary × hidden: 500 MB each at Llama-2-7B's shape in
float32, against a few MB for any other weight. Under [`FusedStepOptimizer`][poet_hf.training.FusedStepOptimizer]
each parameter steps as soon as its gradient is complete and frees it, so both can train as row chunks
(`RowChunked`): each chunk is a leaf of its own that aliases rows of the weight, and autograd forms, and the optimizer
steps and frees, one chunk's gradient before the next one's. Every chunk takes part in every forward (an embedding's
chunk that no token of the batch reads gets a zero gradient), so every row steps at every step, as with the whole
weight.

The arithmetic is the whole tensor's: AdamW-type updates act entry by entry, a chunk of a whole number of
bitsandbytes' 256-entry state blocks quantises its states as the whole tensor would, and the fused clip sums the
chunks' norms into the global one. A head tied to an embedding is left whole, and so is that embedding.
"""

from __future__ import annotations

import math
import re
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from .bf16_storage import UpcastEmbedding, UpcastLinear
from .eight_bit import CHUNK_ENTRIES, STATE_BLOCK

__all__ = [
    "ROW_CHUNK_ENTRIES",
    "RowChunked",
    "RowGradients",
    "largest_chunk_entries",
    "row_chunked_modules",
    "steps_by_entry",
]

ROW_CHUNK_ENTRIES = CHUNK_ENTRIES  # entries per row chunk (16 MB of float32); a weight no larger stays whole


class RowChunked:
    """Train the weight of an ``nn.Linear`` or ``nn.Embedding`` as row chunks of about ``chunk_entries`` entries.

    The chunks alias the weight's storage, so the weight (saved and exported as usual) always holds the trained
    values; while chunked it does not require a gradient itself, and the module's forward reads the chunks.
    `remove` restores both.

    Args:
        module: the layer; its weight must be contiguous.
        chunk_entries: entries per chunk, rounded up to whole rows and to whole 256-entry state blocks.
        dtype: the weight's storage while chunked (``torch.bfloat16``: `poet_hf.training.bf16_storage`, read in
            float32); default the weight's own.
    """

    def __init__(self, module: nn.Linear | nn.Embedding, chunk_entries: int, dtype: torch.dtype | None = None) -> None:
        weight = module.weight
        self.dtype = weight.dtype
        if dtype is not None and dtype != weight.dtype:
            weight.data = weight.data.to(dtype)  # the same parameter (the optimizer's groups name it), stored anew
        rows, cols = weight.shape
        self.module, self.weight = module, weight
        self.starts = chunk_starts(rows, cols, chunk_entries)
        ends = [*self.starts[1:], rows]
        self.chunks = [nn.Parameter(_alias_rows(weight, a, b - a)) for a, b in zip(self.starts, ends, strict=True)]
        weight.requires_grad_(False)
        forward = self._embed if isinstance(module, nn.Embedding) else self._linear
        module.forward = forward  # type: ignore[method-assign, assignment]

    def _linear(self, x: torch.Tensor) -> torch.Tensor:
        """``x Wᵀ (+ b)``, one row chunk of ``W`` at a time."""
        if self.weight.dtype == self.dtype:
            out = torch.cat([F.linear(x, chunk) for chunk in self.chunks], dim=-1)
        else:
            out = torch.cat([UpcastLinear.apply(x, chunk) for chunk in self.chunks], dim=-1)
        bias = cast(nn.Linear, self.module).bias
        return out if bias is None else out + bias

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows of ``W`` at ``ids``, each read from its chunk (every chunk read, if by no token)."""
        flat = ids.reshape(-1)
        padding = cast(nn.Embedding, self.module).padding_idx
        pieces, positions = [], []
        for start, chunk in zip(self.starts, self.chunks, strict=True):
            where = ((flat >= start) & (flat < start + chunk.shape[0])).nonzero().squeeze(-1)
            pad = padding - start if padding is not None and 0 <= padding - start < chunk.shape[0] else None
            if chunk.dtype == self.dtype:
                pieces.append(F.embedding(flat[where] - start, chunk, padding_idx=pad))
            else:
                pieces.append(UpcastEmbedding.apply(flat[where] - start, chunk, pad))
            positions.append(where)
        order = torch.cat(positions).argsort()
        return torch.cat(pieces)[order].reshape(*ids.shape, -1)

    def remove(self) -> None:
        """Train the weight whole again, in its own dtype."""
        del self.module.forward
        self.weight.data = self.weight.data.to(self.dtype)
        self.weight.requires_grad_(True)


class RowGradients:
    """Chunk a model's output head and its input embeddings by rows (`RowChunked`), for fused steps.

    Args:
        model: the model (its ``get_output_embeddings()`` and its ``nn.Embedding`` modules with trainable weights).
        chunk_entries: entries per chunk; a weight no larger stays whole. Default `ROW_CHUNK_ENTRIES`.
        dtype: the storage of the chunked weights (``torch.bfloat16``: `poet_hf.training.bf16_storage`, where a
            weight no larger than a chunk is one chunk); default their own.
    """

    def __init__(self, model: nn.Module, chunk_entries: int | None = None, dtype: torch.dtype | None = None) -> None:
        chunk_entries = chunk_entries or ROW_CHUNK_ENTRIES
        modules = row_chunked_modules(model, chunk_entries, any_size=dtype is not None)
        self.chunked = [RowChunked(m, chunk_entries, dtype) for m in modules]

    def replace_in(self, groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``groups`` with each chunked weight replaced by its chunks (in the weight's group)."""
        chunks = {id(c.weight): c.chunks for c in self.chunked}
        return [{**g, "params": [c for p in g["params"] for c in chunks.get(id(p), [p])]} for g in groups]

    def remove(self) -> None:
        """Train every weight whole again (once; later calls do nothing)."""
        for chunked in self.chunked:
            chunked.remove()
        self.chunked = []


ELEMENTWISE = re.compile(r"(Paged)?(AdamW|Adam|Lion|SGD|RMSprop|Adagrad)(8bit|32bit|4bit|Fp8)?")


def steps_by_entry(optimizer_cls: type, kwargs: dict[str, Any]) -> bool:
    """Whether ``optimizer_cls`` updates each entry from its own gradient and state alone (Adam, AdamW, Lion, SGD, …,
    torch's, bitsandbytes' or torchao's, their 8-bit states blockwise), so that row chunks step as the whole weight.

    Not Adafactor (row and column statistics), LAMB or LARS (a trust ratio per tensor), nor bitsandbytes with
    ``max_unorm`` or ``percentile_clipping`` (a norm per tensor)."""
    whole_tensor_terms = kwargs.get("max_unorm", 0.0) > 0 or kwargs.get("percentile_clipping", 100) < 100
    return bool(ELEMENTWISE.fullmatch(optimizer_cls.__name__)) and not whole_tensor_terms


def row_chunked_modules(
    model: nn.Module, chunk_entries: int | None = None, any_size: bool = False
) -> list[nn.Linear | nn.Embedding]:
    """The output head (an ``nn.Linear``) and the ``nn.Embedding`` modules that `RowGradients` chunks: trainable,
    contiguous, larger than ``chunk_entries`` (default `ROW_CHUNK_ENTRIES`; any size with ``any_size``), plain
    lookups, tied to nothing."""
    head = getattr(model, "get_output_embeddings", lambda: None)()
    candidates = [m for m in model.modules() if type(m) is nn.Embedding] + ([head] if type(head) is nn.Linear else [])
    counts: dict[int, int] = {}
    for module in candidates:
        counts[id(module.weight)] = counts.get(id(module.weight), 0) + 1
    entries = 0 if any_size else chunk_entries or ROW_CHUNK_ENTRIES
    return [m for m in candidates if counts[id(m.weight)] == 1 and _chunkable(m, entries)]  # tied weights stay whole


def chunk_starts(rows: int, cols: int, chunk_entries: int) -> list[int]:
    """The first row of each chunk of a ``rows × cols`` weight.

    Chunks hold about ``chunk_entries`` entries, rounded up to whole rows and whole 256-entry state blocks; a last
    chunk shorter than half of one joins the one before (and so stays above bitsandbytes' 8-bit minimum size)."""
    block_rows = STATE_BLOCK // math.gcd(cols, STATE_BLOCK)  # the fewest rows of whole state blocks
    wanted_rows = -(-chunk_entries // cols)
    step = -(-wanted_rows // block_rows) * block_rows
    starts = list(range(0, rows, step))
    if len(starts) > 1 and rows - starts[-1] < step // 2:
        starts.pop()
    return starts


def largest_chunk_entries(rows: int, cols: int, chunk_entries: int | None = None) -> int:
    """The entries of the largest row chunk of a ``rows × cols`` weight (`chunk_starts`; default `ROW_CHUNK_ENTRIES`),
    or of the whole weight where it stays whole."""
    if rows * cols <= (chunk_entries or ROW_CHUNK_ENTRIES):
        return rows * cols
    starts = chunk_starts(rows, cols, chunk_entries or ROW_CHUNK_ENTRIES)
    return max(b - a for a, b in zip(starts, [*starts[1:], rows], strict=True)) * cols


def _chunkable(module: nn.Module, chunk_entries: int) -> bool:
    weight = module.weight
    plain_lookup = not isinstance(module, nn.Embedding) or (
        module.max_norm is None and not module.scale_grad_by_freq and not module.sparse
    )
    return (
        isinstance(weight, nn.Parameter)
        and weight.requires_grad
        and weight.dim() == 2
        and weight.is_contiguous()
        and weight.numel() > chunk_entries
        and plain_lookup
        and not hasattr(module, "_hf_hook")  # accelerate's hooks own the module's forward
    )


def _alias_rows(weight: torch.Tensor, start: int, rows: int) -> torch.Tensor:
    """Rows ``start:start + rows`` of ``weight`` as a tensor of their own: the same storage, its own version counter,
    so a chunk stepped in place leaves the other chunks' saved tensors valid for their backward."""
    cols = weight.shape[1]
    alias = torch.empty(0, dtype=weight.dtype, device=weight.device)
    return alias.set_(weight.untyped_storage(), weight.storage_offset() + start * cols, (rows, cols), (cols, 1))
