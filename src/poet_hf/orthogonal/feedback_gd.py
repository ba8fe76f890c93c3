"""Feedback Gradient Descent (Bu & Chang, AAAI 2022): momentum on the Stiefel manifold without retraction.

A constrained tensor, viewed as the matrix ``out x (in*kh*kw)``, keeps its smaller Gram at the identity; the feedback
term pulls it back with ``(θᵀθ)^{-1} ≈ 2I − θᵀθ`` (Theorem 4.8: no inverse, QR or SVD). Unconstrained parameters get
``torch.optim.SGD`` semantics exactly. Where the paper's appendix and its reference code disagree, the guide's
"FeedbackGD" section says which this follows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Literal, overload

import torch

from .linalg import orthogonality_error

__all__ = ["FeedbackGD", "stiefel_deviation"]

LR_CHANGE = ("rescale", "reset")


def _tall(tensor: torch.Tensor) -> torch.Tensor:
    """The ``n x p`` (``n >= p``) matrix view of a constrained tensor whose columns are kept orthonormal."""
    mat = tensor.reshape(tensor.shape[0], -1)
    return mat.T if mat.shape[0] <= mat.shape[1] else mat


def stiefel_deviation(tensor: torch.Tensor) -> float:
    """``||theta^T theta - I||_F`` for the tall view of ``tensor`` (``||P P^T - I||_F`` for a wide ``P``).

    The absolute form of [`orthogonality_error`][poet_hf.orthogonal.orthogonality_error], which divides by
    ``||I||_F = √p``.

    Args:
        tensor: a weight (2-D or more; viewed as ``out × in…``).

    Returns:
        ``||θᵀθ − I||_F``.
    """
    theta = _tall(tensor.detach()).double()
    return float(orthogonality_error(theta)) * theta.shape[1] ** 0.5


def _sym(x: torch.Tensor) -> torch.Tensor:
    return (x + x.T) / 2


def _check_group(group: dict[str, Any]) -> None:
    lr, momentum, beta = group["lr"], group["momentum"], group["feedback"]
    if not isinstance(lr, (int, float)) or lr < 0:
        raise ValueError(f"`lr` must be a non-negative number, got {lr!r}")
    if not 0 <= momentum < 1:
        raise ValueError(f"`momentum` must be in [0, 1), got {momentum!r}")
    if group["lr_change"] not in LR_CHANGE:
        raise ValueError(f"`lr_change` must be one of {LR_CHANGE}, got {group['lr_change']!r}")
    if group["weight_decay"] < 0:
        raise ValueError(f"`weight_decay` must be >= 0, got {group['weight_decay']!r}")
    if not isinstance(group["lr_multiplier"], (int, float)) or group["lr_multiplier"] < 0:
        raise ValueError(f"`lr_multiplier` must be a non-negative number, got {group['lr_multiplier']!r}")
    if group["momentum_clip"] is not None and group["momentum_clip"] <= 0:
        raise ValueError(f"`momentum_clip` must be None or > 0, got {group['momentum_clip']!r}")
    if not group["stiefel"]:
        if group["nesterov"] and (momentum <= 0 or group["dampening"] != 0):
            raise ValueError("`nesterov=True` needs `momentum > 0` and `dampening == 0`")
        return
    if group["nesterov"]:
        raise ValueError("`nesterov` is not supported for Stiefel (`stiefel=True`) groups")
    if group["feedback_alpha"] is None and not 0 <= beta < 1:
        raise ValueError(
            f"`feedback` (beta = alpha * lr / 4) must be in [0, 1); 0 < beta <= 0.5 contracts, got {beta!r}"
        )
    if group["feedback_alpha"] is not None and group["feedback_alpha"] < 0:
        raise ValueError(f"`feedback_alpha` must be None or >= 0, got {group['feedback_alpha']!r}")
    for p in group["params"]:
        if p.ndim < 2:
            raise ValueError(
                f"Stiefel parameters must have at least 2 dimensions (out x in...), got shape {tuple(p.shape)}; "
                "put biases and norms in a group with `stiefel=False` or pass `stiefel_params`"
            )


class FeedbackGD(torch.optim.Optimizer):
    """Feedback gradient descent for Stiefel-constrained tensors, plain SGD for the others.

    Args:
        params: parameters or param-group dicts. A group's ``"stiefel"`` key (default: ``stiefel``) says whether
            its tensors are constrained.
        lr: learning rate ``eta``.
        momentum: ``1 - gamma`` (friction ``gamma``); 0 gives the momentum-free feedback step.
        feedback: ``beta = alpha * lr / 4``, the per-step feedback gain of constrained tensors.
        stiefel: default of the groups' ``"stiefel"`` key.
        stiefel_params: if given, exactly these tensors are constrained and every other one is not, whatever
            the groups say (each group is split in two). This is the way to use the optimizer with
            ``Trainer(optimizer_cls_and_kwargs=(FeedbackGD, {..., "stiefel_params": [...]}))``, whose groups
            mix weights and biases.
        feedback_alpha: if set, ``beta = feedback_alpha * lr / 4`` at every step (fixed ``alpha``).
        momentum_clip: cap on ``||b||_F = lr ||phi||_F`` of constrained tensors (Remark A.2's clipping).
        exact_inverse: use ``(theta^T theta)^{-1}`` instead of ``2I - theta^T theta``.
        lr_change: ``"rescale"`` or ``"reset"`` the constrained momentum when ``lr`` changes.
        stiefel_lr_multiplier: default ``lr_multiplier`` of constrained groups (a group's own key wins): their
            step uses ``lr * lr_multiplier``.
        weight_decay: SGD weight decay of unconstrained groups.
        dampening: SGD momentum dampening of unconstrained groups.
        nesterov: Nesterov momentum for unconstrained groups.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float,
        momentum: float = 0.9,
        feedback: float = 0.4,
        *,
        stiefel: bool = True,
        stiefel_params: Iterable[torch.Tensor] | None = None,
        feedback_alpha: float | None = None,
        momentum_clip: float | None = None,
        exact_inverse: bool = False,
        lr_change: Literal["rescale", "reset"] = "rescale",
        stiefel_lr_multiplier: float = 1.0,
        weight_decay: float = 0.0,
        dampening: float = 0.0,
        nesterov: bool = False,
    ) -> None:
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "feedback": feedback,
            "stiefel": stiefel,
            "feedback_alpha": feedback_alpha,
            "momentum_clip": momentum_clip,
            "exact_inverse": exact_inverse,
            "lr_change": lr_change,
            "weight_decay": weight_decay,
            "dampening": dampening,
            "nesterov": nesterov,
        }
        if stiefel_params is not None:
            params = self._split_groups(params, stiefel_params)
        super().__init__(params, defaults)
        for group in self.param_groups:
            group.setdefault("lr_multiplier", stiefel_lr_multiplier if group["stiefel"] else 1.0)
            _check_group(group)

    @staticmethod
    def _split_groups(params: Iterable[Any], stiefel_params: Iterable[torch.Tensor]) -> list[dict[str, Any]]:
        constrained = {id(p) for p in stiefel_params}
        groups = list(params)
        if not groups:
            return groups
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        split = []
        for group in groups:
            members = list(group["params"])
            for flag in (True, False):
                chosen = [p for p in members if (id(p) in constrained) == flag]
                if chosen:
                    split.append({**group, "params": chosen, "stiefel": flag})
        return split

    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One optimizer step; ``closure`` re-evaluates the loss, as in ``torch.optim.SGD``."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                grad = p.grad
                if grad is None:
                    continue
                if grad.is_sparse:
                    raise RuntimeError("FeedbackGD does not support sparse gradients")
                if group["stiefel"]:
                    self._stiefel_step(p, grad, group)
                else:
                    self._sgd_step(p, grad, group)
        return loss

    def _sgd_step(self, p: torch.Tensor, grad: torch.Tensor, group: dict[str, Any]) -> None:
        # The same operations, in the same order, as torch.optim.SGD's single-tensor path.
        d_p = grad if group["weight_decay"] == 0 else grad.add(p, alpha=group["weight_decay"])
        momentum = group["momentum"]
        if momentum != 0:
            state = self.state[p]
            buf = state.get("momentum_buffer")
            if buf is None:
                buf = torch.clone(d_p).detach()
                state["momentum_buffer"] = buf
            else:
                buf.mul_(momentum).add_(d_p, alpha=1 - group["dampening"])
            d_p = d_p.add(buf, alpha=momentum) if group["nesterov"] else buf
        p.add_(d_p, alpha=-group["lr"] * group["lr_multiplier"])

    def _buffer(self, p: torch.Tensor, group: dict[str, Any]) -> torch.Tensor | None:
        """The stored ``b = lr_old * phi``, brought to the current learning rate."""
        state = self.state[p]
        buf = state.get("momentum_buffer")
        if buf is None:
            return None
        lr, old = group["lr"] * group["lr_multiplier"], state["lr"]
        if lr != old:
            if group["lr_change"] == "reset" or old == 0:
                return None
            buf.mul_(lr / old)
        return buf

    def _stiefel_step(self, p: torch.Tensor, grad_p: torch.Tensor, group: dict[str, Any]) -> None:
        lr, mu = group["lr"] * group["lr_multiplier"], group["momentum"]
        beta = group["feedback"] if group["feedback_alpha"] is None else group["feedback_alpha"] * lr / 4
        work = torch.float32 if p.dtype in (torch.float16, torch.bfloat16) else p.dtype
        theta = _tall(p).to(work)
        grad = _tall(grad_p).to(work)
        eye = torch.eye(theta.shape[1], dtype=work, device=p.device)
        gram = theta.T @ theta
        # (theta^T theta)^{-1} ~= 2I - theta^T theta: first-order Neumann series (Theorem 4.8).
        a_inv = torch.linalg.solve(gram, eye) if group["exact_inverse"] else 2 * eye - gram

        def proj(z: torch.Tensor) -> torch.Tensor:  # z - theta Ainv Sym(theta^T z): tangent projection
            return z - theta @ (a_inv @ _sym(theta.T @ z))

        # theta update pulls theta^T theta back to I: - beta theta (I - Ainv), the feedback on theta (eq. 24).
        pull = theta @ (eye - a_inv)
        if mu == 0:
            theta_new = theta - lr * proj(grad) - beta * pull
            p.copy_(self._untall(theta_new, p))
            return
        state = self.state[p]
        old = self._buffer(p, group)
        if old is None:
            b = -lr * proj(grad)  # phi_0 = -Riemannian gradient
        else:
            b = _tall(old).to(work)
            tb = theta.T @ b
            centripetal = -theta @ (a_inv @ (b.T @ b))  # eta^2 * (-theta Ainv phi^T phi)
            force = proj((mu - 1) * b - lr * grad)  # eta * (D - theta Ainv Sym(theta^T D)), D = -gamma phi - G
            correction = theta @ (a_inv @ a_inv @ tb @ _sym(tb))  # eta^2 * theta Ainv^2 theta^T phi Sym(theta^T phi)
            feedback = -beta * theta @ (a_inv @ (b.T @ theta @ a_inv + tb))  # feedback on phi (eq. 25)
            b = b + centripetal + force + correction + feedback
        clip = group["momentum_clip"]
        if clip is not None:
            norm = float(torch.linalg.matrix_norm(b))
            if norm > clip:
                b = b * (clip / norm)
        # The buffer keeps the working precision (float32 for half-precision weights).
        state["momentum_buffer"] = self._untall(b, p, dtype=work).detach().clone()
        state["lr"] = lr
        # Semi-implicit order: theta moves with the *new* b, unprojected, as in the reference code.
        p.copy_(self._untall(theta + b - beta * pull, p))

    @staticmethod
    def _untall(mat: torch.Tensor, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Inverse of `_tall`: back to ``like``'s shape, and to ``dtype`` (default ``like``'s)."""
        rows = like.reshape(like.shape[0], -1)
        out = mat.T if rows.shape[0] <= rows.shape[1] else mat
        return out.reshape(like.shape).to(dtype or like.dtype)

    def stiefel_deviations(self) -> list[float]:
        """``||theta^T theta - I||_F`` of every constrained tensor, in group order (a training diagnostic).

        Returns:
            One deviation per constrained tensor.
        """
        return [stiefel_deviation(p) for g in self.param_groups if g["stiefel"] for p in g["params"]]

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            for key, value in (
                ("stiefel", True),
                ("feedback_alpha", None),
                ("momentum_clip", None),
                ("lr_multiplier", 1.0),
            ):
                group.setdefault(key, value)
