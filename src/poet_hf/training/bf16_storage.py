"""The input embeddings and the output head stored in bfloat16 and stepped with stochastic rounding.

POET trains the vocabulary-sized weights in full. At Llama 3's 128,256-token vocabulary each is 525 M entries: in
float32, with the input embeddings' two 32-bit AdamW moments (bitsandbytes' and transformers' rule,
`poet_hf.training.eight_bit`), they hold 8.4 GB, more than the 4-bit ``W0`` of every other weight. Stored in
bfloat16 (``vocab_weights_dtype="bfloat16"``), the weights take 2 B per entry and every 32-bit moment of them 2 B;
bitsandbytes' 8-bit moments (the head's) stay 8-bit.

Each step runs the run's own optimizer (torch's or bitsandbytes' AdamW, …) in float32 on a float32 copy of one row
chunk (`poet_hf.training.row_gradients`), then writes the weight and its 32-bit moments back to bfloat16 by
stochastic rounding (`stochastic_round`): each value goes to one of the two bfloat16 numbers around it, with
probabilities that make the rounding unbiased. An update smaller than half a bfloat16 step, which rounding to the
nearest would drop every time, so moves the weight by its size on average (Gupta et al., 2015; the
``bf16_stochastic_round`` of torchao's optimizers). The forward reads a chunk upcast to float32 (exact) and the
backward forms its gradient in float32 (`UpcastLinear`, `UpcastEmbedding`), rounded once to bfloat16 to be the
chunk's gradient.
"""

from __future__ import annotations

from typing import Any, TypeGuard

import torch
import torch.nn.functional as F
from torch import nn

from .eight_bit import own_override_index, share_overrides

__all__ = ["BFloat16Step", "UpcastEmbedding", "UpcastLinear", "is_moment", "stochastic_round"]

LOW_BITS = 1 << 16  # the float32 bits that bfloat16 drops


def stochastic_round(values: torch.Tensor) -> torch.Tensor:
    """``values`` (float32) in bfloat16, each rounded up or down at random: to the larger of its two bfloat16
    neighbours with probability (distance to the smaller) / (their gap), so ``E[round(x)] = x``.

    A uniform integer below 2¹⁶ added to the float32 bits, then the low 16 bits dropped (the sign is kept, so the
    magnitude is what is rounded). Draws from torch's global generator, which ``Trainer`` saves in a checkpoint.

    Args:
        values: a float32 tensor.
    """
    if values.dtype != torch.float32:
        raise ValueError(f"`stochastic_round` takes float32 values, got {values.dtype}")
    bits = values.contiguous().view(torch.int32)
    noise = torch.randint(0, LOW_BITS, bits.shape, dtype=torch.int32, device=bits.device)
    return bits.add(noise).bitwise_and_(-LOW_BITS).view(torch.float32).to(torch.bfloat16)


class UpcastLinear(torch.autograd.Function):
    """``x Wᵀ`` with a bfloat16 ``W`` read in float32; the backward recomputes the float32 ``W`` instead of saving it
    and forms ``∂L/∂W`` in float32, rounded to bfloat16 once."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight.to(x.dtype))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        x, weight = ctx.saved_tensors
        grad_x = grad @ weight.to(grad.dtype) if ctx.needs_input_grad[0] else None
        grad_w = grad.reshape(-1, grad.shape[-1]).T.float() @ x.reshape(-1, x.shape[-1]).float()
        return grad_x, grad_w.to(weight.dtype)


class UpcastEmbedding(torch.autograd.Function):
    """The rows of a bfloat16 ``W`` at ``ids``, in float32 (exact); the backward sums each row's gradient in float32
    and rounds it to bfloat16 once (``padding_idx``'s row gets none, as ``nn.Embedding``'s)."""

    @staticmethod
    def forward(ctx: Any, ids: torch.Tensor, weight: torch.Tensor, padding_idx: int | None) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.shape, ctx.dtype, ctx.padding_idx = weight.shape, weight.dtype, padding_idx
        return F.embedding(ids, weight).float()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor, None]:
        (ids,) = ctx.saved_tensors
        flat = grad.reshape(-1, grad.shape[-1]).float()
        total = torch.zeros(ctx.shape, dtype=torch.float32, device=grad.device).index_add_(0, ids.reshape(-1), flat)
        if ctx.padding_idx is not None:
            total[ctx.padding_idx] = 0
        return None, total.to(ctx.dtype), None


class BFloat16Step:
    """Step one bfloat16 parameter with ``optimizer_cls`` in float32, writing the parameter and each 32-bit state of
    its shape back by `stochastic_round`; other states (8-bit codes, block scales, the step count) stay as they are.

    It stands for a one-parameter optimizer inside `FusedStepOptimizer`: ``param_groups`` are the inner optimizer's,
    and ``state`` (which `FusedStepOptimizer` shares) holds the parameter's state under the parameter itself.

    Args:
        param: the bfloat16 parameter (a row chunk of the head or of an input embedding).
        optimizer_cls: the optimizer class the run uses; it sees a float32 parameter.
        **kwargs: its keyword arguments.
    """

    def __init__(self, param: torch.Tensor, optimizer_cls: type[torch.optim.Optimizer], **kwargs: Any) -> None:
        self.param = param
        self.shadow = nn.Parameter(torch.empty(0, device=param.device))  # the float32 values, during a step only
        share_overrides(param, [self.shadow])  # bitsandbytes' 32-bit override of the embeddings
        self.inner = optimizer_cls([self.shadow], **kwargs)
        own_override_index(self.inner)
        self.param_groups = self.inner.param_groups

    @property
    def state(self) -> Any:
        return self.inner.state

    @state.setter
    def state(self, value: Any) -> None:
        self.inner.state = value

    @torch.no_grad()
    def step(self) -> None:
        """One step of the inner optimizer on the float32 values, then back to bfloat16."""
        param, shadow, state = self.param, self.shadow, self.inner.state
        shadow.data = param.float()
        shadow.grad = None if param.grad is None else param.grad.float()
        if param in state:
            state[shadow] = {key: _widened(value, param) for key, value in state.pop(param).items()}
        try:
            self.inner.step()
            param.copy_(stochastic_round(shadow.data))
        finally:
            if shadow in state:
                state[param] = {key: _narrowed(value, param) for key, value in state.pop(shadow).items()}
            shadow.data, shadow.grad = torch.empty(0, device=param.device), None


def is_moment(value: object, param: torch.Tensor) -> TypeGuard[torch.Tensor]:
    """A floating state shaped like ``param`` (torch's ``exp_avg``, bitsandbytes' 32-bit ``state1``): a moment."""
    return type(value) is torch.Tensor and value.is_floating_point() and value.shape == param.shape


def _widened(value: object, param: torch.Tensor) -> object:
    return value.float() if is_moment(value, param) else value


def _narrowed(value: object, param: torch.Tensor) -> object:
    return stochastic_round(value) if is_moment(value, param) and value.dtype == torch.float32 else value
