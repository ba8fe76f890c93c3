"""Non-finite steps, named and survived: what `PoetTrainer` does when a loss, gradient or parameter is not finite.

A step whose loss or global gradient norm is not finite is skipped: no parameter, optimizer state or rotation changes
(the gradients are dropped, so the optimizer steps nothing), the step is counted and logged with what was not finite
(the parameters whose values are, else those whose gradients are, by module name and, for a rotation, its side), and
the run goes on; ``max_consecutive_nonfinite_steps`` in a row stop it with `NonFiniteStepError`, the last checkpoint
untouched. A rotation parameter that holds a non-finite value is reset to the identity, with its optimizer state, so
the run can recover: ``W0`` never held it (a merge folds only finite rotations, `fold_checks`), and the layer computes
what it computed after its last merge. The schedule moves on with the step count, as after a step the AMP grad scaler
skips.

The check costs one reduction over the gradients and one host sync per step: the global norm, which the step's clip
computes anyway (`total_grad_norm` and `clip_to_norm` split ``torch.nn.utils.clip_grad_norm_`` around the check, so a
non-finite norm never multiplies every gradient into NaN), and the loss's finiteness. Parameters are searched for the
culprit only on a skipped step. Engines that step inside the backward cannot skip: DeepSpeed stops at the first
non-finite step, after it, and fused steps (`FusedStepOptimizer`) skip the backward of a non-finite loss and the update
of each parameter whose gradient is not finite. With fp16 mixed precision the grad scaler keeps its own policy: it skips
an overflowing step and lowers its scale, as its loss-scale search expects.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from collections.abc import Iterable

import torch
from torch import nn

from ..sharded import local_tensor
from ..tuners.rotation.layer import reset_rotation, rotation_layers
from .optimizer import reset_optimizer_state

logger = logging.getLogger(__name__)

NAMED_AT_MOST = 5  # parameters a message names before it counts the rest


class NonFiniteStepError(RuntimeError):
    """``max_consecutive_nonfinite_steps`` steps in a row were not finite (or one was, where it cannot be skipped)."""


def total_grad_norm(params: Iterable[torch.Tensor]) -> torch.Tensor:
    """The global 2-norm of the parameters' gradients, without clipping; DTensor (FSDP2) shards reduced per mesh, as
    Accelerate's clip does.

    Args:
        params: the parameters.

    Returns:
        The norm, a plain tensor (non-finite where a gradient is).
    """
    from torch.distributed.tensor import DTensor

    by_mesh: dict[object, list[torch.Tensor]] = defaultdict(list)
    for param in params:
        if param.grad is not None:
            by_mesh[param.grad.device_mesh if isinstance(param.grad, DTensor) else None].append(param.grad)
    norms = [torch.nn.utils.get_total_norm(grads) for grads in by_mesh.values()]
    if not norms:
        return torch.zeros(())
    plain = [norm.full_tensor() if isinstance(norm, DTensor) else norm for norm in norms]
    return torch.linalg.vector_norm(torch.stack([n.to(plain[0].device) for n in plain]))


def clip_to_norm(params: Iterable[torch.Tensor], max_norm: float, total: torch.Tensor) -> None:
    """Scale the gradients by ``min(1, max_norm / total)`` (``torch.nn.utils.clip_grads_with_norm_``), per mesh.

    Args:
        params: the parameters.
        max_norm: the clip threshold.
        total: their global gradient norm (`total_grad_norm`).
    """
    from torch.distributed.tensor import DTensor

    by_mesh: dict[object, list[torch.Tensor]] = defaultdict(list)
    for param in params:
        if param.grad is not None:
            by_mesh[param.grad.device_mesh if isinstance(param.grad, DTensor) else None].append(param)
    for group in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)


def _nonfinite(tensor: torch.Tensor | None) -> bool:
    if tensor is None:
        return False
    return bool((~torch.isfinite(local_tensor(tensor))).any())


def _describe(names: list[str]) -> str:
    shown = ", ".join(names[:NAMED_AT_MOST])
    return shown + (f" and {len(names) - NAMED_AT_MOST} more" if len(names) > NAMED_AT_MOST else "")


class NonFiniteGuard:
    """A run's policy and record of non-finite steps (the module docstring); `PoetTrainer` owns one.

    Args:
        limit: consecutive non-finite steps that stop the run (``max_consecutive_nonfinite_steps``).

    Attributes:
        consecutive: non-finite steps since the last finite one.
        skipped: the numbers of the steps skipped so far.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.consecutive = 0
        self.skipped: list[int] = []
        self._loss_finite: torch.Tensor | None = None

    def note_loss(self, loss: torch.Tensor) -> None:
        """Fold a micro-batch's loss into the step's finiteness, on its device (no host sync)."""
        finite = torch.isfinite(loss.detach()).all()
        self._loss_finite = finite if self._loss_finite is None else self._loss_finite & finite.to(self._loss_finite)

    def step_is_finite(self, grad_norm: torch.Tensor | float | None) -> tuple[bool, bool]:
        """``(the gradient norm is finite, every loss noted was)``: the check's one host sync; the next step's record
        starts. The step is skipped on the norm alone, which every process computes alike from the reduced gradients;
        a non-finite loss makes it non-finite (a loss that is not finite while its gradients are updates nothing
        non-finite, and Trainer's ``logging_nan_inf_filter`` keeps it out of the logged loss)."""
        loss_finite = torch.ones((), dtype=torch.bool) if self._loss_finite is None else self._loss_finite
        self._loss_finite = None
        norm = torch.as_tensor(math.nan if grad_norm is None else grad_norm)
        flags = torch.stack([torch.isfinite(norm).all(), loss_finite.to(norm.device)]).tolist()
        return bool(flags[0]), bool(flags[1])

    def passed(self) -> None:
        """A finite step: the count of consecutive ones starts over."""
        self.consecutive = 0

    def skip(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        step: int,
        loss_finite: bool,
        cause: str | None = None,
    ) -> list[str]:
        """Skip step ``step``: name what is not finite, reset non-finite rotations to the identity, drop every
        gradient, count it, and log it.

        Args:
            model: the model being trained.
            optimizer: its optimizer, whose state of a reset rotation is reset too.
            step: the step's number (``global_step + 1``).
            loss_finite: whether every micro-batch's loss was finite.
            cause: what was not finite, where the caller knows it (fused steps free the gradients); ``None``:
                `describe` reads the model.

        Returns:
            The rotations reset, as ``"layer (side)"``.

        Raises:
            NonFiniteStepError: the step is the ``limit``-th non-finite one in a row.
        """
        cause = cause or self.describe(model, loss_finite)
        reset = reset_nonfinite_rotations(model, optimizer)
        model.zero_grad(set_to_none=True)  # the optimizer then steps no parameter: states untouched
        self.consecutive += 1
        self.skipped.append(step)
        if self.consecutive >= self.limit:
            raise NonFiniteStepError(
                f"{self.consecutive} non-finite steps in a row (the last, step {step}: {cause}); stopping, with the "
                "last checkpoint as it was. Resume from it with a lower learning rate, or raise "
                "max_consecutive_nonfinite_steps"
            )
        repaired = f"; reset to the identity: {_describe(reset)}" if reset else ""
        logger.warning(
            "step %d skipped, nothing updated (%d skipped so far, %d in a row): %s%s",
            step,
            len(self.skipped),
            self.consecutive,
            cause,
            repaired,
        )
        return reset

    @staticmethod
    def describe(model: nn.Module, loss_finite: bool) -> str:
        """What is not finite: parameter values first (the likely cause), else gradients, else the loss."""
        sides = {
            id(layer.rotation_parameter(adapter, side)): f"{name} ({side} rotation)"
            for name, layer in rotation_layers(model)
            for adapter in layer.rotation_specs
            for side in layer.sides(adapter)
        }
        values, grads, with_grads = [], [], 0
        for name, param in model.named_parameters():
            label = sides.get(id(param), name)
            if _nonfinite(param):
                values.append(label)
            if param.grad is not None:
                with_grads += 1
                if _nonfinite(param.grad):
                    grads.append(label)
        loss = "" if loss_finite else "the loss is not finite; "
        if values:
            return f"{loss}non-finite values in {_describe(values)}"
        if grads and len(grads) < with_grads:
            return f"{loss}non-finite gradients of {_describe(grads)}"
        if grads:
            return f"{loss}every gradient is non-finite ({len(grads)} parameters)"
        return loss.rstrip("; ") or "the gradient norm is not finite"


def reset_nonfinite_rotations(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> list[str]:
    """Reset every rotation side whose parameters hold a non-finite value to the identity, with its optimizer state.

    Args:
        model: the model.
        optimizer: the optimizer whose state of those parameters is reset; ``None``: none.

    Returns:
        The sides reset, as ``"layer (side)"``.
    """
    reset = []
    for name, layer in rotation_layers(model):
        for adapter in layer.rotation_specs:
            for side in layer.sides(adapter):
                param = layer.rotation_parameter(adapter, side)
                if _nonfinite(param):
                    reset_rotation(layer, adapter, side)
                    if optimizer is not None:
                        reset_optimizer_state(getattr(optimizer, "optimizer", optimizer), [param])
                    reset.append(f"{name} ({side})")
    return reset
