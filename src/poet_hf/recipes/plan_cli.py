"""The command line of ``scripts/plan_memory.py``: a run's own flags planned as `plan_pretraining` plans them."""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import warnings
from typing import Any

DESCRIPTION = "Plan the per-process memory of a training run, part by part, before running it (poet_hf.plan_memory)."

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
    from .memory_plan import (
        BASE_QUANTIZATIONS,
        DTYPES,
        METHODS,
        RESIDUAL_STORAGES,
        SHARDINGS,
        plan_memory,
    )

    defaults = {name: p.default for name, p in inspect.signature(plan_memory).parameters.items()}
    choices = {"method": METHODS, "dtype": tuple(DTYPES), "sharding": SHARDINGS, "optimizer_bits": (32, 8)}
    choices.update(base_quantization=BASE_QUANTIZATIONS, residual_storage=RESIDUAL_STORAGES)
    parser = argparse.ArgumentParser(description=DESCRIPTION)
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


def plan_parser() -> argparse.ArgumentParser:
    """The options of a plan beside the training script's flags."""
    from .memory_plan import DTYPES, METHODS, SHARDINGS

    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=tuple(DTYPES),
        help="weights' dtype: pretrain.py keeps float32 (--bf16 is autocast); bfloat16 plans a run that stores them so",
    )
    parser.add_argument("--compare", default="", help=f"methods to plan beside the run's (from {', '.join(METHODS)})")
    parser.add_argument("--processes", type=int, default=None, help="data-parallel processes (default: the launcher's)")
    parser.add_argument("--sharding", default="ddp", choices=SHARDINGS, help="ddp, or fsdp2 (fully_shard per block)")
    parser.add_argument("--json", action="store_true", help=SWITCHES["json"])
    return parser


def main(argv: list[str] | None = None) -> int:
    """``scripts/plan_memory.py``: plan the run its flags describe and print the plan; the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if any(arg == "--model" or arg.startswith("--model=") for arg in argv):
        return main_former_spelling(argv)
    from .memory_plan import format_plans
    from .run_plan import parse_run, plan_pretraining

    options, rest = plan_parser().parse_known_args(argv)
    args, training = parse_run(rest, options.processes)
    methods = tuple(m for m in options.compare.split(",") if m)
    try:
        plans = plan_pretraining(args, training, methods, options.processes, options.sharding, options.dtype)
    except ValueError as error:
        print(f"plan_memory.py: error: {error}", file=sys.stderr)
        return 2
    print(json.dumps([plan.to_dict() for plan in plans], indent=2) if options.json else format_plans(plans))
    return 0


def main_former_spelling(argv: list[str]) -> int:
    """The former options (``--model``, ``--batch_size``, ...), for one release."""
    warnings.warn(
        "plan_memory.py's own spellings (--model, --batch_size, --checkpointing, --fused_step, --optimizer_bits, "
        "--accumulation) are deprecated and will be removed in the next release; pass scripts/pretrain.py's flags "
        "(--preset or --config_name, --per_device_train_batch_size, --gradient_checkpointing, "
        "--fused_optimizer_step, --optim adamw_bnb_8bit, --gradient_accumulation_steps)",
        FutureWarning,
        stacklevel=2,
    )
    args = build_parser().parse_args(argv)
    from .memory_plan import format_plans, plan_memory

    methods = [args.method] + [m for m in args.compare.split(",") if m and m != args.method]
    options = {key: getattr(args, key) for key in (*OPTIONS, "checkpointing", "fused_step")}
    try:
        plans = [plan_memory(args.model, method, **options) for method in methods]
    except ValueError as error:
        print(f"plan_memory.py: error: {error}", file=sys.stderr)
        return 2
    print(json.dumps([plan.to_dict() for plan in plans], indent=2) if args.json else format_plans(plans))
    return 0
