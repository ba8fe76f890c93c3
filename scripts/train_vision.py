"""Train a LipConvNet (ECO/SOC orthogonal convolutions) with transformers.Trainer, certify it, export it.

    python scripts/train_vision.py                                   # offline default: sklearn digits, LipConvNet-5
    python scripts/train_vision.py --dataset uoft-cs/cifar10 --recipe eco-paper    # the ECO paper's recipe
    python scripts/train_vision.py --dataset path/to/image_folder --depth 10

Prints clean accuracy and certified accuracy at ℓ2 radii 36/255, 72/255, 108/255 and 1.0, and writes a baked model,
its model card (README.md), certified_accuracy.png and results.json to --output-dir.
"""

from __future__ import annotations

import json

from transformers import HfArgumentParser

from poet_hf.vision.train import VisionTrainArgs, export_lipconvnet, summary_line, train_lipconvnet


def build_parser() -> HfArgumentParser:
    return HfArgumentParser(VisionTrainArgs)


def parse_args(argv: list[str] | None = None) -> VisionTrainArgs:
    (args,) = build_parser().parse_args_into_dataclasses(args=argv)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model, metrics = train_lipconvnet(args)
    out = export_lipconvnet(model, metrics, args, args.output_dir)
    print(json.dumps({k: v for k, v in metrics.items() if k != "certified_curve"}, indent=2))
    print(f"{summary_line(metrics)} | train {metrics['train_seconds']:.0f}s | saved to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
