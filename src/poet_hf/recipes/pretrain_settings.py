"""What a pretraining run will be, from its command line: the options parsed, the preset's defaults for the flags
the user left out, and the resolved recipe (`PretrainRecipe`).

Apart from the run itself (`poet_hf.recipes.pretrain`), so that ``scripts/pretrain.py --help`` and the planner read a
command line without importing the trainer and the data libraries.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from ..data import load_tokenizer
from ..training.arguments import PoetTrainingArguments
from ..tuners.poet import PoetConfig
from ..tuners.poet.config import BaseQuantization
from .cli import TrainingFlags, flag_value, parse_arguments, run_defaults
from .model_source import load_model_config, model_summary
from .presets import PRESETS, Preset, recipe_parameter_counts, targets_for, tied_poet_learning_rate
from .pretrain_arguments import CONFIG_FLAGS, RECIPE_FLAGS, RUN_FLAGS, PretrainArguments
from .recipe import PretrainRecipe, RotationRecipe

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase


def pretrain_defaults(args: PretrainArguments, given: TrainingFlags) -> dict[str, object]:
    """The training flags of the preset's recipe (`resolve_recipe`), for those the user did not give.

    The length, batch and accumulation, the two learning rates, clipping and decay; a cosine schedule to
    ``min_lr_ratio``.

    Args:
        args: the script's options.
        given: the training flags the user set.

    Returns:
        ``PoetTrainingArguments`` field values.
    """
    recipe = resolve_recipe(args, given)
    flat = recipe.as_dict()
    values: dict[str, object] = {flag: flat[key] for key, flag in RECIPE_FLAGS.items() if key in flat}
    values.update(
        output_dir="outputs/pretrain",
        per_device_eval_batch_size=recipe.batch_size,
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": args.min_lr_ratio},
        logging_steps=10,
        eval_strategy="no",
        include_num_input_tokens_seen="all" if args.packing else "non_padding",
        dataloader_drop_last=True,
    )
    if args.method == "galore":
        values.update(optim="galore_adamw", optim_target_modules=targets_for(model_config(args)))
    return run_defaults(given, **values)


def parse_pretrain_arguments(
    argv: list[str] | None = None, **fields: object
) -> tuple[PretrainArguments, PoetTrainingArguments]:
    """``scripts/pretrain.py``'s options from a command line or from keyword ``fields``.

    ``argv`` ``None`` reads ``sys.argv``; ``fields`` may belong to either dataclass (`cli.parse_arguments`).

    Args:
        argv: the command line.
        **fields: field values instead of a command line.

    Returns:
        ``(PretrainArguments, PoetTrainingArguments)``.
    """
    return parse_arguments(PretrainArguments, pretrain_defaults, argv, fields or None, PoetTrainingArguments)


def recipe_flags(training: PoetTrainingArguments) -> TrainingFlags:
    """The recipe's values that ``training`` holds (`RECIPE_FLAGS`), to resolve the recipe of a run."""
    flags = (*RECIPE_FLAGS.values(), *CONFIG_FLAGS, *RUN_FLAGS)
    return cast(TrainingFlags, {flag: getattr(training, flag) for flag in flags})


def _budget(value: float) -> float | int:
    """A budget from the command line: a fraction (<= 1) stays a float, an absolute size (> 1) becomes an int."""
    if value > 1:
        if value != int(value):
            raise ValueError(f"`budget` above 1 is an absolute index-set size and must be whole, got {value!r}")
        return int(value)
    return float(value)


