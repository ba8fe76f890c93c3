"""The chunked causal-LM loss against an output head that FSDP2 keeps split by vocabulary rows, never gathered.

Each process holds ``V/P`` rows of the head (FSDP2's ``Shard(0)``) and ``N`` tokens of its own. For each step of ``c``
token positions, the processes gather the ``P·c`` hidden rows and labels at those positions; each forms the logits of
its vocabulary rows for all of them (``P·c × V/P``, float32: the ``c·V`` entries of a one-process chunk), and one
gather of every process's log-sum-exp and target logit per row gives each row its whole-vocabulary log-sum-exp
``log Σ_v exp z_v = log Σ_p exp lse_p`` and its target. The loss's gradient with respect to the logits,
``softmax − onehot``, weighted by the kept rows over each row's own process's ``num_items_in_batch``, then gives this
process's rows of the head's gradient (``gᵀ·H``, summed over every process's tokens) and a partial ``g·W_p`` for every
row's hidden state, which one reduce-scatter sums over the vocabulary shards and hands back to the rows' owners.

So no process ever holds the head whole, its whole gradient, or more than one chunk of logits: the head's gathered
weight, its unsharded gradient and FSDP2's reduce-scatter buffer of it (``3·V·d`` entries at the head's backward) are
replaced by ``P·c·d`` gathered hidden entries. The head's gradient is the mean over processes of each process's
loss gradient, as FSDP2's reduce-scatter averages every other gradient.
"""

from __future__ import annotations

import math
from typing import cast

import torch
import torch.distributed as dist
from torch.autograd.function import FunctionCtx

from ..tuners.config_utils import check_positive_int
from .chunked_loss import IGNORE_INDEX

__all__ = ["gather_rows", "row_shard", "sharded_head_cross_entropy"]


