"""Stochastic primitives (POET §3.2.1): cheap orthogonal matrices that are applied without densifying.

Block-stochastic (eq. 5): ``G = Ψ^T · Diag(G̃_1, …, G̃_{d/b}) · Ψ`` with ``Ψ = I[perm]`` (``Ψ x = x[perm]``).
Fully stochastic (eq. 4): ``G = I + D(S) (G̃ − I) D(S)^T``, a ``b×b`` block placed on the index subset ``S``.

Every function takes the rotation blocks already built (see `cayley`) and applies
``x @ G`` (on the last dimension) or ``G @ x`` (on the first dimension) by gather, batched matmul and
scatter. ``perm=None`` means contiguous blocks (plain OFT). Transposing ``G`` is transposing its blocks.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .cayley import num_skew_params

__all__ = [
    "SideSpec",
    "make_side_spec",
    "nearest_divisor",
    "blockdiag_right",
    "blockdiag_left",
    "blockdiag_grad_right",
    "blockdiag_grad_left",
    "inverse_permutation",
    "block_matmul_right",
    "block_matmul_left",
    "subset_matmul_right",
    "subset_matmul_left",
    "spo_generator",
    "sample_permutation",
    "sample_subset",
    "subset_size",
]


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    """``inv`` with ``inv[perm[i]] = i``.

    Args:
        perm: a permutation of ``range(d)``.

    Returns:
        The inverse permutation.
    """
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device, dtype=perm.dtype)
    return inv


def block_matmul_right(x: torch.Tensor, perm: torch.Tensor | None, blocks: torch.Tensor) -> torch.Tensor:
    """``x @ G`` for ``G = Ψ^T Diag(blocks) Ψ``, acting on the last dimension of ``x``.

    ``x Ψ^T`` gathers ``x[..., perm]``; the block-diagonal product is one batched matmul; ``· Ψ`` scatters back,
    i.e. gathers with the inverse permutation.

    Args:
        x: the tensor ``(..., d)`` to multiply.
        perm: the permutation ``Ψ`` (``None``: contiguous blocks).
        blocks: the ``(d/b, b, b)`` blocks ``G̃_i``.

    Returns:
        ``x @ G``, the shape of ``x``.
    """
    num_blocks, b, _ = blocks.shape
    lead = x.shape[:-1]
    z = x if perm is None else x.index_select(-1, perm)
    z = z.reshape(-1, num_blocks, b).transpose(0, 1)  # (num_blocks, tokens, b)
    y = torch.bmm(z, blocks).transpose(0, 1).reshape(*lead, num_blocks * b)
    return y if perm is None else y.index_select(-1, inverse_permutation(perm))


def block_matmul_left(x: torch.Tensor, perm: torch.Tensor | None, blocks: torch.Tensor) -> torch.Tensor:
    """``G @ x`` for ``G = Ψ^T Diag(blocks) Ψ``, acting on the first dimension of a matrix ``x``.

    Args:
        x: the matrix ``(d, n)`` to multiply.
        perm: the permutation ``Ψ`` (``None``: contiguous blocks).
        blocks: the ``(d/b, b, b)`` blocks ``G̃_i``.

    Returns:
        ``G @ x``, the shape of ``x``.
    """
    num_blocks, b, _ = blocks.shape
    z = x if perm is None else x.index_select(0, perm)
    y = torch.bmm(blocks, z.reshape(num_blocks, b, -1)).reshape(x.shape)
    return y if perm is None else y.index_select(0, inverse_permutation(perm))


def subset_matmul_right(x: torch.Tensor, index: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
    """``x @ G`` for ``G = I + D(S)(G̃ − I)D(S)^T``: only the columns in ``S`` change, to ``x[..., S] @ G̃``.

    Args:
        x: the tensor ``(..., d)``.
        index: the sorted index set ``S`` (``b`` entries).
        block: the ``b × b`` block ``G̃``.

    Returns:
        ``x @ G``, the shape of ``x``.
    """
    return x.index_copy(-1, index, x.index_select(-1, index) @ block)


def subset_matmul_left(x: torch.Tensor, index: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
    """``G @ x`` for ``G = I + D(S)(G̃ − I)D(S)^T``: only the rows in ``S`` change, to ``G̃ @ x[S]``.

    Args:
        x: the matrix ``(d, n)``.
        index: the sorted index set ``S`` (``b`` entries).
        block: the ``b × b`` block ``G̃``.

    Returns:
        ``G @ x``, the shape of ``x``.
    """
    return x.index_copy(0, index, block @ x.index_select(0, index))


def spo_generator(
    seed: int, merge_count: int, layer_name: str, side: str, adapter_name: str = "default"
) -> torch.Generator:
    """A CPU generator seeded by (seed, adapter name, merge count, layer name, side).

    The seed is a stable hash (not Python's salted ``hash``), so every process and every resumed run draws the same
    permutations without communication, and two adapters of one model draw different ones (the ``"default"``
    adapter's key leaves its name out).

    Args:
        seed: the adapter's seed.
        merge_count: how many merges came before the draw.
        layer_name: the layer's name in the base model.
        side: ``"input"`` (R), ``"output"`` (P), or another purpose (``"init"``, ``"base_init"``…).
        adapter_name: the adapter's name.

    Returns:
        A seeded CPU ``torch.Generator``.
    """
    adapter = "" if adapter_name == "default" else f"{adapter_name}|"
    key = f"{seed}|{adapter}{merge_count}|{layer_name}|{side}".encode()
    generator = torch.Generator(device="cpu")
    generator.manual_seed(int.from_bytes(hashlib.sha256(key).digest()[:8], "little") & ((1 << 63) - 1))
    return generator


def sample_permutation(dim: int, generator: torch.Generator) -> torch.Tensor:
    """A uniformly random permutation of ``range(dim)``.

    Args:
        dim: the length ``d``.
        generator: the generator to draw from.

    Returns:
        A permutation of ``range(dim)`` (int64).
    """
    return torch.randperm(dim, generator=generator)


def subset_size(dim: int, budget: float) -> int:
    """``⌈budget·dim⌉``, the fully stochastic block size for one side.

    Args:
        dim: the side's dimension ``d``.
        budget: the fraction of ``d``, in (0, 1].

    Returns:
        The block size ``b`` (at least 1).
    """
    return max(1, math.ceil(budget * dim - 1e-9))


def sample_subset(dim: int, size: int, generator: torch.Generator) -> torch.Tensor:
    """A uniformly random index subset of ``range(dim)`` of the given size, sorted.

    Args:
        dim: the dimension ``d``.
        size: how many indices, ``b``.
        generator: the generator to draw from.

    Returns:
        The ``size`` sorted indices (int64).
    """
    return torch.randperm(dim, generator=generator)[:size].sort().values


# --- one side of a rotated layer ------------------------------------------------------------------------------------
BLOCK, CONTIGUOUS, FULL = "block", "contiguous", "full"


@dataclass(frozen=True)
class SideSpec:
    """Static shape of one side's primitive.

    ``kind`` is ``"block"`` (eq. 5: blocks on a random permutation), ``"contiguous"`` (the same blocks without the
    permutation, PEFT's OFT) or ``"full"`` (eq. 4: one ``block × block`` rotation on a random index subset).
    """

    kind: str
    dim: int
    block: int

    @property
    def num_blocks(self) -> int:
        return 1 if self.kind == FULL else self.dim // self.block

    @property
    def num_params(self) -> int:
        return self.num_blocks * num_skew_params(self.block)

    @property
    def index_shape(self) -> tuple[int]:
        """The shape of `sample_index`'s tensor: a permutation of ``dim``, a subset of ``block``, or empty."""
        return ({BLOCK: self.dim, FULL: self.block}.get(self.kind, 0),)

    def sample_index(self, generator: torch.Generator) -> torch.Tensor:
        """The permutation (block) or sorted index subset (full) for this side; empty for contiguous blocks."""
        if self.kind == BLOCK:
            return sample_permutation(self.dim, generator)
        if self.kind == FULL:
            return sample_subset(self.dim, self.block, generator)
        return torch.empty(0, dtype=torch.long)

    def matmul_right(self, x: torch.Tensor, index: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """``x @ G`` on the last dimension."""
        if self.kind == FULL:
            return subset_matmul_right(x, index, blocks[0])
        return block_matmul_right(x, index if self.kind == BLOCK else None, blocks)

    def matmul_left(self, x: torch.Tensor, index: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """``G @ x`` on the first dimension."""
        if self.kind == FULL:
            return subset_matmul_left(x, index, blocks[0])
        return block_matmul_left(x, index if self.kind == BLOCK else None, blocks)

    def apply_cost(self, other_dim: int) -> int:
        """Multiply-adds of rotating ``other_dim`` vectors of length ``dim``."""
        return other_dim * (self.block**2 if self.kind == FULL else self.dim * self.block)


def nearest_divisor(dim: int, size: int) -> int:
    """The divisor of ``dim`` nearest to ``size``, never 1; ``dim`` itself when ``size >= dim``.

    A tie goes to the smaller.

    This is PEFT's rule for an ``oft_block_size`` that does not divide a layer (``OFTLayer.adjust_oft_parameters``),
    except that a 1-block (a 1×1 rotation is ±1, so nothing would train) gives way to the next divisor above.

    Args:
        dim: the dimension to split into equal blocks (>= 2).
        size: the block size asked for (>= 2).

    Returns:
        A divisor of ``dim`` in ``[2, dim]``.
    """
    if size >= dim:
        return dim
    lower = next(d for d in range(size, 0, -1) if dim % d == 0)
    higher = next(d for d in range(size, dim + 1) if dim % d == 0)
    return lower if lower > 1 and size - lower <= higher - size else higher


def make_side_spec(spo: str, dim: int, block_size: int, subset: int, layer_name: str, field: str) -> SideSpec:
    """Validate and build one side's spec; errors name the config field, the layer and its size.

    ``block_size`` is used by the block kinds, ``subset`` (the index-set size) by ``spo="full"``.
    """
    if spo == FULL:
        if not 2 <= subset <= dim:
            raise ValueError(
                f"`{field}` gives an index set of {subset} on the {dim}-dimensional side of target module "
                f"'{layer_name}'; it must lie in [2, {dim}]"
            )
        return SideSpec(FULL, dim, subset)
    if dim % block_size:
        raise ValueError(
            f"`{field}`={block_size} does not divide the {dim}-dimensional side of target module "
            f"'{layer_name}'; choose a block size that divides every targeted dimension"
        )
    return SideSpec(CONTIGUOUS if spo == CONTIGUOUS else BLOCK, dim, block_size)


# --- block-diagonal products in permuted coordinates (the fused layers' kernels) ------------------------------------
# ``x`` already holds its coordinates in block order (gathered by the permutation, or contiguous blocks), so each
# product is one batched matmul. The layouts are the ones that ran fastest on CPU for small blocks (b = 32): the
# tokens as the long (N) dimension of every block product.


Allocate = Callable[[tuple[int, ...], torch.dtype, torch.device], torch.Tensor]
"""Called with a shape, dtype and device, returns an uninitialised tensor (`poet_hf.orthogonal.scratch.Scratch`)."""


def select_last(x: torch.Tensor, index: torch.Tensor, empty: Allocate | None = None) -> torch.Tensor:
    """``x.index_select(-1, index)``, by ``torch.gather`` on the rows of ``x``, or on the rows of ``xᵀ``.

    The same values, up to twice as fast on a CPU for wide rows (``index_select`` along the last dimension copies
    element by element). A column-major matrix (what `blockdiag_right` returns) is gathered as whole rows of its
    transpose and stays column-major (a matrix product takes it as it is), four times faster than ``index_select``,
    which copies it contiguous first. ``empty`` (outside autograd) gives the result's memory."""
    if x.dim() == 2 and x.shape[0] > 1 and x.T.is_contiguous():
        if empty is None:
            return x.T.index_select(0, index).T
        return torch.index_select(x.T, 0, index, out=empty((index.shape[0], x.shape[0]), x.dtype, x.device)).T
    if x.dim() < 2 or not x.is_contiguous():
        return x.index_select(-1, index)
    rows = x.reshape(-1, x.shape[-1])
    rows_index = index.expand(rows.shape[0], -1)
    if empty is None:
        gathered = torch.gather(rows, 1, rows_index)
    else:
        gathered = torch.gather(rows, 1, rows_index, out=empty(tuple(rows_index.shape), x.dtype, x.device))
    return gathered.reshape(*x.shape[:-1], index.shape[0])


def blockdiag_right(
    x: torch.Tensor, blocks: torch.Tensor, row_major: bool = False, empty: Allocate | None = None
) -> torch.Tensor:
    """``x @ Diag(blocks)`` on the last dimension of ``x`` (``(..., nb·b)``).

    One batched product, whose result is column-major (a matrix product takes it as it is). ``empty`` (outside
    autograd and compilation) gives the result's memory, and with ``row_major`` the product is one per block, each
    written into its columns of a row-major result: that saves the transposing copy a row-major consumer would
    make (as slow as the product itself on a CPU)."""
    num_blocks, b, _ = blocks.shape
    if row_major and empty is not None:
        rows = x.reshape(-1, x.shape[-1])
        out = empty(tuple(rows.shape), x.dtype, x.device)
        for n in range(num_blocks):
            columns = slice(n * b, (n + 1) * b)
            torch.mm(rows[:, columns], blocks[n], out=out[:, columns])
        return out.reshape(x.shape)
    z = x.reshape(-1, num_blocks, b)
    batch = blocks.transpose(1, 2), z.permute(1, 2, 0)
    if empty is None:
        y = torch.bmm(*batch)
    else:
        y = torch.bmm(*batch, out=empty((num_blocks, b, z.shape[0]), x.dtype, x.device))
    # (nb, b, T): y[n, c, t] = Σ_j z[t, n, j] D[n, j, c]
    return y.permute(2, 0, 1).reshape(x.shape)


def blockdiag_left(m: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """``Diag(blocks) @ m`` on the first dimension of a matrix ``m`` (``(nb·b, n)``)."""
    num_blocks, b, _ = blocks.shape
    return torch.bmm(blocks, m.reshape(num_blocks, b, -1)).reshape(m.shape)


def blockdiag_grad_right(x: torch.Tensor, grad_y: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """``dL/dD_j = x_jᵀ g_j`` for ``y = x @ Diag(D)`` (both ``(..., nb·b)``): ``(nb, b, b)``."""
    b = x.shape[-1] // num_blocks
    x3, g3 = x.reshape(-1, num_blocks, b), grad_y.reshape(-1, num_blocks, b)
    return torch.bmm(x3.permute(1, 2, 0), g3.transpose(0, 1))


def blockdiag_grad_left(grad_y: torch.Tensor, m: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """``dL/dD_j = g_j m_jᵀ`` for ``y = Diag(D) @ m`` (both ``(nb·b, n)``): ``(nb, b, b)``."""
    b = m.shape[0] // num_blocks
    return torch.bmm(grad_y.reshape(num_blocks, b, -1), m.reshape(num_blocks, b, -1).transpose(1, 2))
