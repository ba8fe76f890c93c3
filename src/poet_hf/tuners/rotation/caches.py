"""When the rotation layers build their rotations once per optimizer step instead of once per micro-batch.

With gradient accumulation, every micro-batch but the last of an optimizer step *defers*: its layers read the
rotation blocks from a `RotationCache` (built by the step's first forward)
and add their ``∂L/∂blocks`` to it; the last micro-batch's backward runs the Cayley–Neumann VJP once, on the sum,
inside the backward where DDP and FSDP2 reduce gradients. A micro-batch defers when

- ``transformers.Trainer`` / ``PoetTrainer`` or ``accelerate``'s ``accumulate`` say it is not the step's last
  (``accelerate``'s ``GradientState.sync_gradients`` is ``False``), or
- it runs inside [`defer_rotation_grads`][poet_hf.defer_rotation_grads] (a plain loop: wrap every micro-batch but the
last, as DDP's ``no_sync``).

Outside both, a layer behaves as without accumulation (nothing is cached). A cache is emptied by the last
micro-batch's backward; its pending gradient is applied to the skew parameters' ``.grad`` ("flushed") and the cache
freed when the step is cut short: an optimizer step before the last micro-batch (with a warning), a merge, an
exception in the model's forward, ``model.eval()``; it is dropped with the gradient it belongs to by ``zero_grad()``.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from accelerate.state import GradientState

from ...orthogonal.rotated_linear import RotationCache

logger = logging.getLogger(__name__)

_explicit_deferrals = 0
_layers_with_caches: weakref.WeakSet[Any] = weakref.WeakSet()
_hooks_installed = False
_early_step_warned = False


@contextlib.contextmanager
def defer_rotation_grads() -> Iterator[None]:
    """Run a micro-batch that is not the last of its optimizer step.

    Rotations come from (or go into) the cache, and the polynomial's VJP waits for the step's last micro-batch, which
    runs outside this context.

    For a plain training loop with gradient accumulation (``Trainer``, ``PoetTrainer`` and ``accelerate``'s
    ``accumulate`` need nothing)::

        for i, batch in enumerate(micro_batches):
            with contextlib.nullcontext() if i == len(micro_batches) - 1 else defer_rotation_grads():
                model(**batch).loss.backward()
        optimizer.step()

    Under DDP, use it together with ``model.no_sync()``. Gradients equal those of the loop without it, to rounding.

    Returns:
        A context manager.
    """
    global _explicit_deferrals
    _explicit_deferrals += 1
    try:
        yield
    finally:
        _explicit_deferrals -= 1


def deferring() -> bool:
    """Whether the current micro-batch defers (see the module docstring).

    Accelerate's state is read without creating it: creating ``GradientState`` early would freeze its accumulation
    plugin before the ``Accelerator`` exists."""
    return _explicit_deferrals > 0 or not GradientState._shared_state.get("sync_gradients", True)


def track(layer: Any) -> None:
    """Remember ``layer``, weakly, as one that caches rotations.

    Every optimizer step then flushes and frees its caches."""
    _install_optimizer_hooks()
    _layers_with_caches.add(layer)


def layers_with_caches() -> list[Any]:
    return [layer for layer in list(_layers_with_caches) if layer.rotation_cache_bytes()]


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Apply gradients still deferred when a step comes, and say so once.

    Nothing deferred was reduced across processes, and a gradient clip before the step saw the gradients without
    them."""
    global _early_step_warned
    pending = [layer for layer in layers_with_caches() if layer.fused.has_deferred_grads()]
    if pending and not _early_step_warned:
        _early_step_warned = True
        logger.warning(
            "optimizer.step() ran while rotation gradients were deferred (the accumulation window's last "
            "micro-batch ran under defer_rotation_grads() or with accelerate's sync_gradients=False); they "
            "were applied now, unreduced across processes and after any gradient clipping. (Logged once.)"
        )
    for layer in pending:
        layer.flush_rotation_caches()


def _after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """The skew vectors changed: every cached rotation is stale."""
    for layer in layers_with_caches():
        layer.fused.drop()


def _install_optimizer_hooks() -> None:
    global _hooks_installed
    if not _hooks_installed:
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        register_optimizer_step_pre_hook(_before_step)
        register_optimizer_step_post_hook(_after_step)
        _hooks_installed = True


class _GradAnchor:
    """Hung on a skew parameter's ``.grad``, so that ``zero_grad()`` releases the deferred part of the gradient too.

    The deferred part is the cache's pending sum."""

    def __init__(self, cache: Any) -> None:
        weakref.finalize(self, _drop_pending, weakref.ref(cache))


def _drop_pending(cache_ref: weakref.ref[Any]) -> None:
    cache = cache_ref()
    if cache is not None:
        cache.clear()


def anchor_to_gradient(param: torch.Tensor) -> None:
    """Post-accumulate-grad hook of every skew parameter: tie its cache's pending sum to ``param.grad``.

    The pending sum is part of that gradient. The gradient's version is noted too, so that an in-place
    ``zero_grad(set_to_none=False)`` is seen.

    Registered on the layer's own parameter object. FSDP2 replaces it by sharded and unsharded copies, on which the
    hook never runs: there the cache is freed by the step's last micro-batch, a merge or the step only."""
    cache: RotationCache | None = getattr(param, "_poet_rotation_cache", None)
    grad = param.grad
    if cache is None or cache.pending is None or grad is None:
        return
    cache.grad_version = grad._version
    if getattr(grad, "_poet_anchor_cache", None) is not cache:
        grad._poet_anchor = _GradAnchor(cache)  # type: ignore[attr-defined]  # kept alive by the gradient tensor
        grad._poet_anchor_cache = cache  # type: ignore[attr-defined]


def gradient_was_reset(param: torch.Tensor, cache: Any) -> bool:
    """Whether ``param.grad`` was zeroed in place since the cache's pending sum was added to it."""
    version = cache.grad_version
    return version is not None and (param.grad is None or param.grad._version != version)
