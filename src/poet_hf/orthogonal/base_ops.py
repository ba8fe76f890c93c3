"""The base operation of a rotated layer, with its weight given as the matrix ``W_t`` (out × in)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["LinearOp", "Conv2dOp"]


class LinearOp:
    """``y = x Wᵀ + b`` on the last dimension (``nn.Linear``, and ``Conv1D`` through its transposed weight)."""

    def forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, weight, bias)

    def backward(
        self, grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, input_grad: bool, weight_grad: bool
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        grad_x = grad_y @ weight if input_grad else None
        grad_w = grad_y.reshape(-1, grad_y.shape[-1]).T @ x.reshape(-1, x.shape[-1]) if weight_grad else None
        return grad_x, grad_w

    def bias_grad(self, grad_y: torch.Tensor) -> torch.Tensor:
        return grad_y.reshape(-1, grad_y.shape[-1]).sum(0)


@dataclass(frozen=True)
class Conv2dOp:
    """``nn.Conv2d``'s operation with the weight given as the matrix ``out × (in/groups·kh·kw)``."""

    weight_shape: tuple[int, ...]
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    groups: int

    def forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.conv2d(
            x, weight.reshape(self.weight_shape), bias, self.stride, self.padding, self.dilation, self.groups
        )

    def backward(
        self, grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, input_grad: bool, weight_grad: bool
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        grad_x, grad_w, _ = torch.ops.aten.convolution_backward(
            grad_y,
            x,
            weight.reshape(self.weight_shape),
            None,
            self.stride,
            self.padding,
            self.dilation,
            False,
            [0, 0],
            self.groups,
            [input_grad, weight_grad, False],
        )
        return grad_x, None if grad_w is None else grad_w.reshape(weight.shape)

    def bias_grad(self, grad_y: torch.Tensor) -> torch.Tensor:
        return grad_y.sum((0, 2, 3))
