"""POET on a model that is not a language model: a vision transformer from ``transformers``, and a plain ``nn.Module``.

What it shows:

- ``PoetConfig`` on ``ViTForImageClassification`` (its default targets: every Linear of the encoder blocks) trained
  from scratch by ``PoetTrainer`` on an image dataset, with merge-then-reinitialize every few steps; the trained
  model folds into a stock ``ViTForImageClassification`` (``merge_and_unload``) with the same predictions.
- ``PoetConfig(target_modules=[...])`` on any ``nn.Module`` (here a small MLP) in a plain PyTorch loop, with
  ``merge_and_reinit`` called by hand.

By default it runs on a CPU in under a minute on scikit-learn's digits (8 × 8, upsampled to 16 × 16; no download).
On real data, e.g. CIFAR-10 through ``datasets``:

    python examples/poet_vit.py --dataset uoft-cs/cifar10 --image_size 32 --patch_size 4 --num_train_epochs 20

Needs the ``[examples]`` extra for nothing: only transformers, PEFT and scikit-learn.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--dataset",
        default=None,
        help="an HF image dataset with `img` and `label` columns; default: scikit-learn's digits",
    )
    parser.add_argument("--image_size", type=int, default=16)
    parser.add_argument("--patch_size", type=int, default=4)
    parser.add_argument("--num_train_epochs", type=float, default=3)
    parser.add_argument("--output_dir", default="outputs/poet-vit")
    return parser.parse_args(argv)


def image_dataset(name: str | None, image_size: int):
    """Train / test splits with ``pixel_values`` (C × H × W in [0, 1]) and ``labels``."""
    import numpy as np
    import torch.nn.functional as F
    from datasets import Dataset, load_dataset

    if name is None:
        from sklearn.datasets import load_digits

        digits = load_digits()
        pixels = torch.tensor(digits.images, dtype=torch.float32)[:, None] / 16
        labels = digits.target
    else:
        data = load_dataset(name, split="train")
        pixels = torch.tensor(np.stack([np.asarray(img, dtype=np.float32) for img in data["img"]])) / 255
        pixels = pixels.permute(0, 3, 1, 2) if pixels.ndim == 4 else pixels[:, None]
        labels = np.asarray(data["label"])
    pixels = F.interpolate(pixels, size=image_size, mode="bilinear", align_corners=False)
    dataset = Dataset.from_dict({"pixel_values": pixels.numpy(), "labels": labels}).with_format("torch")
    return dataset.train_test_split(test_size=0.2, seed=0)


def vit(num_channels: int, image_size: int, patch_size: int, num_labels: int):
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    return ViTForImageClassification(
        ViTConfig(
            image_size=image_size,
            patch_size=patch_size,
            num_channels=num_channels,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=128,
            num_labels=num_labels,
        )
    )


def accuracy(model, data) -> float:
    with torch.no_grad():
        logits = model(pixel_values=data["pixel_values"]).logits
    return float((logits.argmax(-1) == data["labels"]).float().mean())


def train_vit(args: argparse.Namespace, splits) -> dict[str, Any]:
    from peft import get_peft_model

    from poet_hf import PoetConfig, PoetTrainer, PoetTrainingArguments

    num_labels = int(max(splits["train"]["labels"])) + 1
    base = vit(splits["train"][0]["pixel_values"].shape[0], args.image_size, args.patch_size, num_labels)
    # Pretraining from scratch: a fresh, well-conditioned W0 (the paper's normalized init); the classifier head and
    # the embeddings train fully beside the rotations.
    model = get_peft_model(
        base, PoetConfig(block_size=32, base_init="normalized", merge_every=20, modules_to_save=["classifier"])
    )
    test = splits["test"][:]
    before = accuracy(model.eval(), test)
    training = PoetTrainingArguments(
        output_dir=args.output_dir,
        num_train_epochs=args.num_train_epochs,
        per_device_train_batch_size=32,
        learning_rate=3e-3,
        poet_learning_rate=3e-3,
        lr_scheduler_type="constant",
        logging_steps=10,
        save_strategy="no",
        report_to="none",
        seed=0,
        use_cpu=not torch.cuda.is_available(),
        disable_tqdm=True,
        remove_unused_columns=False,
    )
    trainer = PoetTrainer(model=model, args=training, train_dataset=splits["train"])
    trainer.train()
    model.eval()
    after = accuracy(model, test)
    merges = trainer.merge_callback.history
    with torch.no_grad():
        adapter_logits = model(pixel_values=test["pixel_values"]).logits
        plain = model.merge_and_unload()  # a stock ViTForImageClassification
        merged_gap = float((plain(pixel_values=test["pixel_values"]).logits - adapter_logits).abs().max())
    return {
        "vit_accuracy_before": before,
        "vit_accuracy_after": after,
        "vit_merges": len(merges),
        "vit_merged_max_abs_gap": merged_gap,
        "vit_logit_scale": float(adapter_logits.abs().max()),
        "vit_merged_class": type(plain).__name__,
    }


def train_mlp(splits) -> dict[str, Any]:
    """POET on a plain ``nn.Module``: targets named explicitly, a hand-written loop, ``merge_and_reinit`` by hand."""
    from peft import get_peft_model
    from torch import nn

    from poet_hf import PoetConfig, merge_and_reinit
    from poet_hf.training import poet_parameters, reset_optimizer_state

    train, test = splits["train"][:], splits["test"][:]
    inputs = train["pixel_values"].flatten(1)
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(inputs.shape[1], 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 10))
    model = get_peft_model(
        mlp, PoetConfig(target_modules=["0", "2"], block_size=32, base_init="normalized", modules_to_save=["4"])
    )
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)

    def test_accuracy() -> float:
        with torch.no_grad():
            return float((model(test["pixel_values"].flatten(1)).argmax(-1) == test["labels"]).float().mean())

    before = test_accuracy()
    for step in range(1, 121):
        batch = torch.randint(0, len(inputs), (64,), generator=torch.Generator().manual_seed(step))
        nn.functional.cross_entropy(model(inputs[batch]), train["labels"][batch]).backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % 40 == 0:  # merge-then-reinitialize, and drop the rotations' optimizer state
            merge_and_reinit(model)
            reset_optimizer_state(optimizer, poet_parameters(model))
    return {"mlp_accuracy_before": before, "mlp_accuracy_after": test_accuracy()}


def run(args: argparse.Namespace) -> dict[str, Any]:
    import poet_hf  # noqa: F401  (registers the tuners with PEFT)

    splits = image_dataset(args.dataset, args.image_size)
    result = {**train_vit(args, splits), **train_mlp(splits)}
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    (Path(args.output_dir) / "result.json").write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    print(json.dumps(run(parse_args()), indent=2))
