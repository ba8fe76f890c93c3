"""Auxiliary reflections ``f(x) = H(W x) x`` ("One Reflection Suffice", seed-002).

One Householder reflection whose vector a linear map computes from the input. With ``W = I - U`` for an
orthogonal ``U``, ``f(x) = U x`` (Theorem 1) for ``x`` outside the fixed subspace of ``U``; in general ``f`` is
norm preserving and homogeneous but not linear.

Numerics that follow the digest rather than the paper:

- ``W x = 0`` (the fixed subspace of ``U``, or ``x = 0``) is 0/0; ``||W x||^2`` is clamped at ``eps``, so ``f``
  tends continuously to ``x`` there (seed-002 §2.1) and gradients stay finite.
- ``log|det J|`` (Lemma 1) uses one eigendecomposition of ``W`` per call, ``A = I - 2 s W`` being diagonal in
  the eigenbasis of ``W`` for every input (seed-002 §4, option 3). Gradients are written by hand from the same
  eigendecomposition, so they never differentiate through ``eig`` (which is singular at repeated eigenvalues,
  e.g. the ``V = I`` start ``W = 1.5 I``).
- The invertible construction is ``W = I + V V^T / (2 sigma_max(V V^T) (1 + margin))``: ``margin > 0`` keeps
  ``lambda_max(W) < 1.5 <= 1.5 lambda_min(W)`` strict (Theorem 2) even for singular ``V`` (seed-002 §2.4).
- The Newton inverse is damped (best of a few step sizes, kept on the sphere ``||x|| = ||y||``) and checks its
  residual, raising or warning: an unconstrained ``W`` is not provably invertible.
"""

from __future__ import annotations

import math
import warnings
from typing import Literal

import torch
from torch import nn

from .linalg import random_orthogonal

__all__ = [
    "NewtonConvergenceError",
    "auxiliary_reflection",
    "auxiliary_reflection_jacobian",
    "auxiliary_reflection_logabsdet",
    "auxiliary_reflection_inverse",
    "invertible_weight",
    "AuxiliaryReflection",
]

DEFAULT_EPS = 1e-12
ON_FAIL = ("raise", "warn", "ignore")


class NewtonConvergenceError(RuntimeError):
    """The Newton inverse of an auxiliary reflection did not reach its residual tolerance."""


def _terms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``u = W x``, ``u^T x`` and the guarded ``||u||^2`` for rows ``x (..., d)``."""
    u = x @ weight.transpose(-1, -2)
    num = (u * x).sum(-1, keepdim=True)
    den = (u * u).sum(-1, keepdim=True).clamp_min(eps)
    return u, num, den


def auxiliary_reflection(x: torch.Tensor, weight: torch.Tensor, eps: float = DEFAULT_EPS) -> torch.Tensor:
    """``f(x) = x - 2 (W x)(x^T W x) / ||W x||^2`` for rows ``x (..., d)``; ``W`` is ``(d, d)``.

    Args:
        x: ``(..., d)`` rows.
        weight: the ``d × d`` matrix ``W``.
        eps: clamp of ``||Wx||²``.

    Returns:
        ``H(Wx) x`` per row, the shape of ``x``.
    """
    u, num, den = _terms(x, weight, eps)
    return x - 2 * u * (num / den)


def auxiliary_reflection_jacobian(x: torch.Tensor, weight: torch.Tensor, eps: float = DEFAULT_EPS) -> torch.Tensor:
    """Jacobians ``(..., d, d)`` of [`auxiliary_reflection`][poet_hf.orthogonal.auxiliary_reflection] at rows ``x``.

    seed-002 Theorem 3.

    ``J = H(Wx) A - 2 (Wx)(x^T W) / ||Wx||^2`` with ``A = I - 2 s W`` and ``s = x^T W x / ||Wx||^2``.

    Args:
        x: ``(..., d)`` rows.
        weight: the ``d × d`` matrix ``W``.
        eps: clamp of ``||Wx||²``.

    Returns:
        The Jacobians ``(..., d, d)``.
    """
    u, num, den = _terms(x, weight, eps)
    s = num / den
    eye = torch.eye(x.shape[-1], dtype=x.dtype, device=x.device)
    a = eye - 2 * s.unsqueeze(-1) * weight
    u_t_a = u - 2 * s * (u @ weight)  # row form of u^T A
    v = x @ weight  # row form of x^T W
    outer = (2 / den).unsqueeze(-1) * u.unsqueeze(-1)
    return a - outer * (u_t_a + v).unsqueeze(-2)


def _eig(weight: torch.Tensor, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Eigenvalues ``lam`` and vectors ``P`` with ``W = P diag(lam) P^{-1}``; returns ``(lam, P, P^{-1})``."""
    if symmetric:
        lam, p = torch.linalg.eigh(weight)
        return lam, p, p.transpose(-1, -2)
    lam, p = torch.linalg.eig(weight)
    return lam, p, torch.linalg.inv(p)


