"""Resuming a DeepSpeed ZeRO-3 checkpoint on another process count, through DeepSpeed's universal checkpoint.

ZeRO partitions its float32 master weights and Adam states by process, and loads them only on as many processes.
DeepSpeed's universal format holds each parameter's states whole (``ds_to_universal``), and an engine whose config
says ``checkpoint.load_universal`` repartitions them for its own process count. That load restores the trainable
parameters and their optimizer states; the frozen ``W0`` (as merged) comes from the checkpoint's saved model as on any
DeepSpeed resume (`zero.frozen_weights_of_checkpoint`), and POET's buffers (the permutations of the current merge
interval, the merge counts), which the universal load leaves as built, from the saved adapter too
(`buffers_of_checkpoint`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..checkpoints import UNIVERSAL_SUFFIX, zero_states_folder, zero_states_processes
from .zero import load_saved_tensors

if TYPE_CHECKING:
    from accelerate import Accelerator
    from deepspeed import DeepSpeedEngine
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

LATEST_UNIVERSAL = "latest_universal"  # the tag file DeepSpeed reads when its config says checkpoint.load_universal


def universal_tag(checkpoint: str | Path) -> str:
    """Convert ``checkpoint``'s ZeRO states to DeepSpeed's universal format, once, and name the result.

    The conversion (``python -m deepspeed.checkpoint.ds_to_universal``) writes into a staging folder that is renamed
    when complete, so a run killed while converting converts again on its next start; ``latest_universal`` is written
    last. Call it on one process; the others wait for it.

    Args:
        checkpoint: the Trainer checkpoint folder (``checkpoint-N``) holding ``global_stepN``.

    Returns:
        The universal tag (``global_stepN_universal``) the engine loads.
    """
    folder, states = Path(checkpoint), zero_states_folder(checkpoint)
    if states is None:
        raise ValueError(f"{folder} holds no DeepSpeed states (global_step*) to convert to a universal checkpoint")
    tag = states.name + UNIVERSAL_SUFFIX
    if not (folder / tag).is_dir():
        staging = folder / f".{tag}.converting"
        shutil.rmtree(staging, ignore_errors=True)
        command = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(states)]
        done = subprocess.run([*command, "--output_folder", str(staging)], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(
                f"DeepSpeed could not convert {states} to a universal checkpoint (ds_to_universal, exit status "
                f"{done.returncode}): {done.stderr.strip()[-2000:]}"
            )
        os.replace(staging, folder / tag)
    (folder / LATEST_UNIVERSAL).write_text(tag)
    return tag


def buffers_of_checkpoint(model: nn.Module, folder: str | Path) -> int:
    """Load the buffers the checkpoint's saved adapter holds (POET's permutations and merge counts) into ``model``.

    PEFT saves an adapter's tensors without the adapter's name (``….poet_R_index`` for ``….poet_R_index.default``);
    buffers are never partitioned by ZeRO, so each is copied as it is.

    Args:
        model: the model being trained (unwrapped).
        folder: the checkpoint folder.

    Returns:
        How many buffers were loaded.
    """
    adapters = list(getattr(model, "peft_config", {}) or {})
    saved_names = {}
    for name, buffer in model.named_buffers():
        short = name
        for adapter in adapters:
            short = short.replace(f".{adapter}", "")
        saved_names[short] = buffer
    return load_saved_tensors(folder, saved_names)


def zero_stage(accelerator: Accelerator) -> int | None:
    """The ZeRO stage of Accelerate's DeepSpeed plugin (``None`` without DeepSpeed)."""
    return getattr(getattr(accelerator.state, "deepspeed_plugin", None), "zero_stage", None)


def prepare_universal_resume(accelerator: Accelerator, checkpoint: str, world_size: int) -> str:
    """Before a ZeRO-3 engine is built: convert ``checkpoint`` if another process count wrote it, and configure the
    engine to load the universal checkpoint.

    Args:
        accelerator: the run's ``accelerate.Accelerator`` (DeepSpeed plugin, ZeRO-3).
        checkpoint: the Trainer checkpoint folder to resume.
        world_size: the run's process count.

    Returns:
        The universal tag the engine loads, or ``""`` when the run has the checkpoint's process count.
    """
    if zero_states_processes(checkpoint) in (0, world_size):
        return ""
    if accelerator.is_main_process:
        universal_tag(checkpoint)
    accelerator.wait_for_everyone()
    accelerator.state.deepspeed_plugin.deepspeed_config.setdefault("checkpoint", {})["load_universal"] = True
    return Path(checkpoint, LATEST_UNIVERSAL).read_text()


def finish_universal_resume(model: nn.Module, engine: DeepSpeedEngine, checkpoint: str, tag: str) -> None:
    """After the engine's universal load: POET's buffers (`buffers_of_checkpoint`) and each optimizer group's own
    hyperparameters and Adam step count (`restore_group_states`)."""
    buffers_of_checkpoint(model, checkpoint)
    restore_group_states(engine.optimizer, checkpoint, tag)


def restore_group_states(zero_optimizer: DeepSpeedZeroOptimizer_Stage3, checkpoint: str | Path, tag: str) -> None:
    """Give each parameter group back its own hyperparameters and Adam step count after a universal load.

    DeepSpeed's ZeRO-3 universal load gives every group the first group's hyperparameters and step count; POET's groups
    have their own learning rate, and a merge resets their step count (`reset_optimizer_state`), so both would be
    wrong from the first resumed step. The universal checkpoint keeps each group's (``zero/optimizer_state.pt``).

    Args:
        zero_optimizer: the engine's ZeRO-3 optimizer (``DeepSpeedZeroOptimizer_Stage3``).
        checkpoint: the Trainer checkpoint folder.
        tag: the universal tag (`universal_tag`).

    Raises:
        ValueError: the run's optimizer groups are not those of the checkpoint.
    """
    saved = torch.load(Path(checkpoint, tag, "zero", "optimizer_state.pt"), weights_only=False)["optimizer_state_dict"]
    inner = zero_optimizer.optimizer
    groups, flats = inner.param_groups, zero_optimizer.fp32_partitioned_groups_flat
    if len(saved["param_groups"]) != len(groups) or len(saved["state"]) != len(flats):
        raise ValueError(
            f"{checkpoint} holds {len(saved['param_groups'])} optimizer groups in {len(saved['state'])} ZeRO-3 "
            f"sub-groups; this run has {len(groups)} in {len(flats)}: resume it with the optimizer settings it was "
            "written with"
        )
    for group, saved_group in zip(groups, saved["param_groups"], strict=True):
        group.update({key: value for key, value in saved_group.items() if key != "params"})
    for index, flat in enumerate(flats):
        inner.state[flat]["step"] = saved["state"][index]["step"]
