"""A resolved pretraining recipe: every value of a run, typed (`pretrain_settings.resolve_recipe` builds it).

`PretrainRecipe.as_dict` is what ``--print_recipe`` prints and ``results.json`` records under ``"recipe"``: one flat
mapping, the method's settings beside the run's.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TypedDict

from ..orthogonal.cayley import paper_neumann_k
from ..orthogonal.cayley_map import CayleyNeumann
from ..orthogonal.maps import map_from_config
from ..tuners.poet import PoetConfig
from .script_arguments import MAP_FLAGS

__all__ = ["ModelSummary", "PretrainRecipe", "RotationRecipe"]


class ModelSummary(TypedDict):
    """The model block of a recipe (`poet_hf.recipes.model_source.model_summary`).

    Args:
        source: the preset, ``--config_name`` or checkpoint the model comes from.
        model_type: the config's ``model_type``.
        hidden: the hidden size.
        intermediate: the feed-forward width.
        heads: attention heads.
        layers: transformer blocks.
        seq_len: tokens per sequence.
        vocab: the vocabulary (a preset's: the tokenizer's; ``None`` before it is known).
        tie_word_embeddings: whether the head shares the input embeddings.
    """

    source: str
    model_type: str
    hidden: int
    intermediate: int
    heads: int
    layers: int
    seq_len: int
    vocab: int | None
    tie_word_embeddings: bool


@dataclass(frozen=True)
class RotationRecipe:
    """POET's part of a recipe: the adapter's config as the run resolves it, the rotations' rate and the clip ramp.

    Args:
        config: the resolved `PoetConfig` (the sides, the orthogonal map, the merges, ``W0``'s initialisation and
            storage, the rotation cache); `apply_recipe` gives it the run's seed.
        poet_learning_rate: the rotations' learning rate.
        post_merge_clip_steps: steps of the clip ramp after a merge.
        post_merge_clip_factor: the clip threshold's factor right after a merge.
    """

    config: PoetConfig
    poet_learning_rate: float
    post_merge_clip_steps: int = 10
    post_merge_clip_factor: float = 0.1

    def as_dict(self) -> dict[str, object]:
        """The recipe's settings flat: the side's ``block_size`` (POET-BS) or ``budget`` (POET-FS), the map's settings
        (with the POET paper's ``k`` of a Cayley–Neumann series), the merges, ``W0``'s, the cache and the rates."""
        config = self.config
        side = "block_size" if config.spo == "block" else "budget"
        orthogonal_map = map_from_config(config)
        paper_k = paper_neumann_k(orthogonal_map.terms) if isinstance(orthogonal_map, CayleyNeumann) else None
        return {
            "spo": config.spo,
            side: getattr(config, side),
            **{name: getattr(config, name) for name in MAP_FLAGS},
            "paper_neumann_k": paper_k,
            "merge_every": config.merge_every,
            "base_init": config.base_init,
            "base_quantization": config.base_quantization,
            "cache_rotations": config.cache_rotations,
            "poet_learning_rate": self.poet_learning_rate,
            "post_merge_clip_steps": self.post_merge_clip_steps,
            "post_merge_clip_factor": self.post_merge_clip_factor,
        }


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
    model: ModelSummary
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
    parameters: dict[str, object] | None = None

    def as_dict(self) -> dict[str, object]:
        """One flat mapping: the run's values, then the method's (a side's ``block_size`` or ``budget``, whichever
        the method has) and the parameter counts."""
        flat = {
            f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("rotation", "lora_rank", "parameters")
        }
        if self.rotation is not None:
            flat.update(self.rotation.as_dict())
        if self.lora_rank is not None:
            flat["lora_rank"] = self.lora_rank
        return {**flat, **(self.parameters or {})}