class _LogDetParts(torch.autograd.Function):
    """Per row: ``log|det A|`` and ``v^T A^{-1} u`` for ``A = I - 2 s W``, from one eigendecomposition of ``W``.

    In the eigenbasis ``A = P diag(1 - 2 s lam) P^{-1}``, so both are O(d^2) per row. Backward uses
    ``d log|det A| = tr(A^{-1} dA)`` and ``d(v^T A^{-1} u) = -p^T dA q`` with ``p = A^{-T} v``, ``q = A^{-1} u``.
    """

    @staticmethod
    def forward(ctx, weight, s, u, v, symmetric: bool):
        lam, p, p_inv = _eig(weight, symmetric)
        cdtype = p.dtype
        a = 1 - 2 * s.to(cdtype).unsqueeze(-1) * lam  # (N, d) eigenvalues of A per row
        u_e = u.to(cdtype) @ p_inv.transpose(-1, -2)  # P^{-1} u
        v_e = v.to(cdtype) @ p  # P^T v
        logdet_a = torch.log(a.abs()).sum(-1).to(s.dtype)
        bracket = (v_e * u_e / a).sum(-1).real.to(s.dtype)
        ctx.save_for_backward(weight, s, lam, p, p_inv, a, u_e, v_e)
        return logdet_a, bracket

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_logdet, g_bracket):
        weight, s, lam, p, p_inv, a, u_e, v_e = ctx.saved_tensors
        cdtype = p.dtype
        real = weight.dtype
        g_logdet = g_logdet.to(cdtype)
        g_bracket = g_bracket.to(cdtype)
        s_c = s.to(cdtype)
        q = (u_e / a) @ p.transpose(-1, -2)  # rows of A^{-1} u
        pv = (v_e / a) @ p_inv  # rows of A^{-T} v
        # log|det A| = sum_i log|1 - 2 s lam_i|: dW = -2 s A^{-T}, ds = -2 sum_i lam_i / a_i.
        diag = ((-2 * s_c * g_logdet).unsqueeze(-1) / a).sum(0)
        grad_w = (p_inv.transpose(-1, -2) * diag) @ p.transpose(-1, -2)
        grad_s = g_logdet * (-2 * lam / a).sum(-1)
        # v^T A^{-1} u: du = A^{-T} v, dv = A^{-1} u, dW = 2 s p q^T, ds = 2 p^T W q.
        grad_w = grad_w + (pv * (2 * s_c * g_bracket).unsqueeze(-1)).transpose(-1, -2) @ q
        grad_s = grad_s + g_bracket * 2 * ((pv @ weight.to(cdtype)) * q).sum(-1)
        grad_u = g_bracket.unsqueeze(-1) * pv
        grad_v = g_bracket.unsqueeze(-1) * q
        return grad_w.real.to(real), grad_s.real.to(real), grad_u.real.to(real), grad_v.real.to(real), None


