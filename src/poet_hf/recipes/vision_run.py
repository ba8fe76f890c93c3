"""Training a LipConvNet with ``transformers.Trainer``, then certifying and exporting it (model card included).

``scripts/train_vision.py`` is a thin command line over `train_lipconvnet` and `export_lipconvnet`.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol, cast

import torch
from transformers import Trainer, TrainingArguments

from ..model_cards import render_card
from ..vision.certify import CertifiedMetrics, accuracy_at_radii, certified_accuracy, pgd_accuracy
from ..vision.data import DEFAULT_DATASET, channel_stats, collate_images, load_image_dataset, pixel_value_transform
from ..vision.lipconvnet import LipConvNetConfig, LipConvNetForImageClassification
from .cli import TrainingFlags, parse_arguments, run_defaults

__all__ = [
    "VisionTrainArgs",
    "VisionRecipe",
    "parse_vision_arguments",
    "vision_defaults",
    "train_lipconvnet",
    "export_lipconvnet",
    "render_model_card",
    "QUICK_RECIPE",
    "ECO_PAPER_RECIPE",
    "REPORTED_RADII",
]


# The ℓ2 radii the ECO and SOC papers report certified accuracy at (pixel scale [0, 1]).
REPORTED_RADII = {"36/255": 36 / 255, "72/255": 72 / 255, "108/255": 108 / 255, "1.0": 1.0}


@dataclass(frozen=True)
class VisionRecipe:
    """A training recipe: the model and data options it fills, and defaults of ``TrainingArguments`` flags.

    The defaults apply to the flags the user does not give.

    Args:
        init_channels: channels of the first block.
        augment: random crop and flip of the training images.
        lr_milestones: epochs at which the learning rate is multiplied by ``lr_decay`` (``None``: the
            ``lr_scheduler_type`` schedule).
        training: ``TrainingArguments`` field values; ``learning_rate`` absent means the papers' depth rule.
    """

    init_channels: int
    augment: bool
    lr_milestones: list[float] | None
    training: dict[str, Any]


# The quick default, and the ECO/SOC papers' recipe (ECO digest §3.2: SGD with momentum 0.9, wd 5e-4, batch 128, lr 0.1
# above 25 conv layers else 0.05, ×0.1 at epochs 50 and 150 of 200, RandomCrop(padding 4) + RandomHorizontalFlip,
# 32 channels in the first block). Trainer leaves biases and norms out of weight decay, where the papers' code did not.
QUICK_RECIPE = VisionRecipe(
    init_channels=8,
    augment=False,
    lr_milestones=None,
    training={
        "num_train_epochs": 4.0,
        "per_device_train_batch_size": 64,
        "learning_rate": 5e-3,
        "weight_decay": 0.0,
        "optim": "adamw_torch",
        "lr_scheduler_type": "cosine",
    },
)
ECO_PAPER_RECIPE = VisionRecipe(
    init_channels=32,
    augment=True,
    lr_milestones=[50.0, 150.0],
    training={
        "num_train_epochs": 200.0,
        "per_device_train_batch_size": 128,
        "weight_decay": 5e-4,
        "optim": "sgd",
        "optim_args": "momentum=0.9",
    },
)
RECIPES = {"eco-paper": ECO_PAPER_RECIPE}


@dataclass
class VisionTrainArgs:
    """The model, data and certification options of `train_lipconvnet`.

    Its optimizer, schedule, length, seed and output folder are ``TrainingArguments`` flags; the defaults train
    LipConvNet-5 on the offline digits in minutes."""

    dataset: str = field(
        default=DEFAULT_DATASET,
        metadata={
            "help": "image dataset: 'digits' (offline default, "
            "scikit-learn's 8×8 digits), an HF dataset id with 'img'/'label' columns, or an image folder"
        },
    )
    depth: int = field(default=5, metadata={"help": "LipConvNet depth (a multiple of 5: 5 blocks of depth/5 layers)"})
    init_channels: int | None = field(
        default=None,
        metadata={
            "help": "channels of the first block (doubled by each strided layer); default 8, the eco-paper recipe's 32"
        },
    )
    image_size: int = field(default=24, metadata={"help": "square input size the images are resized to"})
    num_channels: int | None = field(
        default=None, metadata={"help": "input channels; default: 1 for grey-scale sources, else 3"}
    )
    conv_types: list[str] = field(
        default_factory=lambda: ["soc", "soc", "eco", "eco", "eco"],
        metadata={"help": "orthogonal convolution per block: 'eco' or 'soc'"},
    )
    kernel_sizes: list[int] = field(default_factory=lambda: [3, 3, 3, 3, 1], metadata={"help": "kernel size per block"})
    strides: list[int] = field(
        default_factory=lambda: [2, 2, 2, 3, 1], metadata={"help": "stride of each block's last layer"}
    )
    last_layer: str = field(
        default="orthogonal", metadata={"help": "classifier: 'orthogonal' (1-Lipschitz linear) or 'linear'"}
    )
    recipe: str | None = field(
        default=None,
        metadata={
            "help": "'eco-paper': the ECO/SOC papers' recipe (--optim sgd --optim_args momentum=0.9, "
            "--weight_decay 5e-4, --per_device_train_batch_size 128, --learning_rate 0.1 above 25 conv layers else "
            "0.05, decayed ×0.1 at epochs 50 and 150 of --num_train_epochs 200, random crop (padding 4) and flip, "
            "32 initial channels); explicit flags override it"
        },
    )
    lr_milestones: list[float] | None = field(
        default=None,
        metadata={
            "help": "epochs at which the learning rate is multiplied by lr_decay, replacing --lr_scheduler_type "
            "(recipe: 50 150 of 200, scaled to --num_train_epochs when that is set); default: a cosine schedule"
        },
    )
    lr_decay: float = field(default=0.1, metadata={"help": "factor applied at each of lr_milestones"})
    augment: bool | None = field(
        default=None,
        metadata={"help": "random crop (padding 4) and horizontal flip of the training images (recipe: on)"},
    )
    gamma: float = field(
        default=0.0,
        metadata={
            "help": "certificate regularisation: train on cross-entropy − gamma × "
            "mean certified radius (the later SOC code's --gamma; the ECO paper used 0)"
        },
    )
    eps: float = field(
        default=36 / 255,
        metadata={
            "help": "ℓ2 radius of the headline certified accuracy (36/255); 36, 72, 108/255 and 1.0 are always reported"
        },
    )
    pgd_steps: int = field(
        default=0,
        metadata={
            "help": "if > 0, also run an ℓ2 PGD attack of this many steps at "
            "each reported radius (an upper bound on robust accuracy)"
        },
    )
    max_train_samples: int | None = field(default=None, metadata={"help": "use at most this many training images"})
    max_eval_samples: int | None = field(default=None, metadata={"help": "evaluate on at most this many images"})
    # 1 is fastest for this small model on a shared 2-core machine (2 threads were ~4x slower per step under load).
    torch_threads: int = field(default=1, metadata={"help": "intra-op threads; 0 keeps torch's default"})

    def __post_init__(self) -> None:
        if self.recipe is not None and self.recipe not in RECIPES:
            raise ValueError(f"`recipe` must be one of {(None, *RECIPES)}, got {self.recipe!r}")
        if self.gamma < 0:
            raise ValueError(f"`gamma` must be >= 0, got {self.gamma!r}")
        recipe = self.training_recipe
        if self.init_channels is None:
            self.init_channels = recipe.init_channels
        if self.augment is None:
            self.augment = recipe.augment

    @property
    def training_recipe(self) -> VisionRecipe:
        """The recipe ``recipe`` names (`QUICK_RECIPE` when none)."""
        return QUICK_RECIPE if self.recipe is None else RECIPES[self.recipe]


def vision_defaults(args: VisionTrainArgs, given: TrainingFlags) -> dict[str, object]:
    """The ``TrainingArguments`` values of ``args``' recipe, for the flags the user did not give.

    Args:
        args: the script's options.
        given: the training flags the user set.

    Returns:
        ``TrainingArguments`` field values.
    """
    values = dict(args.training_recipe.training)
    values.setdefault("learning_rate", 0.1 if args.depth > 25 else 0.05)  # the papers' depth rule
    values.update(output_dir="outputs/lipconvnet", logging_steps=50, remove_unused_columns=False)
    return run_defaults(given, **values)


def parse_vision_arguments(
    argv: list[str] | None = None, **fields: object
) -> tuple[VisionTrainArgs, TrainingArguments]:
    """``scripts/train_vision.py``'s options from a command line or from keyword ``fields``.

    ``argv`` ``None`` reads ``sys.argv``; ``fields`` may belong to either dataclass
    (`poet_hf.recipes.cli.parse_arguments`).

    Args:
        argv: the command line.
        **fields: field values instead of a command line.

    Returns:
        ``(VisionTrainArgs, TrainingArguments)``.
    """
    return parse_arguments(VisionTrainArgs, vision_defaults, argv, fields or None)


def lr_milestones(args: VisionTrainArgs, training: TrainingArguments) -> list[float] | None:
    """The epochs of the step decay.

    ``args.lr_milestones``, else the recipe's scaled to the run's epochs (a shortened recipe decays at the same
    fractions of training), else ``None`` (``training.lr_scheduler_type``)."""
    if args.lr_milestones is not None:
        return args.lr_milestones
    recipe = args.training_recipe
    if recipe.lr_milestones is None:
        return None
    scale = training.num_train_epochs / recipe.training["num_train_epochs"]
    return [milestone * scale for milestone in recipe.lr_milestones]


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
        init_channels=cast(int, args.init_channels),  # filled from the recipe by __post_init__
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


class _Logits(Protocol):
    logits: torch.Tensor


def certificate_regularized_loss(gamma: float, lipschitz: float):
    """The later SOC code's certificate-regularised loss, for ``Trainer(compute_loss_func=...)``.

    Cross-entropy minus ``gamma`` times the mean certified radius ``max(0, f_y − max_{j≠y} f_j) / (√2·L)``, with ``L``
    the network's nominal Lipschitz constant (its input normalisation; the orthogonal layers count as 1)."""

    def loss(outputs: _Logits, labels: torch.Tensor, num_items_in_batch: int | None = None) -> torch.Tensor:
        logits = outputs.logits
        true = logits.gather(1, labels[:, None])[:, 0]
        other = logits.masked_fill(torch.nn.functional.one_hot(labels, logits.shape[1]).bool(), -math.inf)
        radius = torch.relu(true - other.max(dim=1).values) / (math.sqrt(2.0) * lipschitz)
        return torch.nn.functional.cross_entropy(logits, labels) - gamma * radius.mean()

    return loss


