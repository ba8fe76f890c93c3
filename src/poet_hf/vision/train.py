"""Training a LipConvNet with ``transformers.Trainer``, then certifying and exporting it (model card included).

``scripts/train_vision.py`` is a thin command line over :func:`train_lipconvnet` and :func:`export_lipconvnet`.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from .certify import certified_accuracy
from .data import DEFAULT_DATASET, channel_stats, collate_images, load_image_dataset, pixel_value_transform
from .lipconvnet import LipConvNetConfig, LipConvNetForImageClassification

__all__ = ["VisionTrainArgs", "train_lipconvnet", "export_lipconvnet", "render_model_card"]

MODEL_CARD_TEMPLATE = Path(__file__).resolve().parents[1] / "model_cards" / "lipconvnet.md"


@dataclass
class VisionTrainArgs:
    """What :func:`train_lipconvnet` trains; the defaults train LipConvNet-5 on the offline digits in minutes."""

    dataset: str = field(default=DEFAULT_DATASET, metadata={"help": "image dataset: 'digits' (offline default, "
                         "scikit-learn's 8×8 digits), an HF dataset id with 'img'/'label' columns, or an image folder"})
    output_dir: str = field(default="outputs/lipconvnet", metadata={"help": "where the baked model, its card and "
                            "metrics.json are written"})
    depth: int = field(default=5, metadata={"help": "LipConvNet depth (a multiple of 5: 5 blocks of depth/5 layers)"})
    init_channels: int = field(default=8, metadata={"help": "channels of the first block (doubled by each strided "
                               "layer)"})
    image_size: int = field(default=24, metadata={"help": "square input size the images are resized to"})
    num_channels: int | None = field(default=None, metadata={"help": "input channels; default: 1 for grey-scale "
                                     "sources, else 3"})
    conv_types: list[str] = field(default_factory=lambda: ["soc", "soc", "eco", "eco", "eco"],
                                  metadata={"help": "orthogonal convolution per block: 'eco' or 'soc'"})
    kernel_sizes: list[int] = field(default_factory=lambda: [3, 3, 3, 3, 1],
                                    metadata={"help": "kernel size per block"})
    strides: list[int] = field(default_factory=lambda: [2, 2, 2, 3, 1],
                               metadata={"help": "stride of each block's last layer"})
    last_layer: str = field(default="orthogonal", metadata={"help": "classifier: 'orthogonal' (1-Lipschitz linear) "
                            "or 'linear'"})
    epochs: float = field(default=4.0, metadata={"help": "training epochs"})
    batch_size: int = field(default=64, metadata={"help": "images per optimizer step"})
    learning_rate: float = field(default=5e-3, metadata={"help": "peak learning rate"})
    weight_decay: float = field(default=0.0, metadata={"help": "weight decay"})
    optim: str = field(default="adamw_torch", metadata={"help": "transformers optimizer name (e.g. 'adamw_torch', "
                       "'sgd')"})
    eps: float = field(default=36 / 255, metadata={"help": "ℓ2 radius of the certified accuracy (default 36/255)"})
    seed: int = field(default=0, metadata={"help": "seed of initialisation, data order and augmentation"})
    max_train_examples: int | None = field(default=None, metadata={"help": "use at most this many training images"})
    max_eval_examples: int | None = field(default=None, metadata={"help": "evaluate on at most this many images"})
    logging_steps: int = field(default=50, metadata={"help": "log the loss every this many steps"})
    # 1 is fastest for this small model on a shared 2-core machine (2 threads were ~4x slower per step under load).
    torch_threads: int = field(default=1, metadata={"help": "intra-op threads; 0 keeps torch's default"})


def _infer_channels(dataset) -> int:
    mode = dataset[0]["img"].mode if hasattr(dataset[0]["img"], "mode") else "RGB"
    return 1 if mode in ("L", "1", "I", "F") else 3


def build_model(args: VisionTrainArgs, train_split, label_names: list[str]) -> LipConvNetForImageClassification:
    """A fresh LipConvNet whose config carries the data's normalisation, size and labels."""
    num_channels = args.num_channels or _infer_channels(train_split)
    mean, std = channel_stats(train_split, num_channels, args.image_size)
    config = LipConvNetConfig(
        depth=args.depth,
        num_channels=num_channels,
        image_size=args.image_size,
        init_channels=args.init_channels,
        conv_types=args.conv_types,
        kernel_sizes=[int(k) for k in args.kernel_sizes],
        strides=[int(s) for s in args.strides],
        last_layer=args.last_layer,
        image_mean=mean,
        image_std=std,
        id2label=dict(enumerate(label_names)),
        label2id={name: i for i, name in enumerate(label_names)},
    )
    return LipConvNetForImageClassification(config)


