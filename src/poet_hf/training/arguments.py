"""`PoetTrainingArguments`: `transformers.TrainingArguments` plus the POET recipe's knobs."""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import TrainingArguments


@dataclass
class PoetTrainingArguments(TrainingArguments):
    """Training arguments for POET (POET §5.3): two learning rates, merge interval and the post-merge clip ramp."""

    poet_learning_rate: float | None = field(
        default=None, metadata={"help": "Learning rate of the POET skew parameters; None uses learning_rate."}
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
        default=None, metadata={"help": "Optimizer steps between merge-then-reinitialize; overrides the config."}
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
    fused_optimizer_step: bool = field(
        default=False,
        metadata={
            "help": "Step each trainable parameter in the backward, as soon as its gradient is complete, and free "
            "the gradient at once (no gradient outlives its step). Needs gradient_accumulation_steps=1, no fp16, "
            "max_grad_norm=0 and one process."
        },
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.merge_every is not None and (not isinstance(self.merge_every, int) or self.merge_every < 1):
            raise ValueError(f"`merge_every` must be an integer >= 1 or None, got {self.merge_every!r}")
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
