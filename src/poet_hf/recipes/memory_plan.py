"""How much memory one training process needs, planned from shapes alone, part by part.

[`plan_memory`][poet_hf.recipes.memory_plan.plan_memory] builds the model on the ``meta`` device (no memory, no
initialisation), wraps it for the method (POET-BS / POET-FS, OFT, LoRA, or AdamW / GaLore on the plain model) and reads
every figure off it:

- parameters, gradients and optimizer states are counted tensor by tensor (adapter parameters in float32, the rest
  in ``dtype``; under FSDP2 each tensor's padded shard along [`shard_dim`][poet_hf.training.distributed.shard_dim],
  except the gradients under accumulation, which FSDP2 holds unsharded between micro-batches while their
  reduce-scatter waits for the last, as accelerate's ``no_sync`` runs it);
- activations are the tensors autograd saves in one forward, traced on the meta device with
  ``torch.autograd.graph.saved_tensors_hooks`` (distinct storages, parameters left out); with ``checkpointing``
  each block keeps its input instead, and the one block being recomputed keeps its own;
- the loss's working set is the two gradients the cross-entropy's backward holds at once beside the saved
  log-softmax, of the log-probabilities and of the logits (``batch·seq·vocab`` floats each), as the backward starts.

The total is the memory alive at the training peak, after the first optimizer step (the *steady state*): the
backward's first steps, where every saved activation is still alive, the cross-entropy's and then the head's
(`poet_hf.recipes.plan_parts.loss_backward`), or the backward's end or the optimizer step where they hold more.
Gradients count there in full only when they persist across the backward's start (gradient accumulation, where the
previous micro-batches' sum is held); otherwise only those of the output head, which the backward produces first.
DDP adds its buckets, a flat copy of every gradient; FSDP2 what it holds gathered at the head's backward
(`poet_hf.recipes.plan_parts.gathered_bytes`).

Paper correspondence (POET, Table 1, one ``m × n`` weight and Adam): AdamW ``3mn`` entries (weight and two
states), POET-BS ``mn + 3/2·(m+n)(b−1)``, POET-FS ``mn + 3·b(b−1)``, GaLore ``mn + mr + 2nr``: the planner's ``W0``,
trainable-parameter and optimizer-state entries of the targeted layers sum to these exactly (gradients, which the
table leaves out, are a separate part here).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from ..dtypes import parse_dtype
from ..training.eight_bit import STATE_BLOCK
from ..tuners.rotation.quantization import residual_bytes
from ..tuners.rotation.quantized_rows import ROW_BLOCK_ENTRIES
from ..tuners.rotation.storage_kinds import storage_kind
from ..tuners.tuner_base import base_model_of
from .activation_trace import trace_activations
from .plan_parts import after_backward, ddp_unheld_bytes, gathered_bytes, loss_backward, loss_bytes, shard_entries
from .plan_settings import METHODS, SHARDINGS, PlanSettings, check_adapter_sizes
from .rotation_cache_plan import plan_rotation_caches

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

__all__ = ["METHODS", "SHARDINGS", "PARTS", "MemoryPlan", "plan_memory", "format_plans"]

PARTS = (
    "W0",
    "other frozen weights",
    "trainable parameters",
    "gradients",
    "DDP gradient buckets",
    "optimizer states",
    "rotation caches",
    "activations",
    "loss working set",
    "bfloat16 steps",
    "gathered layers",
    "optimizer step copies",
)
EIGHT_BIT_MIN_ENTRIES = 4096  # the states of a tensor under 4096 entries stay 32-bit
BASE_LAYER = ".base_layer."  # in the name of a wrapped layer's base weight (PEFT's convention)
ADAPTER_MARKERS = ("poet_", "oft_", "lora_")  # adapter parameters: float32 whatever the model's dtype


@dataclass
class MemoryPlan:
    """The per-process bytes of one run, by part (`PARTS`), and the settings they were planned for.

    Args:
        method: the method planned.
        parts: bytes per process, per part (``W0``, trainable parameters, gradients, …).
        settings: the inputs of the plan (model, dtype, batch, …).
        counts: tensor entries read off the model (``W0``, trainable, optimizer states).
        residual_bytes: the merges' error-feedback residual kept off the steps' memory (``residual_storage`` other
            than ``"layer"``): files under the residual folder on a CPU run, host memory for a ``W0`` on an
            accelerator (`poet_hf.tuners.rotation.residual_store`). Not part of `total_bytes`.
    """

    method: str
    parts: dict[str, int]
    settings: dict[str, object] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)  # entries (not bytes), before any sharding
    residual_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return sum(self.parts.values())

    def to_dict(self) -> dict[str, object]:
        """The plan as JSON-ready data (what ``--json`` prints).

        Returns:
            ``{"method", "settings", "counts", "parts_mb", "total_mb", "residual_mb"}``.
        """
        return {
            "method": self.method,
            "settings": self.settings,
            "counts": self.counts,
            "parts_mb": {k: v / 2**20 for k, v in self.parts.items()},
            "total_mb": self.total_bytes / 2**20,
            "residual_mb": self.residual_bytes / 2**20,
        }


def _resolve_model_config(model: str | PretrainedConfig) -> str | PretrainedConfig:
    """The model config that ``model`` names.

    A preset name (`PRESETS`), a ``PretrainedConfig``, a ``config.json`` (or its folder), or a Hub id (its config is
    read through ``huggingface_hub``'s cache)."""
    from transformers import PretrainedConfig

    if isinstance(model, PretrainedConfig):
        return model
    from .model_source import read_config
    from .presets import PRESETS

    if isinstance(model, str) and model in PRESETS:
        return model
    return read_config(str(model))


def _model_to_plan(
    model: str | PretrainedConfig | nn.Module, settings: PlanSettings, block_size: int, budget: float
) -> nn.Module:
    """``model`` where it is one; else the model the config it names builds, wrapped for the method (with the
    adapter's size, checked here)."""
    check_adapter_sizes(block_size, budget)
    if isinstance(model, nn.Module):
        return model
    return _build(_resolve_model_config(model), settings, block_size, budget)


def _build(model_config: str | PretrainedConfig, settings: PlanSettings, block_size: int, budget: float) -> nn.Module:
    from .presets import PRESETS, build_llama, meta_model

    model: PreTrainedModel
    with torch.device("meta"):
        if isinstance(model_config, str):
            model = build_llama(
                PRESETS[model_config],
                settings.method if settings.rotating else "adamw",
                32000,
                settings.seq_len,
                seed=0,
                device="meta",
            )
        else:
            model = meta_model(model_config)  # as a run builds it (float32); the plan's dtype is its own setting
        return _wrap(model, settings, block_size, budget)


def _wrap(model: PreTrainedModel, settings: PlanSettings, block_size: int, budget: float) -> nn.Module:
    """Wrap the meta model for the method as the pretraining recipes apply it.

    POET and LoRA train every other parameter too (the paper's baselines), OFT fine-tunes its adapters alone, AdamW
    and GaLore train the plain model."""
    from peft import LoraConfig

    from ..tuners.config_utils import DEFAULT_TARGET_MODULES
    from ..tuners.oft.config import OftConfig
    from ..tuners.poet.config import PoetConfig
    from ..tuners.tuner_base import get_peft_model_quietly

    method, rank = settings.method, settings.rank
    if method in ("adamw", "galore"):
        return model
    if method == "poet-bs":
        return get_peft_model_quietly(model, PoetConfig(spo="block", block_size=block_size, train_other_params=True))
    if method == "poet-fs":
        return get_peft_model_quietly(model, PoetConfig(spo="full", budget=budget, train_other_params=True))
    if method == "oft":
        return get_peft_model_quietly(model, OftConfig(block_size=block_size))
    targets = DEFAULT_TARGET_MODULES.get(model.config.model_type)
    peft_model = get_peft_model_quietly(model, LoraConfig(r=rank, lora_alpha=rank, target_modules=targets))
    for name, parameter in peft_model.named_parameters():
        if "lora_" not in name and BASE_LAYER not in name:
            parameter.requires_grad_(True)
    return peft_model


def _galore_targets(model: nn.Module) -> set[str]:
    from ..tuners.config_utils import DEFAULT_TARGET_MODULES

    targets = DEFAULT_TARGET_MODULES.get(base_model_of(model).config.model_type) or []
    return {
        f"{name}.weight"
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in targets
    }


def _block_classes(model: nn.Module) -> tuple[type[nn.Module], ...]:
    """The transformer block classes (what FSDP2 shards one by one); none for a model that declares none."""
    from ..training.distributed import _block_classes as sharded_block_classes

    try:
        return sharded_block_classes(model)
    except ValueError:
        return ()


def plan_memory(
    model: str | PretrainedConfig | nn.Module,
    method: str = "poet-bs",
    *,
    block_size: int = 256,
    budget: float = 0.5,
    rank: int = 128,
    dtype: str = "float32",
    batch_size: int = 4,
    seq_len: int = 256,
    processes: int = 1,
    sharding: str = "ddp",
    checkpointing: bool = False,
    accumulation: int = 1,
    cache_rotations: bool | str = "auto",
    base_quantization: str | None = None,
    residual_storage: str = "auto",
    fused_step: bool = False,
    optimizer_bits: int = 32,
    eight_bit_library: str = "bitsandbytes",
    vocab_weights_dtype: str = "float32",
    loss_chunk_tokens: int | None = None,
) -> MemoryPlan:
    """Plan one process's memory for training ``model`` with ``method`` (see the module docstring for the model).

    Args:
        model: a preset name (``"llama-130m"``), a ``transformers.PretrainedConfig``, a path to a ``config.json``
            (or its folder), or a Hub id whose config is read (from the local cache when offline); or a model on
            ``meta`` already wrapped for ``method`` (`poet_hf.recipes.presets.meta_recipe_model`), planned as it is.
        method: one of `METHODS`.
        block_size: POET-BS's and OFT's block size ``b``.
        budget: POET-FS's sampling budget, a fraction of each dimension.
        rank: LoRA's rank, and GaLore's projection rank.
        dtype: the weights' and activations' type, by torch's or its short name (adapter parameters stay float32).
        batch_size: sequences per micro-batch and process.
        seq_len: tokens per sequence.
        processes: data-parallel processes.
        sharding: ``"ddp"`` (replicated) or ``"fsdp2"`` ([`shard_model`][poet_hf.training.distributed.shard_model]: per
            transformer block, the embeddings, the head, the root).
        checkpointing: activation checkpointing per transformer block.
        accumulation: micro-batches per optimizer step (gradients and rotation caches persist between them).
        cache_rotations: POET's rotation cache ([`PoetConfig`][poet_hf.PoetConfig]), held under accumulation:
            ``"auto"`` decides per layer as a run does, from the plan's shapes (`poet_hf.recipes.rotation_cache_plan`).
        base_quantization: POET's ``W0`` storage kind (`storage_kinds.KINDS`), which counts its bytes.
        residual_storage: where the merges' error-feedback residual of a quantised or 16-bit ``W0`` lives
            ([`PoetConfig`][poet_hf.PoetConfig]): ``"layer"`` counts it in ``W0`` (1.06 B per entry quantised, 1 B
            16-bit); ``"auto"``, ``"cpu"`` and ``"disk"`` keep it off the steps' memory.
        fused_step: optimizer steps fused into the backward (`poet_hf.training.FusedStepOptimizer`): one gradient
            exists at a time, the head's and the input embeddings' one row chunk at a time (`RowGradients`).
        optimizer_bits: 32 (Adam's float32 states) or 8 (blockwise: 2 B per entry and a float32 scale per 256, for
            tensors of 4096 entries or more, torchao's in whole blocks; bitsandbytes' embeddings, and a head whose rows
            are not a multiple of 256 wide, keep 32-bit states, as `create_poet_optimizer` keeps them).
        eight_bit_library: ``"bitsandbytes"`` or ``"torchao"`` (its step holds one parameter's moments in float32).
        vocab_weights_dtype: ``"bfloat16"`` (with ``fused_step``): the untied head and input embeddings stored in
            bfloat16, their 32-bit states too (`poet_hf.training.bf16_storage`), stepped a float32 row chunk at a time.
        loss_chunk_tokens: tokens whose logits the loss forms at once (`poet_hf.training.chunked_loss`), or ``None``.

    Returns:
        A [`MemoryPlan`][poet_hf.recipes.memory_plan.MemoryPlan]: bytes per process by part, alive together at the peak.

    Raises:
        ValueError: an argument outside its allowed values (the message names it and them).
    """
    settings = PlanSettings(**{k: v for k, v in locals().items() if k not in ("model", "block_size", "budget")})
    built = _model_to_plan(model, settings, block_size, budget)
    blocks = _block_classes(built)
    parts, counts, largest, entry_bytes = _parameter_bytes(built, settings, blocks)
    all_gradients = parts["gradients"]  # the backward's start holds only the head's, unless accumulation holds all
    parts["gradients"] = largest["head gradients"] if accumulation == 1 else all_gradients
    if sharding == "ddp" and processes > 1:  # the reducer's flat copy of every gradient it reduces
        parts["DDP gradient buckets"] = parts["trainable parameters"] - ddp_unheld_bytes(built, settings, entry_bytes)
    report: dict[str, object] = {**asdict(settings), "block_size": block_size, "budget": budget}  # then the plan's
    parts.update(_working_bytes(built, settings, blocks, largest["W0"], report))
    if sharding == "fsdp2" and processes > 1:
        parts["gathered layers"] = gathered_bytes(built, blocks, entry_bytes, settings)
    gradients = largest["gradient"] if fused_step else all_gradients  # after the backward
    candidates = loss_backward(built, settings, parts, largest["head gradients"], entry_bytes)
    candidates.update(after_backward(built, settings, parts, gradients, largest, entry_bytes))
    report["peak"] = peak = max(candidates, key=lambda moment: sum(candidates[moment].values()))
    return MemoryPlan(method, candidates[peak], report, counts, _residual_off_memory(built, settings))


def _residual_off_memory(built: nn.Module, settings: PlanSettings) -> int:
    """Bytes of the error-feedback residual kept off the steps' memory: every POET ``W0``'s, where ``W0`` is quantised
    or 16-bit, unsharded, and ``residual_storage`` is not ``"layer"``."""
    sixteen_bit = settings.dtype != "float32" and settings.shards == 1
    if not settings.rotating or settings.residual_storage == "layer":
        return 0
    if settings.base_quantization is None and not sixteen_bit:
        return 0
    quantized = settings.base_quantization is not None
    if quantized and settings.shards > 1:  # a sharded quantised W0 folds to nearest: no residual
        return 0
    weights = [
        p for name, p in built.named_parameters() if name.endswith(f"{BASE_LAYER}weight") and not p.requires_grad
    ]
    entries = [p.numel() for p in weights]
    return sum(residual_bytes(n) if quantized else n for n in entries)


def _parameter_bytes(
    built: nn.Module, settings: PlanSettings, blocks: tuple[type[nn.Module], ...]
) -> tuple[dict[str, int], dict[str, int], dict[str, int], dict[int, int]]:
    """The parameters' bytes by part, their entry counts, and the largest of each kind.

    Also each parameter's bytes per entry, for the FSDP2 gathers."""
    method, value_size = settings.method, torch.finfo(parse_dtype(settings.dtype)).bits // 8
    shards = settings.shards
    # FSDP2 with its gradient sync off between micro-batches (accelerate's no_sync) accumulates unsharded gradients
    unsynced = shards > 1 and settings.accumulation > 1
    from ..training.eight_bit import weights_keeping_32bit_states
    from ..training.row_gradients import largest_chunk_entries, row_chunked_modules

    chunked = {id(m.weight) for m in row_chunked_modules(built)} if settings.fused_step else set()
    narrow = settings.vocab_weights_dtype == "bfloat16"
    bfloat16 = {id(m.weight) for m in row_chunked_modules(built, any_size=True)} if narrow else set()
    chunked |= bfloat16
    block_parameters = {id(p) for m in built.modules() if isinstance(m, blocks) for p in m.parameters()}
    thirty_two_bit = set()  # torchao's 8-bit AdamW keeps no weight at 32 bits
    if settings.eight_bit_library == "bitsandbytes":
        thirty_two_bit = {id(w) for w in weights_keeping_32bit_states(built)}
    galore = _galore_targets(built) if method == "galore" else set()
    counts = dict.fromkeys(("W0", "other frozen", "trainable", "adapter", "optimizer states"), 0)
    parts = dict.fromkeys(PARTS, 0)
    largest = {"head gradients": 0, "gradient": 0, "W0": 0, "8-bit entries": 0}
    entry_bytes = {}
    for name, parameter in built.named_parameters():
        adapter = any(marker in name for marker in ADAPTER_MARKERS)
        size = entry_bytes[id(parameter)] = 2 if id(parameter) in bfloat16 else 4 if adapter else value_size
        local = shard_entries(parameter.shape, shards, parameter.requires_grad) * size
        if not parameter.requires_grad:
            kind = "W0" if BASE_LAYER in name else "other frozen"
            counts[kind] += parameter.numel()
            if kind == "W0" and method.startswith("poet"):
                largest["W0"] = max(largest["W0"], parameter.numel())
                quantization, storage = settings.base_quantization, settings.residual_storage
                local = _w0_bytes(parameter.shape, quantization, storage, value_size, shards)
            parts["W0" if kind == "W0" else "other frozen weights"] += local
            continue
        counts["trainable"] += parameter.numel()
        counts["adapter"] += parameter.numel() if adapter else 0
        parts["trainable parameters"] += local
        parts["gradients"] += parameter.numel() * size if unsynced else local
        gradient = largest_chunk_entries(*parameter.shape) * size if id(parameter) in chunked else local
        if id(parameter) not in block_parameters and parameter.dim() == 2 and "embed" not in name:
            largest["head gradients"] += gradient
        states, local_states = (
            2 * parameter.numel(),
            2 * shard_entries(parameter.shape, shards, parameter.requires_grad),
        )  # shaped as the shard
        if name in galore:  # GaLore (Table 1): a projector m·r and Adam's states of the projected n·r gradient
            short, long = sorted(parameter.shape)
            states = short * settings.rank + 2 * long * settings.rank
            local_states = math.ceil(states / shards)
        counts["optimizer states"] += states
        eight_bit = settings.optimizer_bits == 8 and _quantizes_states(local_states // 2, settings.eight_bit_library)
        bits = 8 if eight_bit and id(parameter) not in thirty_two_bit else 32
        if bits == 8:  # blockwise 8-bit states (`_state_bytes`)
            largest["8-bit entries"] = max(largest["8-bit entries"], local_states // 2)
        parts["optimizer states"] += _state_bytes(local_states, size, bits, settings.eight_bit_library)
        largest["gradient"] = max(largest["gradient"], gradient)
        if id(parameter) in bfloat16:  # float32 weight, gradient, two moments; the rounding's noise and sum
            parts["bfloat16 steps"] = max(parts["bfloat16 steps"], 6 * 4 * largest_chunk_entries(*parameter.shape))
    return parts, counts, largest, entry_bytes


def _working_bytes(
    built: nn.Module,
    settings: PlanSettings,
    blocks: tuple[type[nn.Module], ...],
    largest_w0: int,
    report: dict[str, object],
) -> dict[str, int]:
    """The step's working memory: rotation caches, activations (a dequantised W0 among them) and the loss's.

    What the caches chose, and the planner's notes, go into ``report``."""
    batch, seq_len = settings.batch_size, settings.seq_len
    working = {}
    if settings.rotating:
        caches = plan_rotation_caches(built, settings)
        working["rotation caches"] = caches.bytes
        report["rotation caches"] = caches.summary()
        report["notes"] = caches.notes
    dtype = parse_dtype(settings.dtype)
    outside, largest_block, everything, block_input = trace_activations(built, batch, seq_len, dtype, blocks)
    block_count = sum(1 for m in built.modules() if isinstance(m, blocks))
    checkpointed = outside + block_count * block_input + largest_block
    working["activations"] = checkpointed if settings.checkpointing else everything
    if settings.base_quantization is not None and settings.rotating:  # one layer's W0, dequantised
        if storage_kind(settings.base_quantization).row_blocks:  # a block of its rows at a time
            largest_w0 = min(largest_w0, ROW_BLOCK_ENTRIES)
        working["activations"] += largest_w0 * (torch.finfo(dtype).bits // 8)
    vocabulary, hidden = base_model_of(built).get_output_embeddings().weight.shape
    tokens, value_size = batch * seq_len, torch.finfo(dtype).bits // 8
    working["loss working set"] = loss_bytes(settings, vocabulary, hidden, tokens, value_size)
    return working


def _w0_bytes(shape: torch.Size, quantization: str | None, storage: str, value_size: int, shards: int) -> int:
    """Bytes of one POET ``W0`` on a process.

    Its codes and scales (quantised) or values, and the merges' error-feedback residual when it is kept on the layer
    (a ``W0`` sharded by FSDP2 keeps none: its folds round to nearest)."""
    entries = shard_entries(shape, shards)
    if quantization is None:
        rounding = value_size == 2 and storage == "layer" and shards == 1  # an int8 byte per entry
        return entries * (value_size + int(rounding))
    stored = storage_kind(quantization).stored_bytes(math.ceil(shape[0] / shards), entries)  # codes and scales
    return stored + (residual_bytes(entries) if storage == "layer" and shards == 1 else 0)


def _quantizes_states(entries: int, library: str) -> bool:
    """Whether an 8-bit optimizer quantizes the states of a (local) tensor of ``entries``: 4096 or more, and for
    torchao's a whole number of its 256-entry blocks (`torchao.optim`'s rule; the rest keep float32 states)."""
    return entries >= EIGHT_BIT_MIN_ENTRIES and (library != "torchao" or entries % STATE_BLOCK == 0)


def _state_bytes(entries: int, value_size: int, bits: int, library: str) -> int:
    """Adam's two states of a tensor of ``entries`` (already doubled): float32-sized, or blockwise 8-bit (torchao's
    each with its own 256-entry float32 code table)."""
    if bits == 32:
        return entries * value_size
    tables = 2 * 256 * 4 if library == "torchao" else 0
    return entries + math.ceil(entries / STATE_BLOCK) * 4 + tables


def format_plans(plans: list[MemoryPlan]) -> str:
    """The plans side by side, one column per method, in MiB (2**20 bytes).

    Then, for the first plan, what its rotation caches chose (under accumulation) and the planner's notes, and
    ``total: N MiB per process``."""
    width = max(len(p) for p in PARTS) + 2
    lines = [f"{'MiB per process':<{width}}" + "".join(f"{plan.method:>12}" for plan in plans)]
    for part in PARTS:
        if any(plan.parts[part] for plan in plans):
            lines.append(f"{part:<{width}}" + "".join(f"{plan.parts[part] / 2**20:>12.1f}" for plan in plans))
    lines.append(f"{'sum':<{width}}" + "".join(f"{plan.total_bytes / 2**20:>12.1f}" for plan in plans))
    settings = plans[0].settings
    if settings.get("accumulation") != 1 and settings.get("rotation caches"):
        lines.append(str(settings["rotation caches"]))
    lines.extend(cast(list[str], settings.get("notes", [])))
    lines.append(f"total: {plans[0].total_bytes / 2**20:.0f} MiB per process")
    if plans[0].residual_bytes:
        lines.append(
            f"residual files: {plans[0].residual_bytes / 2**20:.0f} MiB on disk beside it (the merges' error-feedback "
            "residual, under the residual folder; host memory instead for a W0 on an accelerator)"
        )
    return "\n".join(lines)
