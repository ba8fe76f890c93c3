"""`PoetTrainer`: a `transformers.Trainer` with POET's two learning rates, merges and diagnostics."""

from __future__ import annotations

import json
import math
import os
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from ..checkpoints import CrashSafeTrainer, check_zero_states_resumable
from ..diagnostics import poet_statistics
from ..export.card import render_adapter_card
from ..export.source import RUN_INFO_NAME, active_config
from ..initialization import has_meta_tensors, materialize_model
from ..tuners.rotation.layer import rotation_layers
from ..tuners.rotation.model import set_residual_folder
from ..tuners.tuner_base import base_model_of
from .callback import MergeReinitCallback, unwrap
from .chunked_loss import trainer_loss
from .distributed import fsdp_requested, shard_model
from .fused_step import FusedStepOptimizer
from .nonfinite import NonFiniteGuard, NonFiniteStepError, clip_to_norm, total_grad_norm
from .optimizer import adapter_rotation_rate, create_poet_optimizer
from .resume_settings import check_resume_settings
from .zero import check_zero_run, frozen_weights_of_checkpoint, gathered_rotations, prepare_for_zero, whole_state_dict
from .zero_universal import finish_universal_resume, prepare_universal_resume, zero_stage

if TYPE_CHECKING:
    from peft import PeftModel


def check_sharding(fsdp: bool, fsdp_version: int | None = None, fsdp_requested: bool = False) -> None:
    """Which FSDP a POET model trains under: FSDP2, not FSDP1, and never a silent fallback.

    FSDP2 shards parameters as ``DTensor``s, which merge-then-reinitialize gathers one layer at a time; FSDP1 flattens
    them into ``FlatParameter``s, which a merge cannot fold. Accelerate enables FSDP only on accelerators: on a CPU,
    ``--use_fsdp`` quietly becomes plain data parallelism (or independent single-process runs), with every process
    holding the whole model. DeepSpeed ZeRO is checked by `poet_hf.training.zero.check_zero_run`.
    """
    if fsdp and fsdp_version != 2:
        raise ValueError(
            f"POET needs FSDP2 (`fsdp_version: 2`), got FSDP version {fsdp_version}: FSDP1's flat "
            "parameters cannot be folded one layer at a time"
        )
    if fsdp_requested and not fsdp:
        raise ValueError(
            "FSDP was requested (ACCELERATE_USE_FSDP) but is not enabled: Accelerate only enables FSDP on "
            "accelerators, so on this machine every process would hold the whole model. On a CPU, use "
            "DDP (`accelerate launch --multi_gpu`) or shard in your own loop with "
            "`poet_hf.training.distributed.shard_model` (torch's fully_shard runs on CPU with gloo)"
        )