def resolve_recipe(
    args: PretrainArguments,
    given: TrainingFlags | None = None,
    world_size: int | None = None,
    vocab_size: int | None = None,
) -> PretrainRecipe:
    """Every value of the run: the options and training flags given, else the preset's.

    The presets hold the paper's Tables 7–9 and appendix E.

    Args:
        args: the script's options.
        given: training flags the user set (``PoetTrainingArguments`` names, e.g. ``max_steps``, ``learning_rate``);
            for a run, all of them (`recipe_flags`).
        world_size: the number of processes; default the ``WORLD_SIZE`` the launcher set (1 without one).
        vocab_size: the tokenizer's vocabulary, a preset model's; ``None`` before it is known.

    Returns:
        The recipe, its ``parameters`` not yet counted (`counted_recipe`, `parameter_counts`).

    Raises:
        ValueError: ``global_batch_size`` is not a multiple of the micro-batch times the processes.
    """
    import os

    given = cast(TrainingFlags, {k: v for k, v in (given or {}).items() if v is not None})
    preset = PRESETS[args.preset]
    world = world_size or int(os.environ.get("WORLD_SIZE", "1"))
    steps, micro, accumulation, global_batch = _batch_plan(args, given, preset, world)
    config = model_config(args, vocab_size)
    model = model_summary(config, args.seq_len, args.model_name_or_path or args.config_name or args.preset)
    if not (args.model_name_or_path or args.config_name):
        model["vocab"] = vocab_size  # a preset's vocabulary is the tokenizer's
    recipe = PretrainRecipe(
        preset=args.preset,
        method=args.method,
        model=model,
        learning_rate=given.get("learning_rate", preset.learning_rate),
        max_grad_norm=given.get("max_grad_norm", preset.max_grad_norm),
        weight_decay=given.get("weight_decay", preset.weight_decay),
        optimizer=flag_value(given, "optim", "galore_adamw" if args.method == "galore" else None),
        fused_optimizer_step=bool(given.get("fused_optimizer_step", False)),
        vocab_weights_dtype=given.get("vocab_weights_dtype", "float32"),
        schedule=flag_value(given, "lr_scheduler_type", "cosine_with_min_lr"),
        min_lr_ratio=args.min_lr_ratio,
        warmup_steps=given.get("warmup_steps", 0),
        steps=steps,
        sequences_per_step=global_batch,
        batch_size=micro,
        gradient_accumulation_steps=accumulation,
        processes=world,
        packing=args.packing,
        tokens_per_step=global_batch * args.seq_len,
        total_tokens=global_batch * args.seq_len * steps,
        rotation=_rotation_recipe(args, given, preset, config.hidden_size) if args.method.startswith("poet") else None,
        lora_rank=args.lora_rank if args.method == "lora" else None,
    )
    return recipe


def counted_recipe(args: PretrainArguments, training: PoetTrainingArguments) -> PretrainRecipe:
    """The recipe ``--print_recipe`` prints: resolved, and what the method trains counted on its model built on
    ``meta`` (`recipe_parameter_counts`; Table 2's convention: the Linear layers of the blocks).

    Args:
        args: the script's options.
        training: the training flags.

    Returns:
        The recipe, with its ``parameters``.
    """
    vocab_size = len(run_tokenizer(args))
    recipe = resolve_recipe(args, recipe_flags(training), vocab_size=vocab_size)
    return replace(recipe, parameters=recipe_parameter_counts(recipe, vocab_size, model_config(args, vocab_size)))


def model_config(args: PretrainArguments, vocab_size: int | None = None) -> PretrainedConfig:
    """The config of the model the run trains (`load_model_config`): the checkpoint's, ``--config_name``'s or the
    preset's, with ``--config_overrides``."""
    return load_model_config(
        args.preset,
        args.method,
        vocab_size,
        args.seq_len,
        args.config_name,
        args.config_overrides,
        args.model_name_or_path,
    )


