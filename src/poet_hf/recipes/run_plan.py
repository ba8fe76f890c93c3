"""The memory plan of a ``scripts/pretrain.py`` run, read off the run's own flags.

``scripts/plan_memory.py`` takes the training script's flags and calls `plan_pretraining`, so a plan and a run are
one command line with the script's name changed.
"""

from __future__ import annotations

from dataclasses import asdict, replace
from typing import TYPE_CHECKING, TypeVar

from torch import nn

from ..training.arguments import PoetTrainingArguments
from ..training.fused_step import check_fused_step
from ..training.optimizer import optim_name
from ..tuners.rotation.storage_kinds import storage_kind
from .memory_plan import MemoryPlan, plan_memory
from .plan_settings import PlanSettings
from .presets import meta_recipe_model
from .pretrain_arguments import PretrainArguments
from .pretrain_settings import model_config, recipe_flags, resolve_recipe, run_tokenizer
from .recipe import PretrainRecipe

if TYPE_CHECKING:
    from transformers import PretrainedConfig

_Size = TypeVar("_Size", int, float)

__all__ = ["RefusedRun", "parse_run", "plan_pretraining", "plan_settings"]


def parse_run(argv: list[str], processes: int | None = None) -> tuple[PretrainArguments, PoetTrainingArguments]:
    """``scripts/pretrain.py``'s parse of ``argv`` as a launch of ``processes`` processes would see it.

    The recipe's defaults depend on the number of processes (the accumulation that reaches the global batch), which
    a launcher passes as ``WORLD_SIZE``; the flags left to the recipe take its values for ``processes``."""
    from .cli import given_training_flags
    from .pretrain_settings import parse_pretrain_arguments

    args, training = parse_pretrain_arguments(argv)
    if processes:  # the batch plan as the launch's parse would make it
        recipe = resolve_recipe(args, given_training_flags(argv, PoetTrainingArguments), world_size=processes)
        training.per_device_train_batch_size = recipe.batch_size
        training.gradient_accumulation_steps = recipe.gradient_accumulation_steps
    return args, training


def plan_settings(
    args: PretrainArguments,
    training: PoetTrainingArguments,
    processes: int | None = None,
    sharding: str = "ddp",
    dtype: str = "float32",
) -> PlanSettings:
    """The plan's settings (`plan_memory`'s arguments) for the run that ``args`` and ``training`` describe.

    The micro-batch, accumulation and rotation sizes are the resolved recipe's (`resolve_recipe`). The script's weights
    are float32 in every run (``--bf16`` is autocast), so the plan counts float32 unless ``dtype`` says otherwise (a
    run of your own that keeps its weights in bfloat16).

    Args:
        args: the script's options.
        training: the training flags.
        processes: data-parallel processes; default the recipe's (the launcher's ``WORLD_SIZE``).
        sharding: ``"ddp"`` or ``"fsdp2"``.
        dtype: the weights' and activations' dtype (`poet_hf.recipes.memory_plan.DTYPES`).

    Returns:
        The `PlanSettings` of the run's own method (LoRA's rank the recipe's); the rotations' size is the recipe's.
    """
    return _settings_of(
        resolve_recipe(args, recipe_flags(training), world_size=processes), args, training, sharding, dtype
    )


class RefusedRun(ValueError):
    """A run that would be refused before its first step, with the plan it asked for and the nearest one that runs.

    Args:
        message: the refusal, as the run gives it.
        asked: the settings as asked, planned anyway.
        runnable: the same settings without the refused saving.
        without: the flag(s) that ``runnable`` leaves out, for the plan's summary.
    """

    def __init__(self, message: str, asked: PlanSettings, runnable: PlanSettings, without: str) -> None:
        super().__init__(message)
        self.asked, self.runnable, self.without = asked, runnable, without


def _settings_of(
    recipe: PretrainRecipe, args: PretrainArguments, training: PoetTrainingArguments, sharding: str, dtype: str
) -> PlanSettings:
    """The run's `PlanSettings`; `RefusedRun` where the run itself would refuse them."""
    rotation = recipe.rotation
    optim = optim_name(training)
    settings = PlanSettings(
        method=args.method,
        dtype=dtype,
        batch_size=recipe.batch_size,
        seq_len=args.seq_len,
        processes=recipe.processes,
        sharding=sharding,
        checkpointing=bool(training.activation_checkpointing),
        accumulation=recipe.gradient_accumulation_steps,
        cache_rotations="auto" if rotation is None else rotation.config.cache_rotations,
        base_quantization=args.base_quantization,
        fused_step=bool(training.fused_optimizer_step),
        vocab_weights_dtype=training.vocab_weights_dtype,
        optimizer_bits=8 if "8bit" in optim else 32,
        eight_bit_library="torchao" if optim == "adamw_torch_8bit" else "bitsandbytes",
        loss_chunk_tokens=training.loss_chunk_tokens,
    )
    if args.method == "lora":
        settings.rank = args.lora_rank
    _check_runs(settings, optim, bool(training.fp16))
    return settings


