"""Fine-tune a pretrained model with POET, OFT or LoRA and report the evaluation metric before and after.

    python scripts/finetune.py --model_name_or_path gpt2 --method oft --dataset embedded --max_steps 200
    python scripts/finetune.py --model_name_or_path ./my-llama --method poet --dataset ./corpus.txt \\
        --export_dir outputs/merged                               # POET's default recipe (--recipe paper: Table 6)
    python scripts/finetune.py --model_name_or_path bert-base-uncased --task sequence-classification --method oft \\
        --dataset glue --dataset_config sst2 --text_column sentence
    python scripts/finetune.py --model_name_or_path ./my-llama --method oft --base_quantization nf4   # QOFT, 4-bit W0
    python scripts/finetune.py --model_name_or_path ./my-llama --method poet --bf16 --activation_checkpointing \
        --optim adamw_torch

The same command as ``poet-hf finetune`` (`poet_hf.recipes.commands`), which an installed package has.
Every TrainingArguments flag works (--bf16, --activation_checkpointing, --torch_compile, --optim,
--per_device_train_batch_size, --report_to, --push_to_hub, ...). Every option: python scripts/finetune.py --help
"""

from poet_hf.recipes.commands import finetune as main
from poet_hf.recipes.commands import finetune_parser as build_parser
from poet_hf.training.distributed import end_distributed

__all__ = ["build_parser", "main"]

if __name__ == "__main__":
    main()
    end_distributed(exit_process=True)  # gloo can abort the interpreter's exit otherwise