def _batch_plan(args: PretrainArguments, given: TrainingFlags, preset: Preset, world: int) -> tuple[int, int, int, int]:
    """``(steps, micro-batch, accumulation, global batch)`` from the flags given, else the preset's."""
    if "max_steps" in given and given["max_steps"] > 0:
        steps = given["max_steps"]
    else:
        steps = preset.paper_steps if args.paper_steps else preset.steps
    micro = given.get("per_device_train_batch_size") or preset.batch_size
    accumulation = given.get("gradient_accumulation_steps")
    if accumulation is not None:
        return steps, micro, accumulation, micro * accumulation * world
    global_batch = args.global_batch_size or preset.global_batch_size
    micro = min(micro, max(1, global_batch // world))
    if global_batch % (micro * world):
        raise ValueError(
            f"`global_batch_size`={global_batch} is not a multiple of `per_device_train_batch_size`={micro} × "
            f"{world} processes; choose sizes that divide it, or set `gradient_accumulation_steps`"
        )
    return steps, micro, global_batch // (micro * world), global_batch


def _rotation_recipe(args: PretrainArguments, given: TrainingFlags, preset: Preset, hidden: int) -> RotationRecipe:
    """POET's part of the recipe: the resolved `PoetConfig` (sides, map, merges, ``W0``) and the rotations' rate.

    A preset's shape takes its block size; a config's or a checkpoint's takes `PoetConfig`'s, which each layer fits to
    its widths (the nearest divisor where it does not divide one)."""
    own_shape = args.config_name or args.model_name_or_path
    block = args.block_size or (PoetConfig.block_size if own_shape else preset.block_size)
    budget = _budget(args.budget) if args.budget is not None else preset.budget
    sides: dict[str, dict[str, Any]] = {
        "block_size": {"input": args.block_size_input or block, "output": args.block_size_output or block},
        "budget": {
            "input": _budget(args.budget_input) if args.budget_input else budget,
            "output": _budget(args.budget_output) if args.budget_output else budget,
        },
    }
    blockwise = args.method == "poet-bs"
    side = "block_size" if blockwise else "budget"
    mean_size = sum(sides[side].values()) / 2
    if not blockwise and mean_size > 1:  # absolute sizes: as a fraction of the hidden size
        mean_size = mean_size / hidden
    merge_every = cast("int | None", dict(given).get("merge_every"))  # PoetTrainingArguments' field, typed there
    config = PoetConfig(
        spo="block" if blockwise else "full",
        **{side: _collapse(sides[side])},
        **args.map_overrides(),
        merge_every=merge_every or preset.adapter_fields.get("merge_every", PoetConfig.merge_every),
        base_init=args.base_init,
        base_quantization=cast("BaseQuantization | None", args.base_quantization),  # checked by the config
        cache_rotations={"true": True, "false": False}.get(args.cache_rotations, "auto"),
    )
    return RotationRecipe(
        config=config,
        poet_learning_rate=given.get("poet_learning_rate")
        or preset.poet_learning_rate
        or tied_poet_learning_rate(args.method, mean_size),
    )


def _collapse(per_side: dict[str, Any]) -> Any:
    return per_side["input"] if per_side["input"] == per_side["output"] else per_side


def run_tokenizer(args: PretrainArguments) -> PreTrainedTokenizerBase:
    """The run's tokenizer (`load_tokenizer`): ``--tokenizer``; else the ``--model_name_or_path`` checkpoint's (a Hub
    id, or a folder that holds one); else the embedded BPE, with a warning where a checkpoint folder has none (its
    token ids may mean other text)."""
    checkpoint = args.model_name_or_path
    if args.tokenizer_name is not None or checkpoint is None:
        return load_tokenizer(args.tokenizer_name)
    if not Path(checkpoint).is_dir() or Path(checkpoint, "tokenizer_config.json").is_file():
        return load_tokenizer(checkpoint)
    import warnings

    warnings.warn(
        f"the checkpoint folder {checkpoint!r} holds no tokenizer; the run tokenizes with the embedded BPE, whose ids "
        "the checkpoint was not trained on unless it was trained with it: pass --tokenizer_name",
        UserWarning,
        stacklevel=2,
    )
    return load_tokenizer(None)
