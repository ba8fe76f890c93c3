"""Image data loading (HF ``img``/``label`` layout, saved datasets, image folders) and ``scripts/train_vision.py``
end to end on tiny settings: Trainer, certification, baked export with a model card, reload."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from script_modules import command_line_error, load_module
from transformers import AutoModelForImageClassification

import poet_hf.vision.lipconvnet  # noqa: F401  (registers the Auto classes)
from poet_hf.vision.data import image_to_tensor, load_image_dataset

ROOT = Path(__file__).resolve().parent.parent
TINY_ARGS = [
    "--image-size",
    "12",
    "--strides",
    "2",
    "2",
    "3",
    "1",
    "1",
    "--kernel-sizes",
    "3",
    "3",
    "3",
    "1",
    "1",
    "--init-channels",
    "4",
    "--num_train_epochs",
    "1",
    "--per_device_train_batch_size",
    "32",
    "--max_train_samples",
    "192",
    "--max_eval_samples",
    "64",
    "--learning-rate",
    "0.01",
    "--logging-steps",
    "100",
    "--torch-threads",
    "0",  # keep the test session's thread setting
]


def cifar_like(tmp_path: Path, n: int = 24):
    """A CIFAR-10-shaped local dataset (32x32 RGB PIL images, columns img/label), as users get from the Hub."""
    import datasets
    from PIL import Image

    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)) for _ in range(n)]
    features = datasets.Features({"img": datasets.Image(), "label": datasets.ClassLabel(names=["cat", "dog", "ship"])})
    return datasets.Dataset.from_dict({"img": images, "label": [i % 3 for i in range(n)]}, features=features)


def test_digits_default_is_offline_and_in_the_hf_layout():
    data = load_image_dataset("digits")
    assert set(data) == {"train", "test"} and len(data["train"]) + len(data["test"]) == 1797
    assert data["train"].column_names == ["img", "label"]
    x = image_to_tensor(data["train"][0]["img"], 1, 24)
    assert x.shape == (1, 24, 24) and 0 <= float(x.min()) and float(x.max()) <= 1


def test_saved_dataset_and_image_folder_load_in_the_same_layout(tmp_path):
    dataset = cifar_like(tmp_path)
    dataset.save_to_disk(tmp_path / "saved")
    saved = load_image_dataset(str(tmp_path / "saved"))
    assert saved["train"].column_names == ["img", "label"] and len(saved["train"]) + len(saved["test"]) == 24
    for i, row in enumerate(dataset.select(range(6))):
        folder = tmp_path / "folder" / ["cat", "dog", "ship"][row["label"]]
        folder.mkdir(parents=True, exist_ok=True)
        row["img"].save(folder / f"{i}.png")
    folder_data = load_image_dataset(str(tmp_path / "folder"), test_fraction=0.5)
    assert folder_data["test"].column_names == ["img", "label"]
    # Resizing 32 -> 24 keeps the pixel range; the RGB image feeds a 3-channel model.
    assert image_to_tensor(saved["test"][0]["img"], 3, 24).shape == (3, 24, 24)


def test_image_to_tensor_rejects_a_wrong_channel_count():
    with pytest.raises(ValueError, match="`num_channels` must be 1 or 3"):
        image_to_tensor(np.zeros((8, 8), dtype=np.uint8), 2, 8)


def test_train_vision_script_trains_certifies_and_exports(tmp_path, record_property):
    script = load_module(ROOT / "scripts" / "train_vision.py")
    out = tmp_path / "model"
    assert script.main([*TINY_ARGS, "--output-dir", str(out), "--pgd-steps", "5"]) == 0
    metrics = json.loads((out / "results.json").read_text())
    record_property("tiny_clean_accuracy", metrics["clean_accuracy"])
    record_property("tiny_certified_accuracy", metrics["certified_accuracy"])
    assert metrics["num_examples"] == 64 and metrics["train_examples"] == 192
    assert metrics["clean_accuracy"] > 0.2  # 6 steps from scratch; chance is 0.1
    card = (out / "README.md").read_text()
    assert "pipeline_tag: image-classification" in card
    assert f"{metrics['lipschitz_constant']:.6f}" in card and f"{100 * metrics['certified_accuracy']:.2f} %" in card
    # The papers' radii, in results.json and the card; certified accuracy falls with ε, and PGD never beats it.
    at = metrics["certified_accuracy_at"]
    assert list(at) == ["36/255", "72/255", "108/255", "1.0"] and at["36/255"] == metrics["certified_accuracy"]
    assert at["36/255"] >= at["72/255"] >= at["108/255"] >= at["1.0"]
    assert all(metrics["pgd_accuracy_at"][k] >= at[k] for k in at)
    for name, value in at.items():
        assert f"| {name} | {100 * value:.2f} % |" in card
    assert (out / "certified_accuracy.png").read_bytes()[:4] == b"\x89PNG"
    model = AutoModelForImageClassification.from_pretrained(out).eval()
    assert model.config.baked and model.config.image_size == 12
    # The exported, baked model reproduces the certified numbers.
    from poet_hf.vision import certified_accuracy
    from poet_hf.vision.data import load_image_dataset as load

    test_split = load("digits")["test"].select(range(64))
    again = certified_accuracy(model, test_split, eps=metrics["eps"])
    assert again["clean_accuracy"] == metrics["clean_accuracy"]
    assert again["certified_accuracy"] == metrics["certified_accuracy"]
    assert again["lipschitz_constant"] == pytest.approx(metrics["lipschitz_constant"], rel=1e-9)
    assert torch.isfinite(torch.tensor(again["lipschitz_constant"]))


def test_eco_paper_recipe_is_one_flag_and_flags_override_it(capsys):
    from poet_hf.recipes.vision_run import parse_vision_arguments

    args, training = parse_vision_arguments(["--recipe", "eco-paper"])
    assert (training.optim, training.optim_args, training.weight_decay) == ("sgd", "momentum=0.9", 5e-4)
    assert (training.per_device_train_batch_size, training.num_train_epochs, training.seed) == (128, 200, 0)
    assert (args.lr_decay, args.augment, args.image_size, args.init_channels) == (0.1, True, 24, 32)
    assert training.learning_rate == 0.05
    assert parse_vision_arguments(["--recipe", "eco-paper", "--depth", "30"])[1].learning_rate == 0.1
    quick_args, quick = parse_vision_arguments([])
    assert (quick.optim, quick.lr_scheduler_type, quick.learning_rate, quick.num_train_epochs) == (
        "adamw_torch",
        "cosine",
        5e-3,
        4,
    )
    assert (quick_args.init_channels, quick_args.augment, quick.output_dir) == (8, False, "outputs/lipconvnet")
    # Typed flags win over the recipe; the same holds for keyword fields.
    _, typed = parse_vision_arguments(["--recipe", "eco-paper", "--learning_rate", "0.02", "--num_train_epochs", "3"])
    assert (typed.learning_rate, typed.num_train_epochs, typed.optim) == (0.02, 3, "sgd")
    _, fields = parse_vision_arguments(recipe="eco-paper", learning_rate=0.02, optim="adamw_torch")
    assert (fields.learning_rate, fields.optim, fields.weight_decay) == (0.02, "adamw_torch", 5e-4)
    assert "error: --recipe must be one of" in command_line_error(
        capsys, lambda: parse_vision_arguments(["--recipe", "soc-v2"])
    )


def test_a_shortened_recipe_decays_at_the_same_fractions_unless_milestones_are_given():
    from poet_hf.recipes.vision_run import lr_milestones, parse_vision_arguments

    assert lr_milestones(*parse_vision_arguments(["--recipe", "eco-paper"])) == [50, 150]
    assert lr_milestones(*parse_vision_arguments(["--recipe", "eco-paper", "--num_train_epochs", "20"])) == [5, 15]
    given = parse_vision_arguments(["--recipe", "eco-paper", "--num_train_epochs", "20", "--lr_milestones", "7"])
    assert lr_milestones(*given) == [7]
    assert lr_milestones(*parse_vision_arguments([])) is None  # the quick recipe: --lr_scheduler_type cosine


@pytest.mark.parametrize("flag", ["--epochs", "--batch_size", "--momentum", "--max_train_examples"])
def test_former_vision_spellings_are_refused(flag):
    """One spelling per option: TrainingArguments' (--num_train_epochs, --per_device_train_batch_size, --optim_args
    momentum=M) and finetune.py's (--max_train_samples)."""
    from poet_hf.recipes.vision_run import parse_vision_arguments

    with pytest.raises(SystemExit):
        parse_vision_arguments([flag, "3"])


