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
import warnings
import weakref
from collections.abc import Callable, Hashable, Iterator
from contextvars import ContextVar
from typing import Protocol, TypedDict

import torch
from accelerate.state import GradientState
from torch.utils.hooks import RemovableHandle

from ...orthogonal.norm_cap import NormCap
from ...orthogonal.rotated_linear import RotationCache
from ...orthogonal.strategy_costs import CacheChoice
from ...sharded import shard_count
from .residual_folder import ResidualFolder

logger = logging.getLogger(__name__)
_DEFERRAL_DEPTH: ContextVar[int] = ContextVar("poet_hf_rotation_deferral_depth", default=0)


class CacheSummary(TypedDict):
    """What ``cache_rotations="auto"`` chose (`RotationStepState.cache_summary`).

    Args:
        cached: layers that cache.
        decided: layers decided.
        cache_mb: what the caching layers hold, in MiB.
        summary: one line, with the first layer's reason.
    """

    cached: int
    decided: int
    cache_mb: float
    summary: str


class StepCaches(Protocol):
    """One layer's rotation caches (`FusedForward`), as the step hooks see them."""

    caches: dict[tuple[str, str], RotationCache]  # by (adapter, side)

    def has_deferred_grads(self) -> bool: ...

    def drop(self) -> None: ...


class CachingLayer(Protocol):
    """A layer whose rotation caches the model's `RotationStepState` flushes and frees around optimizer steps."""

    @property
    def fused(self) -> StepCaches: ...

    def rotation_cache_bytes(self) -> int: ...

    def flush_rotation_caches(self, collective: bool = True) -> None: ...


class DeferredStepWarning(UserWarning):
    """An optimizer step ran while rotation gradients were still deferred (shown once per process)."""


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
    The window is context-local, as ``torch.no_grad`` is: it covers the forwards run inside it, in this thread.

    Returns:
        A context manager.
    """
    token = _DEFERRAL_DEPTH.set(_DEFERRAL_DEPTH.get() + 1)
    try:
        yield
    finally:
        _DEFERRAL_DEPTH.reset(token)


def deferring() -> bool:
    """Whether the current micro-batch defers (see the module docstring).

    Accelerate's state is read without creating it: creating ``GradientState`` early would freeze its accumulation
    plugin before the ``Accelerator`` exists."""
    return _DEFERRAL_DEPTH.get() > 0 or not GradientState._shared_state.get("sync_gradients", True)


class RotationStepState:
    """The per-step state one model's rotation layers share.

    Which layers hold rotation caches, the optimizer hooks that flush and free those caches around every step, what
    ``cache_rotations="auto"`` chose per layer (`cache_choices`, logged at the first optimizer step after a choice),
    whether the layers run the plain autograd reference (`reference`) instead of the fused forward, and whether a
    training engine moves every gradient off its parameter during the backward (`engine_takes_gradients`, DeepSpeed
    ZeRO: an empty ``.grad`` then says nothing about ``zero_grad``), the norm cap's factors (`norm_cap`), where the
    error-feedback residual files go (`residual_folder`), and what was logged about the model once (`logged`). A
    `RotationModel` owns one and hands it to every layer it injects; a layer built on its own holds its own.

    Args:
        root: the model whose parameters say how many processes share them (`process_shards`); ``None``: unsharded.
    """

    def __init__(self, root: torch.nn.Module | None = None) -> None:
        self.reference = False
        self.engine_takes_gradients = False
        self.norm_cap = NormCap()
        self.residual_folder = ResidualFolder()
        self.logged: set[Hashable] = set()  # messages logged once per model, by key
        self.cache_choices: dict[str, CacheChoice] = {}
        self._unlogged: list[str] = []
        self._root = None if root is None else weakref.ref(root)
        self._layers: weakref.WeakSet[CachingLayer] = weakref.WeakSet()
        self._hooks: tuple[RemovableHandle, RemovableHandle] | None = None

    def __reduce__(self) -> tuple[object, ...]:
        """A copy (``copy.deepcopy``, pickling) keeps `reference` and the residual folder's parent (one folder object
        with the copied layers' stores) and starts with no cache, choice, hook or engine."""
        return _fresh_state, (self.reference, self.residual_folder)

    def process_shards(self) -> int:
        """Processes the model's parameters are sharded over (FSDP2, ZeRO-3), 1 when replicated or unknown."""
        root = None if self._root is None else self._root()
        return 1 if root is None else shard_count(root)

    def note_cache_choice(self, layer_name: str, choice: CacheChoice) -> None:
        """Record what ``cache_rotations="auto"`` chose for one layer (logged at the next optimizer step)."""
        self.cache_choices[layer_name] = choice
        self._unlogged.append(layer_name)
        if self._hooks is None:  # the step hooks log the choices; a layer that never caches registers none
            self._install_hooks()

    def log_cache_choices(self) -> None:
        """Log, once, the choices noted since the last call (`cache_summary` of those layers)."""
        names, self._unlogged = self._unlogged, []
        if names:
            logger.info("cache_rotations='auto': %s", self.cache_summary(names)["summary"])

    def cache_summary(self, names: list[str] | None = None) -> CacheSummary:
        """What ``cache_rotations="auto"`` chose: layers that cache, of those decided, their bytes, and why.

        Args:
            names: the layers to sum over; ``None``: every layer decided so far.

        Returns:
            ``{"cached", "decided", "cache_mb", "summary"}``; ``summary`` is one line with the first layer's reason.
        """
        names = list(self.cache_choices) if names is None else names
        chosen = [self.cache_choices[name] for name in names]
        on = [choice for choice in chosen if choice.cache]
        megabytes = sum(choice.cache_bytes for choice in on) / 2**20
        summary = f"{len(on)} of {len(chosen)} rotation layers cache their rotations across the accumulation window"
        if chosen:
            summary += f" ({megabytes:.1f} MB); {names[0]}: {chosen[0].reason}"
        return {"cached": len(on), "decided": len(chosen), "cache_mb": megabytes, "summary": summary}

    def track(self, layer: CachingLayer) -> None:
        """Remember ``layer``, weakly, as one that caches rotations: every optimizer step flushes and frees them."""
        if self._hooks is None:
            self._install_hooks()
        self._layers.add(layer)

    def _install_hooks(self) -> None:
        self._hooks = _register_step_hooks(weakref.ref(self))
        weakref.finalize(self, _remove_hooks, self._hooks)

    def layers_with_caches(self) -> list[CachingLayer]:
        return [layer for layer in list(self._layers) if layer.rotation_cache_bytes()]

    def before_step(self) -> None:
        """Apply gradients still deferred when a step comes, and say so (once per process).

        Nothing deferred was reduced across processes, and a gradient clip before the step saw the gradients without
        them."""
        self.log_cache_choices()
        pending = [layer for layer in self.layers_with_caches() if layer.fused.has_deferred_grads()]
        if pending:
            warnings.warn(
                "optimizer.step() ran while rotation gradients were deferred (the accumulation window's last "
                "micro-batch ran under defer_rotation_grads() or with accelerate's sync_gradients=False); they "
                "were applied now, unreduced across processes and after any gradient clipping.",
                DeferredStepWarning,
                stacklevel=2,
            )
        for layer in pending:
            layer.flush_rotation_caches()

    def after_step(self) -> None:
        """The skew vectors changed: every cached rotation is stale."""
        for layer in self.layers_with_caches():
            layer.fused.drop()


