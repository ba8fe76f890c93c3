#!/usr/bin/env python
"""Plan the per-process memory of a training run, part by part, before running it (poet_hf.plan_memory).

It takes ``scripts/pretrain.py``'s own flags and plans exactly that run (`poet_hf.recipes.run_plan.plan_pretraining`),
plus --compare, --processes, --sharding, --dtype and --json:

    python scripts/plan_memory.py --preset llama-130m --per_device_train_batch_size 4 --compare adamw,lora,galore
    python scripts/plan_memory.py --config_name configs/models/llama-2-7b.json --per_device_train_batch_size 1 \
        --gradient_accumulation_steps 1 --activation_checkpointing --base_quantization nf4 --fused_optimizer_step \
        --optim adamw_bnb_8bit
    python scripts/plan_memory.py --config_name meta-llama/Llama-3.1-8B --dtype bfloat16 --processes 8 --sharding fsdp2

The model is built on the meta device: no weights are read or allocated. The text output lists each part (MB per
process), one column per method, and ends with the line ``total: N MiB per process`` for the run's method.
"""

import sys

from poet_hf.recipes.plan_cli import build_parser, main

__all__ = ["build_parser", "main"]

if __name__ == "__main__":
    sys.exit(main())