class PoetTrainer(CrashSafeTrainer):
    """A ``transformers.Trainer`` for POET and OFT models (any other model trains as with ``Trainer``).

    - Optimizer: the skew parameters at ``args.poet_learning_rate`` (unset: the rate the adapter is built for,
      `adapter_rotation_rate`) without weight decay, the rest at
      ``args.learning_rate`` with Trainer's decay rules; the scheduler scales both.
    - Adds [`MergeReinitCallback`][poet_hf.training.MergeReinitCallback]: merge-then-reinitialize every
      ``merge_every`` steps (POET Algorithm 1, step 5), the optimizer-state reset and the post-merge clip ramp.
    - Logs the POET learning rate, merge count, ``||Q||``, orthogonality error and vector-probe cosines.
    - Checkpoints also hold the base model's ``config.json`` and ``poet_run.json`` (so a model pretrained from scratch
      exports without a hub id), written atomically; ``train(resume_from_checkpoint="auto")`` resumes from the newest
      complete one (`CrashSafeTrainer`).
    - Writes the merges' residual files (a 4-bit or 16-bit ``W0`` on the CPU) under ``args.residual_folder``, and
      checks that folder's free space before training ([`residual_folder`][poet_hf.tuners.rotation.residual_folder]).
    - Runs under DDP, FSDP2 ([`distributed`][poet_hf.training.distributed]) and DeepSpeed ZeRO-2 and ZeRO-3
      ([`zero`][poet_hf.training.zero]: merges gather what they fold and reset ZeRO's master partitions); FSDP1 is
      refused.
    - Materializes a model built on the ``meta`` device
      ([`materialize_model`][poet_hf.initialization.materialize_model], seeded by ``args.seed``), under FSDP2 after
      [`shard_model`][poet_hf.training.distributed.shard_model] with the plugin's settings, so no process holds the
      whole model.

    Args:
        *args: as ``transformers.Trainer``.
        run_info: what to record in each checkpoint's ``poet_run.json`` (method, dataset, …).
        pretrained_weights: for a ``meta`` model, a ``save_pretrained`` folder or ``.safetensors`` file of its base
            model, read tensor by tensor (under FSDP2 by rank 0, which sends each process its shard).
        **kwargs: as ``transformers.Trainer``.

    Raises:
        ValueError: the model has POET layers and Accelerate runs FSDP1, or FSDP was requested where Accelerate does
            not enable it, or DeepSpeed runs with a setting it cannot take (`check_zero_run`).
    """

    _universal_resume = ""  # the universal tag ZeRO-3 loads, set by `_prepare_resume`

    def __init__(
        self, *args: Any, run_info: dict | None = None, pretrained_weights: str | None = None, **kwargs: Any
    ) -> None:
        self._pretrained_weights = pretrained_weights
        super().__init__(*args, **kwargs)
        residual_folder = getattr(self.args, "residual_folder", None)
        if residual_folder:
            set_residual_folder(self._unwrapped_model(), residual_folder)
        self.run_info = dict(run_info or {})
        self.nonfinite = NonFiniteGuard(getattr(self.args, "max_consecutive_nonfinite_steps", 10))
        self.has_poet = bool(rotation_layers(self._unwrapped_model()))
        if self.has_poet:
            plugin = getattr(self.accelerator.state, "fsdp_plugin", None)
            check_sharding(self.is_fsdp_enabled, getattr(plugin, "fsdp_version", None), fsdp_requested())
            if self.is_deepspeed_enabled:
                stage = getattr(getattr(self.accelerator.state, "deepspeed_plugin", None), "zero_stage", None)
                check_zero_run(self.args, self._unwrapped_model(), stage)
                prepare_for_zero(self._unwrapped_model())
        if self.has_poet and not any(isinstance(cb, MergeReinitCallback) for cb in self.callback_handler.callbacks):
            self.add_callback(MergeReinitCallback())

    def create_accelerator_and_postprocess(self) -> None:
        """Trainer's set-up of Accelerate, then the materialization of a ``meta`` model (see the class docstring)."""
        super().create_accelerator_and_postprocess()
        if self.model is None or not has_meta_tensors(self.model):
            return
        if not self.is_fsdp_enabled:
            materialize_model(
                self.model, seed=self.args.seed, device=self.args.device, checkpoint=self._pretrained_weights
            )
            return
        plugin = self.accelerator.state.fsdp_plugin
        options = {"reshard_after_forward": plugin.reshard_after_forward, "offload_policy": plugin.cpu_offload}
        if plugin.mixed_precision_policy is not None:
            options["mp_policy"] = plugin.mixed_precision_policy
        # Sharded here, so Accelerate takes it as it is (an FSDPModule) instead of broadcasting rank 0's whole copy.
        shard_model(self.model, seed=self.args.seed, checkpoint=self._pretrained_weights, **options)

    @property
    def poet_learning_rate(self) -> float:
        """The rotations' rate: ``args.poet_learning_rate``, else the adapter's (`adapter_rotation_rate`), else
        ``args.learning_rate``."""
        value = getattr(self.args, "poet_learning_rate", None)
        built_for = adapter_rotation_rate(self._unwrapped_model()) if value is None else None
        return value if value is not None else built_for[0] if built_for else self.args.learning_rate

    def _unwrapped_model(self) -> nn.Module:
        """The model under DDP / compile wrappers (``Trainer`` holds one from ``__init__`` on)."""
        return unwrap(cast(nn.Module, self.model))

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """POET's optimizer for a model with POET layers; Trainer's otherwise.

        See [`create_poet_optimizer`][poet_hf.training.create_poet_optimizer]. An optimizer passed in ``optimizers`` is
        kept."""
        opt_model = cast(nn.Module, self.model if model is None else model)
        if self.optimizer is not None or not self.has_poet:
            return super().create_optimizer(model)
        self.optimizer = create_poet_optimizer(
            opt_model,
            self.args,
            optimizer_cls_and_kwargs=self.optimizer_cls_and_kwargs,
            decay_parameter_names=self.get_decay_parameter_names(opt_model),
        )
        return self.optimizer

    def training_step(self, model: nn.Module, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        """Trainer's step of one micro-batch; its loss's finiteness is noted for the step's check (`nonfinite`)."""
        if (fused := self._fused_optimizer()) is not None:
            fused.before_backward(model, last_micro_batch=self.accelerator.sync_gradients)
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.nonfinite.note_loss(loss)
        return loss

    def compute_loss(self, model: nn.Module, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        """Trainer's loss, or `chunked_loss.trainer_loss`'s with ``loss_chunk_tokens``; with fused steps, a non-finite
        training loss has its backward step nothing."""
        chunked = trainer_loss(self, model, inputs, *args, **kwargs)
        result = super().compute_loss(model, inputs, *args, **kwargs) if chunked is None else chunked
        fused = self._fused_optimizer()
        if fused is not None and model.training:
            fused.note_loss(result[0] if isinstance(result, tuple) else result)
        return result

    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        """The global gradient norm, checked (`nonfinite`) before it clips: a non-finite step is skipped, not clipped.

        With fused steps, the norm the `FusedStepOptimizer` measured and clipped by in the backward (its gradients
        are already freed); under DeepSpeed, which clips inside its step, Trainer's."""
        fused = self._fused_optimizer()
        if fused is not None:
            self._check_fused_step(fused)
            return torch.tensor(fused.grad_norm)
        if not self._skips_nonfinite_steps():
            return super()._clip_grad_norm(model)
        self.accelerator.unscale_gradients()
        params = list(model.parameters())
        total = total_grad_norm(params)
        if self._finite_step(total):
            clip_to_norm(params, self.args.max_grad_norm, total)
        return total

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        fused = self._fused_optimizer()
        if fused is not None and grad_norm is None:
            self._check_fused_step(fused)
            return fused.grad_norm
        if grad_norm is None and self._skips_nonfinite_steps():  # no clip this run: the check on its own
            grad_norm = total_grad_norm(model.parameters())
            self._finite_step(grad_norm)
        norm = super()._get_grad_norm(model, grad_norm=grad_norm)
        if self.is_deepspeed_enabled and not self.nonfinite.step_is_finite(norm)[0]:
            cause = self.nonfinite.describe(self._unwrapped_model(), True)
            raise NonFiniteStepError(
                f"step {self.state.global_step + 1} is not finite ({cause}); DeepSpeed steps inside the backward and "
                "cannot skip a step, so the run stops here, its last checkpoint intact"
            )
        return norm

    def _skips_nonfinite_steps(self) -> bool:
        """Whether this run's check skips a non-finite step: not under DeepSpeed or FSDP1, which clip and step
        themselves, nor with fp16 mixed precision, whose grad scaler skips an overflowing step and lowers its scale."""
        plugin = getattr(self.accelerator.state, "fsdp_plugin", None)
        fsdp1 = self.is_fsdp_enabled and getattr(plugin, "fsdp_version", 2) == 1
        return not (self.is_deepspeed_enabled or fsdp1 or getattr(self.accelerator, "scaler", None) is not None)

    def _finite_step(self, grad_norm: torch.Tensor) -> bool:
        """Check the step (`NonFiniteGuard`): ``True`` when it goes ahead; else it is skipped, its gradients dropped."""
        finite, loss_finite = self.nonfinite.step_is_finite(grad_norm)
        if finite:
            self.nonfinite.passed()
            return True
        self.nonfinite.skip(self._unwrapped_model(), self.optimizer, self.state.global_step + 1, loss_finite)
        return False

    def _check_fused_step(self, fused: FusedStepOptimizer) -> None:
        """Count a fused step whose backward stepped nothing (a non-finite loss) or skipped a parameter."""
        finite, loss_finite = self.nonfinite.step_is_finite(0.0 if not fused.skip_backward else math.nan)
        names = {id(p): n for n, p in self._unwrapped_model().named_parameters()}
        skipped = [names.get(id(p), "?") for p in fused.nonfinite]
        if finite and not skipped:
            self.nonfinite.passed()
            return
        cause = "the loss is not finite; nothing stepped" if not finite else f"non-finite gradients of {skipped}"
        self.nonfinite.skip(self._unwrapped_model(), self.optimizer, self.state.global_step + 1, loss_finite, cause)

    def _fused_optimizer(self) -> FusedStepOptimizer | None:
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)  # under Accelerate's wrapper
        return optimizer if isinstance(optimizer, FusedStepOptimizer) else None

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        if self.has_poet and "loss" in logs and self.optimizer is not None:
            reference = getattr(self.args, "poet_reference_block", None)
            logs["poet_learning_rate"] = next(  # at the reference block size, where the rate is per block size
                (
                    g["lr"] * (g["block_size"] / reference if reference else 1.0)
                    for g in self.optimizer.param_groups
                    if g.get("poet")
                ),
                self.poet_learning_rate,
            )
            logs.update(self._poet_statistics())
        super().log(logs, *args, **kwargs)

    def _poet_statistics(self) -> dict[str, float]:
        """The statistics to log now: on a merge step, those taken just before the fold reset them."""
        callback = self.merge_callback
        if callback is not None and callback.statistics_before_merge is not None:
            step, statistics = callback.statistics_before_merge
            if step == self.state.global_step:
                merge_count = max(
                    (
                        int(m.merge_counts[callback.adapter_name])
                        for _, m in rotation_layers(self._unwrapped_model(), callback.adapter_name)
                    ),
                    default=0,
                )
                return {**statistics, "poet/merge_count": merge_count}
        with gathered_rotations(self._unwrapped_model()):
            return poet_statistics(self._unwrapped_model())

    @property
    def merge_callback(self) -> MergeReinitCallback | None:
        return next((cb for cb in self.callback_handler.callbacks if isinstance(cb, MergeReinitCallback)), None)

    @property
    def merge_every(self) -> int | None:
        """The run's merge interval ([`merge_interval`][poet_hf.training.callback.merge_interval]); ``None``: none."""
        callback = self.merge_callback
        return callback.interval(self.args, cast(nn.Module, self.model)) if callback else None

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        """Trainer's evaluation; under DeepSpeed before training starts, of the model as it is (whole, unwrapped).

        There Trainer would wrap the model in an inference engine that ``train`` then never prepares for training;
        the scripts report the loss before training."""
        if not (self.is_deepspeed_enabled and self.deepspeed is None):
            return super().evaluate(*args, **kwargs)
        self.is_deepspeed_enabled = False
        try:
            return super().evaluate(*args, **kwargs)
        finally:
            self.is_deepspeed_enabled = True

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Trainer's save; under DeepSpeed ZeRO-3 with the frozen parameters gathered too (each ``W0`` as merged),
        where Trainer gathers a PEFT model's trainable ones only."""
        engine = cast(Any, self.deepspeed)  # None before training
        if not (self.has_poet and engine is not None and engine.zero_optimization_partition_weights()):
            return super().save_model(output_dir, _internal_call)
        self._save(output_dir or self.args.output_dir, state_dict=whole_state_dict(engine))
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """CrashSafeTrainer's load, after the run's adapter and merge settings are checked against the checkpoint's
        (`check_resume_settings`)."""
        configs = getattr(self._unwrapped_model(), "peft_config", None)
        if self.has_poet and configs:
            check_resume_settings(resume_from_checkpoint, configs, self.merge_every)
        super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _prepare_resume(self, checkpoint: str) -> None:
        """CrashSafeTrainer's check; under ZeRO-3 a checkpoint of another process count is then converted to
        DeepSpeed's universal format, which the engine loads (`prepare_universal_resume`)."""
        reshards = self.is_deepspeed_enabled and zero_stage(self.accelerator) == 3
        check_zero_states_resumable(checkpoint, self.args.world_size, self.is_deepspeed_enabled, reshards)
        if reshards:
            self._universal_resume = prepare_universal_resume(self.accelerator, checkpoint, self.args.world_size)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """Trainer's resume; under DeepSpeed also each merged ``W0``, which DeepSpeed's checkpoint of a PEFT model
        leaves out (`frozen_weights_of_checkpoint`); after a universal load also the buffers and each optimizer group's
        own hyperparameters (`finish_universal_resume`)."""
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None and self.has_poet and self.is_deepspeed_enabled:
            frozen_weights_of_checkpoint(self._unwrapped_model(), checkpoint)
        if checkpoint is not None and self._universal_resume:
            finish_universal_resume(self._unwrapped_model(), self.deepspeed, checkpoint, self._universal_resume)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        super()._save(output_dir, state_dict)
        output_dir = cast(str, output_dir or self.args.output_dir)
        if not self.args.should_save:
            return
        model = self._unwrapped_model()
        base = base_model_of(model)
        if hasattr(self.model, "peft_config") and hasattr(base, "config"):
            base.config.save_pretrained(output_dir)
        config = active_config(cast("PeftModel", model)) if getattr(model, "peft_config", None) else None
        # PEFT's generic card would not say to import poet_hf
        if config is not None and type(config).__module__.startswith("poet_hf."):
            card = render_adapter_card(base, config, model_id=self.args.hub_model_id or output_dir)
            card.save(os.path.join(output_dir, "README.md"))
        info = {
            **self.run_info,
            "merge_every": self.merge_every,
            "global_step": self.state.global_step,
            "num_input_tokens_seen": self.state.num_input_tokens_seen,
            "learning_rate": self.args.learning_rate,
            "poet_learning_rate": self.poet_learning_rate,
        }
        with open(os.path.join(output_dir, RUN_INFO_NAME), "w") as handle:
            json.dump(info, handle, indent=2)
