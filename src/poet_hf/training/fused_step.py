"""Optimizer steps fused into the backward: each parameter steps as soon as its gradient is complete.

Its gradient is freed at once, so no gradient outlives its parameter's step.

This is the scheme of PyTorch's "How to save memory by fusing the optimizer step into the backward pass" tutorial
and of transformers' layer-wise GaLore optimizers (``register_post_accumulate_grad_hook``). `FusedStepOptimizer`
is an ordinary ``torch.optim.Optimizer`` to the outside: its ``param_groups`` are the groups it was given (a
scheduler moves their rates, read at every step), its ``state`` holds every parameter's state (so ``state_dict``,
``load_state_dict`` and `reset_optimizer_state` work as with the unfused optimizer), and its ``step`` and
``zero_grad`` do nothing, the work being done in the backward.

What it cannot do, by construction, and refuses (`check_fused_step`): accumulate gradients over micro-batches (a
step would run at every backward), clip by the global gradient norm (no parameter may wait for the others), unscale
fp16 gradients (the loss scaler acts after the backward), and run under DDP or FSDP2 (a hook sees the local gradient
before it is reduced).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any

import torch
from transformers import TrainingArguments


class FusedStepOptimizer(torch.optim.Optimizer):
    """Runs ``optimizer_cls`` on each parameter of ``groups`` from a post-accumulate-grad hook.

    Each parameter gets an ``optimizer_cls`` of its own, whose hyperparameters are copied from the parameter's
    group at every step (so schedulers and `MergeReinitCallback` act on the groups as usual) and whose state is
    this optimizer's ``state``.

    Args:
        groups: parameter groups, as for ``optimizer_cls`` (`poet_hf.training.poet_param_groups`).
        optimizer_cls: the optimizer class to run per parameter (``torch.optim.AdamW``, bitsandbytes' ``AdamW8bit``,
            …).
        **kwargs: ``optimizer_cls``'s keyword arguments (the defaults of every group).
    """

    def __init__(self, groups: Iterable[dict[str, Any]], optimizer_cls: type[torch.optim.Optimizer], **kwargs: Any):
        groups = list(groups)
        probe = optimizer_cls([torch.zeros(1, requires_grad=True)], **kwargs)  # the class's defaults, with kwargs
        super().__init__(groups, dict(probe.defaults))
        self._inner: list[torch.optim.Optimizer] = []
        self._handles = []
        for index, group in enumerate(self.param_groups):
            for param in group["params"]:
                inner = optimizer_cls([param], **kwargs)
                self._inner.append(inner)
                self._handles.append(param.register_post_accumulate_grad_hook(self._hook(index, inner)))
        self._share_state()

    def _share_state(self) -> None:
        """Every per-parameter optimizer keeps its state in this one's ``state``, saved, loaded and reset as one.

        It begins with what its constructor put there (APOLLO's per-parameter seed)."""
        for inner in self._inner:
            if inner.state is not self.state:
                for param, state in inner.state.items():
                    self.state[param] = {**state, **self.state.get(param, {})}
            inner.state = self.state

    def _hook(self, index: int, inner: torch.optim.Optimizer) -> Callable[[torch.Tensor], None]:
        bounded: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
        if any(c.__module__.startswith("bitsandbytes") for c in type(inner).__mro__):  # CPU kernel, bounded memory
            from .eight_bit import chunked_cpu_updates

            bounded = chunked_cpu_updates

        def step_and_free(param: torch.Tensor) -> None:
            group = self.param_groups[index]  # looked up now: a scheduler or a loaded state may have replaced it
            _copy_hyperparameters(group, inner.param_groups[0])
            with bounded():
                inner.step()
            param.grad = None

        return step_and_free

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """``torch.optim.Optimizer.load_state_dict``, then the per-parameter optimizers read the loaded state."""
        super().load_state_dict(state_dict)
        self._share_state()

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Nothing to do: every parameter stepped in the backward. A closure is still evaluated."""
        return None if closure is None else closure()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: every gradient was freed right after its step."""

    def remove_hooks(self) -> None:
        """Detach the optimizer from the parameters (the model trains with another optimizer afterwards)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _copy_hyperparameters(source: dict[str, Any], target: dict[str, Any]) -> None:
    """``source``'s hyperparameters into ``target``.

    A tensor-valued one is filled in place (torchao keeps ``lr`` as a tensor, which its compiled step reads)."""
    for key, value in source.items():
        if key == "params":
            continue
        current = target.get(key)
        if isinstance(current, torch.Tensor) and not isinstance(value, torch.Tensor):
            current.fill_(value)
        else:
            target[key] = value


def check_fused_step(args: TrainingArguments) -> None:
    """Refuse the settings a fused step cannot honour, naming each.

    Args:
        args: the run's training arguments.

    Raises:
        ValueError: ``gradient_accumulation_steps`` > 1, ``max_grad_norm`` > 0, ``fp16`` (its loss scaler), or more
            than one process.
    """
    if args.gradient_accumulation_steps > 1:
        raise ValueError(
            f"`fused_optimizer_step` steps each parameter in the backward, so it cannot accumulate gradients; got "
            f"gradient_accumulation_steps={args.gradient_accumulation_steps} (use 1, and a larger "
            "per_device_train_batch_size)"
        )
    if args.max_grad_norm and args.max_grad_norm > 0:
        raise ValueError(
            f"`fused_optimizer_step` cannot clip by the global gradient norm (max_grad_norm={args.max_grad_norm}): "
            "each parameter steps before the others' gradients exist; set max_grad_norm=0"
        )
    if args.fp16:
        raise ValueError(
            "`fused_optimizer_step` cannot run with fp16 (fp16=True): the loss scaler unscales and checks the "
            "gradients after the backward, when they have already stepped; use bf16"
        )
    if args.world_size > 1:
        raise ValueError(
            f"`fused_optimizer_step` runs on one process only (world size {args.world_size}): under DDP or FSDP2 a "
            "parameter's hook sees its local gradient before the processes reduce it"
        )