def _step_decay(trainer: Trainer, milestones: list[float], decay: float, steps_per_epoch: int) -> None:
    """Give ``trainer`` its ``--optim`` optimizer and a step decay by ``decay`` at the ``milestones`` epochs.

    No ``lr_scheduler_type`` has one."""
    optimizer = trainer.create_optimizer()
    steps = [round(epoch * steps_per_epoch) for epoch in milestones]
    schedule: Any = torch.optim.lr_scheduler.MultiStepLR(optimizer, steps, gamma=decay)
    trainer.lr_scheduler = schedule


def train_lipconvnet(
    args: VisionTrainArgs, training: TrainingArguments
) -> tuple[LipConvNetForImageClassification, CertifiedMetrics]:
    """Train with ``Trainer`` on ``args.dataset``; return the model (eval mode) and its metrics.

    The clean accuracy and the certified accuracy at ``args.eps`` and at `REPORTED_RADII` (with PGD accuracy there when
    ``pgd_steps``).

    Args:
        args: the model, data and certification options.
        training: the optimizer, schedule, length, seed and output folder (`parse_vision_arguments` fills them
            from the recipe).
    """
    from transformers import set_seed

    from ..checkpoints import CrashSafeTrainer

    if args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)
    set_seed(training.seed)
    data = load_image_dataset(args.dataset, seed=training.seed)
    train_split, test_split = data["train"], data["test"]
    if args.max_train_samples:
        train_split = train_split.select(range(min(args.max_train_samples, len(train_split))))
    if args.max_eval_samples:
        test_split = test_split.select(range(min(args.max_eval_samples, len(test_split))))
    feature = train_split.features["label"]
    label_names = (
        list(feature.names) if hasattr(feature, "names") else [str(i) for i in sorted(set(train_split["label"]))]
    )
    model = build_model(args, train_split, label_names)
    transform = pixel_value_transform(model.config.num_channels, model.config.image_size, augment=bool(args.augment))
    nominal_lipschitz = 1.0 / min(model.config.image_std)
    trainer = CrashSafeTrainer(
        model=model,
        args=training,
        train_dataset=train_split.with_transform(transform),
        data_collator=collate_images,
        compute_loss_func=certificate_regularized_loss(args.gamma, nominal_lipschitz) if args.gamma else None,
    )
    milestones = lr_milestones(args, training)
    if milestones:
        steps_per_epoch = math.ceil(len(train_split) / training.train_batch_size / training.gradient_accumulation_steps)
        _step_decay(trainer, milestones, args.lr_decay, steps_per_epoch)
    start = time.perf_counter()
    train_output = trainer.train(resume_from_checkpoint=training.resume_from_checkpoint)
    train_seconds = time.perf_counter() - start
    model.eval()
    metrics = certified_accuracy(model, test_split, eps=args.eps, return_radii=True)
    radii, correct = metrics.pop("radii"), metrics.pop("correct")
    metrics["certified_accuracy_at"] = accuracy_at_radii(radii, correct, REPORTED_RADII)
    metrics["certified_curve"] = _certified_curve(radii, correct)
    if args.pgd_steps > 0:
        metrics["pgd_accuracy_at"] = pgd_accuracy(model, test_split, REPORTED_RADII, steps=args.pgd_steps)
    metrics["train_seconds"] = train_seconds
    metrics["train_loss"] = float(train_output.training_loss)
    metrics["train_examples"] = len(train_split)
    metrics["dataset"] = args.dataset
    metrics["recipe"] = args.recipe
    metrics["epochs"] = training.num_train_epochs
    return model, metrics


