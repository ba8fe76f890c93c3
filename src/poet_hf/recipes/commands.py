"""The ``poet-hf`` command: ``poet-hf pretrain``, ``finetune``, ``plan-memory`` and ``export``, as TRL's ``trl sft``.

An installed package runs its jobs without the repository's ``scripts/``, which are thin callers of the same
functions (the docs' ``accelerate launch scripts/pretrain.py`` and ``poet-hf pretrain`` are one command):

    poet-hf pretrain --max_steps 200                                  # = python scripts/pretrain.py --max_steps 200
    accelerate launch --multi_gpu --num_processes 2 -m poet_hf pretrain --preset tiny
    poet-hf plan-memory --preset llama-130m --compare adamw
    poet-hf export outputs/pretrain/checkpoint-200 exports/tiny-poet
    poet-hf finetune --model_name_or_path gpt2 --method oft --dataset embedded --max_steps 200
"""

from __future__ import annotations

import importlib
import json
import sys
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from transformers import HfArgumentParser

# command -> (module, function): the function takes the command's arguments
COMMANDS = {
    "pretrain": ("poet_hf.recipes.commands", "pretrain"),
    "finetune": ("poet_hf.recipes.commands", "finetune"),
    "plan-memory": ("poet_hf.recipes.plan_cli", "main"),
    "export": ("poet_hf.recipes.export_command", "main"),
}
TRAINING = ("pretrain", "finetune")  # runs that end the process group they joined (under a launcher), as the scripts do
USAGE = "usage: poet-hf {" + ",".join(COMMANDS) + "} [options]  (poet-hf COMMAND --help: its options)"


def pretrain_parser() -> HfArgumentParser:
    """``poet-hf pretrain``'s parser: `PretrainArguments`, then every `PoetTrainingArguments` flag."""
    from ..training import PoetTrainingArguments
    from .cli import training_parser
    from .pretrain_arguments import PretrainArguments

    return training_parser(PretrainArguments, PoetTrainingArguments)


def pretrain(argv: list[str] | None = None) -> dict:
    """Pretrain as the command line says (`run_pretraining`), print the summary and validation perplexity; the
    results (with ``--print_recipe``: the resolved recipe, without training)."""
    from .pretrain_settings import counted_recipe, parse_pretrain_arguments

    args, training = parse_pretrain_arguments(argv)
    if args.print_recipe:
        recipe = counted_recipe(args, training).as_dict()
        print(json.dumps(recipe, indent=2))
        return recipe
    # The run's modules (the trainer, the data libraries) load after parsing, so --help does without them.
    from .pretrain import run_pretraining, run_summary

    results = run_pretraining(args, training)
    print(json.dumps(run_summary(results), indent=2))
    print(
        f"validation perplexity: {results['val_perplexity']:.2f} "
        f"(initial {results['initial_val_perplexity']:.1f}) -> {training.output_dir}/results.json"
    )
    return results


def finetune_parser() -> HfArgumentParser:
    """``poet-hf finetune``'s parser: `FinetuneArguments`, then every `PoetTrainingArguments` flag."""
    from ..training import PoetTrainingArguments
    from .cli import training_parser
    from .finetune import FinetuneArguments

    return training_parser(FinetuneArguments, PoetTrainingArguments)


def finetune(argv: list[str] | None = None) -> dict:
    """Fine-tune as the command line says (`run_finetuning`), print the metric before and after; the results."""
    from .finetune import parse_finetune_arguments, run_finetuning

    args, training = parse_finetune_arguments(argv)
    results = run_finetuning(args, training)
    summary = {k: results[k] for k in ("method", "model", "task", "before", "after", "steps", "trainable_params")}
    if "export_dir" in results:
        summary["export_dir"] = results["export_dir"]
    print(json.dumps(summary, indent=2))
    name = "perplexity" if args.task == "causal-lm" else "accuracy"
    before, after = (cast(dict[str, float], results[when]) for when in ("before", "after"))
    print(
        f"eval {name}: {before[name]:.4g} -> {after[name]:.4g} (eval loss {before['loss']:.4f} -> {after['loss']:.4f})"
    )
    return results


def main(argv: list[str] | None = None) -> int:
    """``poet-hf COMMAND ...``: run the command; the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(f"{USAGE}\n\n{__doc__}")
        return 0
    if not argv or argv[0] not in COMMANDS:
        given = f"got {argv[0]!r}" if argv else "got none (poet-hf --help lists them)"
        print(f"poet-hf: error: the command must be one of {tuple(COMMANDS)}, {given}", file=sys.stderr)
        return 2
    command, rest = argv[0], argv[1:]
    sys.argv = [f"poet-hf {command}", *rest]  # argparse's prog and the commands' error lines name the command
    module, function = COMMANDS[command]
    result = getattr(importlib.import_module(module), function)(rest)
    if command in TRAINING:
        from ..training.distributed import end_distributed

        end_distributed(exit_process=True)  # gloo can abort the interpreter's exit otherwise
        return 0
    return int(result)
