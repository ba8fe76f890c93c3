"""LLaMA pretraining from scratch with POET or a baseline, as in the POET paper's Table 2.

Every method runs through the same data, model presets and ``PoetTrainer``, so a comparison is one command
per row. ``scripts/pretrain.py`` is the command-line face of
[`run_pretraining`][poet_hf.recipes.pretrain.run_pretraining].
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, TypeAlias, cast

import torch
from transformers import default_data_collator

from ..data import load_corpus, pack_sequences, pad_documents
from ..initialization import materialize_model
from ..sharded import is_sharded
from ..training.arguments import PoetTrainingArguments
from ..training.callback import MergeReinitCallback
from ..training.spectrum import SpectrumCallback
from ..training.trainer import PoetTrainer
from ..tuners.rotation.layer import rotation_layers
from .cli import check_cpu_mixed_precision, training_arguments
from .model_source import adopt_special_tokens, build_model
from .presets import (  # noqa: F401 (public here too)
    PRESETS,
    Preset,
    apply_recipe,
    build_llama,
    count_trainable,
    intermediate_size,
    parameter_counts,
    recipe_parameter_counts,
    targets_for,
    tied_poet_learning_rate,
)
from .pretrain_arguments import (  # noqa: F401 (public here too)
    CONFIG_FLAGS,
    METHODS,
    RECIPE_FLAGS,
    RUN_FLAGS,
    PretrainArguments,
)
from .pretrain_settings import (  # noqa: F401 (public here too)
    counted_recipe,
    model_config,
    parse_pretrain_arguments,
    pretrain_defaults,
    recipe_flags,
    resolve_recipe,
    run_tokenizer,
)
from .recipe import PretrainRecipe
from .script_arguments import MAP_FLAGS

if TYPE_CHECKING:
    from datasets import Dataset, IterableDataset
    from transformers import PreTrainedTokenizerBase

    TextDataset: TypeAlias = Dataset | IterableDataset


def load_data(
    args: PretrainArguments, tokenizer: PreTrainedTokenizerBase, seed: int = 0
) -> tuple[TextDataset, TextDataset]:
    """Train and (capped) validation sets: packed rows, or one truncated / padded row per document.

    ``seed`` orders a streamed dataset and draws a held-out split where the dataset has none."""
    corpus = load_corpus(args.dataset, args.dataset_config, streaming=args.streaming, seed=seed)
    prepare = pack_sequences if args.packing else pad_documents
    train = prepare(corpus["train"], tokenizer, args.seq_len, args.text_column)
    validation = prepare(corpus["validation"], tokenizer, args.seq_len, args.text_column)
    if args.streaming:
        return train, validation.take(args.max_eval_samples)
    return train, validation.select(range(min(args.max_eval_samples, len(validation))))


def _perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))


def _trainer(
    args: PretrainArguments,
    training: PoetTrainingArguments,
    recipe: PretrainRecipe,
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    train: TextDataset,
    validation: TextDataset,
    targets: list[str] | None,
) -> tuple[PoetTrainer, SpectrumCallback]:
    """The run's `PoetTrainer`, with what the model card and ``results.json`` record of the run, and its
    `SpectrumCallback` (over the rotated layers or, for a baseline, the modules named in ``targets``)."""
    run_info: dict[str, object] = {
        "method": args.method,
        "preset": args.preset,
        "dataset": args.dataset,
        "seq_len": args.seq_len,
        **{k: v for k, v in recipe.as_dict().items() if k in ("block_size", "budget", "merge_every", *MAP_FLAGS)},
    }
    merges = MergeReinitCallback() if recipe.rotation is not None else None
    spectra = SpectrumCallback(targets, merges, title=f"{args.method} on {args.preset}")
    trainer = PoetTrainer(
        model=model,
        args=training,
        train_dataset=train,
        eval_dataset=validation,
        data_collator=default_data_collator,
        processing_class=tokenizer,
        run_info=run_info,
        callbacks=[callback for callback in (merges, spectra) if callback is not None],
    )
    return trainer, spectra


def _save_and_export(args: PretrainArguments, trainer: PoetTrainer, results: dict[str, object]) -> None:
    """Save the model, export it when ``--export_dir`` asks (into ``results``), and write the report."""
    output = Path(cast(str, trainer.args.output_dir))
    trainer.save_model(str(output))  # every rank: under FSDP2 the state is gathered collectively
    if args.export_dir and (
        is_sharded(cast(torch.nn.Module, trainer.model)) or trainer.is_world_process_zero()
    ):  # a sharded fold: all
        from ..export import export_merged

        evaluation = {"eval_loss": results["val_loss"], "eval_perplexity": results["val_perplexity"]}
        source = output if trainer.is_deepspeed_enabled else trainer  # ZeRO: the whole state the save gathered
        results["export_dir"] = str(
            export_merged(source, args.export_dir, overwrite=True, run_info={"eval": evaluation})
        )
    if trainer.is_world_process_zero():
        output.mkdir(parents=True, exist_ok=True)
        (output / "results.json").write_text(json.dumps(results, indent=2))


def validation_curve(initial_loss: float, log_history: list[dict[str, float]]) -> list[tuple[int, float]]:
    """``(step, validation loss)`` from the evaluation before training (step 0) through every one in the Trainer's
    log (``--eval_strategy steps`` adds those between), in step order, the last at a step kept."""
    curve = {0: initial_loss, **{int(log["step"]): log["eval_loss"] for log in log_history if "eval_loss" in log}}
    return sorted(curve.items())


def run_pretraining(args: PretrainArguments, training: PoetTrainingArguments | None = None) -> dict[str, object]:
    """Train, evaluate and report; writes ``results.json`` and ``spectra.png`` in ``training.output_dir``.

    Args:
        args: the run's options (``scripts/pretrain.py``'s own flags).
        training: the training arguments (its ``TrainingArguments`` flags); ``None``: the preset's
            (`pretrain_defaults`).

    Returns:
        The report written to ``results.json``: the resolved recipe, validation loss and perplexity (initial and final),
            tokens seen, trainable parameters, merges, spectrum drift and its Cayley–Neumann bound, the training losses
            and the validation curve (`validation_curve`).

    Raises:
        ValueError: the validation set holds fewer sequences than one batch (and, from the arguments, any invalid
            option).
    """
    started = time.time()
    if training is None:
        training = training_arguments(PoetTrainingArguments, pretrain_defaults(args, {}))
    check_cpu_mixed_precision(training)
    tokenizer = run_tokenizer(args)
    recipe = resolve_recipe(args, recipe_flags(training), vocab_size=len(tokenizer))
    seed = training.seed
    train, validation = load_data(args, tokenizer, seed)
    if not args.streaming and len(train) < recipe.batch_size:
        raise ValueError(
            f"the train split of `dataset`={args.dataset!r} gives {len(train)} sequences of {args.seq_len} tokens, "
            f"fewer than one batch (`batch_size`={recipe.batch_size}); give it more text, or a shorter --seq_len"
        )
    if not args.streaming and len(validation) < recipe.batch_size:
        raise ValueError(
            f"the validation set has {len(validation)} sequences, fewer than one batch "
            f"(`batch_size`={recipe.batch_size}); use more validation data or a smaller batch"
        )
    # Built on the meta device (a checkpoint is read); PoetTrainer materializes it (under FSDP2 each process its own
    # shards only; a quantised W0 one layer at a time). LoRA's adapters are added to materialized weights.
    config = model_config(args, len(tokenizer))
    base = build_model(config, seed, args.model_name_or_path)
    if not (args.model_name_or_path or args.config_name):
        adopt_special_tokens(base, tokenizer)  # a preset's model is new: its special tokens are the tokenizer's
    if args.method == "lora" and not args.model_name_or_path:
        materialize_model(base, seed=seed)
    model = apply_recipe(base, recipe, seed=seed)
    parameters = parameter_counts(model, recipe, config)  # what the run's own model trains
    recipe = replace(recipe, parameters=parameters)
    family_targets = targets_for(config)
    targets = family_targets if isinstance(family_targets, list) else None  # a regex: the rotated layers' own
    trainer, spectra = _trainer(args, training, recipe, model, tokenizer, train, validation, targets)
    initial_loss = trainer.evaluate()["eval_loss"]
    trainer.train(resume_from_checkpoint=training.resume_from_checkpoint)
    final_loss = trainer.evaluate()["eval_loss"]
    results = {
        **trainer.run_info,
        "recipe": recipe.as_dict(),
        "val_loss": final_loss,
        "val_perplexity": _perplexity(final_loss),
        "initial_val_loss": initial_loss,
        "initial_val_perplexity": _perplexity(initial_loss),
        "tokens_seen": int(trainer.state.num_input_tokens_seen),
        "steps": trainer.state.global_step,
        **{key: parameters[key] for key in ("trainable_params", "trainable_block_params")},
        "wall_time_s": time.time() - started,
        "merges": max((int(layer.merge_counts["default"]) for _, layer in rotation_layers(model)), default=0),
        "rotation_caches": next(  # what cache_rotations="auto" chose, where it decided
            (layer.step_state.cache_summary() for _, layer in rotation_layers(model) if layer.step_state.cache_choices),
            None,
        ),
        **(spectra.report or {}),
        "train_losses": [log["loss"] for log in trainer.state.log_history if "loss" in log],
        "validation_losses": validation_curve(initial_loss, trainer.state.log_history),
    }
    _save_and_export(args, trainer, results)
    return results


def run_summary(results: dict[str, object]) -> dict[str, object]:
    """The figures of a run's ``results.json`` (`run_pretraining`) that ``scripts/pretrain.py`` prints when it ends.

    Args:
        results: the run's report.

    Returns:
        The method and preset, the validation perplexity (initial and final), tokens seen, trainable parameters,
        merges, wall time, the spectrum's largest drift and what ``cache_rotations="auto"`` chose.
    """
    keys = ("method", "preset", "initial_val_perplexity", "val_perplexity", "tokens_seen", "trainable_params")
    summary = {key: results[key] for key in (*keys, "merges", "wall_time_s")}
    summary["spectrum_max_drift"] = cast(dict, results["spectrum_drift"]).get("max_drift")
    caches = cast("dict | None", results.get("rotation_caches"))
    if caches:  # what cache_rotations="auto" chose, at the run's first window
        summary["rotation_caches"] = caches["summary"]
    return summary
