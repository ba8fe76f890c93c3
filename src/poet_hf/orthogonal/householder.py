"""Products of Householder reflections: sequential and blocked (compact WY) forms.

Two storage conventions are supported:

- **LAPACK / ``torch.linalg.householder_product``** (``input``, ``tau``): column ``i`` of ``input`` holds the
  part of ``v_i`` below the diagonal, ``v_i[i] = 1`` implicitly and ``v_i[:i] = 0``; ``H_i = I - tau_i v_i v_i^T``
  and the result is the first ``n`` columns of ``H_1 H_2 ... H_k``.
- **Dense vectors** (``vectors`` of shape ``(k, d)``): ``H(v) = I - 2 v v^T / (v^T v)`` with no normalisation
  asked of the caller, as in the reflection papers (seed-002 §1, §6).

The blocked form groups ``block_size`` reflections into one ``I - V T V^T`` (Schreiber–Van Loan compact WY).
``T`` is the inverse of ``striu(V^T V) + diag(1 / tau)`` (Joffrain et al. 2006), so every block's ``T`` comes
from one batched triangular solve, in parallel over blocks, and the product is ``k / block_size`` sequential
rank-``block_size`` updates instead of ``k`` rank-one ones (FastH, seed-002 §6).
"""

from __future__ import annotations

import torch

__all__ = [
    "householder_reflect",
    "householder_product_sequential",
    "householder_product_blocked",
    "householder_matrix",
    "apply_householder_sequence",
    "householder_decompose",
]


def _check_block_size(block_size: int) -> None:
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"`block_size` must be a positive integer, got {block_size!r}")


