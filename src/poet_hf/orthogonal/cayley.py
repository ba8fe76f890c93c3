"""Skew-symmetric matrices and the Cayley / Cayley–Neumann maps onto orthogonal matrices.

Convention (shared with PEFT OFTv2 and the POET-X kernel, so adapters interoperate):

- ``Q = M - M^T`` where ``M`` holds the parameter vector on its strict upper triangle.
- Exact Cayley (``terms == 0``): ``R = (I + Q)(I - Q)^{-1}``.
- Cayley–Neumann with ``n`` *terms*, counted as PEFT's OFT counts them so OFT checkpoints
  interoperate: ``R = (I + Q)(I + Q + ... + Q^{n-2}) = I + 2Q + ... + 2Q^{n-2} + Q^{n-1}``.
  The POET paper's eq. 6, ``R ≈ (I + Q)(I + Σ_{i=1..k} Q^i)``, counts the Neumann terms after the identity: its
  ``k`` is ``n − 2``. The paper's recipe (appendix J) is ``k = 4``, i.e. ``n = 6``; its ``k = 1`` (``n = 3``)
  diverged (Table 5).

The truncation error has a closed form: ``R_exact - R_n = R_exact Q^{n-1}`` (Q commutes with
``(I - Q)^{-1}``), so ``R_n = R_exact (I - Q^{n-1})`` and ``||R_n - R_exact||_2 = ||Q||_2^{n-1}``; see
``neumann_error_bound``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from .norm_cap import NormCap, capped_scale

__all__ = [
    "num_skew_params",
    "skew_from_vector",
    "vector_from_skew",
    "cayley",
    "cayley_neumann",
    "rotation_from_skew",
    "SkewRotation",
    "OrthogonalFromVector",
    "orthogonal_from_vector",
    "neumann_error_bound",
    "random_skew_params",
    "check_terms",
]


def num_skew_params(block_size: int) -> int:
    """Number of free parameters of a ``block_size x block_size`` skew-symmetric matrix.

    Args:
        block_size: the side ``b``.

    Returns:
        ``b(b−1)/2``.
    """
    return block_size * (block_size - 1) // 2


def random_skew_params(
    shape: tuple[int, ...],
    block_size: int,
    generator: torch.Generator,
    op_norm: float = 0.1,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Gaussian skew parameters whose ``b × b`` skew matrices have operator norm about ``op_norm``.

    A non-identity start for adapters and tests; the last axis of ``shape`` is
    [`num_skew_params`][poet_hf.orthogonal.num_skew_params].

    A ``b × b`` Gaussian skew matrix with entry std ``s`` has operator norm about ``2 s √b``.

    Args:
        shape: the parameter tensor's shape (last axis ``b(b−1)/2``).
        block_size: the side ``b``.
        generator: the generator to draw from.
        op_norm: the operator norm to aim for.
        dtype: the dtype of the result.

    Returns:
        The parameters, of ``shape``.
    """
    return torch.randn(shape, generator=generator, dtype=dtype) * (op_norm / (2 * math.sqrt(block_size)))


def paper_neumann_k(terms: int) -> int | None:
    """The POET paper's ``k`` for PEFT's term count ``terms``; ``None`` for the exact transform.

    Eq. 6 counts the Neumann terms after the identity, so ``k = terms − 2``."""
    return None if terms == 0 else terms - 2


def check_terms(terms: int, field: str = "terms") -> None:
    """Raise ``ValueError`` unless ``terms`` is 0 (exact Cayley) or at least 2.

    The count is PEFT's; the paper's ``k`` is ``terms − 2``.

    Args:
        terms: the value to check.
        field: the setting's name, for the message.

    Raises:
        ValueError: ``terms`` is neither 0 nor an integer of at least 2.
    """
    if not isinstance(terms, int) or isinstance(terms, bool) or terms < 0 or terms == 1:
        raise ValueError(
            f"`{field}` must be 0 (the exact Cayley transform) or an integer >= 2, got {terms!r}. It counts the terms "
            "of R = I + 2Q + … + 2Q^(n−2) + Q^(n−1) as PEFT does; the POET paper's eq. 6 counts k = n − 2 Neumann "
            f"terms after the identity, so the paper's recipe k = 4 is {field}=6 and its diverging k = 1 is "
            f"{field}=3. n = 1 would be R = 2I, not a rotation."
        )


