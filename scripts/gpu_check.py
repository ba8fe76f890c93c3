"""Run the GPU check on a CUDA machine: the CUDA tests, then the pretraining and fine-tuning step benchmarks in bf16.

    python scripts/gpu_check.py --out gpu-check          # on the GPU machine: writes gpu_check.json and gpu_check.md
    python scripts/gpu_check.py --dry_run                # anywhere: prints what it would run

See benchmarks/gpu_plan.py for what each step measures.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("gpu-check"), help="folder for gpu_check.json and .md")
    parser.add_argument("--dry_run", action="store_true", help="print the plan and run nothing (any machine)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from benchmarks.gpu_plan import check

    results = check(args.out, dry_run=args.dry_run)
    return 0 if all(result["ok"] for result in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