def test_recipe_trains_with_sgd_momentum_and_decays_the_rate_at_its_milestones(tmp_path):
    from poet_hf.recipes.vision_run import parse_vision_arguments, train_lipconvnet

    args, training = parse_vision_arguments(
        recipe="eco-paper",
        image_size=12,
        strides=[2, 2, 3, 1, 1],
        kernel_sizes=[3, 3, 3, 1, 1],
        init_channels=4,
        num_train_epochs=3,
        per_device_train_batch_size=64,
        max_train_samples=128,
        max_eval_samples=32,
        lr_milestones=[1, 2],
        logging_steps=1,
        output_dir=str(tmp_path),
        torch_threads=0,
        disable_tqdm=True,
    )
    rates: list[float] = []
    optimizers: list[torch.optim.Optimizer] = []
    original = torch.optim.SGD.step

    def record_rate(self, *a, **k):
        rates.append(self.param_groups[0]["lr"])
        optimizers.append(self)
        return original(self, *a, **k)

    torch.optim.SGD.step = record_rate
    try:
        model, metrics = train_lipconvnet(args, training)
    finally:
        torch.optim.SGD.step = original
    assert metrics["recipe"] == "eco-paper" and metrics["train_examples"] == 128
    groups = optimizers[0].param_groups
    assert all(g["momentum"] == 0.9 for g in groups)
    assert sorted(g["weight_decay"] for g in groups) == [0.0, 5e-4]  # Trainer's rule: no decay on biases and norms
    assert rates == pytest.approx([0.05, 0.05, 0.005, 0.005, 0.0005, 0.0005])  # ×0.1 at epochs 1 and 2


