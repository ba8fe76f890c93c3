"""Optimizer steps fused into the backward: each parameter steps as soon as its gradient is complete.

Its gradient is freed at once, so no gradient outlives its parameter's step. Given the model, the output head and the
input embeddings step a row chunk at a time (`poet_hf.training.row_gradients`), so neither one's gradient, the
largest a language model has, is ever whole.

This is the scheme of PyTorch's "How to save memory by fusing the optimizer step into the backward pass" tutorial
and of transformers' layer-wise GaLore optimizers (``register_post_accumulate_grad_hook``). `FusedStepOptimizer`
is an ordinary ``torch.optim.Optimizer`` to the outside: its ``param_groups`` are the groups it was given (a
scheduler moves their rates, read at every step), its ``state`` holds every parameter's state (so ``state_dict``,
``load_state_dict`` and `reset_optimizer_state` work as with the unfused optimizer), its ``step`` only closes the
step for the clip's norm estimate, and its ``zero_grad`` does nothing, the work being done in the backward.

It clips by the global gradient norm without waiting for it (`FusedStepOptimizer`'s ``max_grad_norm``): each
parameter's gradient is scaled by ``min(1, max_grad_norm / N)``, with ``N`` the global norm as far as the backward
knows it, this step's norms of the parameters it has reached and the previous step's of the rest. The last parameter
to step sees this step's exact global norm; the first sees its own new norm beside the others' previous ones.

Over several micro-batches (gradient accumulation) the backwards before the last only accumulate
(`step_in_backward` off); the last one steps. Under DDP (`attach_to_ddp`) the parameters DDP reduces step in its
communication hook, each bucket as soon as its all-reduce completes, and the row chunks, which DDP does not hold, are
all-reduced by their own hooks before they step; every decision reads the reduced gradients, so every process steps
alike.

What it cannot do, by construction, and refuses (`check_fused_step`): unscale fp16 gradients (the loss scaler acts
after the backward), and run under FSDP2 (not built: its clip would need every shard's norm inside the backward) or
DeepSpeed (which owns the step).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, cast

import torch

from ..allocator import bound_allocator_slack
from .bf16_storage import BFloat16Step, is_moment
from .eight_bit import own_override_index, share_overrides
from .row_gradients import RowGradients, steps_by_entry

if TYPE_CHECKING:
    from torch.distributed import GradBucket, ProcessGroup


class FusedStepOptimizer(torch.optim.Optimizer):
    """Runs ``optimizer_cls`` on each parameter of ``groups`` from a post-accumulate-grad hook.

    Each parameter gets an ``optimizer_cls`` of its own, whose hyperparameters are copied from the parameter's
    group at every step (so schedulers and `MergeReinitCallback` act on the groups as usual) and whose state is
    this optimizer's ``state``.

    Args:
        groups: parameter groups, as for ``optimizer_cls`` (`poet_hf.training.poet_param_groups`).
        optimizer_cls: the optimizer class to run per parameter (``torch.optim.AdamW``, bitsandbytes' ``AdamW8bit``,
            …).
        max_grad_norm: the clip threshold, or a function returning it (read at every parameter's step, so a schedule
            such as `MergeReinitCallback`'s post-merge ramp of ``args.max_grad_norm`` applies); ``None`` or 0: no
            clip. The norm it compares with is the running estimate of the module docstring.
        model: the model the groups come from: its output head and input embeddings then train as row chunks, so
            neither one's gradient is ever whole (`poet_hf.training.row_gradients`), where ``optimizer_cls`` updates
            entry by entry (`steps_by_entry`: Adam-type, not Adafactor); ``None``: every parameter as it is.
        vocab_weights_dtype: ``torch.bfloat16`` stores the head and the input embeddings (``model``'s, untied) in
            bfloat16 and steps them with stochastic rounding (`poet_hf.training.bf16_storage`); ``None``: their own.
        **kwargs: ``optimizer_cls``'s keyword arguments (the defaults of every group).

    Raises:
        ValueError: ``vocab_weights_dtype`` without a model, with an optimizer that does not update entry by entry,
            or where the model has no untied, trainable head or input embedding (`check_vocab_weights`).
    """

    def __init__(
        self,
        groups: Iterable[dict[str, Any]],
        optimizer_cls: type[torch.optim.Optimizer],
        *,
        max_grad_norm: float | Callable[[], float | None] | None = None,
        model: torch.nn.Module | None = None,
        vocab_weights_dtype: torch.dtype | None = None,
        **kwargs: Any,
    ):
        bound_allocator_slack()  # freed gradients and update chunks must leave the resident set
        groups = list(groups)
        chunkable = model is not None and steps_by_entry(optimizer_cls, kwargs)
        if vocab_weights_dtype is not None:
            check_vocab_weights(model, optimizer_cls, chunkable)
        self.row_gradients = (
            RowGradients(cast(torch.nn.Module, model), dtype=vocab_weights_dtype) if chunkable else None
        )
        narrow: set[torch.Tensor] = set()
        if self.row_gradients is not None:
            groups = self.row_gradients.replace_in(groups)
            for chunked in self.row_gradients.chunked:
                share_overrides(chunked.weight, chunked.chunks)  # a weight's 32-bit states (keep_32bit_states)
                if chunked.weight.dtype != chunked.dtype:
                    narrow.update(chunked.chunks)
        self.max_grad_norm = max_grad_norm
        self._norms_sq: dict[torch.Tensor, torch.Tensor] = {}  # each parameter's latest squared gradient norm
        self._reached: set[torch.Tensor] = set()  # the parameters that stepped in this step's backward
        self._running_sq: torch.Tensor | None = None  # the sum of _norms_sq, updated as the backward goes
        self.skip_backward = False  # set before a backward whose loss is not finite: it steps nothing
        self.step_in_backward = True  # off for a micro-batch before the last: its backward only accumulates
        self._ddp_reduced: set[torch.Tensor] = set()  # the parameters DDP's communication hook steps (attach_to_ddp)
        self._process_group: ProcessGroup | None = None  # set by attach_to_ddp: the processes to average over
        self.nonfinite: list[torch.Tensor] = []  # this step's parameters left unstepped for a non-finite gradient
        probe = optimizer_cls([torch.zeros(1, requires_grad=True)], **kwargs)  # the class's defaults, with kwargs
        super().__init__(groups, dict(probe.defaults))
        self._inner: list[torch.optim.Optimizer] = []
        self._handles = []
        self._steps: dict[torch.Tensor, Callable[[torch.Tensor], None]] = {}  # each parameter's clip-and-step
        for index, group in enumerate(self.param_groups):
            for param in group["params"]:
                if param in narrow:
                    inner = cast(torch.optim.Optimizer, BFloat16Step(param, optimizer_cls, **kwargs))
                else:
                    inner = optimizer_cls([param], **kwargs)
                    own_override_index(inner)
                self._inner.append(inner)
                self._steps[param] = self._step_of(index, inner)
                self._handles.append(param.register_post_accumulate_grad_hook(self._hook))
        self._share_state()

    def _share_state(self) -> None:
        """Every per-parameter optimizer keeps its state in this one's ``state``, saved, loaded and reset as one.

        It begins with what its constructor put there (APOLLO's per-parameter seed)."""
        for inner in self._inner:
            if inner.state is not self.state:
                for param, state in inner.state.items():
                    self.state[param] = {**state, **self.state.get(param, {})}
            inner.state = self.state

    def _step_of(self, index: int, inner: torch.optim.Optimizer) -> Callable[[torch.Tensor], None]:
        """The clip and step of a parameter of group ``index`` by ``inner``, reading its gradient; nothing steps after
        a non-finite loss or for a non-finite gradient."""
        bounded: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
        if any(c.__module__.startswith("bitsandbytes") for c in type(inner).__mro__):  # CPU kernel, bounded memory
            from .eight_bit import chunked_cpu_updates

            bounded = chunked_cpu_updates

        def clip_and_step(param: torch.Tensor) -> None:
            if self.skip_backward or not self._clip(param):
                return  # nothing steps: its state, norm and value stay as they were
            group = self.param_groups[index]  # looked up now: a scheduler or a loaded state may have replaced it
            _copy_hyperparameters(group, inner.param_groups[0])
            with bounded():
                inner.step()

        return clip_and_step

    def _hook(self, param: torch.Tensor) -> None:
        """A parameter's post-accumulate-grad hook: step it and free its gradient, unless the backward only
        accumulates or DDP's communication hook steps it; under DDP a row chunk is all-reduced here first."""
        if not self.step_in_backward or param in self._ddp_reduced:
            return
        if self._process_group is not None:
            _average_over_processes(cast(torch.Tensor, param.grad), self._process_group)  # a chunk DDP does not hold
        self._steps[param](param)
        param.grad = None

    def before_backward(self, model: torch.nn.Module, last_micro_batch: bool) -> None:
        """Ready the next backward: it steps only on a step's last micro-batch, and under DDP (``model`` wrapped in
        ``DistributedDataParallel``) in DDP's communication hook (`attach_to_ddp`, done once here)."""
        self.step_in_backward = last_micro_batch
        if isinstance(model, torch.nn.parallel.DistributedDataParallel) and not self.attached_to_ddp:
            self.attach_to_ddp(model)

    def note_loss(self, loss: torch.Tensor) -> None:
        """From a micro-batch whose loss is not finite on, the step's backwards step nothing (`skip_backward`); under
        DDP the reduced gradients decide instead, alike on every process."""
        if not self.attached_to_ddp and not bool(torch.isfinite(loss.detach()).all()):
            self.skip_backward = True

    def attach_to_ddp(self, ddp: torch.nn.parallel.DistributedDataParallel) -> None:
        """Step under DDP: each parameter DDP reduces as soon as its bucket's all-reduce completes (a communication
        hook, `torch.nn.parallel.DistributedDataParallel.register_comm_hook`), each row chunk after its own all-reduce.

        Call once, after DDP wraps the model and before its first backward. A bucket's gradients stay in the bucket
        (the gradient of a stepped parameter is a view of it until ``zero_grad``), so no second copy outlives the
        step; the all-reduce is waited for inside the backward, which trades DDP's overlap of the next bucket's
        backward with this one's communication for steps that run in order on every process.

        Args:
            ddp: the DDP-wrapped model whose parameters this optimizer steps.
        """
        self._ddp_reduced = {p for p in ddp.module.parameters() if p in self._steps}  # this optimizer's, DDP's
        self._process_group = ddp.process_group
        # unannotated: DDP checks a hook's annotations against dist.GradBucket, which postponed annotations fail
        ddp.register_comm_hook(None, lambda state, bucket: self._all_reduce_then_step(bucket))

    @property
    def attached_to_ddp(self) -> bool:
        """Whether `attach_to_ddp` was called."""
        return self._process_group is not None

    def _all_reduce_then_step(self, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        """DDP's communication hook: average the bucket over the processes, then step each of its parameters with
        its reduced gradient."""
        buffer = bucket.buffer()
        _average_over_processes(buffer, cast("ProcessGroup", self._process_group))
        for param, grad in zip(bucket.parameters(), bucket.gradients(), strict=True):
            if param in self._ddp_reduced:  # a parameter outside this optimizer's groups keeps DDP's gradient
                param.grad = grad  # the reduced gradient; the local one is freed
                self._steps[param](param)
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        future.set_result(buffer)
        return future

    def _threshold(self) -> float | None:
        value = self.max_grad_norm() if callable(self.max_grad_norm) else self.max_grad_norm
        return value if value and value > 0 else None

    @torch.no_grad()
    def _clip(self, param: torch.Tensor) -> bool:
        """Record ``param``'s gradient norm, then scale its gradient by ``min(1, max_grad_norm / N)``; ``False``, and
        nothing recorded, for a non-finite gradient (`nonfinite`).

        ``N`` is the running estimate of the global norm; the coefficient is ``torch.nn.utils.clip_grad_norm_``'s.
        Norms stay tensors on the gradient's device; the finiteness check reads one per parameter (free on a CPU, a
        wait for the device on a GPU)."""
        grad = cast(torch.Tensor, param.grad)
        norm_sq = _squared_norm(grad)
        if not bool(torch.isfinite(norm_sq)):
            self.nonfinite.append(param)
            return False
        previous = self._norms_sq.get(param)
        running = self._running_sq.to(grad.device) if self._running_sq is not None else torch.zeros_like(norm_sq)
        self._running_sq = running + norm_sq - (previous if previous is not None else 0.0)
        self._norms_sq[param] = norm_sq
        self._reached.add(param)
        threshold = self._threshold()
        if threshold is not None:
            estimate = self._running_sq.clamp(min=0).sqrt()
            grad.mul_((threshold / (estimate + 1e-6)).clamp(max=1.0).to(grad.dtype))
        return True

    def _total_sq(self, params: Iterable[torch.Tensor]) -> torch.Tensor | None:
        norms = [self._norms_sq[p] for p in params]
        return torch.stack([n.cpu() for n in norms]).sum() if norms else None

    @property
    def grad_norm(self) -> float:
        """The global norm of this step's gradients before the clip (of the last step, after `step`)."""
        total = self._total_sq(self._reached or self._norms_sq.keys())
        return 0.0 if total is None else float(total.sqrt())

    def state_dict(self) -> dict[str, Any]:
        """``torch.optim.Optimizer.state_dict``, with the gradient norms the next step's clip starts from."""
        state = super().state_dict()
        params = [p for group in self.param_groups for p in group["params"]]
        state["grad_norms_sq"] = [float(self._norms_sq[p]) if p in self._norms_sq else None for p in params]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """``torch.optim.Optimizer.load_state_dict``, then the per-parameter optimizers read the loaded state."""
        super().load_state_dict(state_dict)
        params = [p for group in self.param_groups for p in group["params"]]
        _keep_saved_dtypes(self.state, params, state_dict["state"])
        self._share_state()
        norms = state_dict.get("grad_norms_sq") or [None] * len(params)
        self._norms_sq = {
            p: torch.tensor(n, dtype=torch.float64, device=p.device)
            for p, n in zip(params, norms, strict=True)
            if n is not None
        }
        self._running_sq = self._total_sq(self._norms_sq)
        self._reached = set()

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """End the step: every parameter stepped in the backward. A closure is still evaluated.

        The clip's norm estimate keeps this step's norms and drops those of parameters that got no gradient."""
        if self._reached:
            self._norms_sq = {p: n for p, n in self._norms_sq.items() if p in self._reached}
            self._running_sq = self._total_sq(self._norms_sq)
            self._reached = set()
        self.skip_backward, self.nonfinite = False, []
        return None if closure is None else closure()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients DDP's buckets still lend the parameters; every other one was freed right after its
        step."""
        for param in self._ddp_reduced:
            param.grad = None

    def remove_hooks(self) -> None:
        """Detach the optimizer from the parameters (the model trains with another optimizer afterwards), and train
        the head and embeddings whole again."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self.row_gradients is not None:
            self.row_gradients.remove()


def _average_over_processes(tensor: torch.Tensor, group: ProcessGroup) -> None:
    """Average ``tensor`` over ``group``'s processes in place, as DDP's default hook does (divide, then sum); a 16-bit
    tensor in float32 (summed once, rounded once; gloo reduces no bfloat16)."""
    import torch.distributed as dist

    summed = tensor.float() if tensor.dtype in (torch.float16, torch.bfloat16) else tensor
    dist.all_reduce(summed.div_(dist.get_world_size(group)), group=group)
    if summed is not tensor:
        tensor.copy_(summed)


def _keep_saved_dtypes(state: Any, params: list[torch.Tensor], saved: dict[int, dict[str, Any]]) -> None:
    """Undo torch's cast of every loaded floating-point parameter's state to the parameter's dtype where the state is
    not a moment shaped like the parameter: bitsandbytes' uint8 codes and float32 block scales and code maps keep
    their saved dtype, as bitsandbytes' own ``load_state_dict`` keeps them."""
    for index, param in enumerate(params):
        for key, value in saved.get(index, {}).items() if param in state else ():
            loaded = state[param].get(key)
            if torch.is_tensor(loaded) and not is_moment(value, param) and loaded.dtype != value.dtype:
                state[param][key] = value.to(device=param.device, copy=True)


def check_vocab_weights(model: torch.nn.Module | None, optimizer_cls: type, chunkable: bool) -> None:
    """Refuse bfloat16 vocabulary weights where the head and embeddings cannot train as row chunks, naming why.

    Args:
        model: the model given to `FusedStepOptimizer`.
        optimizer_cls: its optimizer class.
        chunkable: whether the head and embeddings can train as row chunks (a model and `steps_by_entry`).

    Raises:
        ValueError: not ``chunkable``, or no untied, trainable head or input embedding.
    """
    if not chunkable:
        raise ValueError(
            f"`vocab_weights_dtype` needs the model and an optimizer that updates entry by entry (AdamW, Adam, Lion, "
            f"SGD, …; torch's or bitsandbytes'), got {getattr(optimizer_cls, '__name__', optimizer_cls)}"
        )
    from .row_gradients import row_chunked_modules

    if not row_chunked_modules(cast(torch.nn.Module, model), any_size=True):
        raise ValueError(
            "`vocab_weights_dtype` found no untied, trainable output head or input embedding to store in bfloat16 "
            "(a head tied to its embeddings stays float32: use vocab_weights_dtype='float32')"
        )


NORM_CHUNK = 1 << 16  # entries per float32 partial norm: its error stays near float32 rounding; 256 KB temporaries


def _squared_norm(grad: torch.Tensor) -> torch.Tensor:
    """``‖grad‖²`` as a float64 scalar: float32 partial norms (float64 for a float64 gradient) of a chunk at a time,
    so that a half-precision gradient is never cast whole."""
    dtype = torch.float64 if grad.dtype == torch.float64 else torch.float32
    parts = [torch.linalg.vector_norm(chunk, dtype=dtype) for chunk in grad.reshape(-1).split(NORM_CHUNK)]
    if not parts:
        return torch.zeros((), dtype=torch.float64, device=grad.device)
    return torch.stack(parts).double().square().sum()


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


def check_fused_step(fp16: bool, processes: int, sharded: bool) -> None:
    """Refuse the settings a fused step cannot honour, naming each.

    Args:
        fp16: the run's ``fp16``.
        processes: how many processes train (``world_size``).
        sharded: whether FSDP shards the model (`poet_hf.training.distributed.fsdp_requested`, or its parameters are
            already ``DTensor`` shards).

    Raises:
        ValueError: ``fp16`` (its loss scaler), or FSDP2 with more than one process.
    """
    if fp16:
        raise ValueError(
            "`fused_optimizer_step` cannot run with fp16 (fp16=True): the loss scaler unscales and checks the "
            "gradients after the backward, when they have already stepped; use bf16"
        )
    if processes > 1 and sharded:
        raise ValueError(
            f"`fused_optimizer_step` is not built for FSDP2 (world size {processes}): FSDP2 hands each shard's "
            "gradient to its hook after the reduce-scatter, but the fused clip needs the whole parameter's norm there "
            "(a collective per parameter inside the backward), and its gradients are already 1/N each; use DDP for "
            "fused steps across processes, or FSDP2 without them"
        )