def gather_rows(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Every process's ``tensor`` (one shape everywhere), stacked in rank order along a new first dimension."""
    flat = tensor.contiguous().reshape(-1)
    out = torch.empty(dist.get_world_size(group) * flat.numel(), dtype=tensor.dtype, device=tensor.device)
    dist.all_gather_single(out, flat, group=group)
    return out.view(-1, *tensor.shape)


def row_shard(weight: torch.Tensor) -> tuple[torch.Tensor, int, dist.ProcessGroup]:
    """This process's rows of a ``DTensor`` split along its rows (``Shard(0)``), the global index of the first, and
    the mesh's process group (FSDP2 pads to ``ceil(V/P)`` rows a process; trailing processes may hold none)."""
    from torch.distributed.tensor import DTensor

    table = cast(DTensor, weight)
    group = table.device_mesh.get_group()
    rows_per_process = math.ceil(table.shape[0] / dist.get_world_size(group))
    first = min(dist.get_rank(group) * rows_per_process, table.shape[0])
    return table.to_local(), first, group


def _chunk_gradients(
    logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, normalizers: torch.Tensor, group: dist.ProcessGroup
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of one step: the loss (zero where ignored), and ``logits`` turned in place into the weighted
    ``softmax − onehot`` of this process's vocabulary rows."""
    processes, rows = dist.get_world_size(group), logits.shape[0]
    owned = (targets >= vocab_start) & (targets < vocab_start + logits.shape[1])
    local = (targets - vocab_start).clamp(0, logits.shape[1] - 1)[:, None]
    target_logit = logits.gather(1, local)[:, 0] * owned
    statistics = gather_rows(torch.stack([logits.logsumexp(dim=1), target_logit], dim=1), group)
    normalizer = statistics[..., 0].logsumexp(dim=0)
    kept = targets != IGNORE_INDEX
    losses = (normalizer - statistics[..., 1].sum(dim=0)) * kept
    gradient = logits.sub_(normalizer[:, None]).exp_()
    gradient.scatter_add_(1, local, -owned[:, None].to(gradient.dtype))
    weights = kept / normalizers.repeat_interleave(rows // processes).to(gradient.dtype)
    return losses, gradient.mul_(weights[:, None])


class _ShardedHeadCrossEntropy(torch.autograd.Function):
    """This process's loss sum over ``normalizer``; the head shard's gradient as FSDP2's mean over processes."""

    @staticmethod
    def forward(  # noqa: PLR0913
        ctx: FunctionCtx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        chunk: int,
        normalizer: torch.Tensor,
        vocab_start: int,
        group: dist.ProcessGroup,
    ) -> torch.Tensor:
        processes, rank = dist.get_world_size(group), dist.get_rank(group)
        wants_gradients = any(ctx.needs_input_grad[:2])  # type: ignore[attr-defined]
        work = torch.promote_types(hidden.dtype, torch.float32)
        counts = gather_rows(torch.tensor(hidden.shape[0], device=hidden.device), group)
        longest, step = int(counts.max()), max(1, math.ceil(chunk / processes))
        padding = longest - hidden.shape[0]
        hidden_rows = torch.nn.functional.pad(hidden, (0, 0, 0, padding))
        label_rows = torch.nn.functional.pad(labels, (0, padding), value=IGNORE_INDEX)
        normalizers = gather_rows(normalizer, group)
        compute_weight = weight.to(hidden.dtype)  # FSDP2's param_dtype, as its gathered head would be
        grad_hidden = torch.empty_like(hidden_rows)
        grad_weight = torch.zeros_like(compute_weight)  # in the compute dtype, as `linear_cross_entropy`
        total = torch.zeros((), dtype=work, device=hidden.device)
        for start in range(0, longest, step):
            rows = gather_rows(hidden_rows[start : start + step], group).flatten(0, 1)
            targets = gather_rows(label_rows[start : start + step], group).flatten(0, 1)
            logits = (rows @ compute_weight.T).to(work)
            losses, gradient = _chunk_gradients(logits, targets, vocab_start, normalizers, group)
            total += losses.view(processes, -1)[rank].sum()
            if not wants_gradients:  # every process evaluates alike, so the collectives still pair up
                continue
            gradient = gradient.to(hidden.dtype)
            grad_weight.addmm_(gradient.T, rows)
            partial = gradient @ compute_weight  # rows in rank order: one block a process
            dist.reduce_scatter_single(grad_hidden[start : start + step], partial, group=group)
        ctx.group = group  # type: ignore[attr-defined]
        ctx.save_for_backward(grad_hidden[: hidden.shape[0]], grad_weight)
        return total / normalizer.to(work)

    @staticmethod
    def backward(ctx: FunctionCtx, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_hidden, grad_weight = ctx.saved_tensors  # type: ignore[attr-defined]
        group = cast(dist.ProcessGroup, ctx.group)  # type: ignore[attr-defined]
        scales = gather_rows(grad_output.to(torch.float64).reshape(()), group)
        if not bool((scales == scales[0]).all()):
            raise ValueError(
                "the sharded head's chunked loss sums every process's tokens into each head shard's gradient, so "
                f"each process must scale its loss alike; got the scales {scales.tolist()}"
            )
        grad_hidden.mul_(grad_output.to(grad_hidden.dtype))  # each row already over its own normalizer; in place
        grad_weight.mul_((grad_output / dist.get_world_size(group)).to(grad_weight.dtype))
        return grad_hidden, grad_weight, None, None, None, None, None


def sharded_head_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_tokens: int,
    normalizer: torch.Tensor,
) -> torch.Tensor:
    """`linear_cross_entropy`'s loss for an output head that FSDP2 split by vocabulary rows (``Shard(0)``).

    Every process calls it (collectives), each with its own tokens; no process gathers the head.

    Args:
        hidden: this process's ``N × d`` hidden states (``N`` may differ between processes).
        weight: the head's weight, a ``DTensor`` sharded along its vocabulary rows.
        labels: this process's ``N`` target indices; `IGNORE_INDEX` entries count nothing.
        chunk_tokens: token rows, over all processes, whose logits exist at once.
        normalizer: what this process's summed loss is divided by (a float32 scalar).

    Returns:
        This process's loss; its gradients are those of the loss on the whole logits, the head's averaged over
        processes as FSDP2 averages gradients.

    Raises:
        ValueError: ``chunk_tokens`` is not a positive integer, ``weight`` is not split along its rows only, or the
            processes' losses are scaled differently in the backward.
    """
    from torch.distributed.tensor import DTensor, Shard

    check_positive_int("loss_chunk_tokens", chunk_tokens)
    weight_tensor = cast(DTensor, weight)
    if tuple(weight_tensor.placements) != (Shard(0),):
        raise ValueError(
            "the sharded head's chunked loss needs the output head split along its vocabulary rows (`Shard(0)`); got "
            f"{tuple(weight_tensor.placements)}"
        )
    local, vocab_start, group = row_shard(weight_tensor)
    return _ShardedHeadCrossEntropy.apply(hidden, local, labels, chunk_tokens, normalizer, vocab_start, group)
