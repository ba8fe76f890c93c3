"""Optimizer parameter groups for POET and the per-merge state reset."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from ..sharded import is_sharded
from ..tuners.rotation.layer import RotationLayer, rotation_layers
from .eight_bit import own_override_index, weights_keeping_32bit_states

if TYPE_CHECKING:
    from transformers import TrainingArguments

logger = logging.getLogger(__name__)


def poet_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The trainable skew parameters of every POET layer (found structurally, not by name).

    Args:
        model: the model to search.

    Returns:
        The skew parameters, in module order.
    """
    return [
        p
        for module in model.modules()
        if isinstance(module, RotationLayer)
        for p in module.rotation_parameters()
        if p.requires_grad
    ]


def poet_parameters_by_block(model: nn.Module) -> dict[int, list[nn.Parameter]]:
    """The trainable skew parameters grouped by the block size ``b`` of their side.

    For POET-FS the size is the index set's."""
    groups: dict[int, list[nn.Parameter]] = {}
    for module in model.modules():
        if isinstance(module, RotationLayer):
            for adapter, sides in module.rotation_specs.items():
                for side, spec in sides.items():
                    param = module.rotation_parameter(adapter, side)
                    if param.requires_grad:
                        groups.setdefault(spec.block, []).append(param)
    return groups


def poet_param_groups(
    model: nn.Module,
    learning_rate: float,
    poet_learning_rate: float,
    weight_decay: float,
    decay_parameter_names: Iterable[str],
    reference_block: int | None = None,
) -> list[dict]:
    """The parameter groups of POET's optimizer: the other trainable parameters, then the rotations.

    The non-POET parameters with and without decay come first (at ``learning_rate``, so Trainer logs it as
    ``learning_rate``), then the POET parameters, without weight decay as in the POET code. Empty groups are dropped.

    Without ``reference_block`` every POET parameter trains at ``poet_learning_rate``. With it, a side of block size
    ``b`` trains at ``poet_learning_rate · reference_block / b``: Adam moves each skew entry by about the learning
    rate per step, which turns a ``b``-block by about ``lr·b`` while the gradient keeps its direction, so this keeps
    the rotation per step the same for every block size. It is the tie of the POET paper's Tables 8–9
    (``1e-3 · 256/b``) applied per side; POET groups carry ``"poet": True`` and their ``"block_size"``.

    Args:
        model: the model (its trainable parameters are grouped).
        learning_rate: the rate of the non-POET parameters.
        poet_learning_rate: the rate of the POET parameters (of a ``reference_block`` side, with ``reference_block``).
        weight_decay: the weight decay of the non-POET parameters that decay.
        decay_parameter_names: the names of the parameters that decay (``Trainer.get_decay_parameter_names``).
        reference_block: a side of block size ``b`` trains at ``poet_learning_rate · reference_block / b``; ``None``:
            one rate for every side.

    Returns:
        Optimizer parameter groups (dicts with ``params``, ``lr``, ``weight_decay``; the POET ones with ``poet=True``
            and their ``block_size``).
    """
    poet = {id(p) for p in poet_parameters(model)}
    decay = set(decay_parameter_names)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad and id(p) not in poet]
    groups = [
        {"params": [p for n, p in named if n in decay], "lr": learning_rate, "weight_decay": weight_decay},
        {"params": [p for n, p in named if n not in decay], "lr": learning_rate, "weight_decay": 0.0},
    ]
    if reference_block is None:
        groups.append({"params": poet_parameters(model), "lr": poet_learning_rate, "weight_decay": 0.0, "poet": True})
    else:
        for block, params in sorted(poet_parameters_by_block(model).items()):
            groups.append(
                {
                    "params": params,
                    "lr": poet_learning_rate * reference_block / block,
                    "weight_decay": 0.0,
                    "poet": True,
                    "block_size": block,
                }
            )
    return [g for g in groups if g["params"]]


