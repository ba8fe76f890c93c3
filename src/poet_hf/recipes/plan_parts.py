"""Where a plan's sharded and transient bytes go: FSDP2's shards, what it holds gathered, the loss's working set,
and the moments after the backward (`poet_hf.recipes.memory_plan` adds them up)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import cast

import torch
from torch import nn

from ..tuners.tuner_base import base_model_of
from .plan_settings import PlanSettings


def shard_entries(shape: torch.Size, processes: int, trainable: bool = False) -> int:
    """Entries of one process's shard: ``shape`` split along `shard_dim` into ``processes`` padded chunks."""
    from ..training.distributed import shard_dim

    if not shape:
        return 1
    dim = shard_dim(shape, processes, trainable)
    return math.ceil(shape[dim] / processes) * math.prod(shape) // shape[dim]


def unsharded_bytes(parameters: Iterable[nn.Parameter], processes: int, entry_bytes: dict[int, int]) -> int:
    """Bytes FSDP2 adds when it gathers ``parameters``: each whole, less the shard counted elsewhere."""
    return sum(
        (p.numel() - shard_entries(p.shape, processes, p.requires_grad)) * entry_bytes[id(p)] for p in parameters
    )


def gradients_twice(parameters: Iterable[nn.Parameter], entry_bytes: dict[int, int]) -> int:
    """Bytes of the trainable ``parameters``' gradients held twice: unsharded, and in FSDP2's reduce-scatter buffer."""
    return sum(2 * p.numel() * entry_bytes[id(p)] for p in parameters if p.requires_grad)


def loss_bytes(settings: PlanSettings, vocabulary: int, hidden: int, tokens: int, value_size: int) -> int:
    """The loss's working set: for transformers' loss, what the cross-entropy's backward holds beside the saved
    log-probabilities (counted with the activations), ``∂L/∂log-probabilities`` and ``∂L/∂logits`` in float32
    (`loss_backward` places it); or the chunked loss's (`poet_hf.training.chunked_loss`): one step's float32 logits
    (their gradient in place, and a copy in the model's dtype when narrower) and ``∂L/∂hidden``, held to the backward
    (the head's gradient, accumulated in its own dtype, is the one the gradients count). Under FSDP2 the head stays
    split by vocabulary rows (`poet_hf.training.sharded_head_loss`): a step's logits are this process's vocabulary
    rows of every process's chunk of tokens, beside those tokens' gathered hidden states and partial
    ``∂L/∂hidden``."""
    if settings.loss_chunk_tokens is None:
        return 2 * tokens * vocabulary * 4
    shards, narrow_copy = settings.shards, value_size if value_size < 4 else 0
    rows = min(shards * math.ceil(settings.loss_chunk_tokens / shards), shards * tokens)
    logits = rows * math.ceil(vocabulary / shards) * (4 + narrow_copy)
    gathered = 2 * rows * hidden * value_size if shards > 1 else 0
    return logits + gathered + tokens * hidden * value_size


def loss_backward(
    built: nn.Module, settings: PlanSettings, parts: dict[str, int], head_gradients: int, entry_bytes: dict[int, int]
) -> dict[str, dict[str, int]]:
    """The backward's first two moments with transformers' loss (``parts`` being the head's backward, every
    activation alive): first the cross-entropy's backward, with the loss's working set (`loss_bytes`) and no
    gradient of the head yet (nor, under FSDP2, its two unsharded copies); then the head's, where ``∂L/∂logits``
    stands in for the freed log-probabilities, so the loss adds nothing, and under accumulation the head's fresh
    gradient exists beside the held sum it is added to. ``head_gradients``: the bytes of the head's gradients as
    ``parts`` counts them without accumulation. The chunked loss forms both in one moment: ``parts`` as it is."""
    if settings.loss_chunk_tokens is not None:
        return {"backward start": parts}
    head_gradient = dict(parts, **{"loss working set": 0})
    if settings.accumulation > 1:
        head_gradient["gradients"] += head_gradients
    cross_entropy = dict(parts, gradients=parts["gradients"] - (head_gradients if settings.accumulation == 1 else 0))
    cross_entropy["bfloat16 steps"] = 0  # no step runs before the head's gradient exists
    head = base_model_of(built).get_output_embeddings()
    if settings.sharding == "fsdp2" and settings.shards > 1 and head is not None:
        cross_entropy["gathered layers"] -= gradients_twice(head.parameters(), entry_bytes)
    return {"cross-entropy backward": cross_entropy, "backward start": head_gradient}