def _certified_curve(radii: torch.Tensor, correct: torch.Tensor, points: int = 50) -> list[list[float]]:
    """``[[eps, certified accuracy], ...]`` from 0 to 1.5 (the plot of the model card)."""
    grid = torch.linspace(0.0, 1.5, points, dtype=torch.float64)
    return [[float(eps), float((correct & (radii >= eps)).double().mean())] for eps in grid]


def plot_certified_curve(metrics: CertifiedMetrics, path: str | Path, title: str) -> Path:
    """A PNG of certified accuracy against the ℓ2 radius, with the papers' radii marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    eps, accuracy = zip(*metrics["certified_curve"], strict=True)
    fig, ax = plt.subplots(figsize=(5, 3.4))
    ax.plot(eps, [100 * a for a in accuracy], lw=2, label="certified")
    if "pgd_accuracy_at" in metrics:
        ax.plot(
            list(REPORTED_RADII.values()),
            [100 * metrics["pgd_accuracy_at"][k] for k in REPORTED_RADII],
            "o--",
            label="under ℓ2 PGD (upper bound)",
        )
    for name, value in REPORTED_RADII.items():
        ax.axvline(value, color="grey", lw=0.6, ls=":")
        ax.text(value, 2, name, fontsize=7, rotation=90, va="bottom")
    ax.set_xlabel("ℓ2 radius ε")
    ax.set_ylabel("accuracy (%)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def render_model_card(model: LipConvNetForImageClassification, metrics: CertifiedMetrics, args: VisionTrainArgs) -> str:
    """The model card text from ``poet_hf/model_cards/lipconvnet.md`` (a ``huggingface_hub.ModelCard`` template)."""
    config = model.config
    card_data = {
        "pipeline_tag": "image-classification",
        "license": "apache-2.0",
        "tags": ["poet_hf", "lipschitz", "orthogonal-convolution", "eco", "certified-robustness"],
        "datasets": [args.dataset] if args.dataset != DEFAULT_DATASET else None,
        "metrics": ["accuracy"],
    }
    card = render_card(
        "lipconvnet.md",
        card_data,
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
        radii_table=_radii_table(metrics),
        pgd_note=", and accuracy under an ℓ2 PGD attack (an upper bound)" if "pgd_accuracy_at" in metrics else "",
        recipe=f"recipe {args.recipe}" if args.recipe else "quick default recipe",
        num_examples=metrics["num_examples"],
        epochs=metrics["epochs"],
        baked=config.baked,
    )
    return str(card)


def _radii_table(metrics: CertifiedMetrics) -> str:
    pgd = metrics.get("pgd_accuracy_at")
    header = "| ε | certified |" + (" PGD |" if pgd else "") + "\n|---|---|" + ("---|" if pgd else "")
    rows = [
        f"| {name} | {100 * value:.2f} % |" + (f" {100 * pgd[name]:.2f} % |" if pgd else "")
        for name, value in metrics["certified_accuracy_at"].items()
    ]
    return "\n".join([header, *rows])


def summary_line(metrics: CertifiedMetrics) -> str:
    """The console summary: clean accuracy, then certified accuracy at every reported radius."""
    radii = " | ".join(f"ε={name}: {100 * value:.2f}%" for name, value in metrics["certified_accuracy_at"].items())
    return f"clean {100 * metrics['clean_accuracy']:.2f}% | certified {radii} | L = {metrics['lipschitz_constant']:.4f}"


def export_lipconvnet(
    model: LipConvNetForImageClassification,
    metrics: CertifiedMetrics,
    args: VisionTrainArgs,
    output_dir: str | Path,
    training: TrainingArguments | None = None,
) -> Path:
    """Bake the ECO layers, ``save_pretrained`` (safetensors), write ``README.md`` (model card) and metrics.

    Baking replaces the eval kernel by the stored one computed identically, so the exported logits are those
    that were certified.

    Args:
        model: the trained model.
        metrics: `train_lipconvnet`'s metrics.
        args: the options it was trained with.
        output_dir: the folder to write.
        training: the training arguments it was trained with, recorded in ``results.json`` when given.
    """
    output_dir = Path(output_dir)
    model.eval().bake()
    model.save_pretrained(output_dir)
    (output_dir / "README.md").write_text(render_model_card(model, metrics, args))
    plot_certified_curve(
        metrics, output_dir / "certified_accuracy.png", f"LipConvNet-{model.config.depth} on {args.dataset}"
    )
    record = {**metrics, "args": asdict(args)}
    if training is not None:
        record["training_arguments"] = training.to_dict()
    (output_dir / "results.json").write_text(json.dumps(record, indent=2, default=str))
    return output_dir
