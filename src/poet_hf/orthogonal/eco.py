"""ECO: explicitly constructed orthogonal convolutions (Yu, Li, Cai, Li, ICLR 2022), in pure PyTorch.

How the kernel is built (paper §4–5, with the digest's corrections, ``research/seed-000-eco.md``):

1. ``L`` skew-symmetric ``c x c`` matrices ``A_l``, one per conjugate-pair class of the ``k x k`` frequency grid
   (``L = (k²+1)/2`` for odd ``k``, ``(k²+4)/2`` for even ``k``; Algorithm 2,
   [`construct_index_map`][poet_hf.orthogonal.construct_index_map]).
2. Each is spectrally normalised (power iteration, Miyato-style) and exponentiated: a truncated Taylor series
   ``Σ_{i=0}^{T} A^i/i!`` (paper Eq. 15) in training, or ``torch.matrix_exp`` (exact), by option.
3. The orthogonal blocks are placed on the ``k x k`` frequency grid, ``P0[i, j] = Q[I[i, j]]``, and
   inverse-FFT'd with the ``1/k²`` factor into a real ``k x k`` kernel ``W0`` (Eq. 13–14).
4. The layer is that kernel run as a *circular* convolution with dilation ``d = n/k``: its spectrum is ``P0``
   tiled ``d x d`` times over the ``n x n`` grid, so by Sedghi et al.'s theorem every singular value is 1.
   This needs ``k | n`` on each axis (or ``n == 1``, where every tap wraps onto the same pixel and the layer is
   the DC block ``P0[0, 0]``); anything else is refused at construction, because the published code's silent
   ``ceil(n/k)`` is exactly what made it non-orthogonal.

Channel changes work on the width ``c = max(c_in·s², c_out)``: inputs are zero-padded to ``c`` channels and
the first ``c_out`` outputs are kept. Stride ``s`` is a pixel-unshuffle (a permutation) before the conv. Both
are folded into the kernel (``weight[:c_out, :c_in·s²]``), so evaluation is one dilated ``F.conv2d``.
"""

from __future__ import annotations

import math
from typing import Any, Literal, cast

import torch
import torch.nn as nn
import torch.nn.functional as F

from .cayley import num_skew_params, skew_from_vector
from .linalg import power_iteration, spectral_norm_estimate, taylor_exp

__all__ = [
    "EcoConv2d",
    "EcoMap",
    "ECO_MAPS",
    "construct_index_map",
    "num_frequency_blocks",
    "taylor_exp_error",
    "normalize_skew",
    "eco_kernel",
    "synthesis_matrix",
    "eco_geometry",
    "circular_conv_symbol",
    "as_pair",
]

EcoMap = Literal["taylor", "matrix_exp"]  # how an ECO kernel is made orthogonal: its only home
ECO_MAPS: tuple[EcoMap, ...] = ("taylor", "matrix_exp")


def as_pair(value: int | tuple[int, int] | list[int], name: str) -> tuple[int, int]:
    """``(h, w)`` from an int or a pair of positive ints; ``ValueError`` naming ``name`` otherwise."""
    if isinstance(value, int):
        pair: tuple[Any, ...] = (value, value)  # a bool too: refused below
    else:
        pair = tuple(value)
    if len(pair) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in pair):
        raise ValueError(f"`{name}` must be a positive int or a pair of positive ints, got {value!r}")
    return cast(tuple[int, int], pair)


def construct_index_map(kernel_size: int) -> tuple[torch.Tensor, int]:
    """Paper Algorithm 2: a ``k x k`` map ``I`` with ``I[i, j] == I[-i % k, -j % k]``, and the class count ``L``.

    Real, even blocks ``P0[i, j] = Q[I[i, j]]`` make ``ifft2(P0)`` real (conjugate symmetry, §1.4 of the digest).
    ``-1`` marks "unset" (the paper's 0 sentinel only works because (0, 0) is its own mirror).

    Args:
        kernel_size: the kernel side ``k``.

    Returns:
        ``(I, L)``: the ``k × k`` index map and the number of classes.
    """
    index, count = _index_map_list(kernel_size)
    return torch.tensor(index, dtype=torch.long, device="cpu"), count


def _index_map_list(kernel_size: int) -> tuple[list[list[int]], int]:
    k = kernel_size
    index = [[-1] * k for _ in range(k)]
    count = 0
    for i in range(k):
        for j in range(k):
            mirror = index[(k - i) % k][(k - j) % k]
            if mirror < 0:
                index[i][j] = count
                count += 1
            else:
                index[i][j] = mirror
    return index, count


