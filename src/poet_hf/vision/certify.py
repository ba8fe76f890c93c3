"""Certified ℓ2 robustness of Lipschitz classifiers (Tsuzuku et al. 2018; Li et al. 2019; ECO paper §3.3).

If every logit difference ``f_y - f_j`` is ``K_yj``-Lipschitz in the input, no perturbation with
``||δ||_2 < (f_y - f_j)(x) / K_yj`` can make ``j`` overtake ``y``. With an orthogonal head and a network Lipschitz
constant ``L``, ``K_yj <= √2·L`` (``||w_y - w_j|| = √2`` for orthonormal rows), so the radius is
``margin / (√2·L)`` with ``margin = f_top1 - f_top2``. With a row-normalised (LLN) head, ``K_yj = ||w_y -
w_j||·L_feat``. ``L`` includes the input normalisation (``1/min(std)``) because the model normalises internally.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, TypedDict

import torch

from .data import iterate_batches

if TYPE_CHECKING:
    from torch import nn

    from .data import ImageData
    from .lipconvnet import LipConvNetForImageClassification

__all__ = [
    "CertifiedMetrics",
    "certified_radius",
    "certified_accuracy",
    "accuracy_at_radii",
    "pgd_l2_attack",
    "pgd_accuracy",
]


class CertifiedMetrics(TypedDict, total=False):
    """What `certified_accuracy` measures, and what a training run adds to it (`poet_hf.recipes.vision_run`).

    Args:
        clean_accuracy: the fraction classified correctly.
        certified_accuracy: the fraction classified correctly with radius at least ``eps``.
        eps: the radius certified, in pixel space.
        lipschitz_constant: the model's Lipschitz constant ``L``.
        num_examples: the examples measured.
        radii: each example's certified radius (``return_radii``).
        correct: whether each example is classified correctly (``return_radii``).
        certified_accuracy_at: certified accuracy at each reported radius, by its name.
        certified_curve: ``[[eps, certified accuracy], ...]``.
        pgd_accuracy_at: accuracy under PGD at each reported radius.
        train_seconds: the training's wall time.
        train_loss: the mean training loss.
        train_examples: the training examples.
        dataset: the dataset trained on.
        recipe: the recipe trained with (``None``: the quick default).
        epochs: the epochs trained.
    """

    clean_accuracy: float
    certified_accuracy: float
    eps: float
    lipschitz_constant: float
    num_examples: int
    radii: torch.Tensor
    correct: torch.Tensor
    certified_accuracy_at: dict[str, float]
    certified_curve: list[list[float]]
    pgd_accuracy_at: dict[str, float]
    train_seconds: float
    train_loss: float
    train_examples: int
    dataset: str
    recipe: str | None
    epochs: float


def certified_radius(
    model: LipConvNetForImageClassification, logits: torch.Tensor, labels: torch.Tensor, lipschitz: float | None = None
) -> torch.Tensor:
    """ℓ2 radius (pixel space) around each input within which the prediction provably stays ``labels``.

    0 for misclassified points.

    ``lipschitz`` overrides ``model.lipschitz_constant()`` (computed in the model's current mode otherwise).
    """
    logits = logits.detach().double()
    correct = logits.argmax(dim=1) == labels
    if model.config.last_layer == "orthogonal":
        L = model.lipschitz_constant() if lipschitz is None else lipschitz
        top2 = logits.topk(2, dim=1).values
        radius = (top2[:, 0] - top2[:, 1]) / (math.sqrt(2.0) * L)
    else:
        L = model.lipschitz_constant(include_head=False) if lipschitz is None else lipschitz
        w = model.head_weight().double()  # [K, D], unit rows
        pair_norm = torch.cdist(w, w)  # ||w_y - w_j||
        gaps = logits.gather(1, labels[:, None]) - logits  # f_y - f_j
        ratios = gaps / (pair_norm[labels] * L)
        ratios[torch.arange(len(labels)), labels] = math.inf
        radius = ratios.min(dim=1).values
    return torch.where(correct, radius, torch.zeros_like(radius))


@torch.no_grad()
def certified_accuracy(
    model: LipConvNetForImageClassification,
    dataset: ImageData,
    eps: float = 36 / 255,
    batch_size: int = 256,
    return_radii: bool = False,
) -> CertifiedMetrics:
    """Clean accuracy and certified robust accuracy at ℓ2 radius ``eps`` (pixel space), in eval mode.

    A point counts as certified when it is classified correctly and ``radius >= eps`` (the ECO paper's test with
    the model's Lipschitz constant ``L``). ``dataset`` is a ``(pixel_values, labels)`` tensor pair, or a sequence
    of examples with ``pixel_values``/``labels`` or ``img``/``label`` (for example an HF ``Dataset``).

    Returns ``clean_accuracy``, ``certified_accuracy``, ``eps``, ``lipschitz_constant``, ``num_examples`` and,
    with ``return_radii``, the per-example ``radii`` and ``correct`` tensors.

    Args:
        model: a classifier with ``lipschitz_constant()`` (LipConvNet).
        dataset: the examples (see above).
        eps: the ℓ2 radius, in pixel space.
        batch_size: images per forward.
        return_radii: also return the per-example radii and correctness.

    Returns:
        The dict described above.

    Raises:
        ValueError: ``eps`` is negative.
    """
    if eps < 0:
        raise ValueError(f"certified_accuracy: `eps` must be >= 0, got {eps}")
    was_training = model.training
    model.eval()
    try:
        config = model.config
        L = model.lipschitz_constant(include_head=config.last_layer == "orthogonal")
        device = next(model.parameters()).device
        dtype = next(model.parameters()).dtype
        radii, correct = [], []
        for pixels, labels in iterate_batches(dataset, config.num_channels, config.image_size, batch_size):
            logits = model(pixel_values=pixels.to(device, dtype)).logits
            labels = labels.to(device)
            radii.append(certified_radius(model, logits, labels, lipschitz=L).cpu())
            correct.append((logits.argmax(dim=1) == labels).cpu())
    finally:
        model.train(was_training)
    radii_t, correct_t = torch.cat(radii), torch.cat(correct)
    certified = correct_t & (radii_t >= eps)
    result: CertifiedMetrics = {
        "clean_accuracy": float(correct_t.double().mean()),
        "certified_accuracy": float(certified.double().mean()),
        "eps": float(eps),
        "lipschitz_constant": float(L),
        "num_examples": int(correct_t.numel()),
    }
    if return_radii:
        result["radii"] = radii_t
        result["correct"] = correct_t
    return result


def accuracy_at_radii(
    radii: torch.Tensor, correct: torch.Tensor, radii_to_report: dict[str, float]
) -> dict[str, float]:
    """Certified accuracy at each radius: the fraction of points classified correctly with ``radius >= eps``."""
    return {name: float((correct & (radii >= eps)).double().mean()) for name, eps in radii_to_report.items()}


def pgd_l2_attack(
    model: nn.Module,
    pixels: torch.Tensor,
    labels: torch.Tensor,
    eps: float,
    steps: int = 20,
    step_size: float | None = None,
    seed: int = 2,
) -> torch.Tensor:
    """ℓ2 projected gradient ascent on the margin ``max_{j≠y} f_j − f_y`` in the ball of radius ``eps``.

    The ball is around each input on the pixel scale, without clipping to [0, 1], which only makes the attack
    stronger. Returns the adversarial inputs.

    Works for any classifier returning ``.logits``. Robust accuracy under it bounds the true robust accuracy from
    above (the ECO paper's appendix C), as a certificate bounds it from below, so no certified point may fall.
    """
    generator = torch.Generator().manual_seed(seed)
    delta = torch.randn(pixels.shape, dtype=pixels.dtype, generator=generator).to(pixels.device)
    delta = delta / delta.flatten(1).norm(dim=1).view(-1, *[1] * (pixels.dim() - 1)) * eps * 0.5
    step_size = 2.5 * eps / steps if step_size is None else step_size
    shape = (-1, *[1] * (pixels.dim() - 1))
    for _ in range(steps):
        delta.requires_grad_(True)
        logits = model(pixel_values=pixels + delta).logits
        other = logits.masked_fill(torch.nn.functional.one_hot(labels, logits.shape[1]).bool(), -math.inf)
        loss = (other.max(dim=1).values - logits.gather(1, labels[:, None])[:, 0]).sum()
        (grad,) = torch.autograd.grad(loss, delta)
        with torch.no_grad():
            delta = delta + step_size * grad / grad.flatten(1).norm(dim=1).clamp_min(1e-12).view(shape)
            delta = delta * torch.clamp(eps / delta.flatten(1).norm(dim=1).clamp_min(1e-12), max=1.0).view(shape)
    return (pixels + delta).detach()


def pgd_accuracy(
    model: LipConvNetForImageClassification,
    dataset: ImageData,
    radii_to_report: dict[str, float],
    steps: int = 20,
    batch_size: int = 256,
) -> dict[str, float]:
    """Accuracy under `pgd_l2_attack` at each radius (an upper bound on robust accuracy), in eval mode."""
    was_training = model.training
    model.eval()
    try:
        config = model.config
        device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
        hits = dict.fromkeys(radii_to_report, 0)
        total = 0
        for pixels, labels in iterate_batches(dataset, config.num_channels, config.image_size, batch_size):
            pixels, labels = pixels.to(device, dtype), labels.to(device)
            total += len(labels)
            for name, eps in radii_to_report.items():
                adversarial = pgd_l2_attack(model, pixels, labels, eps, steps=steps)
                with torch.no_grad():
                    hits[name] += int((model(pixel_values=adversarial).logits.argmax(dim=1) == labels).sum())
    finally:
        model.train(was_training)
    return {name: count / total for name, count in hits.items()}