def auxiliary_reflection_logabsdet(
    x: torch.Tensor, weight: torch.Tensor, symmetric: bool = False, eps: float = DEFAULT_EPS
) -> torch.Tensor:
    """``log|det J(x)|`` per row of ``x (..., d)`` by Lemma 1, differentiable in ``x`` and ``W``.

    ``det J = -det(A) (1 + 2 v^T A^{-1} u / ||u||^2)``, ``u = W x``, ``v = W^T x``. ``symmetric=True`` uses
    ``eigh`` (the invertible construction); otherwise a complex ``eig`` (``W`` must be diagonalisable).

    Args:
        x: ``(..., d)`` rows.
        weight: the ``d × d`` matrix ``W``.
        symmetric: ``W`` is symmetric (``eigh``), else a complex ``eig``.
        eps: clamp of ``||Wx||²``.

    Returns:
        ``log|det J(x)|`` per row, shape ``x.shape[:-1]``.
    """
    lead = x.shape[:-1]
    rows = x.reshape(-1, x.shape[-1])
    u, num, den = _terms(rows, weight, eps)
    s = (num / den).squeeze(-1)
    v = rows @ weight
    logdet_a, bracket = _LogDetParts.apply(weight, s, u, v, symmetric)
    return (logdet_a + torch.log((1 + 2 * bracket / den.squeeze(-1)).abs())).reshape(lead)


def _check_on_fail(on_fail: str) -> None:
    if on_fail not in ON_FAIL:
        raise ValueError(f"`on_fail` must be one of {ON_FAIL}, got {on_fail!r}")


def _default_tol(dtype: torch.dtype) -> float:
    # Relative residual: Newton converges quadratically (seed-002 §3), so ~100 ulp is reached when it converges.
    return 100 * torch.finfo(dtype).eps


_STEP_SIZES = (1.0, 0.5, 0.25, 0.125, 0.0625, 0.03125)


def _newton_step(
    x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, radius: torch.Tensor, eps: float
) -> torch.Tensor:
    """One damped Newton step per row: the best of a few step sizes, projected on ``||x|| = ||y||``.

    Plain Newton from ``x_0 = y`` can cycle for an unconstrained ``W`` (seed-002 §3 saw 0.5% failures); picking
    the step size with the smallest residual, and staying on the sphere where every solution lies (``f`` is
    norm preserving), makes it converge there too. Near the solution the full step wins, so convergence stays
    quadratic.
    """
    r = auxiliary_reflection(x, weight, eps) - y
    dx = torch.linalg.solve(auxiliary_reflection_jacobian(x, weight, eps), -r.unsqueeze(-1)).squeeze(-1)
    sizes = torch.tensor(_STEP_SIZES, dtype=x.dtype, device=x.device)
    cand = x.unsqueeze(0) + sizes.view(-1, *([1] * x.ndim)) * dx.unsqueeze(0)
    cand = cand * (radius / cand.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(x.dtype).tiny))
    res = (auxiliary_reflection(cand, weight, eps) - y).norm(dim=-1)
    best = res.argmin(0, keepdim=True)
    return torch.take_along_dim(cand, best.unsqueeze(-1), dim=0).squeeze(0)