def gathered_bytes(
    model: nn.Module, blocks: tuple[type[nn.Module], ...], entry_bytes: dict[int, int], settings: PlanSettings
) -> int:
    """FSDP2's unsharded tensors at the peak, the output head's backward, where every activation is still alive.

    The last block's parameters prefetched for its backward; and unless the chunked loss keeps the head split
    (`poet_hf.training.sharded_head_loss`), the head's parameters gathered (its own unit, as
    [`shard_model`][poet_hf.training.distributed.shard_model] shards it; the root when tied to the input embeddings)
    and its gradient twice, unsharded and in the flat reduce-scatter buffer FSDP2 copies it into; less the shards
    counted elsewhere. ``entry_bytes`` maps ``id(parameter)`` to its bytes per entry."""
    processes = settings.shards
    blocks_gathered = (
        unsharded_bytes(m.parameters(), processes, entry_bytes) for m in model.modules() if isinstance(m, blocks)
    )
    largest_block = max(blocks_gathered, default=0)
    head = base_model_of(model).get_output_embeddings()
    if head is None or settings.loss_chunk_tokens is not None:
        return largest_block
    head_parameters = list(head.parameters())
    return (
        unsharded_bytes(head_parameters, processes, entry_bytes)
        + largest_block
        + gradients_twice(head_parameters, entry_bytes)
    )


def after_backward(
    built: nn.Module,
    settings: PlanSettings,
    parts: dict[str, int],
    gradients: int,
    largest: dict[str, int],
    entry_bytes: dict[int, int],
) -> dict[str, dict[str, int]]:
    """The parts at the backward's end and at the optimizer step, where activations and the loss are gone.

    At the end FSDP2 holds the input embeddings' gradient twice, unsharded and in its reduce-scatter buffer (their
    weight is not gathered for their backward; tied, the root holds it gathered too), unless the chunked loss looks
    them up where they are (`looked_up_where_they_are`; then a step's gathered rows of their gradient, float32,
    twice). At the step torchao's compiled 8-bit AdamW holds one parameter's two moments in float32. ``gradients``:
    the bytes of the gradients then alive."""
    end = dict(parts, activations=0, gradients=gradients, **{"loss working set": 0, "gathered layers": 0})
    step = dict(end)
    if settings.shards > 1 and settings.sharding == "fsdp2":
        base = base_model_of(built)
        inputs, head = base.get_input_embeddings(), base.get_output_embeddings()
        weights = list(inputs.parameters()) if inputs is not None else []
        tied = head is not None and inputs is not None and head.weight is inputs.weight
        if looked_up_where_they_are(built, settings):
            chunk = math.ceil(cast(int, settings.loss_chunk_tokens) / settings.shards)
            rows = settings.shards * min(chunk, settings.batch_size * settings.seq_len)
            end["gathered layers"] = 2 * rows * weights[0].shape[1] * 4
        else:
            gathered = unsharded_bytes(weights, settings.shards, entry_bytes) if tied else 0
            end["gathered layers"] = gathered + gradients_twice(weights, entry_bytes)
    if settings.optimizer_bits == 8 and settings.eight_bit_library == "torchao":
        step["optimizer step copies"] = 2 * 4 * largest["8-bit entries"]
    return {"backward end": end, "step": step}


def looked_up_where_they_are(built: nn.Module, settings: PlanSettings) -> bool:
    """Whether the chunked loss under FSDP2 looks the input embeddings up in their shards, never gathering them
    (`poet_hf.training.sharded_embedding`): untied, trainable, a plain lookup, split along their rows."""
    from ..training.distributed import shard_dim
    from ..training.sharded_embedding import looks_up_its_own_table

    base = base_model_of(built)
    inputs, head = base.get_input_embeddings(), base.get_output_embeddings()
    if settings.loss_chunk_tokens is None or settings.sharding != "fsdp2":
        return False
    return looks_up_its_own_table(inputs, head) and shard_dim(inputs.weight.shape, settings.shards, True) == 0


def ddp_unheld_bytes(built: nn.Module, settings: PlanSettings, entry_bytes: dict[int, int]) -> int:
    """Bytes of the trainable weights DDP's buckets do not hold: with fused steps, the row-chunked head and input
    embeddings (`poet_hf.training.row_gradients`), whose chunks all-reduce and step in their own hooks."""
    from ..training.row_gradients import row_chunked_modules

    if not settings.fused_step:
        return 0
    modules = row_chunked_modules(built, any_size=settings.vocab_weights_dtype == "bfloat16")
    return sum(m.weight.numel() * entry_bytes[id(m.weight)] for m in modules)