def tied_poet_learning_rate(method: str, size: float) -> float:
    """The POET learning rate that Tables 8–9 tie to the rotation size.

    1e-3 / 2e-3 / 4e-3 for BS blocks 256 / 128 / 64 and FS budgets ½ / ¼ / ⅛, i.e. ``1e-3 · 256/b`` and
    ``1e-3 · ½/budget`` (the same rule between those sizes); ``size`` is the block size (BS) or the budget fraction
    (FS)."""
    return 1e-3 * 256 / size if method == "poet-bs" else 1e-3 * 0.5 / size


def adapter_rotation_rate(model: nn.Module) -> tuple[float, int | None, str] | None:
    """The rotations' rate a POET adapter of ``model`` is built for: ``(rate, reference block, where it comes from)``.

    The config's ``rotation_learning_rate`` (a `PoetConfig.for_finetuning` recipe's) with its
    ``rotation_reference_block``; else the pretraining recipe of the POET paper's Tables 8–9: 1e-3 at a 256-block
    side (``1e-3 · 256/b`` per side), or ``1e-3 · ½/budget`` for ``spo="full"`` with a fractional budget. ``None``
    for a model without a POET adapter (OFT trains at the Trainer's ``learning_rate``, as PEFT's OFT does)."""
    from ..tuners.poet import PoetConfig

    configs = getattr(model, "peft_config", None) or {}
    config = next((c for c in configs.values() if isinstance(c, PoetConfig)), None)
    if config is None:
        return None
    if config.rotation_learning_rate is not None:
        return config.rotation_learning_rate, config.rotation_reference_block, "the adapter's rotation_learning_rate"
    if config.spo == "full":
        budget = config.budget if isinstance(config.budget, float) and config.budget <= 1 else 0.5
        return tied_poet_learning_rate("poet-fs", budget), None, "the pretraining recipe's (1e-3 · ½/budget)"
    reference_block = 256
    rate = tied_poet_learning_rate("poet-bs", reference_block)
    return rate, reference_block, "the pretraining recipe's (1e-3 at a 256-block side, POET Tables 8–9)"


def _log_rotation_rate(rate: float, reference_block: int | None, source: str) -> None:
    per_side = f" at a {reference_block}-block side (scaled by {reference_block}/b per side)" if reference_block else ""
    logger.warning(
        "poet_learning_rate is not set: the rotations train at %g%s, %s. Set poet_learning_rate (and "
        "poet_reference_block) to choose another.",
        rate,
        per_side,
        source,
    )