def num_frequency_blocks(kernel_size: int) -> int:
    """``L``: ``(k²+1)/2`` for odd ``k``, ``(k²+4)/2`` for even ``k``."""
    return (kernel_size**2 + 1) // 2 if kernel_size % 2 else (kernel_size**2 + 4) // 2


def taylor_exp_error(a: torch.Tensor, terms: int) -> torch.Tensor:
    """``||exp(A) - S_T(A)||_2`` per block (the paper's Table 8 first row), computed in float64."""
    a64 = a.detach().double()
    return torch.linalg.matrix_norm(torch.matrix_exp(a64) - taylor_exp(a64, terms), ord=2)


def normalize_skew(a: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``A / σ̂`` with ``σ̂ = ||A^T u||`` (= ``u^T A v`` for ``v = A^T u/||A^T u||``); gradient flows through A only.

    Spectral normalisation keeps the Taylor series accurate (paper Eq. 15); ``exp(A/σ̂)`` is orthogonal for any
    ``σ̂ > 0``, so orthogonality never depends on the power-iteration estimate. A zero ``A`` maps to ``I``.
    """
    sigma = spectral_norm_estimate(a, u)
    return a / sigma.clamp_min(torch.finfo(a.dtype).tiny)[..., None, None]


def synthesis_matrix(
    index_map: torch.Tensor | list[list[int]], num_blocks: int, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """``[k, k, L]`` real coefficients with ``W0[p, q] = Σ_l C[p, q, l] Q_l`` (paper Eq. 13–14).

    It is ``ifft2`` (default ``norm="backward"``, i.e. with the ``1/k²`` the construction needs; ``"ortho"`` would
    scale every singular value by ``k``) of the one-hot frequency pattern of each class ``l``, ``fftshift``'ed so
    kernel index ``k // 2`` is tap 0. The imaginary part cancels exactly because ``I[f] == I[-f]``.
    """
    index = torch.as_tensor(index_map, dtype=torch.long, device="cpu")
    onehot = F.one_hot(index, num_blocks).to(torch.float64)  # [k, k, L]
    coefficients = torch.fft.ifft2(onehot, dim=(0, 1)).real
    return torch.fft.fftshift(coefficients, dim=(0, 1)).to(dtype)


def eco_kernel(blocks: torch.Tensor, index_map: torch.Tensor | list[list[int]]) -> torch.Tensor:
    """Torch conv weight ``[c, c, k, k]`` from orthogonal blocks ``[L, c, c]``: ``real(ifft2(P0))``, centred.

    Equivalent to ``fftshift(ifft2(blocks[index_map], dim=(0, 1)).real)`` (tested), computed as one small real
    matmul with `synthesis_matrix` instead of ``c²`` strided length-``k`` complex FFTs.

    Args:
        blocks: the ``L`` orthogonal ``c × c`` blocks ``(L, c, c)``.
        index_map: the map of [`construct_index_map`][poet_hf.orthogonal.construct_index_map].

    Returns:
        The real ``[c, c, k, k]`` kernel.
    """
    coefficients = synthesis_matrix(index_map, blocks.shape[0], blocks.dtype).to(blocks.device)
    w0 = torch.einsum("pql,lab->abpq", coefficients, blocks)
    return w0.contiguous()


def eco_geometry(
    spatial_size: tuple[int, int], kernel_size: int
) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int, int, int]]:
    """Effective kernel size, dilation and circular padding ``(left, right, top, bottom)`` for one map size.

    Per axis: ``n == 1`` collapses the kernel to one tap (all taps wrap onto the pixel); else ``d = n / k``
    with ``k // 2 · d`` before and the rest of ``d (k - 1)`` after, so kernel index ``k // 2`` sits at offset 0.
    Raises ``ValueError`` when ``k`` does not divide ``n``: the layer would not be orthogonal.
    """
    k = kernel_size
    ksize, dil, pads = [], [], []
    for axis, n in zip(("height", "width"), spatial_size, strict=True):
        if n == 1 or k == 1:
            ksize.append(1)
            dil.append(1)
            pads.append((0, 0))
        elif n % k == 0:
            d = n // k
            ksize.append(k)
            dil.append(d)
            pads.append(((k // 2) * d, (k - 1 - k // 2) * d))
        else:
            raise ValueError(
                f"EcoConv2d: the feature map {axis} seen by the convolution is {n}, which kernel_size={k} does not "
                f"divide; the ECO construction is orthogonal only when kernel_size divides every spatial size of "
                f"the (pixel-unshuffled) input, or that size is 1. Use a kernel size dividing {n}, or an input "
                f"size that is a multiple of {k}·stride."
            )
    (pt, pb), (pl, pr) = pads
    return (ksize[0], ksize[1]), (dil[0], dil[1]), (pl, pr, pt, pb)


def circular_conv_symbol(
    weight: torch.Tensor,
    spatial_size: tuple[int, int],
    dilation: tuple[int, int],
    padding: tuple[int, int, int, int],
) -> torch.Tensor:
    """Per-frequency matrices ``[n_h, n_w, c_out, c_in]`` (complex128) of a circularly padded cross-correlation.

    Sedghi et al. (2019): the singular values of the whole layer are the union of those of these matrices. The
    taps are scattered onto the ``n_h x n_w`` grid at their true circular offsets (summing taps that wrap onto
    the same offset), then ``fft2``'d.
    """
    c_out, c_in, kh, kw = weight.shape
    nh, nw = spatial_size
    pl, _, pt, _ = padding
    expanded = torch.zeros(nh, nw, c_out, c_in, dtype=torch.float64, device=weight.device)
    for a in range(kh):
        for b in range(kw):
            expanded[(a * dilation[0] - pt) % nh, (b * dilation[1] - pl) % nw] += weight[:, :, a, b].double()
    return torch.fft.fft2(expanded, dim=(0, 1))


def _check_int(value: object, name: str, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"`{name}` must be an int >= {minimum}, got {value!r}")
    return value


class EcoConv2d(nn.Module):
    """Orthogonal convolution built explicitly on the frequency grid (ECO), for one fixed input size.

    Attribute ``update_power_iteration`` (default True) lets a training forward refresh ``u``; set it False to
    freeze ``u``, e.g. under ``torch.func`` transforms, which refuse in-place buffer updates.

    Args:
        in_channels: input channels ``c_in``.
        out_channels: output channels ``c_out``. The layer works on ``c = max(c_in·s², c_out)`` channels:
            ``c_out >= c_in·s²`` gives an isometry (orthonormal Jacobian columns, norm-preserving);
            ``c_out < c_in·s²`` keeps the first ``c_out`` outputs (orthonormal rows, norm-non-increasing).
        kernel_size: ``k`` (square kernel). ``k`` must divide the unshuffled input size on each axis, or that
            size must be 1 (then the layer is a 1x1 orthogonal conv, the DC block).
        stride: ``s``, done by ``pixel_unshuffle(s)``; must divide the input size.
        input_size: the spatial size ``n`` or ``(n_h, n_w)`` this layer will see; the dilation ``n/(s·k)`` depends
            on it, so it is fixed at construction and checked in ``forward``.
        bias: add a learned bias (it does not change the Lipschitz constant).
        orthogonal_map: ``"taylor"`` (truncated exponential, ``train_terms`` terms, the paper's default) or
            ``"matrix_exp"`` (exact) for the training forward. Evaluation and `bake` always use
            ``torch.matrix_exp``.
        train_terms: ``T`` of the training Taylor series ``Σ_{i=0}^{T}``; the paper uses 5.
        power_iterations: power-iteration steps per training forward for the spectral normalisation.
        baked: build the layer already baked (a plain kernel buffer, no parametrization), e.g. to load a
            baked checkpoint.
        device: device of the parameters.
        dtype: dtype of the parameters.

    Raises:
        ValueError: a size does not fit (the stride must divide ``input_size``, the kernel must divide the unshuffled
            size, or that size is 1) or an option is invalid.
    """

    u: torch.Tensor  # buffers: the power-iteration vectors, and the baked kernel
    weight: torch.Tensor

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        stride: int = 1,
        *,
        input_size: int | tuple[int, int],
        bias: bool = True,
        orthogonal_map: EcoMap = "taylor",
        train_terms: int = 5,
        power_iterations: int = 1,
        baked: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.in_channels = _check_int(in_channels, "in_channels", 1)
        self.out_channels = _check_int(out_channels, "out_channels", 1)
        self.kernel_size = _check_int(kernel_size, "kernel_size", 1)
        self.stride = _check_int(stride, "stride", 1)
        self.train_terms = _check_int(train_terms, "train_terms", 1)
        self.power_iterations = _check_int(power_iterations, "power_iterations", 1)
        if orthogonal_map not in ECO_MAPS:
            raise ValueError(f"`orthogonal_map` must be one of {ECO_MAPS}, got {orthogonal_map!r}")
        self.orthogonal_map = orthogonal_map
        self.input_size = as_pair(input_size, "input_size")
        nh, nw = self.input_size
        if nh % self.stride or nw % self.stride:
            raise ValueError(
                f"EcoConv2d: stride={self.stride} must divide input_size={self.input_size} (pixel-unshuffle)"
            )
        self.conv_size = (nh // self.stride, nw // self.stride)
        # Both axes 1x1: only the DC block P0[0, 0] acts, so a 1x1 kernel is the same operator family (digest §1.3).
        self.block_kernel_size = 1 if self.conv_size == (1, 1) else self.kernel_size
        self.effective_kernel_size, self.dilation, self.padding = eco_geometry(self.conv_size, self.block_kernel_size)
        self.conv_in_channels = self.in_channels * self.stride**2
        self.width = max(self.conv_in_channels, self.out_channels)
        factory: dict[str, Any] = {"device": device, "dtype": dtype}
        # A plain list, not a buffer: transformers materialises non-persistent buffers empty after meta init.
        self.index_map, num_blocks = _index_map_list(self.block_kernel_size)
        self.num_blocks = num_blocks
        self.bias = nn.Parameter(torch.zeros(self.out_channels, **factory)) if bias else None
        self.baked = False
        self.update_power_iteration = True
        self._cache: tuple[tuple, torch.Tensor] | None = None
        if baked:
            kh, kw = self.effective_kernel_size
            self.register_buffer("weight", torch.zeros(self.out_channels, self.conv_in_channels, kh, kw, **factory))
            self.baked = True
        else:
            self.skew = nn.Parameter(torch.empty(num_blocks, num_skew_params(self.width), **factory))
            self.register_buffer("u", torch.empty(num_blocks, self.width, **factory))
            self.reset_parameters()

    # ----------------------------------------------------------------------------------------------------------
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """``A`` entries ~ N(0, 2/c) (SOC's ``P̃ ~ N(0, 1/c)`` gives ``P̃ - P̃^T`` this variance), random ``u``.

        Args:
            generator: the generator to draw from (default: torch's global one).
        """
        if self.baked:
            return
        with torch.no_grad():
            self.skew.normal_(0.0, math.sqrt(2.0 / self.width), generator=generator)
            self.u.normal_(generator=generator)
            self.u.copy_(F.normalize(self.u, dim=-1))
            if self.u.device.type != "meta":
                # Warm start so that the first Taylor step already sees ||A/σ̂|| ≈ 1.
                self.u.copy_(power_iteration(self.skew_matrices(), self.u, 30))
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def skew_matrices(self) -> torch.Tensor:
        """The ``[L, c, c]`` skew-symmetric matrices ``A_l`` (before normalisation), in float32 or wider.

        Returns:
            The ``[L, c, c]`` matrices.
        """
        return skew_from_vector(self.skew.to(torch.promote_types(self.skew.dtype, torch.float32)), self.width)

    def normalized_skew(self, update: bool) -> torch.Tensor:
        """``A_l / σ̂_l``; ``update`` runs the power iteration and stores ``u`` (training forward only).

        Args:
            update: run the power iteration and store ``u`` first.

        Returns:
            The ``[L, c, c]`` normalized matrices.
        """
        a = self.skew_matrices()
        if update:
            self.u.copy_(power_iteration(a, self.u, self.power_iterations))
        return normalize_skew(a, self.u)

    def full_kernel(self, method: EcoMap, update: bool = False) -> torch.Tensor:
        """The ``[c, c, k, k]`` ECO kernel with the given orthogonal map (before channel folding).

        Args:
            method: ``"taylor"`` or ``"matrix_exp"``.
            update: refresh the power-iteration vector first.

        Returns:
            The ``[c, c, k, k]`` kernel.

        Raises:
            RuntimeError: the layer is baked (its kernel is ``weight``).
        """
        if self.baked:
            raise RuntimeError("EcoConv2d.full_kernel: the layer is baked; its kernel is `weight`")
        a = self.normalized_skew(update)
        blocks = torch.matrix_exp(a) if method == "matrix_exp" else taylor_exp(a, self.train_terms)
        return eco_kernel(blocks, self.index_map)

    def fold_kernel(self, kernel: torch.Tensor) -> torch.Tensor:
        """Fold channel padding/slicing and 1-pixel axes into the kernel: ``[c_out, c_in·s², kh', kw']``.

        Zero-padded input channels meet zero columns and dropped outputs are never computed, so slicing the
        kernel is the same map. On a 1-pixel axis every tap lands on the same pixel, so the taps sum.

        Args:
            kernel: a ``[c, c, k, k]`` kernel.

        Returns:
            The folded ``[c_out, c_in·s², kh', kw']`` kernel.
        """
        kernel = kernel[: self.out_channels, : self.conv_in_channels]
        if self.effective_kernel_size[0] == 1 and kernel.shape[2] > 1:
            kernel = kernel.sum(dim=2, keepdim=True)
        if self.effective_kernel_size[1] == 1 and kernel.shape[3] > 1:
            kernel = kernel.sum(dim=3, keepdim=True)
        return kernel

    def kernel(self, update: bool = False) -> torch.Tensor:
        """The folded kernel the current mode uses (training map in training, cached ``matrix_exp`` in eval).

        ``update`` refreshes the power-iteration vector first (training forward only).

        Args:
            update: refresh the power-iteration vector first (training forward only).

        Returns:
            The folded kernel.
        """
        if self.baked:
            return self.weight
        if self.training:
            return self.fold_kernel(self.full_kernel(self.orthogonal_map, update=update))
        if torch.is_grad_enabled() and self.skew.requires_grad:
            return self.fold_kernel(self.full_kernel("matrix_exp"))  # never cache a tensor that holds a graph
        # Eval: build once with the exact map; rebuild only when the parameters or u changed in place.
        key = (self.skew._version, self.u._version, self.skew.data_ptr(), self.skew.dtype, self.skew.device)
        if self._cache is None or self._cache[0] != key:
            with torch.no_grad():
                self._cache = (key, self.fold_kernel(self.full_kernel("matrix_exp")))
        return self._cache[1]

    @torch.no_grad()
    def bake(self) -> EcoConv2d:
        """Build the kernel once with ``torch.matrix_exp`` and store it; drop the parametrization (``skew``, ``u``).

        Afterwards ``forward`` is ``pixel_unshuffle`` (if strided) + circular pad + one dilated ``F.conv2d`` and
        the state dict holds only ``weight`` (and ``bias``).

        Returns:
            The layer itself.
        """
        if self.baked:
            return self
        # Contiguous, as a reloaded checkpoint is: the same strides give the same conv kernel, bit for bit.
        weight = self.fold_kernel(self.full_kernel("matrix_exp")).detach().clone(memory_format=torch.contiguous_format)
        del self.skew
        del self.u
        self._cache = None
        self.register_buffer("weight", weight)
        self.baked = True
        return self

    def train(self, mode: bool = True) -> EcoConv2d:
        self._cache = None
        return super().train(mode)

    # ----------------------------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if tuple(x.shape[-2:]) != self.input_size:
            raise ValueError(
                f"EcoConv2d was built for input_size={self.input_size} (its dilation depends on it), got a "
                f"{tuple(x.shape[-2:])} input"
            )
        if self.stride > 1:
            x = F.pixel_unshuffle(x, self.stride)
        if x.shape[-3] != self.conv_in_channels:
            raise ValueError(
                f"EcoConv2d expected {self.in_channels} input channels, got {x.shape[-3] // self.stride**2}"
            )
        x = F.pad(x, self.padding, mode="circular") if any(self.padding) else x
        kernel = self.kernel(update=self.training and self.update_power_iteration)
        return F.conv2d(x, kernel.to(x.dtype), self.bias, dilation=self.dilation)

    @torch.no_grad()
    def singular_values(self) -> torch.Tensor:
        """All singular values of the layer's Jacobian in the current mode (float64, Sedghi's theorem).

        Returns:
            The singular values, float64.
        """
        symbol = circular_conv_symbol(self.kernel(), self.conv_size, self.dilation, self.padding)
        return torch.linalg.svdvals(symbol).flatten()

    def lipschitz_constant(self) -> float:
        """Exact ℓ2 Lipschitz constant (largest singular value) of the map the current mode computes.

        Returns:
            The largest singular value.
        """
        return float(self.singular_values().max())

    @torch.no_grad()
    def truncation_error(self) -> float:
        """Largest ``||exp(A_l) - S_T(A_l)||_2`` over the blocks (paper Table 8), for the current ``A_l``.

        Returns:
            The largest error over the blocks.
        """
        if self.baked:
            return 0.0
        return float(taylor_exp_error(normalize_skew(self.skew_matrices(), self.u), self.train_terms).max())

    def extra_repr(self) -> str:
        return (
            f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
            f"input_size={self.input_size}, dilation={self.dilation}, orthogonal_map={self.orthogonal_map!r}, "
            f"baked={self.baked}"
        )