_T = TypeVar("_T")


def _eager_cache(function: Callable[..., _T]) -> Callable[..., _T]:
    """``functools.cache`` in eager mode; under ``torch.compile`` the function itself.

    Dynamo would trace it into the graph anyway, and warn that it ignores the cache."""
    cached = functools.cache(function)

    @functools.wraps(function)
    def call(*args: Any) -> _T:
        return function(*args) if torch.compiler.is_compiling() else cached(*args)

    return call


@_eager_cache
def _triu_indices(block_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = torch.triu_indices(block_size, block_size, offset=1, device=device)
    return rows, cols


@_eager_cache
def _skew_gather_index(block_size: int, device: torch.device) -> torch.Tensor:
    """Where each entry of a flattened ``b × b`` skew matrix is read from ``[0, vec, −vec]``."""
    rows, cols = _triu_indices(block_size, torch.device("cpu"))
    num = rows.numel()
    index = torch.zeros(block_size, block_size, dtype=torch.long)
    index[rows, cols] = torch.arange(1, num + 1)
    index[cols, rows] = torch.arange(num + 1, 2 * num + 1)
    return index.flatten().to(device)


@_eager_cache
def _triangle_flat_indices(block_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat positions of the strict upper triangle and of its mirror image."""
    rows, cols = _triu_indices(block_size, torch.device("cpu"))
    return (rows * block_size + cols).to(device), (cols * block_size + rows).to(device)


def skew_from_vector(vec: torch.Tensor, block_size: int) -> torch.Tensor:
    """Batched skew-symmetric matrices from strict-upper-triangle vectors.

    Args:
        vec: ``(..., block_size * (block_size - 1) / 2)`` parameters, row-major over the upper triangle
            (the order of ``torch.triu_indices(b, b, 1)``, which PEFT OFT also uses).
        block_size: side ``b`` of each matrix.

    Returns:
        ``(..., b, b)`` tensor ``Q`` with ``Q = -Q^T``.

    Raises:
        ValueError: the last axis of ``vec`` is not ``b(b−1)/2``.
    """
    expected = num_skew_params(block_size)
    if vec.shape[-1] != expected:
        raise ValueError(f"skew vector has {vec.shape[-1]} entries, expected {expected} for block size {block_size}")
    # One gather from [0, vec, −vec]: no zero fill, no scatter, no transpose-subtract.
    padded = torch.cat([vec.new_zeros(*vec.shape[:-1], 1), vec, -vec], dim=-1)
    return padded.index_select(-1, _skew_gather_index(block_size, vec.device)).reshape(
        *vec.shape[:-1], block_size, block_size
    )


def vector_from_skew(grad_q: torch.Tensor, block_size: int) -> torch.Tensor:
    """``dL/dvec`` of [`skew_from_vector`][poet_hf.orthogonal.skew_from_vector] from ``dL/dQ``.

    ``Q = U − Uᵀ`` gives ``dL/dU = dQ − dQᵀ``, read on the strict upper triangle. Only the skew part of ``grad_q``
    contributes."""
    upper, lower = _triangle_flat_indices(block_size, grad_q.device)
    flat = grad_q.reshape(*grad_q.shape[:-2], block_size * block_size)
    return flat.index_select(-1, upper) - flat.index_select(-1, lower)


@_eager_cache
def _identity(size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A shared identity matrix (read-only by convention: never written in place)."""
    return torch.eye(size, dtype=dtype, device=device)


def cayley(q: torch.Tensor) -> torch.Tensor:
    """Exact Cayley transform ``(I + Q)(I - Q)^{-1}`` of a batch of skew-symmetric matrices."""
    eye = torch.eye(q.shape[-1], dtype=q.dtype, device=q.device)
    # X (I - Q) = (I + Q)  <=>  X = (I + Q)(I - Q)^{-1}; the two factors commute.
    return torch.linalg.solve(eye - q, eye + q, left=False)


def cayley_neumann(q: torch.Tensor, terms: int) -> torch.Tensor:
    """Cayley–Neumann approximation ``I + 2Q + ... + 2Q^{terms-2} + Q^{terms-1}``; ``terms == 0`` is exact.

    Args:
        q: skew-symmetric blocks ``(..., b, b)``.
        terms: the number of terms ``n`` (PEFT's count; the paper's ``k = n − 2``), or 0 for the exact transform.

    Returns:
        The rotation blocks ``(..., b, b)``.
    """
    check_terms(terms)
    if terms == 0:
        return cayley(q)
    eye = torch.eye(q.shape[-1], dtype=q.dtype, device=q.device)
    # Horner form of (I + Q)(I + Q + ... + Q^{k-2}), starting from I + Q: k - 2 matmuls, as many as PEFT's loop.
    series = eye + q
    if terms == 2:
        return series
    for _ in range(terms - 3):
        series = eye + q @ series
    return series + q @ series


# --- fused evaluation: the same polynomial, fewer products, and a backward that keeps nothing ------------------------
# R_k = Σ_i c_i Q^i with c = (1, 2, …, 2, 1) is evaluated by Horner's rule in Z = Q², with coefficients linear in Q:
# R = C_0 + Z(C_1 + Z(C_2 + …)), C_j = c_{2j} I + c_{2j+1} Q. That costs ⌈(k−1)/2⌉ products (2 at k = 5, where the
# plain Horner rule in Q costs 3). The backward recomputes Z and the partial sums H_j instead of storing every power,
# and uses dL/dQ only through its skew part (the parameter is skew), which folds the two products of Z's adjoint
# (dZ·Qᵀ + Qᵀ·dZ) into one.


def _neumann_pairs(terms: int) -> list[tuple[float, float]]:
    coefficients = [1.0] + [2.0] * (terms - 2) + [1.0]
    if len(coefficients) % 2:
        coefficients.append(0.0)
    return [(coefficients[i], coefficients[i + 1]) for i in range(0, len(coefficients), 2)]


def _linear_in_q(a: float, b: float, q: torch.Tensor) -> torch.Tensor:
    """``a I + b Q`` as a new tensor."""
    out = q * b if b else torch.zeros_like(q)
    out.diagonal(dim1=-2, dim2=-1).add_(a)
    return out


def _neumann_partial_sums(
    q: torch.Tensor, terms: int
) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor | None]]:
    """``R``, ``Z = Q²`` and the partial sums ``[H_1, …, H_m]`` of Horner's rule in ``Z`` (``H_0 = R``).

    An ``H_m`` that is a multiple of the identity is ``None``. Works on ``(n, b, b)`` batches."""
    pairs = _neumann_pairs(terms)
    if len(pairs) == 1:
        return _linear_in_q(*pairs[0], q), None, []
    z = torch.bmm(q, q)
    last_a, last_b = pairs[-1]
    h = None if last_b == 0 else _linear_in_q(last_a, last_b, q)
    sums: list[torch.Tensor | None] = [h]
    for j in range(len(pairs) - 2, -1, -1):
        a, b = pairs[j]
        h = torch.add(q * b, z, alpha=last_a) if h is None else torch.baddbmm(q * b, z, h)  # C_j + Z H_{j+1}
        h.diagonal(dim1=-2, dim2=-1).add_(a)
        if j:
            sums.append(h)
    assert h is not None  # the loop ran: two or more pairs
    return h, z, sums[::-1]


