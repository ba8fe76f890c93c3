"""Stochastic primitives (POET §3.2.1): cheap orthogonal matrices that are applied without densifying.

Block-stochastic (eq. 5): ``G = Ψ^T · Diag(G̃_1, …, G̃_{d/b}) · Ψ`` with ``Ψ = I[perm]`` (``Ψ x = x[perm]``).
Fully stochastic (eq. 4): ``G = I + D(S) (G̃ − I) D(S)^T``, a ``b×b`` block placed on the index subset ``S``.

Every function takes the rotation blocks already built (see :mod:`poet_hf.orthogonal.cayley`) and applies
``x @ G`` (on the last dimension) or ``G @ x`` (on the first dimension) by gather, batched matmul and
scatter. ``perm=None`` means contiguous blocks (plain OFT). Transposing ``G`` is transposing its blocks.
"""

from __future__ import annotations

import hashlib
import math

import torch

__all__ = [
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
    """``inv`` with ``inv[perm[i]] = i``."""
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device, dtype=perm.dtype)
    return inv


def block_matmul_right(x: torch.Tensor, perm: torch.Tensor | None, blocks: torch.Tensor) -> torch.Tensor:
    """``x @ G`` for ``G = Ψ^T Diag(blocks) Ψ``, acting on the last dimension of ``x``.

    ``x Ψ^T`` gathers ``x[..., perm]``; the block-diagonal product is one batched matmul; ``· Ψ`` scatters back,
    i.e. gathers with the inverse permutation.
    """
    num_blocks, b, _ = blocks.shape
    lead = x.shape[:-1]
    z = x if perm is None else x.index_select(-1, perm)
    z = z.reshape(-1, num_blocks, b).transpose(0, 1)  # (num_blocks, tokens, b)
    y = torch.bmm(z, blocks).transpose(0, 1).reshape(*lead, num_blocks * b)
    return y if perm is None else y.index_select(-1, inverse_permutation(perm))


def block_matmul_left(x: torch.Tensor, perm: torch.Tensor | None, blocks: torch.Tensor) -> torch.Tensor:
    """``G @ x`` for ``G = Ψ^T Diag(blocks) Ψ``, acting on the first dimension of a matrix ``x``."""
    num_blocks, b, _ = blocks.shape
    z = x if perm is None else x.index_select(0, perm)
    y = torch.bmm(blocks, z.reshape(num_blocks, b, -1)).reshape(x.shape)
    return y if perm is None else y.index_select(0, inverse_permutation(perm))


def subset_matmul_right(x: torch.Tensor, index: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
    """``x @ G`` for ``G = I + D(S)(G̃ − I)D(S)^T``: only the columns in ``S`` change, to ``x[..., S] @ G̃``."""
    return x.index_copy(-1, index, x.index_select(-1, index) @ block)


def subset_matmul_left(x: torch.Tensor, index: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
    """``G @ x`` for ``G = I + D(S)(G̃ − I)D(S)^T``: only the rows in ``S`` change, to ``G̃ @ x[S]``."""
    return x.index_copy(0, index, block @ x.index_select(0, index))


def spo_generator(seed: int, merge_count: int, layer_name: str, side: str) -> torch.Generator:
    """A CPU generator seeded by (seed, merge count, layer name, side).

    The seed is a stable hash (not Python's salted ``hash``), so every process and every resumed run draws
    the same permutations without communication.
    """
    key = f"{seed}|{merge_count}|{layer_name}|{side}".encode()
    generator = torch.Generator(device="cpu")
    generator.manual_seed(int.from_bytes(hashlib.sha256(key).digest()[:8], "little") & ((1 << 63) - 1))
    return generator


def sample_permutation(dim: int, generator: torch.Generator) -> torch.Tensor:
    """A uniformly random permutation of ``range(dim)``."""
    return torch.randperm(dim, generator=generator)


def subset_size(dim: int, budget: float) -> int:
    """``⌈budget·dim⌉``, the fully stochastic block size for one side."""
    return max(1, math.ceil(budget * dim - 1e-9))


def sample_subset(dim: int, size: int, generator: torch.Generator) -> torch.Tensor:
    """A uniformly random index subset of ``range(dim)`` of the given size, sorted."""
    return torch.randperm(dim, generator=generator)[:size].sort().values
