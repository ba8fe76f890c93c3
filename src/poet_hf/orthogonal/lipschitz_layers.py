"""The other LipConvNet building blocks, in pure PyTorch: SOC convolution, MaxMin, last-layer normalisation.

- `SocConv2d`: skew orthogonal convolution (Singla & Feizi, ICML 2021), the baseline the ECO paper
  compares against. The Jacobian of a conv with kernel ``L = M - M^T_conv`` (channels swapped, taps flipped) is
  skew-symmetric, so ``exp(J_L)`` is orthogonal; it is applied as the Taylor series ``Σ_{i=0}^{T} L^{*i} x / i!``,
  i.e. ``T`` sequential convolutions, in training *and* evaluation. We pad circularly (the ECO paper's setting;
  the SOC release pads with zeros), which keeps the Jacobian block-circulant, so its exact singular values are
  computable per frequency (`SocConv2d.singular_values`).
- `MaxMin`: GroupSort-2 (Anil et al. 2019); 1-Lipschitz and gradient-norm-preserving.
- `RowNormLinear`: last-layer normalisation (LLN), a linear layer with unit-norm rows.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from .eco import _check_int, as_pair, circular_conv_symbol
from .linalg import power_iteration, spectral_norm_estimate, taylor_exp

__all__ = ["SocConv2d", "MaxMin", "RowNormLinear", "fantastic_four"]

# The four reshapings of a [c_out, c_in, h, w] kernel into matrices (Singla & Feizi, "Fantastic Four", ICLR 2021):
# (c_out·h × c_in·w), (c_out·w × c_in·h), (c_out × c_in·h·w), (c_out·h·w × c_in). Each entry: the shape of the right
# vector u (over the kernel's axes), the kernel axes u runs over, and those the left vector v runs over.
_FOUR_RESHAPES = (
    (lambda o, i, h, w: (1, i, 1, w), (1, 3), (0, 2)),
    (lambda o, i, h, w: (1, i, h, 1), (1, 2), (0, 3)),
    (lambda o, i, h, w: (1, i, h, w), (1, 2, 3), (0,)),
    (lambda o, i, h, w: (1, i, 1, 1), (1,), (0, 2, 3)),
)


@torch.no_grad()
def fantastic_four(kernel: torch.Tensor, vectors: list[torch.Tensor], iterations: int) -> tuple[torch.Tensor, list]:
    """Spectral norms of the four reshapings of ``kernel`` by power iteration from ``vectors`` (one per reshaping).

    Returns ``(σ, new_vectors)`` with ``σ`` the four estimates; ``√(h·w)·min σ`` bounds the circular convolution's
    operator norm. The SOC code scales its kernel by ``correction / min σ``.
    """
    sigmas, updated = [], []
    for (_, u_axes, v_axes), u in zip(_FOUR_RESHAPES, vectors, strict=True):
        # The reshaping's transpose, rows over u's axes: power iteration on it gives the reshaping's top singular pair.
        matrix = kernel.permute(*u_axes, *v_axes).reshape(u.numel(), -1)
        u_flat = power_iteration(matrix, u.reshape(-1), iterations)
        sigmas.append(spectral_norm_estimate(matrix, u_flat))
        updated.append(u_flat.reshape(u.shape))
    return torch.stack(sigmas), updated


class SocConv2d(nn.Module):
    """Skew orthogonal convolution (SOC) with circular padding, for one fixed input size.

    Args:
        in_channels, out_channels: channel counts; channel changes and stride work as in
            `EcoConv2d` (zero-pad inputs to ``c = max(c_in·s², c_out)``, keep the
            first ``c_out`` outputs, ``pixel_unshuffle`` for stride).
        kernel_size: odd ``k`` (the circular conv-transpose is the adjoint only for centred, odd kernels).
        stride: ``s``; must divide ``input_size``.
        input_size: ``n`` or ``(n_h, n_w)``, fixed so the exact spectrum can be computed.
        train_terms, eval_terms: Taylor terms ``T`` in training / evaluation (SOC: 5 and 10).
        correction: ``L`` is scaled to ``correction / min σ``, ``σ`` the spectral norms of its four reshapings
            (`fantastic_four`), as the SOC code does (``correction = 0.7``); the operator norm of the scaled
            ``L`` is then about 1.2 at initialisation (at most ``correction·√(k²)``). Orthogonality needs no bound
            (``exp`` of a skew operator is orthogonal); it only keeps the truncated series accurate.
        power_iterations: power-iteration steps per training forward for the bound.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int = 3,
        stride: int = 1,
        *,
        input_size: int | tuple[int, int],
        bias: bool = True,
        train_terms: int = 5,
        eval_terms: int = 10,
        correction: float = 0.7,
        power_iterations: int = 1,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.in_channels = _check_int(in_channels, "in_channels", 1)
        self.out_channels = _check_int(out_channels, "out_channels", 1)
        self.kernel_size = _check_int(kernel_size, "kernel_size", 1)
        if kernel_size % 2 == 0:
            raise ValueError(f"SocConv2d: `kernel_size` must be odd, got {kernel_size}")
        self.stride = _check_int(stride, "stride", 1)
        self.train_terms = _check_int(train_terms, "train_terms", 1)
        self.eval_terms = _check_int(eval_terms, "eval_terms", 1)
        self.power_iterations = _check_int(power_iterations, "power_iterations", 1)
        if not 0 < correction <= 1:
            raise ValueError(f"SocConv2d: `correction` must be in (0, 1], got {correction!r}")
        self.correction = float(correction)
        self.input_size = as_pair(input_size, "input_size")
        nh, nw = self.input_size
        if nh % self.stride or nw % self.stride:
            raise ValueError(
                f"SocConv2d: stride={self.stride} must divide input_size={self.input_size} (pixel-unshuffle)"
            )
        self.conv_size = (nh // self.stride, nw // self.stride)
        if kernel_size // 2 > min(self.conv_size):
            raise ValueError(
                f"SocConv2d: kernel_size={kernel_size} needs circular padding {kernel_size // 2}, larger than the "
                f"{self.conv_size} map it convolves"
            )
        self.conv_in_channels = self.in_channels * self.stride**2
        self.width = max(self.conv_in_channels, self.out_channels)
        self.padding = (kernel_size // 2,) * 4
        self.update_power_iteration = True
        factory: dict[str, Any] = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(self.width, self.width, kernel_size, kernel_size, **factory))
        for index, shape in enumerate(self._vector_shapes(), start=1):
            self.register_buffer(f"u{index}", torch.empty(shape, **factory))
        self.bias = nn.Parameter(torch.zeros(self.out_channels, **factory)) if bias else None
        self.reset_parameters()

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Kernel ~ N(0, 1/(c k²)), zero bias, and warmed-up power-iteration vectors.

        The random unit vectors for the four bounds are warmed up by 30 power iterations."""
        with torch.no_grad():
            self.weight.normal_(0.0, 1.0 / math.sqrt(self.width * self.kernel_size**2), generator=generator)
            for u in self._vectors():
                u.normal_(generator=generator)
                u.div_(u.norm())
            if self.weight.device.type != "meta":
                self._store(fantastic_four(self._skew_kernel_raw(), self._vectors(), 30)[1])
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def _skew_kernel_raw(self) -> torch.Tensor:
        # The adjoint of a centred circular cross-correlation swaps channels and flips taps.
        return self.weight - self.weight.transpose(0, 1).flip(2, 3)

    def _vector_shapes(self) -> list[tuple[int, ...]]:
        c, k = self.width, self.kernel_size
        return [shape(c, c, k, k) for shape, _, _ in _FOUR_RESHAPES]

    def _vectors(self) -> list[torch.Tensor]:
        return [getattr(self, f"u{index}") for index in range(1, 5)]

    def _store(self, vectors: list[torch.Tensor]) -> None:
        for target, value in zip(self._vectors(), vectors, strict=True):
            target.copy_(value)

    def skew_kernel(self, update: bool = False) -> torch.Tensor:
        """``L · correction / min σ`` with ``σ`` the Fantastic Four estimates.

        No gradient flows through ``σ``, as in the SOC code; ``update`` refreshes the power-iteration vectors first
        (training forward only)."""
        raw = self._skew_kernel_raw()
        sigmas, vectors = fantastic_four(raw, self._vectors(), self.power_iterations if update else 0)
        if update:
            self._store(vectors)
        return raw * (self.correction / sigmas.min().clamp_min(torch.finfo(raw.dtype).tiny))

    @property
    def terms(self) -> int:
        return self.train_terms if self.training else self.eval_terms

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if tuple(x.shape[-2:]) != self.input_size:
            raise ValueError(f"SocConv2d was built for input_size={self.input_size}, got a {tuple(x.shape[-2:])} input")
        if self.stride > 1:
            x = F.pixel_unshuffle(x, self.stride)
        if x.shape[-3] < self.width:
            x = F.pad(x, (0, 0, 0, 0, 0, self.width - x.shape[-3]))
        kernel = self.skew_kernel(update=self.training and self.update_power_iteration).to(x.dtype)
        out, term = x, x
        for i in range(1, self.terms + 1):  # Σ_{i=0}^{T} L^{*i} x / i!: T sequential convolutions
            term = F.conv2d(F.pad(term, self.padding, mode="circular"), kernel) / i
            out = out + term
        out = out[:, : self.out_channels]
        return out if self.bias is None else out + self.bias.view(1, -1, 1, 1)

    @torch.no_grad()
    def singular_values(self) -> torch.Tensor:
        """All singular values of the layer's Jacobian for the current mode's number of terms (float64).

        The Jacobian is block-circulant, so per frequency it is ``S_T(L̂(f))``, sliced to ``[c_out, c_in·s²]``.
        """
        kernel = self.skew_kernel()
        symbol = circular_conv_symbol(kernel, self.conv_size, (1, 1), self.padding)
        series = taylor_exp(symbol, self.terms)[..., : self.out_channels, : self.conv_in_channels]
        return torch.linalg.svdvals(series).flatten()

    def lipschitz_constant(self) -> float:
        """Exact ℓ2 Lipschitz constant of the map the current mode computes."""
        return float(self.singular_values().max())

    def extra_repr(self) -> str:
        return (
            f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
            f"input_size={self.input_size}, terms=({self.train_terms}, {self.eval_terms})"
        )


class MaxMin(nn.Module):
    """GroupSort-2 over channel halves: ``[max(a, b), min(a, b)]`` for ``a, b = x.chunk(2, dim=1)``.

    It permutes each pair of entries, so it is 1-Lipschitz and preserves norms and gradient norms.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] % 2:
            raise ValueError(f"MaxMin needs an even number of channels, got {x.shape[1]}")
        a, b = x.chunk(2, dim=1)
        return torch.cat([torch.maximum(a, b), torch.minimum(a, b)], dim=1)


class RowNormLinear(nn.Module):
    """Last-layer normalisation (LLN): ``y = (W / ||W_i||) x + b``, every row of unit norm.

    Each logit is 1-Lipschitz, and the margin ``y_i - y_j`` is ``||w_i - w_j||``-Lipschitz, which is what the
    certificate for this head uses (not ``√2``: the rows are not orthogonal).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__()
        self.in_features = _check_int(in_features, "in_features", 1)
        self.out_features = _check_int(out_features, "out_features", 1)
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.reset_parameters()

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        with torch.no_grad():
            self.weight.normal_(generator=generator)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def normalized_weight(self) -> torch.Tensor:
        return F.normalize(self.weight, dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.normalized_weight().to(x.dtype), self.bias)
