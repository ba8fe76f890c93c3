"""`MergeReinitCallback`: POET's merge-then-reinitialize inside any `transformers.Trainer`."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, cast

from torch import nn
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_callback import ExportableState

from ..diagnostics import poet_statistics, rotation_angle
from ..tuners.poet import POET_FINETUNE_RECIPES, merge_and_reinit
from ..tuners.rotation.layer import rotation_layers
from ..tuners.rotation.model import prepare_residual_files
from .optimizer import poet_parameters, reset_optimizer_state
from .zero import (
    check_zero_resettable,
    gathered_layer,
    gathered_rotations,
    reset_rotation_partitions,
    set_clip_threshold,
    zero_optimizer,
)

logger = logging.getLogger(__name__)

# Fine-tuning starts from pretrained W0, which a large early rotation scrambles: a layer whose rotations turn it by
# more than FINETUNE_WARN_ANGLE degrees (`poet_hf.diagnostics.rotation_angle`) within the first FINETUNE_WARN_STEPS
# steps gets a warning. docs/finetuning.md has the angles of the runs that improved the testbed models.
FINETUNE_WARN_ANGLE = 45.0
FINETUNE_WARN_STEPS = 20


def starts_from_pretrained(model: nn.Module, adapter: str = "default") -> bool:
    """Whether ``W0`` is a pretrained weight (fine-tuning): OFT, or POET without ``base_init``."""
    config = getattr(model, "peft_config", {}).get(adapter)
    return config is not None and getattr(config, "base_init", None) is None


def unwrap(model: nn.Module) -> nn.Module:
    """The model under DDP / compile wrappers."""
    while hasattr(model, "module") or hasattr(model, "_orig_mod"):
        model = cast(nn.Module, getattr(model, "module", None) or getattr(model, "_orig_mod", None))
    return model


@dataclass(frozen=True)
class MergeSchedule:
    """A run's merges: every ``interval`` optimizer steps, and the clip threshold that ramps back after each.

    Built once when training begins (`MergeSchedule.of_run`) and read by `MergeReinitCallback` alone.

    Args:
        interval: optimizer steps between merges; ``None``: no merges.
        max_grad_norm: the clip threshold away from merges (the run's ``max_grad_norm``); ``None`` or 0: no clipping.
        ramp_steps: how many steps the post-merge ramp lasts (``post_merge_clip_steps``).
        factor: the fraction of ``max_grad_norm`` right after a merge (``post_merge_clip_factor``).
    """

    interval: int | None
    max_grad_norm: float | None = None
    ramp_steps: int = 10
    factor: float = 0.1

    @classmethod
    def of_run(cls, model: nn.Module, args: TrainingArguments, adapter: str = "default") -> MergeSchedule:
        """The schedule of a run of ``model`` under ``args`` (`merge_interval`, and the clip settings of ``args``)."""
        return cls(
            merge_interval(model, args, adapter),
            args.max_grad_norm,
            getattr(args, "post_merge_clip_steps", 10),
            getattr(args, "post_merge_clip_factor", 0.1),
        )

    def merges_after(self, step: int) -> bool:
        """Whether optimizer step ``step`` (1-based) ends with a merge."""
        return bool(self.interval) and step % cast(int, self.interval) == 0

    def clip_threshold(self, step: int) -> float | None:
        """The clip threshold of optimizer step ``step`` (1-based); ``None`` when the run does not clip or merge."""
        if not self.interval or not self.max_grad_norm or self.max_grad_norm <= 0:
            return None
        return clip_threshold(step, self.interval, self.max_grad_norm, self.ramp_steps, self.factor)


def merge_interval(model: nn.Module, args: TrainingArguments, adapter: str = "default") -> int | None:
    """The merge interval of a run: the one place that reads it.

    It is the adapter config's ``merge_every``, unless ``PoetTrainingArguments.merge_every`` overrides it for this
    run.

    Args:
        model: the model being trained (unwrapped).
        args: the run's training arguments.
        adapter: the adapter that merges.

    Returns:
        Optimizer steps between merges; ``None``: no merges.
    """
    override = getattr(args, "merge_every", None)  # PoetTrainingArguments has it
    if override:
        return int(override)
    config = getattr(model, "peft_config", {}).get(adapter)
    return getattr(config, "merge_every", None) if rotation_layers(model) else None


def clip_threshold(step: int, interval: int, base: float, ramp_steps: int, factor: float) -> float:
    """The gradient-clip threshold for optimizer step ``step`` (1-based).

    After each merge it ramps linearly from ``factor·base`` back to ``base`` over ``ramp_steps`` steps, as the POET
    code's post-merge clipping does.

    Args:
        step: the optimizer step, 1-based.
        interval: the merge interval.
        base: the clip threshold away from merges (``max_grad_norm``).
        ramp_steps: how many steps the ramp lasts.
        factor: the fraction of ``base`` right after a merge.

    Returns:
        The threshold for this step.
    """
    since_merge = step - (step - 1) // interval * interval  # 1 … interval
    if step <= interval or ramp_steps == 0 or since_merge > ramp_steps:
        return base
    return base * (factor + (1 - factor) * (since_merge - 1) / ramp_steps)


class MergeReinitCallback(TrainerCallback, ExportableState):
    """POET's merge-then-reinitialize (Algorithm 1, step 5) in any ``transformers.Trainer``.

    Every ``merge_every`` optimizer steps (by ``state.global_step``, so it survives resume and gradient
    accumulation) it folds R and P into W0, zeroes Q, resamples the permutations and resets the rotations'
    optimizer state. Before each step it sets the post-merge clip threshold.

    ``history`` (what each merge reported, with its step) is saved in every checkpoint's ``trainer_state.json`` and
    restored on resume, so a resumed run knows the merges before it. On a merge step that is also a logging step,
    the POET statistics are taken just before the fold (``statistics_before_merge``), since the fold resets them.

    Works with a plain ``Trainer``; `PoetTrainer` adds it automatically.

    The interval is [`merge_interval`][poet_hf.training.callback.merge_interval]'s, read once when training begins.

    Args:
        adapter_name: the adapter to merge.

    Raises:
        TypeError: ``adapter_name`` is not a string (the interval is not an argument: it is the config's).
    """

    def __init__(self, adapter_name: str = "default") -> None:
        if not isinstance(adapter_name, str):
            raise TypeError(
                f"`adapter_name` must be the name of an adapter (a str), got {adapter_name!r}; the merge interval is "
                "the adapter config's `merge_every`, or `PoetTrainingArguments.merge_every` for one run"
            )
        self.adapter_name = adapter_name
        self.schedule: MergeSchedule | None = None  # read when training begins
        self.base_max_grad_norm: float | None = None
        self.history: list[dict] = []
        self.statistics_before_merge: tuple[int, dict[str, float]] | None = None  # (step, statistics)

    def state(self) -> dict:
        return {"args": {"adapter_name": self.adapter_name}, "attributes": {"history": self.history}}

    def read_schedule(self, args: TrainingArguments, model: nn.Module) -> MergeSchedule:
        """The run's `MergeSchedule`, read at the start of training (or now, before it).

        Args:
            args: the training arguments.
            model: the model being trained.

        Returns:
            The schedule.
        """
        if self.schedule is None:
            self.schedule = MergeSchedule.of_run(unwrap(model), args, self.adapter_name)
        return self.schedule

    def interval(self, args: TrainingArguments, model: nn.Module) -> int | None:
        """The merge interval of the run's schedule.

        Args:
            args: the training arguments.
            model: the model being trained.

        Returns:
            Optimizer steps between merges; ``None``: no merges.
        """
        return self.read_schedule(args, model).interval

    def on_train_begin(self, args, state: TrainerState, control: TrainerControl, model=None, **kwargs):
        if model is not None and rotation_layers(unwrap(model), self.adapter_name):
            prepare_residual_files(unwrap(model), self.adapter_name)  # before any merge writes a residual file
            if zero_optimizer(kwargs.get("optimizer")) is not None:
                check_zero_resettable(unwrap(model), self.adapter_name)
        self.base_max_grad_norm = args.max_grad_norm
        self.schedule = None
        if model is not None:
            self.read_schedule(args, model)
        stateful = cast(dict[str, Any], state.stateful_callbacks or {})  # name -> state, as read from the checkpoint
        saved = stateful.get(type(self).__name__)
        if state.global_step and not self.history and saved:  # resumed: the merges before the checkpoint
            saved = saved[0] if isinstance(saved, list) else saved
            self.history = [m for m in saved.get("attributes", {}).get("history", []) if m["step"] <= state.global_step]

    def on_step_begin(self, args, state: TrainerState, control: TrainerControl, model=None, optimizer=None, **kwargs):
        threshold = self.read_schedule(args, model).clip_threshold(state.global_step + 1)
        if threshold is not None:
            args.max_grad_norm = threshold
            set_clip_threshold(optimizer, threshold)  # DeepSpeed ZeRO clips inside its own step

    def on_step_end(self, args, state: TrainerState, control: TrainerControl, model=None, optimizer=None, **kwargs):
        if state.global_step <= FINETUNE_WARN_STEPS and state.global_step % 5 == 0:
            self._check_early_angle(unwrap(model), state.global_step, args)
        if not self.read_schedule(args, model).merges_after(state.global_step):
            return
        model = unwrap(model)
        if control.should_log:  # DefaultFlowCallback, which runs first, decided this step logs
            with gathered_rotations(model, self.adapter_name):
                self.statistics_before_merge = (state.global_step, poet_statistics(model, self.adapter_name))
        zero = zero_optimizer(optimizer)  # DeepSpeed ZeRO: gather each layer, reset the master partitions
        summary = merge_and_reinit(model, self.adapter_name, gathered_layer if zero is not None else None)
        self.history.append({**summary, "step": state.global_step})
        if zero is not None:
            reset_rotation_partitions(zero)
        elif optimizer is not None:
            reset_optimizer_state(optimizer, poet_parameters(model))

    def _check_early_angle(self, model: nn.Module, step: int, args: TrainingArguments) -> None:
        if getattr(self, "_angle_warned", False) or not starts_from_pretrained(model, self.adapter_name):
            return
        with gathered_rotations(model, self.adapter_name):
            angle = max(
                (rotation_angle(layer, self.adapter_name) for _, layer in rotation_layers(model, self.adapter_name)),
                default=0.0,
            )
        if angle > FINETUNE_WARN_ANGLE:
            self._angle_warned = True
            rate = getattr(args, "poet_learning_rate", None) or args.learning_rate
            logger.warning(
                "after %d steps the rotations already turn a layer by %.0f° (> %.0f°, FINETUNE_WARN_ANGLE): "
                "fine-tuning a pretrained model this fast usually damages it. Lower the rotation learning rate "
                "(now %g); the defaults are 1e-3 for OFT and, for POET, %g at a 32-block side with "
                "poet_reference_block=32 scaling other sizes.",
                step,
                angle,
                FINETUNE_WARN_ANGLE,
                rate,
                POET_FINETUNE_RECIPES["default"].learning_rate,
            )

    def on_train_end(self, args, state: TrainerState, control: TrainerControl, **kwargs):
        if self.base_max_grad_norm is not None:
            args.max_grad_norm = self.base_max_grad_norm
