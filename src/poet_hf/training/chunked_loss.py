"""A causal LM's loss computed a chunk of tokens at a time, so the ``tokens × vocabulary`` logits never exist whole.

`linear_cross_entropy` is the head and the cross-entropy in one (as fused linear cross-entropy kernels such as Liger's
are): for each chunk of ``c`` tokens it forms the chunk's logits in float32, their log-sum-exp and target entry, and
the gradient of the summed loss with respect to them, ``softmax − onehot``, from which it accumulates the gradients of
the hidden states and of the head's weight (and bias), the weight's in its own dtype (as Liger's kernel: a bfloat16
head's gradient is rounded once per chunk). Only one chunk's ``c × V`` logits are alive at a time, instead of the
whole ``N × V`` and their gradient; the gradients are held from the forward to the backward, which scales them in
place by the incoming gradient, so the head's gradient is never held twice. The loss is transformers'
``ForCausalLMLoss``: the labels shifted by one, ``-100`` ignored, the sum over the kept tokens divided by
``num_items_in_batch`` when given, else by their count.

`causal_lm_loss` runs a transformers causal LM with ``logits_to_keep`` empty (no logits), reads the normalised final
hidden states off its decoder, and applies `linear_cross_entropy` with the model's output head; where FSDP2 split the
head by vocabulary rows, `poet_hf.training.sharded_head_loss` instead, which never gathers it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
from torch import nn
from torch.autograd.function import FunctionCtx

from ..sharded import is_dtensor
from ..tuners.config_utils import check_positive_int

if TYPE_CHECKING:
    from transformers import PreTrainedModel, Trainer

__all__ = ["IGNORE_INDEX", "causal_lm_loss", "linear_cross_entropy", "trainer_loss"]

IGNORE_INDEX = -100  # transformers' ignored label


class _LinearCrossEntropy(torch.autograd.Function):
    """Sum of the cross-entropies of ``hidden @ weight.T + bias`` against ``labels``, over ``normalizer``."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        labels: torch.Tensor,
        chunk: int,
        normalizer: torch.Tensor,
    ) -> torch.Tensor:
        wants_hidden, wants_weight, wants_bias = ctx.needs_input_grad[:3]  # type: ignore[attr-defined]
        work = torch.promote_types(hidden.dtype, torch.float32)  # the logits' dtype: float32, or float64
        grad_hidden = torch.zeros_like(hidden) if wants_hidden else None
        grad_weight = torch.zeros_like(weight) if wants_weight else None  # the weight's dtype, as Liger's kernel
        grad_bias = torch.zeros(weight.shape[0], dtype=work, device=weight.device) if wants_bias else None
        total = torch.zeros((), dtype=work, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk):
            rows, targets = hidden[start : start + chunk], labels[start : start + chunk]
            logits = (rows @ weight.T).to(work)
            if bias is not None:
                logits += bias.to(work)
            kept = targets != IGNORE_INDEX
            picked = targets.clamp_min(0)[:, None]
            normalizer_of_rows = logits.logsumexp(dim=1, keepdim=True)
            total += ((normalizer_of_rows[:, 0] - logits.gather(1, picked)[:, 0]) * kept).sum()
            if not (wants_hidden or wants_weight or wants_bias):
                continue
            gradient = logits.sub_(normalizer_of_rows).exp_()  # softmax, in place of the logits
            gradient.scatter_add_(1, picked, torch.full_like(picked, -1, dtype=gradient.dtype))
            gradient *= kept[:, None]
            if grad_bias is not None:
                grad_bias += gradient.sum(dim=0)
            gradient = gradient.to(weight.dtype)
            if grad_hidden is not None:
                grad_hidden[start : start + chunk] = gradient @ weight
            if grad_weight is not None:
                grad_weight.addmm_(gradient.T, rows)
        ctx.save_for_backward(*cast(list[torch.Tensor], [grad_hidden, grad_weight, grad_bias, normalizer]))
        return total / normalizer.to(work)

    @staticmethod
    def backward(ctx: FunctionCtx, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # Scaled in place, so the head's gradient is the forward's sum itself (a second backward through the same
        # graph finds the saved tensors modified, and autograd refuses it).
        grad_hidden, grad_weight, grad_bias, normalizer = ctx.saved_tensors  # type: ignore[attr-defined]
        scale = grad_output / normalizer.to(grad_output.dtype)
        for gradient in (grad_hidden, grad_weight, grad_bias):
            if gradient is not None:
                gradient.mul_(scale.to(gradient.dtype))
        return grad_hidden, grad_weight, grad_bias, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    chunk_tokens: int = 1024,
    num_items_in_batch: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """The cross-entropy of the logits ``hidden @ weight.T + bias`` against ``labels``, ``chunk_tokens`` rows at a time.

    Args:
        hidden: the ``N × d`` inputs of the head (any float dtype).
        weight: the head's ``V × d`` weight.
        labels: the ``N`` target indices; `IGNORE_INDEX` entries count nothing.
        bias: the head's ``V`` bias, if any.
        chunk_tokens: rows whose logits exist at once.
        num_items_in_batch: what the summed loss is divided by (transformers' count of the batch's kept tokens under
            gradient accumulation); default the count of kept ``labels``.

    Returns:
        The loss, in float32 (float64 for float64 inputs); its gradients are those of the loss computed on the whole
        logits.

    Raises:
        ValueError: ``chunk_tokens`` is not a positive integer.
    """
    check_positive_int("loss_chunk_tokens", chunk_tokens)
    normalizer = _normalizer(labels, num_items_in_batch, hidden.device)
    return _LinearCrossEntropy.apply(hidden, weight, bias, labels, chunk_tokens, normalizer)


def _normalizer(
    labels: torch.Tensor, num_items_in_batch: int | torch.Tensor | None, device: torch.device
) -> torch.Tensor:
    """What the summed loss is divided by: ``num_items_in_batch``, else the count of kept ``labels`` (at least 1)."""
    count = (labels != IGNORE_INDEX).sum() if num_items_in_batch is None else num_items_in_batch
    return torch.as_tensor(count, dtype=torch.float32, device=device).clamp_min(1)


def causal_lm_loss(
    model: nn.Module,
    inputs: dict[str, torch.Tensor],
    chunk_tokens: int,
    num_items_in_batch: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """A causal LM's training loss on ``inputs`` (with ``labels``), the head applied `linear_cross_entropy`'s way.

    The model (any wrapper: DDP, a ``PeftModel``) runs its forward with ``logits_to_keep`` empty, so its head forms no
    logits; the final hidden states come from its decoder (``base_model_prefix``), normalised as the head reads them.

    Args:
        model: the model as the trainer calls it.
        inputs: the batch, ``labels`` included (unshifted, as transformers takes them).
        chunk_tokens: rows whose logits exist at once.
        num_items_in_batch: transformers' count of the batch's kept tokens, if the trainer gives one.

    Raises:
        ValueError: the model has no decoder under its ``base_model_prefix``; its head is partitioned by ZeRO-3, or
            sharded by FSDP2 and has a bias.
    """
    from ..tuners.tuner_base import base_model_of
    from .callback import unwrap
    from .sharded_head_loss import sharded_head_cross_entropy

    base = base_model_of(unwrap(model))
    decoder, head = getattr(base, getattr(base, "base_model_prefix", ""), None), base.get_output_embeddings()
    if not isinstance(decoder, nn.Module) or head is None:
        raise ValueError(
            f"`loss_chunk_tokens` reads the final hidden states off a causal LM's decoder; {type(base).__name__} has "
            "no decoder under its `base_model_prefix` or no output embeddings"
        )
    if hasattr(head.weight, "ds_id"):  # ZeRO-3's partition
        raise ValueError(
            "`loss_chunk_tokens` reads the output head's weight outside its forward, where ZeRO-3 keeps only this "
            "process's partition; train the chunked loss with one process, DDP, ZeRO-2 or FSDP2"
        )
    sharded_head = is_dtensor(head.weight)
    if sharded_head and getattr(head, "bias", None) is not None:
        raise ValueError("`loss_chunk_tokens` under FSDP2 takes an output head without a bias")
    labels = inputs["labels"]
    batch = {k: v for k, v in inputs.items() if k != "labels"}
    hidden = _final_hidden(model, base, decoder, batch, chunk_tokens if sharded_head else None)
    shifted = torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:].reshape(-1).to(hidden.device)
    rows = hidden.reshape(-1, hidden.shape[-1])
    if sharded_head:  # FSDP2 split the head by vocabulary rows: each process forms the logits of its own rows
        normalizer = _normalizer(shifted, num_items_in_batch, hidden.device)
        return sharded_head_cross_entropy(rows, head.weight, shifted, chunk_tokens, normalizer)
    return linear_cross_entropy(
        rows, head.weight, shifted, getattr(head, "bias", None), chunk_tokens, num_items_in_batch
    )


class _NoLogits(nn.Module):
    """Stands in for an FSDP2-sharded head while the model runs: the model asks for no logits, but FSDP2 would
    gather the whole head before any call of its unit, even on the empty slice."""

    def __init__(self, vocabulary: int) -> None:
        super().__init__()
        self.vocabulary = vocabulary

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden.new_empty(*hidden.shape[:-1], self.vocabulary)


def _final_hidden(
    model: nn.Module, base: PreTrainedModel, decoder: nn.Module, inputs: dict[str, torch.Tensor], chunk: int | None
) -> torch.Tensor:
    """The decoder's final hidden states for ``inputs``, the model run with ``logits_to_keep`` empty.

    With a sharded head (``chunk`` given), `_NoLogits` stands in for it while the model runs
    (``set_output_embeddings``), and `ShardedEmbeddingLookup` for input embeddings that look up their own table
    (`looks_up_its_own_table`) and that FSDP2 split by rows, so no process gathers either."""
    from .sharded_embedding import ShardedEmbeddingLookup, looks_up_its_own_table, splits_by_rows

    captured: list[torch.Tensor] = []
    hook = decoder.register_forward_hook(lambda _module, _args, output: captured.append(output[0]))
    head, embeddings = base.get_output_embeddings(), base.get_input_embeddings()
    lookup = chunk is not None and looks_up_its_own_table(embeddings, head) and splits_by_rows(embeddings)
    if chunk is not None:
        base.set_output_embeddings(_NoLogits(head.weight.shape[0]))
    if lookup:
        table = cast(nn.Embedding, embeddings)
        base.set_input_embeddings(ShardedEmbeddingLookup(table, cast(int, chunk), _compute_dtype(table)))
    try:
        device = next(iter(inputs.values())).device
        model(**inputs, logits_to_keep=torch.empty(0, dtype=torch.long, device=device))
    finally:
        hook.remove()
        if chunk is not None:
            base.set_output_embeddings(head)
        if lookup:
            base.set_input_embeddings(embeddings)
    return captured[-1]


def _compute_dtype(module: nn.Module) -> torch.dtype:
    """The dtype FSDP2 gathers ``module``'s parameters in: its mixed-precision ``param_dtype``, else their own."""
    policy = getattr(getattr(module, "_get_fsdp_state", lambda: None)(), "_mp_policy", None)
    return getattr(policy, "param_dtype", None) or next(module.parameters()).dtype


def trainer_loss(
    trainer: Trainer,
    model: nn.Module,
    inputs: dict[str, torch.Tensor],
    return_outputs: bool = False,
    num_items_in_batch: int | torch.Tensor | None = None,
) -> torch.Tensor | None:
    """``Trainer.compute_loss``'s loss by `causal_lm_loss`, scaled as ``Trainer`` scales a model's own loss when it
    averages tokens across processes; ``None`` where the trainer computes it its own way (no ``loss_chunk_tokens``,
    outputs asked for, no ``labels``, a custom loss or label smoothing).

    Args:
        trainer: the ``transformers.Trainer``.
        model: the model as the trainer calls it.
        inputs: the batch.
        return_outputs: whether the caller wants the model's outputs too.
        num_items_in_batch: the trainer's count of the accumulated batch's kept tokens, or ``None``.
    """
    chunk = getattr(trainer.args, "loss_chunk_tokens", None)
    custom = trainer.compute_loss_func is not None or trainer.label_smoother is not None
    if not chunk or return_outputs or "labels" not in inputs or custom:
        return None
    items = num_items_in_batch if trainer.model_accepts_loss_kwargs else None
    loss = causal_lm_loss(model, inputs, chunk, items)
    if trainer.args.average_tokens_across_devices and items is not None:
        loss = loss * (trainer.accelerator.num_processes // trainer.get_tp_size())
    return loss
