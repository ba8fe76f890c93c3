"""The auxiliary-reflection paper's SVD-network experiment (its §5.1 / Figure 3) as one command.

    python scripts/train_svd_network.py                                 # offline: 64-wide network on the digits
    python scripts/train_svd_network.py --dataset mnist-5k --num_train_epochs 10  # the paper's 784-wide network

Trains the same network with each orthogonal map (auxiliary reflections, sequential and compact-WY Householder
products, matrix exponential, Cayley) and writes results.json and svd_network.png (validation error against
epochs and against wall time) to --output_dir.
"""

from __future__ import annotations

from poet_hf.recipes.cli import ScriptArgumentParser
from poet_hf.vision.svd_experiment import SvdExperimentArgs, run_svd_experiment


def build_parser() -> ScriptArgumentParser:
    return ScriptArgumentParser(SvdExperimentArgs)


def main(argv: list[str] | None = None) -> int:
    (args,) = build_parser().parse_args_into_dataclasses(args=argv)
    results = run_svd_experiment(args)
    print(f"{'method':<16}{'final error':>12}{'s / epoch':>11}{'× auxiliary':>13}")
    for method, run in results["runs"].items():
        ratio = run.get("time_vs_auxiliary", float("nan"))
        print(f"{method:<16}{100 * run['final_val_error']:>11.2f}%{run['seconds_per_epoch']:>11.3f}{ratio:>13.2f}")
    print(f"saved to {args.output_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
