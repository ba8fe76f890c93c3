"""Image data loading (HF ``img``/``label`` layout, saved datasets, image folders) and ``scripts/train_vision.py``
end to end on tiny settings: Trainer, certification, baked export with a model card, reload."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForImageClassification

import poet_hf.vision.lipconvnet  # noqa: F401  (registers the Auto classes)
from poet_hf.vision.data import image_to_tensor, load_image_dataset

ROOT = Path(__file__).resolve().parent.parent
TINY_ARGS = [
    "--image-size", "12", "--strides", "2", "2", "3", "1", "1", "--kernel-sizes", "3", "3", "3", "1", "1",
    "--init-channels", "4", "--epochs", "1", "--batch-size", "32", "--max-train-examples", "192",
    "--max-eval-examples", "64", "--learning-rate", "0.01", "--logging-steps", "100",
    "--torch-threads", "0",  # keep the test session's thread setting
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
    spec = importlib.util.spec_from_file_location("train_vision", ROOT / "scripts" / "train_vision.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "model"
    assert script.main([*TINY_ARGS, "--output-dir", str(out)]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    record_property("tiny_clean_accuracy", metrics["clean_accuracy"])
    record_property("tiny_certified_accuracy", metrics["certified_accuracy"])
    assert metrics["num_examples"] == 64 and metrics["train_examples"] == 192
    assert metrics["clean_accuracy"] > 0.2  # 6 steps from scratch; chance is 0.1
    card = (out / "README.md").read_text()
    assert "pipeline_tag: image-classification" in card
    assert f"{metrics['lipschitz_constant']:.6f}" in card and f"{100 * metrics['certified_accuracy']:.2f} %" in card
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
