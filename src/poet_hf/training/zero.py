"""POET and OFT under DeepSpeed ZeRO-2 and ZeRO-3 (through Accelerate): merges that gather, partitions they reset.

ZeRO keeps each process's share of the trainable parameters as a float32 master partition inside its optimizer, and
copies it into the model's parameters after every step. A merge (POET Algorithm 1, step 5) zeroes the skews in the
model; unless the master partition and its Adam state are zeroed too, the next step writes the old skews back. Under
ZeRO-3 the model's parameters themselves are partitioned: a merge gathers one layer's ``W0`` and skews
(``deepspeed.zero.GatheredParameters``), folds them on every process (the same arithmetic, the same seeded draws) and
partitions rank 0's result again; statistics gather the skews read-only. Each rotation layer is a ZeRO-3 leaf module,
so its forward and backward find every parameter it reads (its ``W0`` included) gathered.

The POET groups of `create_poet_optimizer` hold skews only, so their master partitions are all skew: zeroing them
whole, with the step count of their state, is the per-parameter reset `reset_optimizer_state` makes elsewhere.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from ..tuners.oft import OftConfig
from ..tuners.rotation.layer import RotationLayer, rotation_layers
from ..tuners.rotation.storage_kinds import storage_kind
from .optimizer import optim_name, reset_optimizer_state

UNSUPPORTED_WITH_ZERO = {
    "fused_optimizer_step": "DeepSpeed owns the optimizer step, which fused steps would take inside the backward",
    "base_quantization": "ZeRO partitions and casts every parameter, which a bitsandbytes W0 cannot follow (its "
    "quantisation state rides on the parameter); store W0 as 'nf4-shardable' or 'int8-shardable', which ZeRO-3 "
    "partitions like any frozen parameter",
    "optim": "DeepSpeed's universal checkpoint, its way to resume a run on another process count, carries an "
    "optimizer's float32 Adam moments (`exp_avg`, `exp_avg_sq`) and not an 8-bit optimizer's codes and scales, and "
    "its flat partitions put the quantisation blocks across parameters at places that move with the process count "
    "(ZeRO already divides float32 states by the process count; FSDP2 steps 8-bit ones, optim='adamw_torch_8bit')",
}


def zero_optimizer(optimizer: Any) -> Any | None:
    """The ZeRO optimizer under Accelerate's and Trainer's wrappers, if ``optimizer`` is one.

    Args:
        optimizer: the optimizer a callback or the trainer holds.

    Returns:
        DeepSpeed's ``DeepSpeedZeroOptimizer`` (stages 1, 2) or ``DeepSpeedZeroOptimizer_Stage3``; ``None`` otherwise.
    """
    seen = 0
    while optimizer is not None and seen < 4:
        if hasattr(optimizer, "single_partition_of_fp32_groups") or hasattr(optimizer, "fp32_partitioned_groups_flat"):
            return optimizer
        optimizer, seen = getattr(optimizer, "optimizer", None), seen + 1
    return None


def check_zero_run(args: Any, model: nn.Module, stage: int | None) -> None:
    """Refuse the settings a POET or OFT run cannot take under DeepSpeed ZeRO, naming each.

    Args:
        args: the run's training arguments (`PoetTrainingArguments` or ``transformers.TrainingArguments``).
        model: the model to train (unwrapped).
        stage: the ZeRO stage.

    Raises:
        ValueError: a stage other than 2 or 3, a setting of `UNSUPPORTED_WITH_ZERO`, or an OFT adapter under ZeRO-3.
    """
    if stage is not None and stage not in (2, 3):
        raise ValueError(
            f"DeepSpeed ZeRO stage {stage} is not supported for POET and OFT (merges reset ZeRO-2's and ZeRO-3's "
            "master partitions; stage 1 in bfloat16 runs another optimizer); set `zero_stage` to 2 or 3"
        )
    quantized = any(
        layer.base_quantization and not storage_kind(layer.base_quantization).shardable
        for _, layer in rotation_layers(model)
    )
    optim = optim_name(args)
    settings = {"fused_optimizer_step": getattr(args, "fused_optimizer_step", False), "base_quantization": quantized}
    settings["optim"] = "8bit" in optim
    for field, why in UNSUPPORTED_WITH_ZERO.items():
        if settings[field]:
            setting = f"optim='{optim}' (8-bit optimizer states)" if field == "optim" else f"`{field}`"
            raise ValueError(
                f"{setting} is not supported under DeepSpeed ZeRO: {why}; unset it, or train with DDP or FSDP2"
            )
    if stage == 3 and any(isinstance(c, OftConfig) for c in getattr(model, "peft_config", {}).values()):
        raise ValueError(
            "OFT is not supported under DeepSpeed ZeRO-3 (its backward reads the rotation's skew vector after ZeRO-3 "
            "has partitioned it again); train OFT with ZeRO-2, FSDP2 or DDP"
        )


def prepare_for_zero(model: nn.Module) -> int:
    """Ready the rotation layers for DeepSpeed ZeRO, before DeepSpeed wraps the model.

    Every rotation layer becomes a ZeRO-3 leaf module: its forward reads its base layer's ``W0`` without calling the
    base layer, so ZeRO-3's per-module hooks would leave it partitioned; as a leaf the layer gathers all its
    parameters on entry. And the layers' step state learns that ZeRO moves each gradient off its parameter in the
    backward (`RotationStepState.engine_takes_gradients`), so a deferred micro-batch's rotation gradients stay in the
    rotation cache until the window's last micro-batch instead of being taken for abandoned with the emptied
    ``.grad``.

    Args:
        model: the model, not yet wrapped.

    Returns:
        How many layers were marked as leaves.
    """
    from deepspeed.utils import set_z3_leaf_modules

    layers = rotation_layers(model)
    if not layers:
        return 0
    for _, layer in layers:
        layer.step_state.engine_takes_gradients = True
    return len(set_z3_leaf_modules(model, [RotationLayer]))


def gathered(parameters: Iterable[torch.Tensor], modify: bool) -> contextlib.AbstractContextManager:
    """ZeRO-3's gather of ``parameters`` for the block inside it; nothing to do for unpartitioned ones (and buffers).

    Args:
        parameters: the parameters to gather.
        modify: whether the block changes them (rank 0's values are partitioned again on exit).
    """
    partitioned = [p for p in parameters if hasattr(p, "ds_id")]
    if not partitioned:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(partitioned, modifier_rank=0 if modify else None)


def gathered_layer(layer: RotationLayer) -> contextlib.AbstractContextManager:
    """One layer's parameters gathered for a merge that folds and zeroes them (`gathered`)."""
    return gathered(cast(nn.Module, layer).parameters(), modify=True)


@contextlib.contextmanager
def gathered_rotations(model: nn.Module, adapter: str = "default") -> Iterator[None]:
    """Every rotation layer's skews gathered read-only, for statistics taken outside a forward."""
    skews = [p for _, layer in rotation_layers(model, adapter) for p in layer.rotation_parameters()]
    with gathered(skews, modify=False):
        yield


def master_partitions(zero: Any, group_index: int) -> list[torch.Tensor]:
    """The float32 master partitions that one parameter group of ``zero`` steps (ZeRO-3: one per sub-group)."""
    if hasattr(zero, "fp32_partitioned_groups_flat"):
        owners = zero.sub_group_to_group_id
        return [flat for sub, flat in enumerate(zero.fp32_partitioned_groups_flat) if owners[sub] == group_index]
    return [zero.single_partition_of_fp32_groups[group_index]]


def check_zero_resettable(model: nn.Module, adapter: str = "default") -> None:
    """Refuse, before training, a map whose reset at a merge is not all zeros: `reset_rotation_partitions` zeroes
    ZeRO's master partitions in place.

    Args:
        model: the model with rotation layers.
        adapter: the adapter the run merges.

    Raises:
        ValueError: a layer's ``orthogonal_map`` starts from parameters that are not zero.
    """
    for name, layer in rotation_layers(model, adapter):
        orthogonal_map = layer.rotation_settings[adapter].orthogonal_map
        if not orthogonal_map.zero_is_identity:
            raise ValueError(
                f"`orthogonal_map`={orthogonal_map.name!r} (layer '{name}') resets to non-zero parameters at a merge, "
                "and DeepSpeed ZeRO's merge resets its master partitions to zero; train it without ZeRO (DDP or "
                "FSDP2), or with orthogonal_map='cayley_neumann'"
            )


@torch.no_grad()
def reset_rotation_partitions(optimizer: Any) -> int:
    """After a merge: zero the master partitions of the POET groups and their optimizer state, step count included.

    Args:
        optimizer: the run's optimizer (a ZeRO optimizer under any wrapper).

    Returns:
        How many partitions had a state that was reset.

    Raises:
        ValueError: ``optimizer`` is not a ZeRO optimizer.
    """
    zero = zero_optimizer(optimizer)
    if zero is None:
        raise ValueError(f"not a DeepSpeed ZeRO optimizer: {type(optimizer).__name__}")
    inner = zero.optimizer
    poet_groups = [index for index, group in enumerate(inner.param_groups) if group.get("poet")]
    partitions = [flat for index in poet_groups for flat in master_partitions(zero, index)]
    for flat in partitions:
        flat.zero_()
    return reset_optimizer_state(inner, partitions)


def set_clip_threshold(optimizer: Any, threshold: float) -> bool:
    """Set the clip threshold the ZeRO optimizer applies in its next step (POET's post-merge ramp).

    Returns:
        Whether ``optimizer`` was a ZeRO optimizer."""
    zero = zero_optimizer(optimizer)
    if zero is not None:
        zero.clip_grad = threshold
    return zero is not None


def load_saved_tensors(folder: str | Path, targets: Mapping[str, torch.Tensor]) -> int:
    """Copy each tensor the saved model files of a checkpoint hold into the tensor of ``targets`` under its key; a
    ZeRO-3 parameter is gathered, written and partitioned again.

    Args:
        folder: the checkpoint folder (its ``*.safetensors``).
        targets: the tensors to write, by their key in those files.

    Returns:
        How many tensors were loaded.
    """
    from safetensors import safe_open

    loaded = 0
    for file in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as saved:
            for key in saved.keys():
                if key in targets:
                    with gathered([targets[key]], modify=True), torch.no_grad():
                        targets[key].copy_(saved.get_tensor(key))
                    loaded += 1
    return loaded


def frozen_weights_of_checkpoint(model: nn.Module, folder: str) -> int:
    """Load the frozen parameters a checkpoint's saved model holds (each POET ``W0`` as merged) into ``model``.

    Trainer saves DeepSpeed's checkpoint of a PEFT model without its frozen parameters, and resumes from that alone;
    POET's merges change ``W0``, which the saved model (``adapter_model.safetensors``, or the whole model) holds
    (`load_saved_tensors`).

    Args:
        model: the model being trained (unwrapped).
        folder: the checkpoint folder.

    Returns:
        How many parameters were loaded.
    """
    return load_saved_tensors(folder, {name: p for name, p in model.named_parameters() if not p.requires_grad})


def whole_state_dict(engine: Any) -> dict[str, torch.Tensor]:
    """ZeRO-3's gathered state dict with the frozen parameters (a collective: every rank calls it; rank 0 gets it).

    Trainer gathers a PEFT model's trainable parameters only; POET's merges change the frozen ``W0`` too."""
    return engine._zero3_consolidated_16bit_state_dict()