def _check_runs(settings: PlanSettings, optim: str, fp16: bool) -> None:
    """Raise `RefusedRun` for what the run refuses: bitsandbytes' states or ``W0`` under FSDP2, fused steps where
    they cannot run."""
    fsdp2, quantization = settings.sharding == "fsdp2", settings.base_quantization
    if fsdp2 and "bnb" in optim:  # what create_poet_optimizer refuses (check_steps_shards)
        message = (
            f"--optim {optim} (bitsandbytes) cannot step FSDP2's sharded parameters; plan 8-bit states under fsdp2 "
            "with --optim adamw_torch_8bit (torchao's AdamW8bit, which the run can step)"
        )
        raise RefusedRun(message, settings, settings, f"--optim {optim} (as adamw_torch_8bit)")
    if settings.fused_step:  # what the trainer refuses, on the plan's process count
        try:
            check_fused_step(fp16, settings.processes, settings.sharding == "fsdp2")
        except ValueError as error:
            runnable = replace(settings, fused_step=False, vocab_weights_dtype="float32")
            raise RefusedRun(str(error), settings, runnable, "--fused_optimizer_step") from None
    if fsdp2 and quantization is not None and not storage_kind(quantization).shardable:
        message = (  # what shard_model refuses (refuse_quantized_bases)
            f"--base_quantization {quantization} is a bitsandbytes layer, which FSDP2 cannot shard; plan "
            "--base_quantization nf4-shardable or int8-shardable (the same codes as plain tensors by row)"
        )
        shardable = "int8-shardable" if quantization == "int8" else "nf4-shardable"
        runnable = replace(settings, base_quantization=shardable)
        raise RefusedRun(message, settings, runnable, f"--base_quantization {quantization} (as {shardable})")


def _plan(model: PretrainedConfig | nn.Module, settings: PlanSettings, recipe: PretrainRecipe) -> MemoryPlan:
    """`plan_memory` of ``model`` with ``settings`` and the recipe's rotation size (a side's largest)."""
    rotation = recipe.rotation
    if rotation is None:
        return plan_memory(model, **asdict(settings))
    if rotation.config.spo == "block":
        return plan_memory(model, **asdict(settings), block_size=_largest(rotation.config.block_size))
    return plan_memory(model, **asdict(settings), budget=_largest(rotation.config.budget))


def _largest(size: _Size | dict[str, _Size]) -> _Size:
    return max(size.values()) if isinstance(size, dict) else size


def plan_pretraining(
    args: PretrainArguments,
    training: PoetTrainingArguments,
    methods: tuple[str, ...] = (),
    processes: int | None = None,
    sharding: str = "ddp",
    dtype: str = "float32",
    plan_refused: bool = False,
) -> list[MemoryPlan]:
    """Plan the run's memory per process: its own method first, then ``methods`` with the same settings.

    The model is the run's (`model_config`: the preset's, ``--config_name``'s or the checkpoint's config, with the
    tokenizer's vocabulary), built on ``meta`` and wrapped as the run wraps it (`meta_recipe_model`); the other
    methods wrap it as `plan_memory` does.

    Args:
        args: the script's options.
        training: the training flags.
        methods: other methods of `poet_hf.recipes.plan_settings.METHODS` to plan beside it.
        processes: data-parallel processes; default the launcher's.
        sharding: ``"ddp"`` or ``"fsdp2"``.
        dtype: the weights' and activations' dtype.
        plan_refused: for a run that would be refused, return instead its plan as asked and the plan of the same
            run without the refused saving (`RefusedRun`), in that order.

    Returns:
        The plans, in MiB-ready bytes (`MemoryPlan`).

    Raises:
        RefusedRun: the run would be refused before its first step (unless ``plan_refused``).
    """
    vocab_size = len(run_tokenizer(args))
    config = model_config(args, vocab_size)
    recipe = resolve_recipe(args, recipe_flags(training), world_size=processes, vocab_size=vocab_size)
    try:
        settings = _settings_of(recipe, args, training, sharding, dtype)
    except RefusedRun as refusal:
        if not plan_refused:
            raise
        model = meta_recipe_model(recipe, config)
        return [_plan(model, refusal.asked, recipe), _plan(model, refusal.runnable, recipe)]
    plans = [_plan(meta_recipe_model(recipe, config), settings, recipe)]
    others = [method for method in methods if method != args.method]
    return plans + [_plan(config, replace(settings, method=method), recipe) for method in others]
