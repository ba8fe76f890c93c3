"""The norm cap of the Cayley–Neumann map: a skew block past the series' domain is rescaled back onto it.

The truncated series only approximates ``(I − Q)^{-1}`` for ``||Q||_2 < 1``; `skew_norm_scale` gives the per-block
factors that bring ``||Q||_2`` down to `MAX_SKEW_NORM`, from cheap certified bounds first
(`skew_spectral_norm_bounds`). A `NormCap`, which a model's rotation layers share, keeps each skew vector's factor
while its value lasts and logs the first rescaling.
"""

from __future__ import annotations

import logging
import math

import torch
from torch.utils.weak import WeakIdKeyDictionary

logger = logging.getLogger(__name__)

__all__ = ["MAX_SKEW_NORM", "NormCap", "skew_spectral_norm_bounds", "skew_spectral_norm", "skew_norm_scale"]

# The truncated series only approximates (I − Q)^{-1} for ||Q||_2 < 1; at ||Q||_2 = 1 the k = 5 polynomial is
# singular (its singular values are |1 − (iθ)^4|), and beyond it the polynomial grows like ||Q||^(k−1), so one large
# optimizer step can push a model to inf/NaN. The Cayley–Neumann path therefore rescales any block whose spectral norm
# exceeds this cap back onto it (the exact transform needs no cap). At the cap the k = 5 rotation's singular values
# lie within [1 − 0.75⁴, 1] = [0.68, 1]; below it nothing changes, bit for bit.
MAX_SKEW_NORM = 0.75
# ||Q||_2 from (QᵀQ)^(2^s) by s repeated squarings: s = 6 weighs the eigenvalues as 64 power iterations would, in
# 7 batched matrix products instead of 64 memory-bound matrix-vector products. The first 2 squarings already give a
# certified upper bound.
_SQUARINGS, _SQUARINGS_FOR_BOUND = 6, 2


