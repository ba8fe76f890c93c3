"""The memory plan of a ``scripts/pretrain.py`` run, read off the run's own flags.

``scripts/pretrain.py --plan_only`` and ``scripts/plan_memory.py`` with the training script's flags both call
`plan_pretraining`, so a plan and a run are one command line.
"""

from __future__ import annotations

from typing import Any

from ..training.arguments import PoetTrainingArguments
from .memory_plan import MemoryPlan, plan_memory
from .pretrain import model_config, recipe_flags, resolve_recipe, run_tokenizer
from .pretrain_arguments import PretrainArguments

__all__ = ["parse_run", "plan_pretraining", "plan_settings"]


def parse_run(argv: list[str], processes: int | None = None) -> tuple[PretrainArguments, PoetTrainingArguments]:
    """``scripts/pretrain.py``'s parse of ``argv`` as a launch of ``processes`` processes would see it.

    The recipe's defaults depend on the number of processes (the accumulation that reaches the global batch), which
    a launcher passes as ``WORLD_SIZE``; the flags left to the recipe take its values for ``processes``."""
    from .cli import given_training_flags
    from .pretrain import parse_pretrain_arguments

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
) -> dict[str, Any]:
    """`plan_memory`'s keyword arguments for the run that ``args`` and ``training`` describe.

    The micro-batch, accumulation and rotation sizes are the resolved recipe's (`resolve_recipe`). The script's weights
    are float32 in every run (``--bf16`` is autocast), so the plan counts float32 unless ``dtype`` says otherwise (a
    run of your own that keeps its weights in bfloat16).

    Args:
        args: the script's options.
        training: the training flags.
        processes: data-parallel processes; default the recipe's (the launcher's ``WORLD_SIZE``).
        sharding: ``"ddp"`` or ``"fsdp2"``.
        dtype: the weights' and activations' dtype (`poet_hf.recipes.memory_plan.DTYPES`).
    """
    recipe = resolve_recipe(args, recipe_flags(training), world_size=processes)
    rotation = recipe.rotation
    settings: dict[str, Any] = {
        "dtype": dtype,
        "batch_size": recipe.batch_size,
        "seq_len": args.seq_len,
        "processes": recipe.processes,
        "sharding": sharding,
        "checkpointing": bool(training.activation_checkpointing),
        "accumulation": recipe.gradient_accumulation_steps,
        "cache_rotations": "auto" if rotation is None else rotation.config.cache_rotations,
        "base_quantization": args.base_quantization,
        "fused_step": bool(training.fused_optimizer_step),
        "vocab_weights_dtype": training.vocab_weights_dtype,
        "optimizer_bits": 8 if "8bit" in str(getattr(training.optim, "value", training.optim)) else 32,
    }
    if args.method == "lora":
        settings["rank"] = args.lora_rank
    if rotation is not None:
        side = "block_size" if rotation.config.spo == "block" else "budget"
        size = getattr(rotation.config, side)
        settings[side] = max(size.values()) if isinstance(size, dict) else size
    return settings


def plan_pretraining(
    args: PretrainArguments,
    training: PoetTrainingArguments,
    methods: tuple[str, ...] = (),
    processes: int | None = None,
    sharding: str = "ddp",
    dtype: str = "float32",
) -> list[MemoryPlan]:
    """Plan the run's memory per process: its own method first, then ``methods`` with the same settings.

    The model is the run's (`model_config`: the preset's, ``--config_name``'s or the checkpoint's config, with the
    tokenizer's vocabulary), built on ``meta``.

    Args:
        args: the script's options.
        training: the training flags.
        methods: other methods of `poet_hf.recipes.memory_plan.METHODS` to plan beside it.
        processes: data-parallel processes; default the launcher's.
        sharding: ``"ddp"`` or ``"fsdp2"``.
        dtype: the weights' and activations' dtype.
    """
    config = model_config(args, len(run_tokenizer(args)))
    settings = plan_settings(args, training, processes, sharding, dtype)
    ordered = [args.method, *(m for m in methods if m != args.method)]
    return [plan_memory(config, method, **settings) for method in ordered]