def auxiliary_reflection_inverse(
    y: torch.Tensor,
    weight: torch.Tensor,
    *,
    max_iter: int = 20,
    tol: float | None = None,
    on_fail: Literal["raise", "warn", "ignore"] = "raise",
    eps: float = DEFAULT_EPS,
) -> torch.Tensor:
    """Solve ``H(W x) x = y`` for rows ``y (..., d)`` by damped Newton from ``x_0 = y`` (seed-002 §3).

    Stops when every row's relative residual ``||f(x) - y|| / ||y||`` is below ``tol`` (default 100 ulp of the dtype);
    otherwise raises [`NewtonConvergenceError`][poet_hf.orthogonal.NewtonConvergenceError] (``on_fail="raise"``), warns,
    or returns the last iterate. So whatever it returns is a verified preimage of ``y``.

    The preimage is unique when ``W`` comes from [`invertible_weight`][poet_hf.orthogonal.invertible_weight] (the map is
    then a bijection, Theorem 2). For an unconstrained ``W`` it need not be: in 2000 random draws of ``W = I − Q +
    0.1·N(0, 1)`` (``d = 6``, float64), Newton from ``x_0 = y`` failed to converge in 0.1% (raised) and converged to
    *another* preimage than the ``x`` that produced ``y`` in 1.5% — a residual cannot tell those apart. Use
    [`invertible_weight`][poet_hf.orthogonal.invertible_weight] where the inverse must be the one.

    The iterations run without autograd; when a graph is wanted, one last plain Newton step is taken with autograd
    on, which gives the implicit-function gradient.

    Args:
        y: outputs ``(..., d)`` rows.
        weight: the ``d × d`` matrix ``W``.
        max_iter: the iteration cap.
        tol: the relative residual to reach (default 100 ulp of the dtype).
        on_fail: ``"raise"``, ``"warn"`` or ``"ignore"`` when it is not reached.
        eps: clamp of ``||Wx||²``.

    Returns:
        A verified preimage ``x`` (the residual checked), the shape of ``y``.

    Raises:
        ValueError: ``on_fail`` or ``max_iter`` is invalid.
        NewtonConvergenceError: with ``on_fail="raise"``, the residual tolerance is not met.
    """
    _check_on_fail(on_fail)
    if not isinstance(max_iter, int) or max_iter < 1:
        raise ValueError(f"`max_iter` must be a positive integer, got {max_iter!r}")
    tol = _default_tol(y.dtype) if tol is None else tol
    radius = y.detach().norm(dim=-1, keepdim=True)
    scale = radius.squeeze(-1).clamp_min(torch.finfo(y.dtype).tiny)

    with torch.no_grad():
        x = y.detach().clone()
        w = weight.detach()
        for _ in range(max_iter):
            r = auxiliary_reflection(x, w, eps) - y
            if bool(((r.norm(dim=-1) / scale) <= tol).all()):
                break
            x = _newton_step(x, y.detach(), w, radius, eps)
        worst = float(((auxiliary_reflection(x, w, eps) - y).norm(dim=-1) / scale).max()) if x.numel() else 0.0
    if not math.isfinite(worst) or worst > tol:
        msg = (
            f"auxiliary reflection Newton inverse did not converge: max relative residual {worst:.3g} > tol {tol:.3g} "
            f"after {max_iter} iterations (W is not provably invertible unless built with `invertible_weight`)"
        )
        if on_fail == "raise":
            raise NewtonConvergenceError(msg)
        if on_fail == "warn":
            warnings.warn(msg, RuntimeWarning, stacklevel=2)
    if torch.is_grad_enabled() and (y.requires_grad or weight.requires_grad):
        r = auxiliary_reflection(x, weight, eps) - y
        x = x - torch.linalg.solve(auxiliary_reflection_jacobian(x, weight, eps), r.unsqueeze(-1)).squeeze(-1)
    return x


def invertible_weight(factor: torch.Tensor, margin: float = 1e-3) -> torch.Tensor:
    """``W = I + V V^T / (2 sigma_max(V V^T) (1 + margin))``: symmetric with ``1.5 lambda_min > lambda_max``.

    Eigenvalues lie in ``[1, 1 + 1 / (2 (1 + margin))]``, so Theorem 2 of seed-002 makes ``H(W x) x`` invertible.

    Args:
        factor: the trainable ``V`` (``d × r``).
        margin: strictness of the construction (> 0).

    Returns:
        The symmetric ``d × d`` ``W``.

    Raises:
        ValueError: ``margin`` is not positive.
    """
    if margin <= 0:
        raise ValueError(f"`margin` must be > 0 (the paper's margin 0 attains lambda_max = 1.5), got {margin!r}")
    gram = factor @ factor.transpose(-1, -2)
    sigma_max = torch.linalg.eigvalsh(gram)[..., -1]
    eye = torch.eye(factor.shape[-1], dtype=factor.dtype, device=factor.device)
    return eye + gram / (2 * sigma_max * (1 + margin))[..., None, None]