@torch.no_grad()
def skew_spectral_norm_bounds(q: torch.Tensor, squarings: int = _SQUARINGS) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lower, upper)`` bounds of ``||Q||_2`` per block of ``(..., b, b)``.

    They come from ``G = QᵀQ`` squared ``squarings`` times (``G^n``, ``n = 2^squarings``, renormalised each time).

    ``upper = ||G^n||_F^(1/2n)`` (the Frobenius norm bounds the largest eigenvalue); ``lower`` is the square root of
    ``tr(G^(n+1)) / tr(G^n)``, the mean of ``G``'s eigenvalues weighted by their ``n``-th powers. Both converge to
    ``||Q||_2`` as ``n`` grows, the lower one like ``n`` power iterations but with no start vector to depend on.
    """
    b = q.shape[-1]
    q3 = q.detach().reshape(-1, b, b)
    frobenius = torch.linalg.matrix_norm(q3).clamp_min(torch.finfo(q3.dtype).tiny)
    gram = q3.mT @ q3 / frobenius[:, None, None] ** 2  # eigenvalues σ²/||Q||_F² in [0, 1]
    power, log_norm = gram, torch.zeros_like(frobenius)  # G^(2^k) = power · exp(log_norm)
    for _ in range(squarings):
        power = power @ power
        norm = torch.linalg.matrix_norm(power).clamp_min(torch.finfo(q3.dtype).tiny)
        power, log_norm = power / norm[:, None, None], 2 * log_norm + norm.log()
    n = 2**squarings
    upper = torch.exp(log_norm / n) if squarings else torch.linalg.matrix_norm(gram)
    weighted = (power * gram).sum((-2, -1)) / power.diagonal(dim1=-2, dim2=-1).sum(-1).clamp_min(
        torch.finfo(q3.dtype).tiny
    )  # tr(G^(n+1)) / tr(G^n), G symmetric
    return (
        (frobenius * weighted.clamp_min(0).sqrt()).reshape(q.shape[:-2]),
        (frobenius * upper.sqrt()).reshape(q.shape[:-2]),
    )


def skew_spectral_norm(q: torch.Tensor) -> torch.Tensor:
    """``||Q||_2`` per block of ``(..., b, b)``, to within 2% for blocks up to 256.

    The lower estimate of `skew_spectral_norm_bounds`; the exact ``torch.linalg.matrix_norm(q, 2)`` costs an SVD per
    block."""
    return skew_spectral_norm_bounds(q)[0]


def skew_norm_scale(q: torch.Tensor, terms: int, cap: float | None = None) -> torch.Tensor | None:
    """Per-block factors ``min(1, cap / ||Q||_2)`` of shape ``(..., 1, 1)``, or ``None`` when no block exceeds ``cap``.

    Always ``None`` for the exact transform (``terms == 0``).

    Certified upper bounds decide cheaply that nothing needs doing: ``||Q||_F``, then ``||(QᵀQ)⁴||_F^(1/8)``. Only
    when one of them exceeds the cap is ``||Q||_2`` estimated from below (`skew_spectral_norm`), so every
    process computes the same factor. The factor carries no gradient: beyond the cap the rotation is that of the
    rescaled block, like a norm clip.
    """
    cap = MAX_SKEW_NORM if cap is None else cap
    if terms == 0 or math.isinf(cap):
        return None
    with torch.no_grad():
        if not bool((torch.linalg.matrix_norm(q.detach()) > cap).any()):
            return None
        if not bool((skew_spectral_norm_bounds(q, _SQUARINGS_FOR_BOUND)[1] > cap).any()):
            return None
        spectral = skew_spectral_norm(q)
        scale = torch.where(spectral > cap, cap / spectral, torch.ones_like(spectral))
        if not bool((scale < 1).any()):
            return None
    return scale[..., None, None]


class NormCap:
    """The norm cap of one model's rotations (`skew_norm_scale`), remembered per skew vector.

    The forward and the backward's rebuild of one step (and every micro-batch until the optimizer changes the vector)
    share one factor, and so agree. The first rescaling is logged, once per `NormCap`: a `RotationStepState` holds
    one for all of its model's layers.
    """

    def __init__(self) -> None:
        self.logged = False
        self._scales: WeakIdKeyDictionary = WeakIdKeyDictionary()  # skew vector -> (key, factor); leaves with it

    def scale(self, vec: torch.Tensor, q: torch.Tensor, terms: int) -> torch.Tensor | None:
        """`skew_norm_scale` of ``q``, the blocks of ``vec``: the one kept for ``vec``'s current value, if any."""
        # The version counter misses writes through ``.data``; the norm (one cheap reduction) catches those.
        key = (
            vec._version,
            float(torch.linalg.vector_norm(vec.detach())),
            tuple(q.shape),
            terms,
            MAX_SKEW_NORM,
            q.dtype,
            q.device,
        )
        hit = self._scales.get(vec)
        if hit is not None and hit[0] == key:
            return hit[1]
        scale = skew_norm_scale(q, terms)
        self._scales[vec] = (key, scale)
        if scale is not None and not self.logged:
            self.logged = True
            logger.warning(
                "a skew block reached ||Q||_2 = %.3g > %.3g, outside the Cayley–Neumann series' domain; it is "
                "rescaled to the cap (MAX_SKEW_NORM). The learning rate of the rotations is probably too large. "
                "(Logged once per model.)",
                MAX_SKEW_NORM / float(scale.min()),
                MAX_SKEW_NORM,
            )
        return scale


def capped_scale(
    vec: torch.Tensor, q: torch.Tensor, terms: int, norm_cap: NormCap | None = None
) -> torch.Tensor | None:
    """The factors of `skew_norm_scale` for ``q``, the blocks of ``vec``, kept in ``norm_cap`` where one is given.

    ``None`` on the meta device (a trace by shapes: no values to cap); under ``torch.compile`` the factor is computed
    without data-dependent branches (1 where below the cap)."""
    if vec.device.type == "meta":
        return None
    if torch.compiler.is_compiling():
        return _traced_norm_scale(q, terms)
    return skew_norm_scale(q, terms) if norm_cap is None else norm_cap.scale(vec, q, terms)


def _traced_norm_scale(q: torch.Tensor, terms: int) -> torch.Tensor | None:
    """`skew_norm_scale` without its data-dependent shortcuts, for ``torch.compile``.

    The factors are the same: where the certified bounds are below the cap, so is the estimate, and the factor is 1."""
    if terms == 0 or math.isinf(MAX_SKEW_NORM):
        return None
    with torch.no_grad():
        spectral = skew_spectral_norm(q.detach())
        scale = torch.where(spectral > MAX_SKEW_NORM, MAX_SKEW_NORM / spectral, torch.ones_like(spectral))
    return scale[..., None, None]