def train_lipconvnet(args: VisionTrainArgs) -> tuple[LipConvNetForImageClassification, dict[str, Any]]:
    """Train with ``Trainer`` on ``args.dataset``; return the model (eval mode) and its clean/certified metrics."""
    from transformers import Trainer, TrainingArguments, set_seed

    if args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)
    set_seed(args.seed)
    data = load_image_dataset(args.dataset, seed=args.seed)
    train_split, test_split = data["train"], data["test"]
    if args.max_train_examples:
        train_split = train_split.select(range(min(args.max_train_examples, len(train_split))))
    if args.max_eval_examples:
        test_split = test_split.select(range(min(args.max_eval_examples, len(test_split))))
    feature = train_split.features["label"]
    label_names = list(feature.names) if hasattr(feature, "names") else [str(i) for i in sorted(set(train_split["label"]))]
    model = build_model(args, train_split, label_names)
    transform = pixel_value_transform(model.config.num_channels, model.config.image_size)
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        per_device_train_batch_size=args.batch_size,
        num_train_epochs=args.epochs,
        learning_rate=args.learning_rate,
        weight_decay=args.weight_decay,
        optim=args.optim,
        lr_scheduler_type="cosine",
        warmup_steps=0,
        logging_steps=args.logging_steps,
        save_strategy="no",
        eval_strategy="no",
        report_to=[],
        remove_unused_columns=False,
        dataloader_num_workers=0,
        use_cpu=not torch.cuda.is_available(),
        seed=args.seed,
        disable_tqdm=True,
    )
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train_split.with_transform(transform),
        data_collator=collate_images,
    )
    start = time.perf_counter()
    train_output = trainer.train()
    train_seconds = time.perf_counter() - start
    model.eval()
    metrics = certified_accuracy(model, test_split, eps=args.eps)
    metrics.update(
        train_seconds=train_seconds,
        train_loss=float(train_output.training_loss),
        train_examples=len(train_split),
        dataset=args.dataset,
    )
    return model, metrics


def render_model_card(model: LipConvNetForImageClassification, metrics: dict[str, Any], args: VisionTrainArgs) -> str:
    """The model card text from ``poet_hf/model_cards/lipconvnet.md`` (a ``huggingface_hub.ModelCard`` template)."""
    from huggingface_hub import ModelCard, ModelCardData

    config = model.config
    card_data = ModelCardData(
        library_name="transformers",
        pipeline_tag="image-classification",
        license="apache-2.0",
        tags=["poet_hf", "lipschitz", "orthogonal-convolution", "eco", "certified-robustness"],
        datasets=[args.dataset] if args.dataset != DEFAULT_DATASET else None,
        metrics=["accuracy"],
    )
    if not MODEL_CARD_TEMPLATE.exists():
        raise FileNotFoundError(f"model card template not found at {MODEL_CARD_TEMPLATE} (it ships with the repository)")
    card = ModelCard.from_template(
        card_data,
        template_path=str(MODEL_CARD_TEMPLATE),
        depth=config.depth,
        dataset=args.dataset,
        image_size=config.image_size,
        num_channels=config.num_channels,
        conv_types=", ".join(config.conv_types),
        last_layer=config.last_layer,
        image_mean=", ".join(f"{v:.4f}" for v in config.image_mean),
        image_std=", ".join(f"{v:.4f}" for v in config.image_std),
        lipschitz_constant=f"{metrics['lipschitz_constant']:.6f}",
        eps=f"{metrics['eps']:.4f}",
        clean_accuracy=f"{100 * metrics['clean_accuracy']:.2f}",
        certified_accuracy=f"{100 * metrics['certified_accuracy']:.2f}",
        num_examples=metrics["num_examples"],
        epochs=args.epochs,
        baked=config.baked,
    )
    return str(card)


def export_lipconvnet(
    model: LipConvNetForImageClassification, metrics: dict[str, Any], args: VisionTrainArgs, output_dir: str | Path
) -> Path:
    """Bake the ECO layers, ``save_pretrained`` (safetensors), write ``README.md`` (model card) and metrics.

    Baking replaces the eval kernel by the stored one computed identically, so the exported logits are those
    that were certified.
    """
    output_dir = Path(output_dir)
    model.eval().bake()
    model.save_pretrained(output_dir)
    (output_dir / "README.md").write_text(render_model_card(model, metrics, args))
    (output_dir / "metrics.json").write_text(json.dumps({**metrics, "args": asdict(args)}, indent=2, default=str))
    return output_dir
