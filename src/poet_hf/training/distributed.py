"""POET under FSDP2 (``torch.distributed.fsdp.fully_shard``): sharding a model, and gathering what must be whole.

POET trains under FSDP2 as it is: every parameter (the frozen ``W0`` included) is a sharded ``DTensor``, FSDP2
all-gathers one decoder layer's parameters for its forward and backward, and the fused POET layers see ordinary
tensors there. Merge-then-reinitialize runs outside the forward on the sharded weights: each layer gathers its own
``W0`` and skew vectors, folds, writes back only its shard and draws the same permutations on every rank
(`merge_and_reinit`), so a merge never holds more than one
layer's full weight. This module adds what a sharded run needs around that: sharding per decoder layer (what
Accelerate's ``fsdp_version: 2`` does inside ``Trainer``); the gathers that end a run (an unsharded copy on
rank 0 to export or save, written once) live in [`poet_hf.sharded`][poet_hf.sharded] and are re-exported here.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from ..sharded import (
    barrier,
    end_distributed,
    full_tensor,
    gather_full_state_dict,
    is_sharded,
    save_pretrained_unsharded,
    unsharded_replica,
)
from ..tuners.tuner_base import base_model_of

__all__ = [
    "shard_model",
    "shard_dim",
    "is_sharded",
    "gather_full_state_dict",
    "unsharded_replica",
    "save_pretrained_unsharded",
    "end_distributed",
    "fsdp_requested",
    "barrier",
    "full_tensor",
]


def fsdp_requested() -> bool:
    """Whether ``accelerate launch`` asked for FSDP (it sets ``ACCELERATE_USE_FSDP``), CPU or not.

    Returns:
        ``True`` when the launcher asked for FSDP.
    """
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() in ("1", "true")


def _block_classes(model: nn.Module) -> tuple[type[nn.Module], ...]:
    """The transformer block classes to shard one by one: transformers' ``_no_split_modules``."""
    base = base_model_of(model)
    names = set(getattr(base, "_no_split_modules", None) or [])
    classes = {type(m) for m in model.modules() if type(m).__name__ in names}
    if not classes:
        raise ValueError(
            f"{type(base).__name__} declares no `_no_split_modules` (its transformer block class); "
            "shard it yourself with torch.distributed.fsdp.fully_shard, one call per block"
        )
    return tuple(classes)


def refuse_quantized_bases(model: nn.Module) -> None:
    """Raise a ``ValueError`` if ``model`` holds a bitsandbytes layer, which FSDP2 cannot shard (see the message)."""
    from ..tuners.rotation.quantization import is_bnb_module

    quantized = next((name for name, m in model.named_modules() if is_bnb_module(m)), None)
    if quantized is not None:
        raise ValueError(
            f"'{quantized}' is a bitsandbytes layer, and quantised bases cannot be sharded by FSDP2: fully_shard turns "
            "each Params4bit / Int8Params into a plain DTensor and drops the quantisation state bitsandbytes keeps on "
            "the parameter (quant_state, SCB), and a merge requantises W0 by installing a new parameter, which FSDP2 "
            "would not track. Store W0 as base_quantization='nf4-shardable' or 'int8-shardable' (the same codes as "
            "plain tensors by row, which FSDP2 shards), or train a bitsandbytes base with DDP "
            "(accelerate launch --multi_gpu)."
        )


def _quantize_shardable_bases(model: nn.Module, checkpoint: str | Path | None) -> None:
    """Give each layer of a ``meta`` model whose adapter asked for a shardable ``base_quantization`` its
    ``ShardableQuantizedLinear``, empty, so that it is sharded with its block and materialized in place (its
    ``base_init`` then writes and quantises ``W0`` shard by shard)."""
    from ..tuners.rotation.layer import rotation_layers
    from ..tuners.rotation.storage_kinds import storage_kind

    for name, layer in rotation_layers(model):
        kind = layer.pending_quantization
        if kind is None or not storage_kind(kind).shardable:
            continue
        if checkpoint is not None:
            raise ValueError(
                f"'{name}': base_quantization={kind!r} on a meta model read from a checkpoint while sharding is not "
                "supported (its codes would be made from the checkpoint's float W0 before sharding); build the model "
                "on a device, load and quantise it there, then call shard_model"
            )
        layer.quantize_base(kind)


def _embedding_units(model: nn.Module) -> list[nn.Module]:
    """The input embeddings and the output head, to shard as units of their own.

    Left to the root, FSDP2 would hold them unsharded from the start of the forward to the end of the backward (the
    root is not resharded after its forward), a full vocabulary × hidden copy of each per process. Tied, they stay
    with the root."""
    base = base_model_of(model)
    units = [m for m in (base.get_input_embeddings(), base.get_output_embeddings()) if m is not None]
    shared = len(units) == 2 and {id(p) for p in units[0].parameters()} & {id(p) for p in units[1].parameters()}
    return [] if shared else units