def create_poet_optimizer(
    model: nn.Module,
    args: TrainingArguments,
    *,
    poet_learning_rate: float | None = None,
    poet_reference_block: int | None = None,
    optimizer_cls_and_kwargs: tuple[type[torch.optim.Optimizer], dict[str, Any]] | None = None,
    decay_parameter_names: Iterable[str] | None = None,
    fused_step: bool | None = None,
) -> torch.optim.Optimizer:
    """The optimizer `PoetTrainer` builds, for any ``transformers.Trainer`` (TRL's ``SFTTrainer`` too) or a loop.

    Pass it as ``Trainer(..., optimizers=(optimizer, None))`` (the Trainer then builds the scheduler from ``args``,
    which scales every group) with [`MergeReinitCallback`][poet_hf.training.MergeReinitCallback], which merges and
    resets the rotations' optimizer state (`reset_optimizer_state`) every ``merge_every`` steps. In a hand-written
    loop, call ``merge_and_reinit(model)`` and ``reset_optimizer_state(optimizer, poet_parameters(model))`` yourself.
    Like PEFT's ``create_loraplus_optimizer``, it groups the parameters by rate: the groups of `poet_param_groups`,
    with the class and keyword arguments of ``args.optim`` (``Trainer.get_optimizer_cls_and_kwargs``).

    Args:
        model: the PEFT model (built before the Trainer, e.g. by ``get_peft_model``).
        args: the training arguments (``TrainingArguments``, ``SFTConfig``, `PoetTrainingArguments`, …): ``optim``,
            ``learning_rate``, ``weight_decay``, and ``poet_learning_rate`` / ``poet_reference_block`` where they
            exist.
        poet_learning_rate: the rotations' rate; default ``args.poet_learning_rate``, else the rate the POET adapter
            is built for (`adapter_rotation_rate`: a fine-tuning recipe's, else the pretraining recipe's; logged
            once), else ``args.learning_rate`` (OFT).
        poet_reference_block: a side of block size ``b`` trains at ``poet_learning_rate · poet_reference_block / b``;
            default ``args.poet_reference_block``; with the adapter's rate, the adapter's (fine-tuning's: 32).
        optimizer_cls_and_kwargs: the optimizer class and its keyword arguments, instead of ``args.optim``'s.
        decay_parameter_names: the parameters that decay; default Trainer's rule (not biases nor norms).
        fused_step: step each parameter in the backward (`FusedStepOptimizer`), freeing its gradient at once (the
            head and input embeddings a row chunk at a time, stored as ``args.vocab_weights_dtype`` says), and clip by
            ``args.max_grad_norm`` as it goes; default ``args.fused_optimizer_step`` where it exists, else off.

    Returns:
        The optimizer.

    Raises:
        ValueError: ``args.optim`` builds its own parameter groups (GaLore, APOLLO, …); a bitsandbytes optimizer
            for a sharded model (`check_steps_shards`); ``fused_step`` it cannot honour (`check_fused_step`).
    """
    from transformers import Trainer

    optimizer_cls, kwargs = optimizer_cls_and_kwargs or Trainer.get_optimizer_cls_and_kwargs(args, cast(Any, model))
    if {"params", "model", "optimizer_dict"} & set(kwargs):
        raise ValueError(
            f"optim={args.optim!r} builds its own parameter groups, which POET's two "
            "learning rates cannot be combined with; use an AdamW-type optim"
        )
    if decay_parameter_names is None:  # Trainer's rule; the method reads nothing of the trainer
        decay_parameter_names = Trainer.get_decay_parameter_names(cast(Any, None), model)
    poet_learning_rate, poet_reference_block = _rotation_rate(model, args, poet_learning_rate, poet_reference_block)
    groups = poet_param_groups(
        model,
        args.learning_rate,
        args.learning_rate if poet_learning_rate is None else poet_learning_rate,
        args.weight_decay,
        decay_parameter_names,
        poet_reference_block,
    )
    check_steps_shards(model, optimizer_cls)
    keep_32bit_states(model, optimizer_cls, kwargs)
    if fused_step if fused_step is not None else getattr(args, "fused_optimizer_step", False):
        from .distributed import fsdp_requested
        from .fused_step import FusedStepOptimizer, check_fused_step

        check_fused_step(args.fp16, args.world_size, is_sharded(model) or fsdp_requested())
        vocab_dtype = getattr(args, "vocab_weights_dtype", "float32")
        return FusedStepOptimizer(
            groups,
            optimizer_cls,
            max_grad_norm=lambda: args.max_grad_norm,  # read at every step: MergeReinitCallback ramps it after merges
            model=model,
            vocab_weights_dtype=None if vocab_dtype == "float32" else getattr(torch, vocab_dtype),
            **kwargs,
        )
    optimizer = optimizer_cls(groups, **kwargs)
    own_override_index(optimizer)
    return optimizer


def optim_name(args: object) -> str:
    """``args.optim`` as the command line spells it (Trainer keeps an ``OptimizerNames``); ``""`` without one.

    Args:
        args: training arguments (`PoetTrainingArguments`, ``transformers.TrainingArguments``) or any object.

    Returns:
        The optimizer's name, e.g. ``"adamw_bnb_8bit"``.
    """
    optim = getattr(args, "optim", "")
    return str(getattr(optim, "value", optim))


def check_steps_shards(model: nn.Module, optimizer_cls: type) -> None:
    """Refuse a bitsandbytes optimizer for a model whose parameters FSDP2 has sharded.

    bitsandbytes' update kernels take plain tensors and stop at a ``DTensor`` shard ("got mixed torch.Tensor and
    DTensor"); torchao's ``AdamW8bit`` (``optim="adamw_torch_8bit"``) keeps 8-bit states per shard and steps them.

    Args:
        model: the model whose trainable parameters the optimizer will step.
        optimizer_cls: the optimizer class.

    Raises:
        ValueError: ``optimizer_cls`` is a bitsandbytes optimizer and ``model`` is sharded.
    """
    if "bitsandbytes" in getattr(optimizer_cls, "__module__", "") and is_sharded(model):
        raise ValueError(
            f"{optimizer_cls.__name__} (bitsandbytes) cannot step the DTensor shards of a model FSDP2 has sharded: "
            "its kernels take plain tensors; for 8-bit optimizer states under FSDP2 use optim='adamw_torch_8bit' "
            "(torchao's AdamW8bit, which keeps 8-bit states per shard)"
        )


