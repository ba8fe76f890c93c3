"""Build the fine-tuning testbed (benchmarks/testbed.py) into .cache/testbed, ahead of the tests and benchmarks.

    python scripts/build_testbed.py                  # the pretrained causal LM, its fine-tuning data, the encoder
    python scripts/build_testbed.py --what causal-lm --torch_threads 1

Everything is seeded and keyed by its recipe, so a second call finds the cache and returns at once. The causal LM
(a 5.5M-parameter LLaMA pretrained on the bundled plays) takes about 3 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("causal-lm", "encoder", "all", "trained")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--what",
        choices=PARTS,
        default="all",
        help="what to build (default: all the tests use); 'trained': the LMs trained until their validation loss is "
        "flat, on which the fine-tuning defaults are chosen and reported (benchmark assets: about 25 minutes of one "
        "core each)",
    )
    parser.add_argument("--torch_threads", type=int, help="torch threads for the pretraining (default: torch's choice)")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from benchmarks import testbed

    started = time.time()
    if args.what in ("causal-lm", "all"):
        print(f"causal LM: {testbed.ensure_causal_lm(args.torch_threads)}; fine-tuning data: {testbed.milton_corpus()}")
    if args.what in ("encoder", "all"):
        data = testbed.classification_files()["train"].parent
        print(f"encoder: {testbed.ensure_encoder()}; classification data: {data}")
    if args.what == "trained":
        for name in testbed.TRAINED_CAUSAL_LMS:
            print(f"{name}: {testbed.ensure_causal_lm(args.torch_threads, name)}")
    print(f"testbed ready in {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