def _fresh_state(reference: bool, residual_folder: ResidualFolder) -> RotationStepState:
    state = RotationStepState()
    state.reference, state.residual_folder = reference, residual_folder
    return state


def _register_step_hooks(state: weakref.ref[RotationStepState]) -> tuple[RemovableHandle, RemovableHandle]:
    """Process-wide optimizer hooks that reach ``state`` while it lives (every optimizer steps the model's layers).

    A step inside a backward (a parameter's own step, fused into it: `poet_hf.training.FusedStepOptimizer`) is let
    pass: the layers the backward has not reached yet still owe their deferred gradients to it, and the fused
    optimizer's ``step()`` after the backward flushes and drops as any step does."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    def before(optimizer: torch.optim.Optimizer, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
        if (live := state()) is not None and not _inside_backward():
            live.before_step()

    def after(optimizer: torch.optim.Optimizer, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
        if (live := state()) is not None and not _inside_backward():
            live.after_step()

    return register_optimizer_step_pre_hook(before), register_optimizer_step_post_hook(after)


def _inside_backward() -> bool:
    return torch._C._current_graph_task_id() != -1  # the autograd engine is running a backward on this thread


def _remove_hooks(hooks: tuple[RemovableHandle, RemovableHandle]) -> None:
    for hook in hooks:
        hook.remove()


class StatefulLayer(Protocol):
    """A layer that shares its model's `RotationStepState`."""

    @property
    def step_state(self) -> RotationStepState: ...


def gradient_anchor(
    step_caches: StepCaches, layer: StatefulLayer, adapter_name: str, side: str
) -> Callable[[torch.Tensor], None]:
    """The post-accumulate-grad hook of one skew parameter: it ties its cache's pending sum to ``param.grad``.

    The pending sum is part of that gradient, so a ``zero_grad()`` that frees the gradient frees the sum too (a weak
    reference to the gradient, held by the cache, clears it). The gradient's version is noted too, so that an
    in-place ``zero_grad(set_to_none=False)`` is seen (`gradient_was_reset`). Nothing is tied where a training
    engine takes every gradient off its parameter (``engine_takes_gradients``, ZeRO).

    Registered on the layer's own parameter object. FSDP2 replaces it by sharded and unsharded copies, on which the
    hook never runs: there the cache is freed by the step's last micro-batch, a merge or the step only.

    Args:
        step_caches: the layer's rotation caches (held weakly).
        layer: the layer that owns the parameter (held weakly).
        adapter_name: the adapter of the parameter.
        side: its side.
    """
    caches_ref, layer_ref = weakref.ref(step_caches), weakref.ref(layer)

    def anchor(param: torch.Tensor) -> None:
        live, live_caches, grad = layer_ref(), caches_ref(), param.grad
        if live is None or live_caches is None or grad is None or live.step_state.engine_takes_gradients:
            return
        cache = live_caches.caches.get((adapter_name, side))
        if cache is None or cache.pending is None:
            return
        cache.grad_version = grad._version
        if cache.anchor is None or cache.anchor() is not grad:
            cache.anchor = weakref.ref(grad, _pending_dropper(weakref.ref(cache)))

    return anchor


def _pending_dropper(cache_ref: weakref.ref[RotationCache]) -> Callable[[object], None]:
    def drop(_: object) -> None:
        cache = cache_ref()
        if cache is not None:
            cache.clear()

    return drop


def gradient_was_reset(param: torch.Tensor, cache: RotationCache) -> bool:
    """Whether ``param.grad`` was zeroed in place since the cache's pending sum was added to it."""
    version = cache.grad_version
    return version is not None and (param.grad is None or param.grad._version != version)
