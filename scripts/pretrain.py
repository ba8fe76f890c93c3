"""Pretrain a LLaMA from scratch with POET or a baseline (POET paper, Table 2).

    python scripts/pretrain.py                                   # POET-BS on the tiny preset, embedded corpus
    python scripts/pretrain.py --method adamw                    # the same run with the full-rank baseline
    accelerate launch --multi_gpu --num_processes 2 scripts/pretrain.py --preset tiny   # DDP (gloo on a CPU)
    python scripts/pretrain.py --base_quantization int8               # QPOET: W0 stored in int8 (bitsandbytes)
    python scripts/pretrain.py --preset llama-60m --method poet-fs --budget 0.5 \\
        --dataset allenai/c4 --dataset_config en --streaming --tokenizer_name t5-base --paper_steps
    python scripts/pretrain.py --preset llama-130m --bf16 --activation_checkpointing --torch_compile
    python scripts/pretrain.py --config_name Qwen/Qwen2.5-0.5B --config_overrides num_hidden_layers=4  # any causal LM
    python scripts/pretrain.py --model_name_or_path ./my-checkpoint        # continued pretraining: its weights are W0
    python scripts/plan_memory.py --preset llama-2-7b --base_quantization nf4    # the memory plan of that run

The same command as ``poet-hf pretrain`` (`poet_hf.recipes.commands`), which an installed package has.
Every TrainingArguments flag works (--bf16, --activation_checkpointing, --torch_compile, --optim, --max_steps,
--per_device_train_batch_size, --report_to, --push_to_hub, ...); a flag left out takes the preset's value.
Every option, with the values a run would use: python scripts/pretrain.py [--preset ...] --help
"""

from poet_hf.recipes.commands import pretrain as main
from poet_hf.recipes.commands import pretrain_parser as build_parser
from poet_hf.training.distributed import end_distributed

__all__ = ["build_parser", "main"]

if __name__ == "__main__":
    main()
    end_distributed(exit_process=True)  # gloo can abort the interpreter's exit otherwise