def neumann_product_count(terms: int) -> tuple[int, int]:
    """Batched ``b × b`` products of the fused evaluation: ``(forward, vector-Jacobian product)``.

    The exact transform (``terms == 0``) is counted as three products each way (an LU factorisation and two
    triangular solves are about that much work).
    """
    check_terms(terms)
    if terms == 0:
        return 3, 3
    pairs = _neumann_pairs(terms)
    if len(pairs) == 1:
        return 0, 0
    scalar_last = pairs[-1][1] == 0  # H_m = c I: multiplying by it costs nothing
    full_sums = len(pairs) - 1 - scalar_last  # partial sums H_1 … H_m that need a product each way
    return 1 + full_sums, 2 * full_sums + 1


class SkewRotation:
    """``R = cayley_neumann(Q, terms)`` evaluated once, keeping what one vector-Jacobian product needs.

    The fused backward of a rotated layer builds ``R`` (it needs it to recompute the rotated weight or activations),
    then calls `vjp` with ``dL/dR``; nothing is kept between the forward and the backward pass.
    """

    @classmethod
    def from_vector(
        cls, vec: torch.Tensor, block_size: int, terms: int, norm_cap: NormCap | None = None
    ) -> SkewRotation:
        """The rotation of the skew vectors ``vec``, with the norm cap of `skew_norm_scale` applied (its factor kept
        in ``norm_cap`` while ``vec``'s value lasts, where one is given)."""
        q = skew_from_vector(vec, block_size)
        scale = capped_scale(vec, q, terms, norm_cap)
        evaluation = cls(q if scale is None else q * scale, terms)
        evaluation.scale = scale
        return evaluation

    def vector_vjp(self, grad_r: torch.Tensor) -> torch.Tensor:
        """``dL/dvec`` for an evaluation built by `from_vector`."""
        grad_q = self.vjp(grad_r)
        return vector_from_skew(grad_q if self.scale is None else grad_q * self.scale, self._shape[-1])

    scale: torch.Tensor | None = None

    def __init__(self, q: torch.Tensor, terms: int) -> None:
        check_terms(terms)
        self.terms, self._shape = terms, q.shape
        b = q.shape[-1]
        self.q = q.reshape(-1, b, b)
        if terms == 0:
            eye = _identity(b, q.dtype, q.device)
            self._lu = torch.linalg.lu_factor(eye - self.q)
            rotation = torch.linalg.lu_solve(*self._lu, eye + self.q, left=False)
        else:
            rotation, self._z, self._sums = _neumann_partial_sums(self.q, terms)
        self.rotation = rotation.reshape(q.shape)

    def vjp(self, grad_r: torch.Tensor) -> torch.Tensor:
        """``dL/dQ`` for ``dL/dR = grad_r`` (only its skew part is meaningful: feed it to `vector_from_skew`)."""
        b = self._shape[-1]
        grad = grad_r.reshape(-1, b, b)
        rotation = self.rotation.reshape(-1, b, b)
        if self.terms == 0:
            # dR = (I + R) dQ (I − Q)^{-1}, so dL/dQ = (I + R)ᵀ Γ (I − Q)^{-T}: one more solve with the same LU.
            scaled = torch.linalg.lu_solve(*self._lu, grad, left=False, adjoint=True)
            return torch.baddbmm(scaled, rotation.transpose(-1, -2), scaled).reshape(self._shape)
        pairs = _neumann_pairs(self.terms)
        if len(pairs) == 1:
            return (pairs[0][1] * grad).reshape(self._shape)
        # Blocks are independent: a group of VJP_BLOCKS at a time bounds the temporaries, with the same values.
        parts = [self._polynomial_vjp(grad, group) for group in _groups(grad.shape[0], VJP_BLOCKS)]
        return (parts[0] if len(parts) == 1 else torch.cat(parts)).reshape(self._shape)

    def _polynomial_vjp(self, grad: torch.Tensor, group: slice) -> torch.Tensor:
        """``dL/dQ`` of the blocks in ``group`` (the Neumann polynomial's reverse Horner pass)."""
        pairs = _neumann_pairs(self.terms)
        grad = grad[group]
        through_q = grad * pairs[0][1]
        assert self._z is not None  # set by the forward for two or more pairs
        z = self._z[group]
        grad_h, grad_z = grad, None
        for j, h_next in enumerate(h if h is None else h[group] for h in self._sums):  # H_j = C_j + Z H_{j+1}
            if h_next is None:  # H_m = c I: Z H_m costs no product
                grad_z = grad_h * pairs[-1][0] if grad_z is None else grad_z.add_(grad_h, alpha=pairs[-1][0])
                break
            grad_z = (
                torch.bmm(grad_h, h_next.transpose(-1, -2))
                if grad_z is None
                else torch.baddbmm(grad_z, grad_h, h_next.transpose(-1, -2))
            )
            grad_h = torch.bmm(z, grad_h)  # Zᵀ = Z
            through_q.add_(grad_h, alpha=pairs[j + 1][1])
        # Z = QQ contributes −(dZ Q + Q dZ), whose skew part is the skew part of −(dZ + dZᵀ)Q.
        assert grad_z is not None  # the loop ran: there is at least one partial sum
        return torch.baddbmm(through_q, grad_z + grad_z.transpose(-1, -2), self.q[group], alpha=-1)