INITS = ("orthogonal", "negative_identity", "random")


class AuxiliaryReflection(nn.Module):
    """``x -> H(W x) x`` on vectors ``(..., d)`` or, with ``conv1x1=True``, on every pixel of ``(B, d, h, w)``.

    Args:
        features: ``d``, the vector length or number of channels.
        conv1x1: apply per pixel to ``(B, C, H, W)`` inputs (Glow's 1x1 convolution position).
        invertible: parameterise ``W = I + V V^T / (2 sigma_max (1 + margin))`` (provably invertible,
            Theorem 2) with trainable ``V``; otherwise ``W`` is a free trainable matrix.
        init: ``"orthogonal"`` (free ``W = I - Q`` for a seeded random orthogonal ``Q``, so ``f(x) = Q x``, Glow's
            1x1 init; not with ``invertible``), ``"negative_identity"`` (``f(x) = -x``: ``W = I``, or ``V = I``),
            ``"random"`` (free ``W`` or ``V`` uniform in ``±1/sqrt(d)``), or an orthogonal ``(d, d)`` tensor ``U``
            (free ``W = I - U``, ``f(x) = U x``). Default: ``"orthogonal"``, or ``"negative_identity"`` when
            ``invertible``.
        eps: clamp of ``||W x||^2``.
        margin: strictness of the invertible construction.
        newton_iters: the Newton inverse's iteration cap.
        newton_tol: the relative residual the inverse must reach (default 100 ulp of the dtype).
        on_fail: what an inverse that does not reach it does: ``"raise"``, ``"warn"`` or ``"ignore"``.
        seed: seed of the random init.
        dtype: dtype of the parameters.
        device: device of the parameters.

    Raises:
        ValueError: an argument is out of range (``features`` < 2, ``margin`` ≤ 0, a bad ``init``…).
    """

    factor: nn.Parameter  # V, when invertible (W = invertible_weight(V)); else the weight W itself
    weight: nn.Parameter

    def __init__(
        self,
        features: int,
        *,
        conv1x1: bool = False,
        invertible: bool = False,
        init: str | torch.Tensor | None = None,
        eps: float = DEFAULT_EPS,
        margin: float = 1e-3,
        newton_iters: int = 20,
        newton_tol: float | None = None,
        on_fail: Literal["raise", "warn", "ignore"] = "raise",
        seed: int = 0,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(features, int) or features < 2:
            raise ValueError(f"`features` must be an integer >= 2 (a reflection of R^1 is just -1), got {features!r}")
        _check_on_fail(on_fail)
        if margin <= 0:
            raise ValueError(f"`margin` must be > 0, got {margin!r}")
        if not isinstance(newton_iters, int) or newton_iters < 1:
            raise ValueError(f"`newton_iters` must be a positive integer, got {newton_iters!r}")
        self.features, self.conv1x1, self.invertible = features, conv1x1, invertible
        self.eps, self.margin = eps, margin
        self.newton_iters, self.newton_tol, self.on_fail = newton_iters, newton_tol, on_fail
        dtype = dtype or torch.get_default_dtype()
        init = ("negative_identity" if invertible else "orthogonal") if init is None else init
        start = self._initial_matrix(init, features, invertible, seed, dtype)
        name = "factor" if invertible else "weight"
        self.register_parameter(name, nn.Parameter(start.to(device=device)))

    @staticmethod
    def _initial_matrix(
        init: str | torch.Tensor, d: int, invertible: bool, seed: int, dtype: torch.dtype
    ) -> torch.Tensor:
        eye = torch.eye(d, dtype=dtype)
        if isinstance(init, torch.Tensor):
            if invertible:
                raise ValueError(
                    "`init` as an orthogonal matrix needs `invertible=False` (W = I - U is singular in general)"
                )
            if init.shape != (d, d):
                raise ValueError(f"`init` matrix must have shape ({d}, {d}), got {tuple(init.shape)}")
            return eye - init.to(dtype)
        allowed = INITS[1:] if invertible else INITS
        if init not in allowed:
            raise ValueError(
                f"`init` must be one of {allowed} or an orthogonal tensor (invertible={invertible}), got {init!r}"
            )
        generator = torch.Generator().manual_seed(seed)
        if init == "orthogonal":
            return eye - random_orthogonal(d, generator, dtype)
        if init == "negative_identity":
            return eye.clone()  # W = I gives H(x) x = -x; V = I gives W = c I, the same map.
        bound = 1 / math.sqrt(d)
        return (torch.rand(d, d, generator=generator, dtype=torch.float64) * 2 - 1).mul(bound).to(dtype)

    def matrix(self) -> torch.Tensor:
        """The auxiliary weight ``W`` (``d x d``).

        Returns:
            The current ``W`` (``d × d``).
        """
        if self.invertible:
            return invertible_weight(self.factor, self.margin)
        return self.weight

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        if self.conv1x1:
            if x.ndim != 4 or x.shape[1] != self.features:
                raise ValueError(f"expected (B, {self.features}, H, W) input, got {tuple(x.shape)}")
            return x.permute(0, 2, 3, 1).reshape(-1, self.features)
        if x.shape[-1] != self.features:
            raise ValueError(f"expected (..., {self.features}) input, got {tuple(x.shape)}")
        return x

    def _unrows(self, rows: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        if self.conv1x1:
            b, c, h, w = like.shape
            return rows.reshape(b, h, w, c).permute(0, 3, 1, 2)
        return rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``H(W x) x`` (per pixel in conv mode)."""
        return self._unrows(auxiliary_reflection(self._rows(x), self.matrix(), self.eps), x)

    def log_abs_det_jacobian(self, x: torch.Tensor) -> torch.Tensor:
        """``log|det J|`` per vector, or per image summed over pixels in conv mode (seed-002 §4).

        Args:
            x: inputs (rows, or images for ``conv1x1``).

        Returns:
            ``log|det J|`` per row (per image for ``conv1x1``).
        """
        logdet = auxiliary_reflection_logabsdet(self._rows(x), self.matrix(), symmetric=self.invertible, eps=self.eps)
        if self.conv1x1:
            return logdet.reshape(x.shape[0], -1).sum(-1)
        return logdet

    def forward_and_logdet(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(f(x), log|det J|)`` with one evaluation of ``W``.

        Args:
            x: inputs (rows, or images for ``conv1x1``).

        Returns:
            ``(f(x), log|det J|)``.
        """
        w = self.matrix()
        rows = self._rows(x)
        out = self._unrows(auxiliary_reflection(rows, w, self.eps), x)
        logdet = auxiliary_reflection_logabsdet(rows, w, symmetric=self.invertible, eps=self.eps)
        if self.conv1x1:
            logdet = logdet.reshape(x.shape[0], -1).sum(-1)
        return out, logdet

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        """``x`` with ``H(W x) x = y``, by Newton's method with a residual check (see ``on_fail``).

        Args:
            y: outputs of the layer.

        Returns:
            The verified preimage (see
                [`auxiliary_reflection_inverse`][poet_hf.orthogonal.auxiliary_reflection_inverse]).
        """
        rows = auxiliary_reflection_inverse(
            self._rows(y),
            self.matrix(),
            max_iter=self.newton_iters,
            tol=self.newton_tol,
            on_fail=self.on_fail,
            eps=self.eps,
        )
        return self._unrows(rows, y)

    def extra_repr(self) -> str:
        return f"features={self.features}, conv1x1={self.conv1x1}, invertible={self.invertible}"
