"""Certified-robust image classification with LipConvNet: train, certify, and push the model to the Hub.

What it shows: a LipConvNet (orthogonal ECO and SOC convolutions, 1-Lipschitz by construction) trained with
``transformers.Trainer`` (``poet_hf.recipes.vision_run``), certified at the ℓ2 radii the papers report (a prediction is
certified when its logit margin exceeds ``√2 · L · ε``), exported as a baked ``PreTrainedModel`` with a model card,
reloaded with stock ``AutoModelForImageClassification``, and pushed to the Hub with ``push_merged_to_hub``.

By default it runs on a CPU in under a minute: LipConvNet-5 on scikit-learn's digits (resized to 24 × 24; no
download), and it does not push. With the ECO paper's recipe on CIFAR-10:

    python examples/lipconvnet_certified.py --dataset uoft-cs/cifar10 --recipe eco-paper --depth 20 \\
        --push_to_hub --hub_model_id me/lipconvnet-20-cifar10

Pushing needs a token (``HF_TOKEN`` or ``hf auth login``); ``HF_ENDPOINT`` points it at another Hub instance.
"""

from __future__ import annotations

import argparse
import json
from typing import Any


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from poet_hf.recipes.export_command import add_hub_arguments, check_hub_arguments

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--dataset",
        default="digits",
        help="'digits' (offline), an HF dataset id with img/label columns, or an image folder",
    )
    parser.add_argument("--depth", type=int, default=5)
    parser.add_argument("--recipe", default=None, help="'eco-paper' for the papers' recipe (default: the quick one)")
    parser.add_argument("--num_train_epochs", type=float, default=None, help="default: the recipe's")
    parser.add_argument("--output_dir", default="outputs/lipconvnet-example")
    add_hub_arguments(parser)  # --push_to_hub, --hub_model_id, --hub_private_repo, --hub_token: the scripts' flags
    args = parser.parse_args(argv)
    check_hub_arguments(parser, args)
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Train, certify, export, reload and (optionally) push; returns the accuracies and the checks."""
    from transformers import AutoModelForImageClassification

    from poet_hf import push_merged_to_hub
    from poet_hf.recipes.vision_run import export_lipconvnet, parse_vision_arguments, summary_line, train_lipconvnet
    from poet_hf.vision import certified_accuracy
    from poet_hf.vision.data import load_image_dataset

    epochs = {} if args.num_train_epochs is None else {"num_train_epochs": args.num_train_epochs}
    options, training = parse_vision_arguments(
        dataset=args.dataset, depth=args.depth, recipe=args.recipe, output_dir=args.output_dir, **epochs
    )
    model, metrics = train_lipconvnet(options, training)
    print(summary_line(metrics))
    folder = export_lipconvnet(model, metrics, options, args.output_dir, training)

    # Stock transformers reloads it (the model classes register with the Auto classes) and certifies the same.
    reloaded = AutoModelForImageClassification.from_pretrained(folder).eval()
    test = load_image_dataset(args.dataset, seed=training.seed)["test"]
    again = certified_accuracy(reloaded, test, eps=options.eps)
    result = {
        "clean_accuracy": metrics["clean_accuracy"],
        "certified_accuracy": metrics["certified_accuracy"],
        "certified_accuracy_at": metrics["certified_accuracy_at"],
        "lipschitz_constant": metrics["lipschitz_constant"],
        "reloaded_clean_accuracy": again["clean_accuracy"],
        "reloaded_certified_accuracy": again["certified_accuracy"],
        "reloaded_lipschitz_constant": again["lipschitz_constant"],
        "folder": str(folder),
    }
    if args.push_to_hub:
        result["commit_url"] = push_merged_to_hub(
            folder, args.hub_model_id, private=args.hub_private_repo, token=args.hub_token
        )
    return result


if __name__ == "__main__":
    print(json.dumps(run(parse_args()), indent=2, default=str))
