"""The settings of a memory plan: `plan_memory`'s arguments, typed and checked."""

from __future__ import annotations

from dataclasses import dataclass

from ..dtypes import dtype_name
from ..tuners.config_utils import check_budget, check_choice, check_positive_int
from ..tuners.rotation.residual_store import RESIDUAL_STORAGES
from ..tuners.rotation.storage_kinds import BASE_QUANTIZATIONS

__all__ = ["METHODS", "SHARDINGS", "PlanSettings", "check_adapter_sizes"]

METHODS = ("poet-bs", "poet-fs", "oft", "lora", "adamw", "galore")
SHARDINGS = ("ddp", "fsdp2")


@dataclass
class PlanSettings:
    """What one plan is made for; each field is the `plan_memory` argument of its name, documented there.

    The adapter's size (``block_size``, ``budget``) is not here: it only wraps the model (`check_adapter_sizes`).

    Args:
        method: one of `METHODS`.
        rank: LoRA's and GaLore's rank.
        dtype: the weights' and activations' dtype, stored by torch's name (``bfloat16`` for ``bf16``).
        batch_size: sequences per micro-batch and process.
        seq_len: tokens per sequence.
        processes: data-parallel processes.
        sharding: one of `SHARDINGS`.
        checkpointing: activation checkpointing per transformer block.
        accumulation: micro-batches per optimizer step.
        cache_rotations: POET's rotation cache setting.
        base_quantization: POET's ``W0`` storage kind, or ``None``.
        residual_storage: where the merges' error-feedback residual lives.
        fused_step: optimizer steps fused into the backward.
        optimizer_bits: 32 or 8.
        eight_bit_library: whose 8-bit AdamW: ``"bitsandbytes"`` or ``"torchao"`` (its compiled step copies a
            parameter's two moments to float32).
        vocab_weights_dtype: ``"float32"`` or ``"bfloat16"`` (with ``fused_step``).
        loss_chunk_tokens: tokens whose logits the loss forms at once (`poet_hf.training.chunked_loss`), or ``None``.

    Raises:
        ValueError: a field outside its allowed values (the message names it and them).
    """

    method: str = "poet-bs"
    rank: int = 128
    dtype: str = "float32"
    batch_size: int = 4
    seq_len: int = 256
    processes: int = 1
    sharding: str = "ddp"
    checkpointing: bool = False
    accumulation: int = 1
    cache_rotations: bool | str = "auto"
    base_quantization: str | None = None
    residual_storage: str = "auto"
    fused_step: bool = False
    optimizer_bits: int = 32
    eight_bit_library: str = "bitsandbytes"
    vocab_weights_dtype: str = "float32"
    loss_chunk_tokens: int | None = None

    def __post_init__(self) -> None:
        self.dtype = dtype_name(self.dtype, "dtype")
        self.vocab_weights_dtype = dtype_name(self.vocab_weights_dtype, "vocab_weights_dtype")
        check_choice("method", self.method, METHODS)
        check_choice("sharding", self.sharding, SHARDINGS)
        for name in ("batch_size", "seq_len", "processes", "accumulation", "rank"):
            check_positive_int(name, getattr(self, name))
        if self.loss_chunk_tokens is not None:
            check_positive_int("loss_chunk_tokens", self.loss_chunk_tokens)
        check_choice("base_quantization", self.base_quantization, (None, *BASE_QUANTIZATIONS))
        check_choice("residual_storage", self.residual_storage, RESIDUAL_STORAGES)
        check_choice("optimizer_bits", self.optimizer_bits, (32, 8))
        check_choice("eight_bit_library", self.eight_bit_library, ("bitsandbytes", "torchao"))
        check_choice("vocab_weights_dtype", self.vocab_weights_dtype, ("float32", "bfloat16"))
        if self.vocab_weights_dtype != "float32" and not self.fused_step:
            raise ValueError(
                "`vocab_weights_dtype='bfloat16'` needs `fused_step=True` (its row chunks step in the backward)"
            )

    @property
    def shards(self) -> int:
        """The processes each tensor is split over: FSDP2's, else 1."""
        return self.processes if self.sharding == "fsdp2" else 1

    @property
    def rotating(self) -> bool:
        """Whether the method is POET's (rotation layers, a frozen ``W0``)."""
        return self.method.startswith("poet")


def check_adapter_sizes(block_size: int, budget: float) -> None:
    """Raise a ``ValueError`` unless the adapter's size is one `plan_memory` can wrap a model with.

    Args:
        block_size: POET-BS's and OFT's block size.
        budget: POET-FS's sampling budget.

    Raises:
        ValueError: ``block_size`` is not an integer >= 1, or ``budget`` is not in (0, 1].
    """
    check_positive_int("block_size", block_size)
    check_budget(budget)
