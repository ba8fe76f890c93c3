"""Speed and memory benchmarks, each measured as a ratio against a baseline run in the same process.

    python scripts/benchmark.py --suite poet_layer          # one suite; writes benchmarks/results/poet_layer.json
    python scripts/benchmark.py --suite all --out bench.json
    python scripts/benchmark.py --render_figures            # the README's and docs' figures from the results files
    python scripts/benchmark.py --check_figures             # exit 1, naming page and figure, where one differs
    python scripts/benchmark.py --plot benchmarks/results/pretrain_step.json   # redraw a suite's PNGs

Each suite is a module of ``benchmarks/suites/`` (``benchmarks/suites/<suite>.py``, found there: no list to keep)
and exposes ``run(quick: bool) -> list[dict]``; this script dispatches, prints a Markdown table per suite and writes
each suite's results file (``benchmarks/results/<suite>.json``, with the machine, date and commit; not for
``--quick``, whose rows are a smoke run's), from which the README's and the docs' figures are rendered
(`benchmarks.rendering.figures`). A suite with figures (`benchmarks.rendering.plots.PLOTTERS`) also draws its PNGs
into ``--plot_dir``. Helpers the suites share (``common``, ``results``, ``run_cache``, ``testbed``, …) stay at
``benchmarks/``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
# The suites are the modules of benchmarks/suites/: a new suite is one file there.
SUITES = tuple(sorted(path.stem for path in (ROOT / "benchmarks" / "suites").glob("*.py") if path.stem != "__init__"))


def machine_description() -> str:
    """The device (the CPU's model name from ``/proc/cpuinfo`` where there is no GPU), cores, memory and torch."""
    if torch.cuda.is_available():
        device = torch.cuda.get_device_name(0)
    else:
        device = f"CPU ({_cpu_model() or platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30 if hasattr(os, "sysconf") else 0
    return f"{device}, {memory:.0f} GiB, torch {torch.__version__}, {torch.get_num_threads()} threads"


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as handle:
            return next((line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")), None)
    except OSError:
        return None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", choices=(*SUITES, "all"), default="all", help="which suite to run (default: all)")
    parser.add_argument("--quick", action="store_true", help="smaller sizes and fewer repeats, for a smoke run")
    parser.add_argument("--out", type=Path, help="write all rows as JSON here")
    parser.add_argument(
        "--plot",
        type=Path,
        metavar="JSON",
        help="instead of running: draw the figures of a suite's results file (pretrain_step, pretrain_quality) into "
        "--plot_dir",
    )
    parser.add_argument(
        "--plot_dir", type=Path, default=Path("docs/figures"), help="where the suites' PNGs go (default: docs/figures)"
    )
    parser.add_argument(
        "--render_figures", action="store_true", help="instead of running: rewrite the figures of the README and docs/"
    )
    parser.add_argument(
        "--check_figures",
        action="store_true",
        help="instead of running: exit 1 where a figure of the README or docs/ differs from its results file",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    sys.path.insert(0, str(ROOT))
    if args.render_figures or args.check_figures:
        from benchmarks.rendering.figures import figures_command

        return figures_command(ROOT, render=args.render_figures)
    if args.plot:
        from benchmarks.rendering.plots import PLOTTERS

        data = json.loads(args.plot.read_text())
        plot = PLOTTERS[data.get("suite", "pretrain_step")]
        for path in plot(data.get("rows", data.get("pretrain_step")), args.plot_dir, data.get("machine", "")):
            print(path)
        return 0
    results = run_suites(args, "python scripts/benchmark.py " + " ".join(sys.argv[1:] if argv is None else argv))
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))
    return 0


def run_suites(args: argparse.Namespace, command: str) -> dict:
    """Run the suites asked for, print each as a table and write its results file (not for ``--quick``)."""
    import tempfile

    from benchmarks.common import to_markdown
    from benchmarks.rendering.plots import PLOTTERS
    from benchmarks.results import save_results

    results = {"machine": machine_description()}
    print(f"machine: {results['machine']}")
    for suite in SUITES if args.suite == "all" else (args.suite,):
        module = importlib.import_module(f"benchmarks.suites.{suite}")
        rows = module.run(quick=args.quick)
        results[suite] = rows
        print(f"\n## {suite}\n\n{to_markdown(rows)}")
        if not args.quick:
            print(save_results(suite, rows, results["machine"], command, getattr(module, "SETTINGS", None)))
        if suite in PLOTTERS:  # a quick run's figures go to a scratch folder, not over the docs' own
            plot_dir = args.plot_dir if not args.quick else Path(tempfile.mkdtemp())
            for path in PLOTTERS[suite](rows, plot_dir, results["machine"]):
                print(path)
    return results


if __name__ == "__main__":
    raise SystemExit(main())