def shard_dim(shape: torch.Size, processes: int, trainable: bool = False) -> int:
    """The dimension FSDP2 shards a parameter on.

    0, as ``fully_shard`` does, unless the parameter has fewer rows than processes (a POET-FS skew vector is
    ``1 × b(b−1)/2``, a POET-BS one ``m/b`` rows): ``fully_shard`` would pad dim 0 to one row per process and every
    process would hold a whole row, so such a matrix is split along its longest dimension instead. A trainable
    parameter whose rows do not split evenly (Llama-2-7B's FFN skews: 43 rows of 32,640) is split along its first
    dimension that does, when one does, so every process's shard has one shape: compiled optimizer steps (torchao's
    8-bit AdamW) build a kernel per shape, and the processes of one machine share torch's compile cache, which we saw
    hand one process a kernel built for its neighbour's shard.

    Args:
        shape: the parameter's shape.
        processes: how many processes share it.
        trainable: whether the parameter trains (has optimizer states).

    Returns:
        The dimension to split.
    """
    if len(shape) < 2:
        return 0
    if trainable and shape[0] % processes:
        even = [d for d, size in enumerate(shape) if size >= processes and size % processes == 0]
        if even:
            return even[0]
    if shape[0] >= processes:
        return 0
    return max(range(len(shape)), key=lambda d: shape[d])


def _placement(processes: int):
    from torch.distributed.tensor import Shard

    return lambda parameter: Shard(shard_dim(parameter.shape, processes, parameter.requires_grad))


def shard_model(
    model: nn.Module,
    mesh: Any = None,
    seed: int = 0,
    checkpoint: str | Path | None = None,
    loading: str = "scatter",
    **fully_shard_kwargs: Any,
) -> nn.Module:
    """Shard ``model`` in place with FSDP2's ``fully_shard``, one transformer block at a time.

    The input embeddings and the output head (when not tied) are units of their own, then the root; the input
    embeddings are not gathered for their backward, which reads only the token ids. Each parameter is split along
    [`shard_dim`][poet_hf.training.distributed.shard_dim].

    A model built on the ``meta`` device is sharded there and then materialized shard by shard
    ([`materialize_model`][poet_hf.initialization.materialize_model] with ``seed``, ``checkpoint`` and ``loading``): no
    process ever holds the whole model, and the result equals, bit for bit, the model one process would build.

    Args:
        model: the model to shard, built on the ``meta`` device or materialized.
        mesh: the device mesh; default a 1-D mesh over every process (gloo on CPU, nccl on CUDA).
        seed: seed of the keyed initialisation of a ``meta`` model's base modules.
        checkpoint: for a ``meta`` model, a ``save_pretrained`` folder or ``.safetensors`` file to read its base weights
            from.
        loading: how rank 0 hands out a checkpoint's tensors: ``"scatter"`` (each process its shard) or ``"broadcast"``.
        **fully_shard_kwargs: passed to ``fully_shard`` (``reshard_after_forward``, ``mp_policy``,
            ``shard_placement_fn`` to place shards yourself, …).

    Returns:
        ``model``, sharded in place.

    Raises:
        ValueError: the model holds a bitsandbytes layer (`refuse_quantized_bases`) or declares no transformer
            block class; or, for a meta model, as [`materialize_model`][poet_hf.initialization.materialize_model].
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ..initialization import has_meta_tensors, materialize_model

    refuse_quantized_bases(model)
    _quantize_shardable_bases(model, checkpoint)
    if mesh is None:
        mesh = init_device_mesh("cuda" if torch.cuda.is_available() else "cpu", (dist.get_world_size(),))
    blocks = _block_classes(model)
    fully_shard_kwargs.setdefault("shard_placement_fn", _placement(mesh.size()))
    embedding_units = _embedding_units(model)
    for module in [m for m in model.modules() if isinstance(m, blocks)] + embedding_units:
        fully_shard(module, mesh=mesh, **fully_shard_kwargs)
    fully_shard(model, mesh=mesh, **fully_shard_kwargs)
    inputs = base_model_of(model).get_input_embeddings()
    if any(unit is inputs for unit in embedding_units):  # its backward reads only the token ids, not the weight
        cast(Any, inputs).set_unshard_in_backward(False)
    if has_meta_tensors(model):
        device = torch.device(mesh.device_type, torch.cuda.current_device()) if mesh.device_type == "cuda" else "cpu"
        materialize_model(model, seed=seed, device=device, checkpoint=checkpoint, loading=loading)
    return model