VJP_BLOCKS = 8  # blocks per group of SkewRotation.vjp: 2 MB per temporary at b = 256, float32


def _groups(count: int, size: int) -> list[slice]:
    return [slice(start, min(start + size, count)) for start in range(0, count, size)]


def rotation_from_skew(q: torch.Tensor, terms: int) -> torch.Tensor:
    """``cayley_neumann(q, terms)`` by the fused evaluation (no autograd graph; same polynomial, fewer products)."""
    check_terms(terms)
    if terms == 0:
        return cayley(q)
    b = q.shape[-1]
    return _neumann_partial_sums(q.reshape(-1, b, b), terms)[0].reshape(q.shape)


class OrthogonalFromVector(torch.autograd.Function):
    """Rotation blocks from skew vectors, saving only the vectors: the backward recomputes the polynomial."""

    @staticmethod
    def forward(ctx, vec: torch.Tensor, block_size: int, terms: int) -> torch.Tensor:
        ctx.save_for_backward(vec)
        ctx.block_size, ctx.terms = block_size, terms
        return SkewRotation.from_vector(vec, block_size, terms).rotation

    @staticmethod
    def backward(ctx, grad_r: torch.Tensor):
        (vec,) = ctx.saved_tensors
        return SkewRotation.from_vector(vec, ctx.block_size, ctx.terms).vector_vjp(grad_r), None, None


