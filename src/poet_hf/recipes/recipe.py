"""A resolved pretraining recipe: every value of a run, typed (`poet_hf.recipes.pretrain.resolve_recipe` builds it).

`PretrainRecipe.as_dict` is what ``--print_recipe`` prints and ``results.json`` records under ``"recipe"``: one flat
mapping, the method's settings beside the run's.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal

__all__ = ["PretrainRecipe", "RotationRecipe"]

SideSizes = int | float | dict[str, Any]  # one size for both sides, or {"input": …, "output": …}


@dataclass(frozen=True)
class RotationRecipe:
    """POET's part of a recipe: the sides, the Cayley–Neumann terms, the merges and the rotations' rate.

    Args:
        spo: ``"block"`` (POET-BS) or ``"full"`` (POET-FS).
        block_size: POET-BS's block size (``None`` for POET-FS).
        budget: POET-FS's budget (``None`` for POET-BS).
        neumann_terms: Cayley–Neumann terms, PEFT's count (0: the exact transform).
        paper_neumann_k: the same count as the POET paper's ``k`` (``neumann_terms − 2``; ``None`` for the exact
            transform).
        merge_every: optimizer steps between merges.
        base_init: the initialisation of ``W0``.
        base_quantization: the storage kind of ``W0`` (``None``: unquantised).
        cache_rotations: ``True``, ``False`` or ``"auto"``.
        poet_learning_rate: the rotations' learning rate.
        post_merge_clip_steps: steps of the clip ramp after a merge.
        post_merge_clip_factor: the clip threshold's factor right after a merge.
    """

    spo: Literal["block", "full"]
    block_size: SideSizes | None
    budget: SideSizes | None
    neumann_terms: int
    paper_neumann_k: int | None
    merge_every: int
    base_init: str | None
    base_quantization: str | None
    cache_rotations: bool | Literal["auto"]
    poet_learning_rate: float
    post_merge_clip_steps: int = 10
    post_merge_clip_factor: float = 0.1


@dataclass(frozen=True)
class PretrainRecipe:
    """Every value of a pretraining run: the options and training flags given, else the preset's.

    Args:
        preset: the preset's name.
        method: the method (``poet-bs``, ``poet-fs``, ``adamw``, ``lora``, ``galore``).
        model: the model's summary (`poet_hf.recipes.model_source.model_summary`).
        learning_rate: the rate of the weights that train plainly.
        max_grad_norm: the clip threshold.
        weight_decay: AdamW's decay.
        optimizer: ``--optim``, where the method sets one.
        fused_optimizer_step: whether each parameter steps in the backward.
        vocab_weights_dtype: the storage dtype of the embeddings and the head.
        schedule: the learning-rate schedule.
        min_lr_ratio: the cosine schedule's floor, as a fraction of the peak.
        warmup_steps: warm-up steps.
        steps: optimizer steps.
        sequences_per_step: the global batch, in sequences.
        batch_size: the micro-batch per process.
        gradient_accumulation_steps: micro-batches per optimizer step.
        processes: data-parallel processes.
        packing: whether sequences are packed.
        tokens_per_step: tokens of one optimizer step.
        total_tokens: tokens of the run.
        rotation: POET's settings (``None`` for the other methods).
        lora_rank: LoRA's rank (``None`` for the other methods).
        parameters: what the method trains (`poet_hf.recipes.presets.recipe_parameter_counts`), where counted.
    """

    preset: str
    method: str
    model: dict[str, Any]
    learning_rate: float
    max_grad_norm: float
    weight_decay: float
    optimizer: str | None
    fused_optimizer_step: bool
    vocab_weights_dtype: str
    schedule: str
    min_lr_ratio: float
    warmup_steps: int
    steps: int
    sequences_per_step: int
    batch_size: int
    gradient_accumulation_steps: int
    processes: int
    packing: bool
    tokens_per_step: int
    total_tokens: int
    rotation: RotationRecipe | None = None
    lora_rank: int | None = None
    parameters: dict[str, Any] | None = None

    def as_dict(self) -> dict[str, Any]:
        """One flat mapping: the run's values, then the method's (a side's ``block_size`` or ``budget``, whichever
        the method has) and the parameter counts."""
        flat = {
            f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("rotation", "lora_rank", "parameters")
        }
        if self.rotation is not None:
            rotation = {f.name: getattr(self.rotation, f.name) for f in fields(self.rotation)}
            flat.update({k: v for k, v in rotation.items() if v is not None or k not in ("block_size", "budget")})
        if self.lora_rank is not None:
            flat["lora_rank"] = self.lora_rank
        return {**flat, **(self.parameters or {})}