def householder_reflect(v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Apply ``H(v) = I - 2 v v^T / (v^T v)`` to the last dimension of ``x`` without forming the matrix.

    Args:
        v: ``(d,)`` reflection vector, or ``(..., d)`` broadcastable against ``x``.
        x: ``(..., d)`` vectors (one per row).

    Returns:
        ``x`` reflected, the shape of ``x``.
    """
    return x - (2 * (x * v).sum(-1, keepdim=True) / (v * v).sum(-1, keepdim=True)) * v


def _unpack_lapack(input: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """The ``(..., m, k)`` unit-lower-trapezoidal matrix of reflection vectors stored in ``input``."""
    m, n = input.shape[-2:]
    k = tau.shape[-1]
    if not (m >= n >= k):
        raise ValueError(
            f"householder_product needs input (..., m, n) and tau (..., k) with m >= n >= k, got m={m}, n={n}, k={k}"
        )
    vecs = input[..., :, :k].tril(-1)
    return vecs + torch.eye(m, k, dtype=input.dtype, device=input.device)


def householder_product_sequential(input: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """First ``n`` columns of ``H_1 ... H_k``, one reflection at a time.

    The semantics are ``torch.linalg.householder_product``'s.

    Real dtypes only. Differentiable with respect to ``input`` and ``tau``.

    Args:
        input: the reflection vectors in LAPACK's packed form ``(..., m, n)``.
        tau: the scale factors ``(..., k)``.

    Returns:
        The first ``n`` columns of ``H_1 ⋯ H_k``, as ``torch.linalg.householder_product``.
    """
    vecs = _unpack_lapack(input, tau)
    m, n = input.shape[-2:]
    out = torch.eye(m, n, dtype=input.dtype, device=input.device).expand(*input.shape[:-2], m, n)
    # Accumulate from the right, Q = H_1 (H_2 (... (H_k E))), so each step is a rank-one update of (m, n).
    for i in reversed(range(tau.shape[-1])):
        v = vecs[..., :, i : i + 1]
        out = out - (tau[..., i, None, None] * v) @ (v.transpose(-1, -2) @ out)
    return out


def _wy_factor(vecs: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """Upper-triangular ``T`` with ``H_1 ... H_b = I - V T V^T`` for ``V = vecs (..., m, b)``, ``tau (..., b)``.

    ``T^{-1} = striu(V^T V) + diag(1 / tau)``; a reflection with ``tau = 0`` is the identity and is handled by
    zeroing its column of ``V`` and using ``1 / tau := 1`` (its row and column of ``T`` are then 0).
    """
    active = tau != 0
    vecs = vecs * active.unsqueeze(-2)
    inv_tau = torch.where(active, 1 / torch.where(active, tau, torch.ones_like(tau)), torch.ones_like(tau))
    gram = (vecs.transpose(-1, -2) @ vecs).triu(1)
    t_inv = gram + torch.diag_embed(inv_tau)
    eye = torch.eye(tau.shape[-1], dtype=tau.dtype, device=tau.device)
    t = torch.linalg.solve_triangular(t_inv, eye.expand_as(t_inv), upper=True)
    # Rows/columns of inactive reflections must be exactly zero, whatever V held.
    return t * active.unsqueeze(-1) * active.unsqueeze(-2)


def _blocks(vecs: torch.Tensor, tau: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad ``k`` reflections to a multiple of ``block_size`` with identities and stack into blocks.

    Returns ``V (..., nb, m, b)`` and ``T (..., nb, b, b)``; block ``j`` is ``I - V_j T_j V_j^T``.
    """
    m, k = vecs.shape[-2:]
    nb = -(-k // block_size)
    pad = nb * block_size - k
    if pad:
        vecs = torch.cat([vecs, vecs.new_zeros(*vecs.shape[:-1], pad)], dim=-1)
        tau = torch.cat([tau, tau.new_zeros(*tau.shape[:-1], pad)], dim=-1)
    vb = vecs.reshape(*vecs.shape[:-1], nb, block_size).movedim(-2, -3)  # (..., nb, m, b)
    tb = tau.reshape(*tau.shape[:-1], nb, block_size)
    return vb, _wy_factor(vb, tb)


def householder_product_blocked(input: torch.Tensor, tau: torch.Tensor, block_size: int = 32) -> torch.Tensor:
    """The product of [`householder_product_sequential`][poet_hf.orthogonal.householder_product_sequential], blocked.

    It applies compact-WY blocks of ``block_size`` reflections.

    Args:
        input: the reflection vectors in LAPACK's packed form ``(..., m, n)``.
        tau: the scale factors ``(..., k)``.
        block_size: reflections per compact-WY block.

    Returns:
        The same as ``torch.linalg.householder_product(input, tau)``.
    """
    _check_block_size(block_size)
    vecs = _unpack_lapack(input, tau)
    m, n = input.shape[-2:]
    out = torch.eye(m, n, dtype=input.dtype, device=input.device).expand(*input.shape[:-2], m, n)
    if tau.shape[-1] == 0:
        return out.clone()
    vb, tb = _blocks(vecs, tau, block_size)
    for j in reversed(range(vb.shape[-3])):
        v, t = vb[..., j, :, :], tb[..., j, :, :]
        out = out - v @ (t @ (v.transpose(-1, -2) @ out))
    return out


def _dense_tau(vectors: torch.Tensor) -> torch.Tensor:
    return 2 / (vectors * vectors).sum(-1)


def householder_matrix(vectors: torch.Tensor, block_size: int | None = None) -> torch.Tensor:
    """The ``d x d`` matrix ``H(v_1) H(v_2) ... H(v_k)`` for dense vectors ``(..., k, d)``.

    ``block_size=None`` multiplies one reflection at a time; an integer uses compact-WY blocks.

    Args:
        vectors: dense reflection vectors ``(k, d)``.
        block_size: reflections per compact-WY block; ``None``: one after another.

    Returns:
        ``H(v_1) ⋯ H(v_k)``, ``d × d``.
    """
    d = vectors.shape[-1]
    eye = torch.eye(d, dtype=vectors.dtype, device=vectors.device)
    return apply_householder_sequence(vectors, eye.expand(*vectors.shape[:-2], d, d), block_size).transpose(-1, -2)


def apply_householder_sequence(vectors: torch.Tensor, x: torch.Tensor, block_size: int | None = None) -> torch.Tensor:
    """Rows ``x (..., B, d)`` mapped to ``U x`` with ``U = H(v_1) ... H(v_k)``, i.e. returns ``x @ U^T``.

    ``block_size=None``: ``k`` sequential reflections (``H(v_k)`` first). Integer: blocks of that many
    reflections, each applied as one ``x <- x - (x V) T^T V^T`` update.

    Args:
        vectors: dense reflection vectors ``(k, d)``.
        x: rows ``(..., d)``.
        block_size: reflections per compact-WY block; ``None``: one after another.

    Returns:
        ``x`` times the product of the reflections, the shape of ``x``.
    """
    if block_size is None:
        for i in reversed(range(vectors.shape[-2])):
            x = householder_reflect(vectors[..., i, :].unsqueeze(-2), x)
        return x
    _check_block_size(block_size)
    vb, tb = _blocks(vectors.transpose(-1, -2), _dense_tau(vectors), block_size)
    for j in reversed(range(vb.shape[-3])):
        v, t = vb[..., j, :, :], tb[..., j, :, :]
        x = x - ((x @ v) @ t.transpose(-1, -2)) @ v.transpose(-1, -2)
    return x


def householder_decompose(u: torch.Tensor, tol: float = 1e-12) -> torch.Tensor:
    """Dense vectors ``(k, d)``, ``k <= d``, with ``H(v_1) ... H(v_k) = u`` for an orthogonal ``u``.

    seed-002 §6: reduce ``M = u`` column by column with ``v = M e_i - e_i``; every recorded reflection maps
    the current column onto ``e_i`` (Lemma 5), and the reduction ends at ``M = I``.

    Args:
        u: an orthogonal ``d × d`` matrix.
        tol: below this norm a reflection vector is skipped.

    Returns:
        Vectors ``(k, d)`` with ``H(v_1) ⋯ H(v_k) = u``.

    Raises:
        ValueError: ``u`` is not square.
    """
    if u.ndim != 2 or u.shape[0] != u.shape[1]:
        raise ValueError(f"`u` must be a square matrix, got shape {tuple(u.shape)}")
    d = u.shape[0]
    m = u.clone()
    eye = torch.eye(d, dtype=u.dtype, device=u.device)
    vecs = []
    for i in range(d):
        v = m[:, i] - eye[:, i]
        if v.norm() > tol:
            vecs.append(v)
            m = householder_reflect(v, m.T).T
    if not vecs:
        return u.new_zeros(0, d)
    return torch.stack(vecs)
