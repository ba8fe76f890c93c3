"""Training arguments: `PoetTrainingArguments` (POET's knobs) and `ScriptArguments` (what every script adds)."""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import TrainingArguments

from ..dtypes import DTYPES, dtype_name
from ..tuners.config_utils import check_positive_int

VOCAB_WEIGHTS_DTYPES = ("float32", "bfloat16")  # PoetTrainingArguments.vocab_weights_dtype


@dataclass
class PoetTrainingArguments(TrainingArguments):
    """Training arguments for POET (POET §5.3): two learning rates, merge interval and the post-merge clip ramp."""

    poet_learning_rate: float | None = field(
        default=None,
        metadata={
            "help": "Learning rate of the skew parameters. None: a POET adapter's own (its config's "
            "rotation_learning_rate, else the POET paper's 1e-3 at a 256-block side, logged); OFT's: learning_rate."
        },
    )
    poet_reference_block: int | None = field(
        default=None,
        metadata={
            "help": "If set, a POET side of block size b trains at poet_learning_rate · "
            "poet_reference_block / b, so every block size turns by the same angle per step (the "
            "paper's Tables 8–9 tie lr = 1e-3·256/b, per side). None or 0: one rate for every side."
        },
    )
    merge_every: int | None = field(
        default=None,
        metadata={
            "help": "Optimizer steps between merge-then-reinitialize for this run; None: the adapter config's "
            "merge_every (POET's default 400, §5.2)."
        },
    )
    post_merge_clip_steps: int = field(
        default=10,
        metadata={
            "help": "Steps after each merge over which the clip threshold ramps back to "
            "max_grad_norm; 0 disables the ramp."
        },
    )
    post_merge_clip_factor: float = field(
        default=0.1, metadata={"help": "Clip threshold right after a merge, as a fraction of max_grad_norm."}
    )
    residual_folder: str | None = field(
        default=None,
        metadata={
            "help": "Parent folder of the merges' residual files (error feedback of a 4-bit or 16-bit W0 on the "
            "CPU: about 1.06 B per 4-bit W0 entry, 1 B per 16-bit one); default the system temp folder ($TMPDIR, "
            "else /tmp). Each process writes into a poet-residuals-<pid>-* folder of its own, removed at exit; one "
            "left by a killed process is removed at the next start. The free space is checked before training."
        },
    )
    fused_optimizer_step: bool = field(
        default=False,
        metadata={
            "help": "Step each trainable parameter in the backward, as soon as its gradient is complete, and free "
            "the gradient at once (no gradient outlives its step). It clips by max_grad_norm against the global "
            "norm known so far (this step's norms of the parameters already stepped, the previous step's of the "
            "rest). With gradient accumulation the last micro-batch's backward steps; under DDP each bucket steps "
            "after its all-reduce. Not with fp16, FSDP2 or DeepSpeed."
        },
    )
    max_consecutive_nonfinite_steps: int = field(
        default=10,
        metadata={
            "help": "A step whose loss or gradient norm is not finite is skipped (nothing updated), named in a "
            "warning and counted; this many in a row stop the run with an error, its last checkpoint intact."
        },
    )

    vocab_weights_dtype: str = field(
        default="float32",
        metadata={
            "help": "Storage of the output head and the input embeddings, which POET trains in full: float32, or "
            "bfloat16 (2 B per entry, and 2 B for each 32-bit optimizer moment of them; stepped in float32 and "
            "written back with stochastic rounding; bf16 is the same name). Needs fused_optimizer_step and an "
            "untied head.",
        },
    )

    loss_chunk_tokens: int | None = field(
        default=None,
        metadata={
            "help": "Compute a causal LM's loss this many tokens at a time, the head and the cross-entropy in one (as "
            "fused linear cross-entropy kernels do): the tokens x vocabulary logits and their gradient never exist "
            "whole, only one chunk's. One process, DDP or ZeRO-2 (FSDP2 and ZeRO-3 shard the head outside its "
            "forward), without fused_optimizer_step. None: transformers' loss on the whole logits."
        },
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.loss_chunk_tokens is not None:
            check_positive_int("loss_chunk_tokens", self.loss_chunk_tokens)
            if self.fused_optimizer_step:
                raise ValueError(
                    "`loss_chunk_tokens` holds the head's whole gradient from the loss to the step, which "
                    "fused_optimizer_step computes a chunk of rows at a time and never holds: choose one"
                )
        if self.vocab_weights_dtype in DTYPES:  # bf16 and bfloat16 alike
            self.vocab_weights_dtype = dtype_name(self.vocab_weights_dtype)
        if self.vocab_weights_dtype not in VOCAB_WEIGHTS_DTYPES:
            allowed = ", ".join(VOCAB_WEIGHTS_DTYPES)
            raise ValueError(f"`vocab_weights_dtype` must be one of {allowed}, got {self.vocab_weights_dtype!r}")
        if self.vocab_weights_dtype != "float32" and not self.fused_optimizer_step:
            raise ValueError(
                f"`vocab_weights_dtype={self.vocab_weights_dtype!r}` steps the head and embeddings by row chunks "
                "inside the backward: set fused_optimizer_step=True too"
            )
        if self.merge_every is not None:
            check_positive_int("merge_every", self.merge_every)
        check_positive_int("max_consecutive_nonfinite_steps", self.max_consecutive_nonfinite_steps)
        if self.poet_learning_rate is not None and self.poet_learning_rate < 0:
            raise ValueError(f"`poet_learning_rate` must be >= 0, got {self.poet_learning_rate!r}")
        if self.poet_reference_block == 0:  # the command line's way to say None
            self.poet_reference_block = None
        if self.poet_reference_block is not None and (
            not isinstance(self.poet_reference_block, int) or self.poet_reference_block < 2
        ):
            raise ValueError(
                f"`poet_reference_block` must be an integer >= 2, or 0 / None (one rate for every side), got "
                f"{self.poet_reference_block!r}"
            )
        if self.post_merge_clip_steps < 0:
            raise ValueError(f"`post_merge_clip_steps` must be >= 0, got {self.post_merge_clip_steps!r}")
        if not 0 < self.post_merge_clip_factor <= 1:
            raise ValueError(f"`post_merge_clip_factor` must be in (0, 1], got {self.post_merge_clip_factor!r}")
