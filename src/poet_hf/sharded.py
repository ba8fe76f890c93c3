"""Whole views of what FSDP2 shards: one tensor, a state dict, a model copy; and the process-group helpers around them.

Every function here that gathers is a collective: call it on every rank. Nothing here imports the rest of
``poet_hf``, so the tuners, the diagnostics and the export read sharded weights through it;
[`poet_hf.training.distributed`][poet_hf.training.distributed] re-exports the public names beside ``shard_model``.
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole of a tensor FSDP2 may have sharded into a ``DTensor`` (then a collective: every rank calls it).

    Args:
        tensor: a tensor or a ``DTensor``.

    Returns:
        The tensor itself, or the ``DTensor`` gathered whole.
    """
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


@torch.no_grad()
def write_full(param: torch.Tensor, full: torch.Tensor) -> None:
    """Write the whole tensor ``full`` into ``param``.

    A sharded ``DTensor`` takes each rank's own shard of ``full``, which every rank computed identically, so no
    communication is needed.

    Args:
        param: the tensor or ``DTensor`` to write into.
        full: its whole new value.
    """
    write_local(param, local_part(param, full.to(param.dtype)))


def local_part(like: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """The part of ``full`` that this process holds of ``like``, a tensor of ``full``'s shape, or of as many rows when
    FSDP2 split it by rows (``Shard(0)``): all of ``full`` when ``like`` is not a ``DTensor``. No communication.

    Args:
        like: the tensor or ``DTensor`` whose split to follow.
        full: the whole tensor, as every rank computed it.

    Returns:
        This process's part of ``full`` (a view where the split allows), or ``full`` itself.
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(like, DTensor):
        return full
    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None).to_local()


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """What this process holds of ``tensor``: a ``DTensor``'s local shard, or the tensor itself.

    Args:
        tensor: a tensor or a ``DTensor``.

    Returns:
        The local shard, or ``tensor``.
    """
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


@torch.no_grad()
def write_local(param: torch.Tensor, local: torch.Tensor) -> None:
    """Write this process's part ``local`` of ``param`` (its shard, or all of it when it is not a ``DTensor``).

    Args:
        param: the tensor or ``DTensor`` to write into.
        local: what this process holds of its new value.
    """
    from torch.distributed.tensor import DTensor

    (param.to_local() if isinstance(param, DTensor) else param.data).copy_(local)  # .data: no version bump


def is_dtensor(tensor: torch.Tensor) -> bool:
    """Whether FSDP2 has sharded ``tensor`` into a ``DTensor``.

    Args:
        tensor: the tensor to inspect.

    Returns:
        ``True`` for a ``DTensor``.
    """
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def barrier() -> None:
    """Wait for every process of the default group (nothing without one)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def end_distributed(exit_process: bool = False) -> None:
    """Tear down the default process group when one is up: every rank meets at a barrier, then destroys it.

    With ``exit_process=True`` the process then ends at once (``os._exit(0)``, after flushing stdout and stderr).
    gloo's threads outlive ``destroy_process_group`` (PyTorch keeps references to the group), and the interpreter's
    finalization can then abort ("terminate called without an active exception", exit -6) although the run
    succeeded. ``os._exit`` skips ``atexit`` handlers: call it as the last line of a launched script. Without a
    process group this does nothing and returns.

    Args:
        exit_process: end the process with status 0 after the teardown.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    dist.barrier()  # no rank tears gloo down while a peer still talks to it
    dist.destroy_process_group()
    if exit_process:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def is_sharded(model: nn.Module) -> bool:
    """Whether any parameter of ``model`` is a ``DTensor`` (FSDP2 has sharded it).

    Args:
        model: the model to inspect.

    Returns:
        ``True`` when FSDP2 has sharded at least one parameter.
    """
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def shard_count(model: nn.Module) -> int:
    """How many processes share ``model``'s parameters: FSDP2's ``DTensor`` shards or DeepSpeed ZeRO-3 partitions.

    Read from the parameters that are sharded now (inside an FSDP2 unit's forward its own are gathered, the others
    are not).

    Args:
        model: the model to inspect.

    Returns:
        The largest ratio of a parameter's entries to those this process holds; 1 when nothing is sharded.
    """
    from torch.distributed.tensor import DTensor

    shards = 1
    for p in model.parameters():
        if isinstance(p, DTensor):
            full, local = p.numel(), p.to_local().numel()
        else:  # a ZeRO-3 partition: ds_numel entries in all, ds_tensor this process's
            partition = getattr(p, "ds_tensor", None)
            full, local = getattr(p, "ds_numel", 0), 0 if partition is None else partition.numel()
        if local and full:
            shards = max(shards, round(full / local))
    return shards


def gather_full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole state dict on rank 0's CPU (an empty dict on the other ranks), gathered one tensor at a time.

    Args:
        model: the model, sharded or not.

    Returns:
        The state dict on rank 0, ``{}`` on the others.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if not is_sharded(model):
        return {k: v.detach().cpu() for k, v in model.state_dict().items()} if _rank() == 0 else {}
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return cast(dict[str, torch.Tensor], state)  # full_state_dict: plain tensors


def _unwrapped_class(module: nn.Module) -> type:
    """The model class under FSDP2's generated ``FSDP<Name>`` subclass."""
    from torch.distributed.fsdp import FSDPModule

    return next(cls for cls in type(module).__mro__ if not issubclass(cls, FSDPModule))


def unsharded_replica(model: nn.Module) -> nn.Module | None:
    """On rank 0, an unsharded CPU copy of ``model`` (a ``PeftModel`` keeps its adapters); ``None`` elsewhere.

    The base model is rebuilt from its class and config, the adapters from their configs, and the gathered state
    dict (buffers included: permutations, merge counts) is loaded into it, so the copy computes what the sharded
    model computes.

    Args:
        model: the sharded model (a ``PeftModel`` or a plain one).

    Returns:
        The copy on rank 0, ``None`` on the others.

    Raises:
        RuntimeError: the gathered state dict does not fit the rebuilt model.
    """
    state = gather_full_state_dict(model)
    if _rank() != 0:
        return None
    from peft import PeftModel, get_peft_model

    base = model.get_base_model() if isinstance(model, PeftModel) else model
    replica: Any = _unwrapped_class(base)(copy.deepcopy(base.config))  # then a PeftModel around it
    if isinstance(model, PeftModel):
        names = list(model.peft_config)
        replica = get_peft_model(replica, copy.deepcopy(model.peft_config[names[0]]), adapter_name=names[0])
        for name in names[1:]:
            replica.add_adapter(name, copy.deepcopy(model.peft_config[name]))
        replica.base_model.set_adapter(
            model.active_adapters if len(model.active_adapters) > 1 else model.active_adapters[0]
        )
    missing, unexpected = replica.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if not k.endswith("inv_freq")]:
        raise RuntimeError(
            f"the gathered state dict does not fit the rebuilt {type(replica).__name__}: missing "
            f"{missing[:5]}, unexpected {unexpected[:5]}"
        )
    return replica.eval() if not model.training else replica


def save_pretrained_unsharded(model: nn.Module, output_dir: str | Path, **kwargs: Any) -> None:
    """``model.save_pretrained(output_dir)`` for a sharded model: gathered on rank 0 and written once.

    A ``PeftModel`` writes its adapter folder as usual (plus the base weights POET changed, as unsharded
    ``save_pretrained`` does); every rank returns when the folder is complete.

    Args:
        model: the sharded model.
        output_dir: the folder to write.
        **kwargs: passed to ``save_pretrained``.
    """
    state = gather_full_state_dict(model)
    if _rank() == 0:
        cast(Any, model).save_pretrained(output_dir, state_dict=state, is_main_process=True, **kwargs)
    barrier()
