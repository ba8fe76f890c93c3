"""An input-embedding lookup against a table that FSDP2 keeps split by vocabulary rows, never gathered.

Each process holds ``V/P`` rows of the table (FSDP2's ``Shard(0)``) and ``N`` token ids of its own. For each step of
``c`` token positions the processes gather the ``P·c`` ids; each looks up the ids its rows hold (zero elsewhere) and one
reduce-scatter sums the vocabulary shards' rows and hands every process its own tokens' embeddings. The backward
gathers the ``P·c`` rows of ``∂L/∂embeddings`` and adds each into the table row it came from, for this process's rows
only: that is the sum over processes of each process's gradient, divided by ``P`` as FSDP2's reduce-scatter averages.

So no process holds the table whole, its whole gradient, or FSDP2's reduce-scatter buffer of it (``3·V·d`` entries
over a step); a step holds ``2·P·c·d`` looked-up entries instead. `poet_hf.training.chunked_loss` uses it with the
sharded head (`poet_hf.training.sharded_head_loss`), standing in for the embedding module while the model runs.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.function import FunctionCtx

from .sharded_head_loss import gather_rows, row_shard

__all__ = ["ShardedEmbeddingLookup", "looks_up_its_own_table", "splits_by_rows"]


class _ShardedLookup(torch.autograd.Function):
    """This process's tokens' rows of a table split by rows; its shard's gradient as FSDP2's mean over processes."""

    @staticmethod
    def forward(  # noqa: PLR0913
        ctx: FunctionCtx,
        local: torch.Tensor,
        ids: torch.Tensor,
        vocab_start: int,
        chunk: int,
        padding_idx: int | None,
        dtype: torch.dtype,
        group: dist.ProcessGroup,
    ) -> torch.Tensor:
        processes = dist.get_world_size(group)
        counts = gather_rows(torch.tensor(ids.numel(), device=ids.device), group)
        longest, step = int(counts.max()), max(1, math.ceil(chunk / processes))
        padded = torch.nn.functional.pad(ids.reshape(-1), (0, longest - ids.numel()), value=-1)
        out = local.new_empty(longest, local.shape[1], dtype=dtype)
        for start in range(0, longest, step):
            every = gather_rows(padded[start : start + step], group).flatten()
            owned = (every >= vocab_start) & (every < vocab_start + local.shape[0])
            rows = local[(every - vocab_start).clamp(0, local.shape[0] - 1)].to(dtype) * owned[:, None]
            dist.reduce_scatter_single(out[start : start + step], rows, group=group)
        ctx.save_for_backward(padded)
        ctx.table = (local.shape, local.dtype, vocab_start, step, padding_idx, group)  # type: ignore[attr-defined]
        return out[: ids.numel()].view(*ids.shape, local.shape[1])

    @staticmethod
    def backward(ctx: FunctionCtx, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (padded,) = ctx.saved_tensors  # type: ignore[attr-defined]
        shape, dtype, start_row, step, padding_idx, group = ctx.table  # type: ignore[attr-defined]
        rows = grad_output.reshape(-1, shape[1])
        rows = torch.nn.functional.pad(rows, (0, 0, 0, padded.numel() - rows.shape[0]))
        grad = torch.zeros(shape, dtype=dtype, device=grad_output.device)  # the shard's own dtype, as FSDP2's
        for start in range(0, padded.numel(), step):
            every = gather_rows(padded[start : start + step], group).flatten()
            gradients = gather_rows(rows[start : start + step], group).flatten(0, 1)
            owned = (every >= start_row) & (every < start_row + shape[0])
            if padding_idx is not None:  # nn.Embedding leaves its padding row's gradient at zero
                owned &= every != padding_idx
            grad.index_add_(0, every[owned] - start_row, gradients[owned].to(dtype))
        return grad.div_(dist.get_world_size(group)), None, None, None, None, None, None


def looks_up_its_own_table(embedding: nn.Module | None, head: nn.Module | None) -> bool:
    """Whether ``embedding`` is an ``nn.Embedding`` (or FSDP2's subclass of it) that only looks rows up (its own
    ``forward``, no ``max_norm``, no gradient scaling by frequency; ``padding_idx`` is honoured), trains, and does not
    share its table with ``head``: what `ShardedEmbeddingLookup` stands in for, on a table split by rows."""
    if not isinstance(embedding, nn.Embedding) or type(embedding).forward is not nn.Embedding.forward:
        return False
    plain = embedding.max_norm is None and not embedding.scale_grad_by_freq
    untied = head is None or getattr(head, "weight", None) is not embedding.weight
    return plain and untied and embedding.weight.requires_grad


def splits_by_rows(embedding: nn.Module) -> bool:
    """Whether FSDP2 split ``embedding``'s table along its rows (``Shard(0)``) only."""
    from torch.distributed.tensor import DTensor, Shard

    weight = getattr(embedding, "weight", None)
    return isinstance(weight, DTensor) and tuple(weight.placements) == (Shard(0),)


class ShardedEmbeddingLookup(nn.Module):
    """Stands in for an FSDP2-sharded ``nn.Embedding`` while the model runs, looking its rows up where they are.

    FSDP2 would gather the whole table before any call of its unit; this module reads only the local shard.

    Args:
        embedding: the sharded ``nn.Embedding`` (`looks_up_its_own_table`, `splits_by_rows`).
        chunk_tokens: token positions, over all processes, looked up at once.
        dtype: the dtype of the embeddings it returns (FSDP2's ``param_dtype``, as its gathered table would give).
    """

    def __init__(self, embedding: nn.Embedding, chunk_tokens: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.embedding, self.chunk_tokens, self.dtype = [embedding], chunk_tokens, dtype  # a list: not a submodule

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embeddings of ``input_ids``: this process's tokens, any shape."""
        embedding = self.embedding[0]
        local, vocab_start, group = row_shard(embedding.weight)
        return _ShardedLookup.apply(
            local, input_ids, vocab_start, self.chunk_tokens, embedding.padding_idx, self.dtype, group
        )
