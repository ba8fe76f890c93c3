"""Train a LipConvNet (ECO/SOC orthogonal convolutions) with transformers.Trainer, certify it, export it.

    python scripts/train_vision.py                                   # offline default: sklearn digits, LipConvNet-5
    python scripts/train_vision.py --dataset uoft-cs/cifar10 --recipe eco-paper    # the ECO paper's recipe
    python scripts/train_vision.py --dataset path/to/image_folder --depth 10 --num_train_epochs 20

Every TrainingArguments flag works (--num_train_epochs, --per_device_train_batch_size, --learning_rate, --optim,
--seed, --save_steps, --resume_from_checkpoint, --report_to, ...); a recipe sets their defaults. Prints clean accuracy
and certified accuracy at ℓ2 radii 36/255, 72/255, 108/255 and 1.0, and writes a baked model, its model card
(README.md), certified_accuracy.png and results.json to --output_dir.
Every option: python scripts/train_vision.py --help
"""

from __future__ import annotations

import json

from transformers import HfArgumentParser

from poet_hf.recipes.cli import training_parser
from poet_hf.recipes.vision_run import (
    VisionTrainArgs,
    export_lipconvnet,
    parse_vision_arguments,
    summary_line,
    train_lipconvnet,
)


def build_parser() -> HfArgumentParser:
    return training_parser(VisionTrainArgs)


def main(argv: list[str] | None = None) -> int:
    args, training = parse_vision_arguments(argv)
    model, metrics = train_lipconvnet(args, training)
    out = export_lipconvnet(model, metrics, args, training.output_dir, training)
    print(json.dumps({k: v for k, v in metrics.items() if k != "certified_curve"}, indent=2))
    print(f"{summary_line(metrics)} | train {metrics['train_seconds']:.0f}s | saved to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
