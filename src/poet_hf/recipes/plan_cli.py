"""The command line of ``scripts/plan_memory.py``: a run's own flags planned as `plan_pretraining` plans them."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, cast

from ..dtypes import NAMES as DTYPE_NAMES
from ..dtypes import dtype_name
from .argument_errors import OneLineErrorParser, command_name, option_type

DESCRIPTION = "Plan the per-process memory of a training run, part by part, before running it (poet_hf.plan_memory)."


def build_parser() -> argparse.ArgumentParser:
    """The whole command line, for ``--help``: the plan's options, then ``scripts/pretrain.py``'s flags."""
    from ..training import PoetTrainingArguments
    from .cli import ScriptArgumentParser
    from .pretrain_arguments import PretrainArguments

    return ScriptArgumentParser(
        cast(Any, (PretrainArguments, PoetTrainingArguments)), description=DESCRIPTION, parents=[plan_parser()]
    )


def plan_parser() -> argparse.ArgumentParser:
    """The options of a plan beside the training script's flags."""
    from .plan_settings import METHODS, SHARDINGS

    parser = OneLineErrorParser(add_help=False)
    parser.add_argument(
        "--dtype",
        default="float32",
        type=option_type(dtype_name),
        choices=DTYPE_NAMES,
        help="weights' dtype (bf16 and fp16 are the same names): pretrain.py keeps float32 (--bf16 is autocast); "
        "bfloat16 plans a run that stores them so",
    )
    parser.add_argument("--compare", default="", help=f"methods to plan beside the run's (from {', '.join(METHODS)})")
    parser.add_argument("--processes", type=int, default=None, help="data-parallel processes (default: the launcher's)")
    parser.add_argument("--sharding", default="ddp", choices=SHARDINGS, help="ddp, or fsdp2 (fully_shard per block)")
    parser.add_argument("--json", action="store_true", help="print the plans as JSON instead of the table")
    return parser


def main(argv: list[str] | None = None) -> int:
    """``scripts/plan_memory.py``: plan the run its flags describe and print the plan; the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if "-h" in argv or "--help" in argv:
        build_parser().print_help()
        return 0
    from .memory_plan import format_plans
    from .run_plan import RefusedRun, parse_run, plan_pretraining

    options, rest = plan_parser().parse_known_args(argv)
    prog = command_name()
    if options.processes is not None and options.processes < 1:
        print(f"{prog}: error: --processes must be an integer >= 1, got {options.processes}", file=sys.stderr)
        return 2
    args, training = parse_run(rest, options.processes)
    methods = tuple(m for m in options.compare.split(",") if m)
    plan_of_run = (args, training, methods, options.processes, options.sharding, options.dtype)
    try:
        plans = plan_pretraining(*plan_of_run)
    except RefusedRun as refusal:
        print(f"{prog}: error: {refusal}", file=sys.stderr)
        asked, runnable = plan_pretraining(*plan_of_run, plan_refused=True)
        print(_refused_summary(str(refusal), refusal.without, asked.total_bytes, runnable.total_bytes, options.json))
        return 2
    except ValueError as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 2
    print(json.dumps([plan.to_dict() for plan in plans], indent=2) if options.json else format_plans(plans))
    return 0


def _refused_summary(message: str, without: str, asked: int, runnable: int, as_json: bool) -> str:
    """What a refused run would hold, planned anyway, beside the same run without the refused saving; no total."""
    asked_mb, runnable_mb = asked / 2**20, runnable / 2**20
    if as_json:
        return json.dumps({"refused": message, "asked_mb": asked_mb, "without": without, "runnable_mb": runnable_mb})
    return (
        f"refused before its first step: {message}\n"
        f"planned anyway: {asked_mb:.0f} MiB per process as asked; {runnable_mb:.0f} MiB without {without}: the "
        f"refused saving is worth {runnable_mb - asked_mb:.0f} MiB per process"
    )