def orthogonal_from_vector(vec: torch.Tensor, block_size: int, terms: int) -> torch.Tensor:
    """Rotation blocks ``(..., b, b)`` from skew parameter vectors ``(..., b(b-1)/2)``.

    Evaluated by `rotation_from_skew`; under autograd through `OrthogonalFromVector`, which keeps only
    ``vec`` for the backward (the plain composition [`cayley_neumann`][poet_hf.orthogonal.cayley_neumann] ∘
    [`skew_from_vector`][poet_hf.orthogonal.skew_from_vector] is the
    reference it is tested against). Blocks beyond `MAX_SKEW_NORM` are rescaled onto it
    (`skew_norm_scale`).

    Args:
        vec: skew parameters ``(..., b(b−1)/2)``.
        block_size: the side ``b``.
        terms: the number of Cayley–Neumann terms ``n`` (0: exact).

    Returns:
        The rotation blocks ``(..., b, b)``.
    """
    check_terms(terms)
    if torch.is_grad_enabled() and vec.requires_grad:
        return OrthogonalFromVector.apply(vec, block_size, terms)
    return SkewRotation.from_vector(vec, block_size, terms).rotation


def neumann_error_bound(q: torch.Tensor, terms: int) -> torch.Tensor:
    """Largest deviation from 1 of any singular value of the Cayley–Neumann rotation of ``Q``, per block.

    ``R_k = R_exact (I - Q^{k-1})`` with ``R_exact`` orthogonal and ``Q`` normal, so the singular values of
    ``R_k`` are ``|1 - (iθ)^{k-1}|`` over the eigenvalues ``iθ`` of ``Q``. That distance from 1 grows with
    ``|θ|``, so the largest is reached at ``θ = ||Q||_2``: ``θ^{k-1}`` for odd ``k`` and
    ``sqrt(1 + θ^{2(k-1)}) - 1`` for even ``k``. Zero for the exact transform (``terms == 0``).

    Args:
        q: skew-symmetric blocks ``(..., b, b)``.
        terms: the number of terms ``n``.

    Returns:
        The bound per block, shape ``q.shape[:-2]``.
    """
    return neumann_error_bound_at_norm(torch.linalg.matrix_norm(q, ord=2), terms)


def neumann_error_bound_at_norm(theta: torch.Tensor, terms: int) -> torch.Tensor:
    """`neumann_error_bound` of blocks whose spectral norms ``||Q||_2`` are ``theta`` (elementwise).

    A caller that has the norms already spares an SVD per block."""
    check_terms(terms)
    if terms == 0:
        return torch.zeros_like(theta)
    return ((1 - (1j * theta.to(torch.complex128)) ** (terms - 1)).abs() - 1).abs().to(theta.dtype)
