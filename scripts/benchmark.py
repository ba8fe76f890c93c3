"""Speed and memory benchmarks, each measured as a ratio against a baseline run in the same process.

    python scripts/benchmark.py --suite poet_layer          # one suite
    python scripts/benchmark.py --suite all --out bench.json
    python scripts/benchmark.py --plot bench.json --plot_dir docs/figures   # figures of the pretrain_step rows

Each suite lives in ``benchmarks/<suite>.py`` and exposes ``run(quick: bool) -> list[dict]``; this script only
dispatches, prints a Markdown table per suite and optionally writes JSON.
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
SUITES = (
    "poet_layer",
    "pretrain_step",
    "finetune_step",
    "finetune_quality",
    "finetune_sweep",
    "finetune_rates",
    "oft_layer",
    "fsdp",
    "eco",
    "reflection",
    "import_time",
    "load_checks",
    "quantized",
    "training_modes",
    "memory_peers",
    "pretrain_7b",
)


def machine_description() -> str:
    device = (
        torch.cuda.get_device_name(0)
        if torch.cuda.is_available()
        else f"CPU ({platform.processor() or platform.machine()})"
    )
    return f"{device}, torch {torch.__version__}, {torch.get_num_threads()} threads"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", choices=(*SUITES, "all"), default="all", help="which suite to run (default: all)")
    parser.add_argument("--quick", action="store_true", help="smaller sizes and fewer repeats, for a smoke run")
    parser.add_argument("--out", type=Path, help="write all rows as JSON here")
    parser.add_argument(
        "--plot",
        type=Path,
        metavar="JSON",
        help="instead of running: draw the figures of a JSON "
        "file written by --out (its pretrain_step rows) into --plot_dir",
    )
    parser.add_argument("--plot_dir", type=Path, default=Path("docs/figures"), help="where --plot writes its PNGs")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    sys.path.insert(0, str(ROOT))
    from benchmarks.common import to_markdown

    if args.plot:
        from benchmarks.plots import plot_pretrain_step

        data = json.loads(args.plot.read_text())
        for path in plot_pretrain_step(data["pretrain_step"], args.plot_dir, data.get("machine", "")):
            print(path)
        return 0
    results = {"machine": machine_description()}
    print(f"machine: {results['machine']}")
    for suite in SUITES if args.suite == "all" else (args.suite,):
        rows = importlib.import_module(f"benchmarks.{suite}").run(quick=args.quick)
        results[suite] = rows
        print(f"\n## {suite}\n\n{to_markdown(rows)}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
