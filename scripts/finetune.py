"""Fine-tune a pretrained model with POET, OFT or LoRA and report the evaluation metric before and after.

    python scripts/finetune.py --model_name_or_path gpt2 --method oft --dataset embedded --max_steps 200
    python scripts/finetune.py --model_name_or_path ./my-llama --method poet --dataset ./corpus.txt \\
        --export_dir outputs/merged                               # POET's default recipe (--recipe paper: Table 6)
    python scripts/finetune.py --model_name_or_path bert-base-uncased --task sequence-classification --method oft \\
        --dataset glue --dataset_config sst2 --text_column sentence
    python scripts/finetune.py --model_name_or_path ./my-llama --method oft --base_quantization nf4   # QOFT, 4-bit W0
    python scripts/finetune.py --model_name_or_path ./my-llama --method poet --bf16 --activation_checkpointing \
        --optim adamw_torch

Every TrainingArguments flag works (--bf16, --activation_checkpointing, --torch_compile, --optim,
--per_device_train_batch_size, --report_to, --push_to_hub, ...). Every option: python scripts/finetune.py --help
"""

from __future__ import annotations

import json

from transformers import HfArgumentParser

from poet_hf.recipes.cli import training_parser
from poet_hf.recipes.finetune import FinetuneArguments, parse_finetune_arguments, run_finetuning
from poet_hf.training import PoetTrainingArguments
from poet_hf.training.distributed import end_distributed


def build_parser() -> HfArgumentParser:
    return training_parser(FinetuneArguments, PoetTrainingArguments)


def main(argv: list[str] | None = None) -> dict:
    args, training = parse_finetune_arguments(argv)
    results = run_finetuning(args, training)
    summary = {k: results[k] for k in ("method", "model", "task", "before", "after", "steps", "trainable_params")}
    if "export_dir" in results:
        summary["export_dir"] = results["export_dir"]
    print(json.dumps(summary, indent=2))
    name = "perplexity" if args.task == "causal-lm" else "accuracy"
    print(
        f"eval {name}: {results['before'][name]:.4g} -> {results['after'][name]:.4g} "
        f"(eval loss {results['before']['loss']:.4f} -> {results['after']['loss']:.4f})"
    )
    return results


if __name__ == "__main__":
    main()
    end_distributed(exit_process=True)  # gloo can abort the interpreter's exit otherwise