def _rotation_rate(
    model: nn.Module, args: TrainingArguments, rate: float | None, reference_block: int | None
) -> tuple[float | None, int | None]:
    """The rotations' rate and reference block: as given, else ``args``', else the adapter's (logged once per model)."""
    rate = getattr(args, "poet_learning_rate", None) if rate is None else rate
    reference_block = getattr(args, "poet_reference_block", None) if reference_block is None else reference_block
    built_for = adapter_rotation_rate(model) if rate is None else None
    if built_for is None:
        return rate, reference_block
    rate, reference_block, source = built_for  # a rate goes with its own reference block
    layers = rotation_layers(model)
    logged = layers[0][1].step_state.logged if layers else set()
    if built_for not in logged:  # once per model, however many optimizers it gets
        logged.add(built_for)
        _log_rotation_rate(rate, reference_block, source)
    return rate, reference_block


def keep_32bit_states(model: nn.Module, optimizer_cls: type, kwargs: dict[str, Any]) -> int:
    """Keep 32-bit states, under bitsandbytes' 8-bit optimizers, for the embeddings and for a head whose rows do not
    fill whole state blocks (`weights_keeping_32bit_states`).

    Set per parameter (``GlobalOptimManager.override_config``), which the per-parameter optimizers of
    `FusedStepOptimizer` read too.

    Args:
        model: the model whose embeddings and head to look at.
        optimizer_cls: the optimizer class; anything but a bitsandbytes optimizer with 8-bit states (``optim_bits=8``
            or an ``…8bit`` class) is left alone.
        kwargs: its keyword arguments.

    Returns:
        How many weights were kept at 32 bits.
    """
    default_bits = 8 if "8bit" in getattr(optimizer_cls, "__name__", "") else 32
    if "bitsandbytes" not in str(optimizer_cls) or kwargs.get("optim_bits", default_bits) != 8:
        return 0
    from bitsandbytes.optim import GlobalOptimManager

    manager = GlobalOptimManager.get_instance()
    weights = [w for w in weights_keeping_32bit_states(model) if w.requires_grad]
    for weight in weights:
        manager.override_config(weight, "optim_bits", 32)
        # The manager is keyed by id(): forget the entry with the weight, so no later tensor inherits it.
        weakref.finalize(weight, manager.pid2config.pop, id(weight), None)
    return len(weights)


@torch.no_grad()
def reset_optimizer_state(optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor]) -> int:
    """Reset the state (moments, step count) of ``params`` to a fresh one, in place, as POET does after a merge.

    Zeroed rather than dropped, so the state keeps one layout and a checkpoint taken right after a merge resumes
    exactly; float32, DTensor (FSDP2), bitsandbytes' and torchao's 8-bit states alike
    (the pretraining guide says why).

    Args:
        optimizer: the optimizer holding the state.
        params: the parameters whose state to reset.

    Returns:
        How many parameters had a state that was reset.
    """
    state = optimizer.state
    reset = 0
    for p in params:
        if p in state:
            for key, value in state[p].items():
                if torch.is_tensor(value) and not key.startswith("qmap"):
                    _zero(value)
                elif key == "step" and isinstance(value, int):
                    state[p][key] = 0
            reset += 1
    return reset


def _zero(state: torch.Tensor) -> None:
    """Zero one optimizer-state tensor in place, whatever its storage."""
    try:
        state.zero_()
    except NotImplementedError:  # a quantised state subclass (torchao's OptimState8bit) quantises what it copies
        state.copy_(torch.zeros(state.shape, dtype=state.dtype, device=state.device))
