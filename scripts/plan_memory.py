#!/usr/bin/env python
"""Plan the per-process memory of a training run, part by part, before running it (poet_hf.plan_memory).

    python scripts/plan_memory.py --model llama-130m --method poet-bs --block_size 256 --batch_size 4 --seq_len 256
    python scripts/plan_memory.py --model meta-llama/Llama-3.1-8B --method poet-bs --dtype bfloat16 \\
        --processes 8 --sharding fsdp2 --checkpointing --compare adamw,lora,galore
    python scripts/plan_memory.py --model configs/models/llama-2-7b.json --method poet-bs --batch_size 1 \
        --checkpointing --base_quantization nf4 --fused_step --optimizer_bits 8

The model is built on the meta device: no weights are read or allocated. The text output lists each part (MB per
process), one column per method, and ends with the line ``total: N MB per process`` for --method.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
from typing import Any

# The options passed through to poet_hf.plan_memory, with their help; defaults are read off its signature.
OPTIONS: dict[str, tuple[str, dict[str, Any]]] = {
    "block_size": ("POET-BS / OFT block size b", {"type": int}),
    "budget": ("POET-FS budget, a fraction of each dimension in (0, 1]", {"type": float}),
    "rank": ("LoRA rank and GaLore projection rank", {"type": int}),
    "dtype": ("weights' and activations' dtype; adapter parameters stay float32", {}),
    "batch_size": ("sequences per micro-batch per process", {"type": int}),
    "seq_len": ("tokens per sequence", {"type": int}),
    "accumulation": (
        "micro-batches per optimizer step: gradients and POET's rotation caches persist between them",
        {"type": int},
    ),
    "processes": ("data-parallel processes", {"type": int}),
    "sharding": ("ddp: every process holds the whole model; fsdp2: fully_shard per block", {}),
    "base_quantization": ("POET's W0 stored by bitsandbytes: nf4, fp4 or int8 (default: the dtype)", {}),
    "residual_storage": (
        "where a quantised or 16-bit W0 keeps its error-feedback residual: layer (in the steps' memory), or "
        "auto, cpu, disk (off it)",
        {},
    ),
    "optimizer_bits": ("32: float32 Adam states; 8: blockwise 8-bit states (bitsandbytes)", {"type": int}),
}

SWITCHES = {
    "checkpointing": "activation checkpointing per block",
    "fused_step": "optimizer steps fused into the backward (--fused_optimizer_step)",
    "json": "print the plans as JSON instead of the table",
}


def build_parser() -> argparse.ArgumentParser:
    from poet_hf.memory_plan import BASE_QUANTIZATIONS, DTYPES, METHODS, RESIDUAL_STORAGES, SHARDINGS, plan_memory

    defaults = {name: p.default for name, p in inspect.signature(plan_memory).parameters.items()}
    choices = {"method": METHODS, "dtype": tuple(DTYPES), "sharding": SHARDINGS, "optimizer_bits": (32, 8)}
    choices.update(base_quantization=BASE_QUANTIZATIONS, residual_storage=RESIDUAL_STORAGES)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model",
        required=True,
        help="a preset (tiny, llama-60m, llama-130m, llama-350m, llama-1.3b), a config.json or its "
        "folder, or a Hub id (its config.json only, from the local cache when offline)",
    )
    parser.add_argument(
        "--compare",
        default="",
        help=f"comma-separated methods to plan side by side with --method (from {', '.join(METHODS)})",
    )
    for name, (text, kwargs) in {"method": ("training method", {}), **OPTIONS}.items():
        parser.add_argument(
            f"--{name}",
            default=defaults[name],
            choices=choices.get(name),
            help=f"{text} (default: {defaults[name]})",
            **kwargs,
        )
    for name, text in SWITCHES.items():
        parser.add_argument(f"--{name}", action="store_true", help=text)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from poet_hf.memory_plan import format_plans, plan_memory

    methods = [args.method] + [m for m in args.compare.split(",") if m and m != args.method]
    options = {key: getattr(args, key) for key in (*OPTIONS, "checkpointing", "fused_step")}
    try:
        plans = [plan_memory(args.model, method, **options) for method in methods]
    except ValueError as error:
        print(f"plan_memory.py: error: {error}", file=sys.stderr)
        return 2
    print(json.dumps([plan.to_dict() for plan in plans], indent=2) if args.json else format_plans(plans))
    return 0


if __name__ == "__main__":
    sys.exit(main())