def test_random_crop_and_flip_keeps_the_size_and_moves_the_content():
    from poet_hf.vision.data import random_crop_and_flip

    image = torch.arange(3 * 12 * 12, dtype=torch.float32).reshape(3, 12, 12)
    torch.manual_seed(0)
    outputs = [random_crop_and_flip(image) for _ in range(20)]
    assert all(o.shape == image.shape for o in outputs)
    assert any(not torch.equal(o, image) for o in outputs)
    flipped = [o for o in outputs if torch.equal(o, image.flip(-1))]
    shifted = [o for o in outputs if (o == 0).any()]  # zero padding came in
    assert shifted and len(flipped) + len(shifted) >= 1
    torch.manual_seed(0)
    assert all(torch.equal(a, random_crop_and_flip(image)) for a in outputs)  # seeded: reproducible


def test_certificate_regularised_loss_is_cross_entropy_minus_gamma_times_the_radius():
    from types import SimpleNamespace

    from poet_hf.recipes.vision_run import certificate_regularized_loss

    logits = torch.tensor([[3.0, 1.0, 0.5], [0.2, 0.1, 2.0], [1.0, 1.5, 0.0]])
    labels = torch.tensor([0, 1, 1])
    loss = certificate_regularized_loss(0.3, lipschitz=2.0)(SimpleNamespace(logits=logits), labels)
    margins = [3.0 - 1.0, 0.0, 1.5 - 1.0]  # the second point is misclassified: no radius
    radius = sum(m / (2.0**0.5 * 2.0) for m in margins) / 3
    expected = torch.nn.functional.cross_entropy(logits, labels) - 0.3 * radius
    assert float(loss) == pytest.approx(float(expected), rel=1e-6)
