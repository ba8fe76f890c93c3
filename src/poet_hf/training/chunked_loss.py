"""A causal LM's loss computed a chunk of tokens at a time, so the ``tokens × vocabulary`` logits never exist whole.

`linear_cross_entropy` is the head and the cross-entropy in one (as fused linear cross-entropy kernels such as Liger's
are): for each chunk of ``c`` tokens it forms the chunk's logits in float32, their log-sum-exp and target entry, and
the gradient of the summed loss with respect to them, ``softmax − onehot``, from which it accumulates the gradients of
the hidden states and of the head's weight (and bias). Only one chunk's ``c × V`` logits are alive at a time, instead
of the whole ``N × V`` and their gradient; the gradients are held from the forward to the backward, which scales them
by the incoming gradient. The loss is transformers' ``ForCausalLMLoss``: the labels shifted by one, ``-100`` ignored,
the sum over the kept tokens divided by ``num_items_in_batch`` when given, else by their count.

`causal_lm_loss` runs a transformers causal LM with ``logits_to_keep`` empty (no logits), reads the normalised final
hidden states off its decoder, and applies `linear_cross_entropy` with the model's output head.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
from torch import nn
from torch.autograd.function import FunctionCtx

from ..sharded import is_dtensor
from ..tuners.config_utils import check_positive_int

if TYPE_CHECKING:
    from transformers import Trainer

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
        grad_weight = torch.zeros(weight.shape, dtype=work, device=weight.device) if wants_weight else None
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
            if grad_hidden is not None:
                grad_hidden[start : start + chunk] = gradient.to(weight.dtype) @ weight
            if grad_weight is not None:
                grad_weight += gradient.T @ rows.to(work)
            if grad_bias is not None:
                grad_bias += gradient.sum(dim=0)
        ctx.save_for_backward(*cast(list[torch.Tensor], [grad_hidden, grad_weight, grad_bias, normalizer]))
        return total / normalizer.to(work)

    @staticmethod
    def backward(ctx: FunctionCtx, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_hidden, grad_weight, grad_bias, normalizer = ctx.saved_tensors  # type: ignore[attr-defined]
        scale = grad_output / normalizer.to(grad_output.dtype)
        hidden_part = None if grad_hidden is None else grad_hidden * scale.to(grad_hidden.dtype)
        weight_part = None if grad_weight is None else grad_weight * scale
        bias_part = None if grad_bias is None else grad_bias * scale
        return hidden_part, weight_part, bias_part, None, None, None


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
    if num_items_in_batch is None:
        num_items_in_batch = (labels != IGNORE_INDEX).sum()
    normalizer = torch.as_tensor(num_items_in_batch, dtype=torch.float32, device=hidden.device).clamp_min(1)
    return _LinearCrossEntropy.apply(hidden, weight, bias, labels, chunk_tokens, normalizer)


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
        ValueError: the model has no decoder under its ``base_model_prefix``, or its head is sharded (a ``DTensor``).
    """
    from ..tuners.tuner_base import base_model_of
    from .callback import unwrap

    base = base_model_of(unwrap(model))
    decoder, head = getattr(base, getattr(base, "base_model_prefix", ""), None), base.get_output_embeddings()
    if not isinstance(decoder, nn.Module) or head is None:
        raise ValueError(
            f"`loss_chunk_tokens` reads the final hidden states off a causal LM's decoder; {type(base).__name__} has "
            "no decoder under its `base_model_prefix` or no output embeddings"
        )
    if is_dtensor(head.weight) or hasattr(head.weight, "ds_id"):  # FSDP2's shard, or ZeRO-3's partition
        raise ValueError(
            "`loss_chunk_tokens` reads the output head's weight outside its forward, where FSDP2 and ZeRO-3 keep only "
            "this process's shard; train the chunked loss with one process, DDP or ZeRO-2"
        )
    captured: list[torch.Tensor] = []
    hook = decoder.register_forward_hook(lambda _module, _args, output: captured.append(output[0]))
    labels = inputs["labels"]
    try:
        rest = {key: value for key, value in inputs.items() if key != "labels"}
        model(**rest, logits_to_keep=torch.empty(0, dtype=torch.long, device=labels.device))
    finally:
        hook.remove()
    hidden = captured[-1]
    shifted = torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]
    return linear_cross_entropy(
        hidden.reshape(-1, hidden.shape[-1]),
        head.weight,
        shifted.reshape(-1).to(hidden.device),
        getattr(head, "bias", None),
        chunk_tokens,
        num_items_in_batch,
    )


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
