"""`PoetTrainer`: a `transformers.Trainer` with POET's two learning rates, merges and diagnostics."""

from __future__ import annotations

import json
import os
from typing import Any, Optional

import torch
from transformers import Trainer

from ..diagnostics import poet_statistics
from ..tuners.poet import poet_layers
from .callback import MergeReinitCallback, unwrap
from .optimizer import poet_param_groups

RUN_INFO_NAME = "poet_run.json"


def check_sharding(fsdp: bool, deepspeed: bool) -> None:
    """Refuse FSDP and DeepSpeed for POET models: a merge folds full weights in place, which they shard."""
    if fsdp or deepspeed:
        backend = "FSDP" if fsdp else "DeepSpeed"
        raise ValueError(
            f"POET merge-then-reinitialize folds full weights in place, which {backend} shards; poet_hf does not "
            "fold sharded weights yet. Train with DDP instead (`accelerate launch --multi_gpu --num_processes N` "
            "without an FSDP/DeepSpeed config); POET's optimizer state is already small."
        )


class PoetTrainer(Trainer):
    """Trainer for POET models (works for any model; without POET layers it behaves like ``Trainer``).

    - Optimizer: POET parameters at ``args.poet_learning_rate`` without weight decay; the rest at
      ``args.learning_rate`` with Trainer's usual decay rules. The scheduler scales both groups.
    - Adds :class:`MergeReinitCallback` (merge every ``merge_every`` steps, optimizer-state reset, post-merge
      clip ramp).
    - Logs the POET learning rate, merge count, ``||Q||``, orthogonality error and vector-probe cosines.
    - Checkpoints also hold the base model's ``config.json`` and ``poet_run.json``, so a model pretrained
      from scratch can be rebuilt and exported without a hub id.

    POET merges fold weights in place on every process, which is exact under DDP (every rank draws the same
    permutations). Under FSDP or DeepSpeed the weights are sharded; that is refused with a clear error.
    """

    def __init__(self, *args: Any, run_info: Optional[dict] = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.run_info = dict(run_info or {})
        self.has_poet = bool(poet_layers(unwrap(self.model)))
        if self.has_poet:
            check_sharding(self.is_fsdp_enabled, self.is_deepspeed_enabled)
        if self.has_poet and not any(isinstance(cb, MergeReinitCallback) for cb in self.callback_handler.callbacks):
            self.add_callback(MergeReinitCallback())

    @property
    def poet_learning_rate(self) -> float:
        value = getattr(self.args, "poet_learning_rate", None)
        return self.args.learning_rate if value is None else value

    def create_optimizer(self, model=None) -> torch.optim.Optimizer:
        opt_model = self.model if model is None else model
        if self.optimizer is not None or not self.has_poet:
            return super().create_optimizer(model)
        optimizer_cls, kwargs = (self.optimizer_cls_and_kwargs
                                 or self.get_optimizer_cls_and_kwargs(self.args, opt_model))
        kwargs = dict(kwargs)
        if "params" in kwargs or "model" in kwargs or "optimizer_dict" in kwargs:
            raise ValueError(f"optim={self.args.optim!r} builds its own parameter groups, which POET's two "
                             "learning rates cannot be combined with; use an AdamW-type optim")
        groups = poet_param_groups(opt_model, self.args.learning_rate, self.poet_learning_rate,
                                   self.args.weight_decay, self.get_decay_parameter_names(opt_model))
        self.optimizer = optimizer_cls(groups, **kwargs)
        return self.optimizer

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        if self.has_poet and "loss" in logs and self.optimizer is not None:
            logs["poet_learning_rate"] = next(
                (g["lr"] for g in self.optimizer.param_groups if g.get("poet")), self.poet_learning_rate)
            logs.update(self._poet_statistics())
        super().log(logs, *args, **kwargs)

    def _poet_statistics(self) -> dict[str, float]:
        """The statistics to log now: on a merge step, those taken just before the fold reset them."""
        callback = self.merge_callback
        if callback is not None and callback.statistics_before_merge is not None:
            step, statistics = callback.statistics_before_merge
            if step == self.state.global_step:
                merge_count = max((int(m.merge_counts[callback.adapter_name]) for _, m in poet_layers(
                    unwrap(self.model), callback.adapter_name)), default=0)
                return {**statistics, "poet/merge_count": merge_count}
        return poet_statistics(unwrap(self.model))

    @property
    def merge_callback(self) -> Optional[MergeReinitCallback]:
        return next((cb for cb in self.callback_handler.callbacks if isinstance(cb, MergeReinitCallback)), None)

    def _save(self, output_dir: Optional[str] = None, state_dict: Optional[dict] = None) -> None:
        super()._save(output_dir, state_dict)
        output_dir = output_dir or self.args.output_dir
        if not self.args.should_save:
            return
        base = unwrap(self.model)
        base = base.get_base_model() if hasattr(base, "get_base_model") else base
        if hasattr(self.model, "peft_config") and hasattr(base, "config"):
            base.config.save_pretrained(output_dir)
        callback = self.merge_callback
        merge_every = callback.interval(self.args, self.model) if callback else None
        info = {**self.run_info, "merge_every": merge_every, "global_step": self.state.global_step,
                "num_input_tokens_seen": self.state.num_input_tokens_seen,
                "learning_rate": self.args.learning_rate, "poet_learning_rate": self.poet_learning_rate}
        with open(os.path.join(output_dir, RUN_INFO_NAME), "w") as handle:
            json.dump(info, handle, indent=2)
