"""The LLaMA shapes and training recipes of the POET paper's pretraining runs (Tables 7–9, appendix E).

[`PRESETS`][poet_hf.recipes.presets.PRESETS] names each shape with its recipe; `build_llama` builds one on the ``meta``
device and materializes it with keyed initialisation, and `apply_recipe` wraps it for a method. ``scripts/pretrain.py``
(`poet_hf.recipes.pretrain`) and [`plan_memory`][poet_hf.recipes.memory_plan.plan_memory] both read them here.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, cast

import torch
from peft import PeftConfig
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PretrainedConfig, PreTrainedModel

from ..initialization import materialize_model
from ..training.optimizer import tied_poet_learning_rate
from ..tuners.config_utils import DEFAULT_TARGET_MODULES
from ..tuners.poet import PoetConfig
from .recipe import PretrainRecipe

__all__ = [
    "PRESETS",
    "Preset",
    "apply_recipe",
    "build_llama",
    "count_trainable",
    "intermediate_size",
    "meta_recipe_model",
    "non_target_modules",
    "parameter_counts",
    "preset_config",
    "recipe_parameter_counts",
    "recipe_peft_config",
    "targets_for",
    "tied_poet_learning_rate",
]


@dataclass(frozen=True)
class Preset:
    """A LLaMA shape (Table 7) and the training recipe that goes with it (Tables 8–9, appendix E).

    ``intermediate_bs`` is the FFN size of the POET-BS column of Table 7 (divisible by the block sizes);
    ``intermediate_fs`` the one the POET-FS rows of Table 2 imply; ``intermediate`` GaLore's, for the baselines.
    """

    hidden: int
    intermediate_bs: int
    intermediate_fs: int
    intermediate: int
    heads: int
    layers: int
    learning_rate: float  # lr (base), Tables 8–9
    paper_steps: int  # Tables 8–9
    steps: int = 1000  # the default length: a short run of the paper's recipe
    batch_size: int = 32  # sequences per micro-batch per process (the official 60M script's)
    global_batch_size: int = 512  # sequences per optimizer step (appendix E: batch × accumulation × GPUs)
    budget: float | None = None  # None: PoetConfig's (½, the paper's)
    adapter_fields: Mapping[str, Any] = field(default_factory=dict, hash=False)  # PoetConfig fields (block_size, …)
    max_grad_norm: float = 0.1  # appendix E
    weight_decay: float = 0.01  # appendix E
    poet_learning_rate: float | None = None  # None: tied to the rotation size, as Tables 8–9 (poet_learning_rate)

    def __post_init__(self) -> None:
        if self.budget is None:  # one default, PoetConfig's
            object.__setattr__(self, "budget", PoetConfig.budget)

    @property
    def block_size(self) -> int:
        """POET-BS's block size: the preset's ``adapter_fields``, else PoetConfig's (256, the paper's)."""
        return int(self.adapter_fields.get("block_size", PoetConfig.block_size))


PRESETS = {
    # Not the paper's: a shape and recipe that train meaningfully in minutes on 2 CPU cores (the README's main job).
    "tiny": Preset(
        128,
        256,
        256,
        256,
        4,
        4,
        learning_rate=5e-3,
        paper_steps=0,
        steps=200,
        batch_size=8,
        global_batch_size=8,
        adapter_fields={"merge_every": 50, "block_size": 32},
        max_grad_norm=1.0,
        weight_decay=0.0,
        poet_learning_rate=4e-3,
    ),
    "llama-60m": Preset(512, 1280, 1376, 1376, 8, 8, learning_rate=1e-2, paper_steps=300_000),
    "llama-130m": Preset(768, 2048, 2048, 2048, 12, 12, learning_rate=5e-3, paper_steps=400_000),
    "llama-350m": Preset(1024, 2816, 2736, 2736, 16, 24, learning_rate=5e-3, paper_steps=400_000),
    # 1.3B: Table 2's FS counts (25.39/101.66/406.88M) need an FFN of 5464; GaLore's 5461 (the AdamW row, 1.21B)
    # misses them. Its BS-256 count, 118.26M, fits no FFN divisible by 256 (5376 gives 118.29M), so BS keeps Table 7.
    "llama-1.3b": Preset(2048, 5376, 5464, 5461, 32, 24, learning_rate=1e-3, paper_steps=500_000),
    # Not in the paper: Llama-2-7B's shape (configs/models/llama-2-7b.json), the 1.3B recipe; one process trains it
    # with the memory savings of docs/pretraining-7b.md.
    "llama-2-7b": Preset(4096, 11008, 11008, 11008, 32, 32, learning_rate=1e-3, paper_steps=0, batch_size=1),
}


def intermediate_size(preset: Preset, method: str) -> int:
    """The FFN size of ``method``'s column: Table 7's for POET-BS, Table 2's for POET-FS, GaLore's otherwise."""
    return {"poet-bs": preset.intermediate_bs, "poet-fs": preset.intermediate_fs}.get(method, preset.intermediate)


def preset_config(preset: Preset, method: str, vocab_size: int, seq_len: int) -> LlamaConfig:
    """The LLaMA config of a preset: Table 7's shape, with the FFN size of ``method``'s column (`intermediate_size`)."""
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=preset.hidden,
        num_hidden_layers=preset.layers,
        intermediate_size=intermediate_size(preset, method),
        num_attention_heads=preset.heads,
        num_key_value_heads=preset.heads,
        max_position_embeddings=seq_len,
        tie_word_embeddings=False,
    )


def build_llama(
    preset: Preset, method: str, vocab_size: int, seq_len: int, seed: int, device: str = "cpu"
) -> LlamaForCausalLM:
    """A randomly initialised LLaMA of the preset's shape, with the FFN size of the method's Table 7 / 2 column.

    Built on the ``meta`` device and materialized on ``device`` by
    [`materialize_model`][poet_hf.initialization.materialize_model] (transformers' initialisation, keyed by ``seed`` and
    each module's name); ``device="meta"`` returns it unmaterialized, for a trainer or ``shard_model`` to materialize
    shard by shard with the same values.

    Args:
        preset: the shape (one of ``PRESETS``).
        method: the method whose FFN size to use (``poet-bs``, ``poet-fs`` or a baseline).
        vocab_size: the vocabulary size.
        seq_len: the longest sequence (``max_position_embeddings``).
        seed: the seed of the keyed initialisation.
        device: where to materialize it, or ``"meta"`` to leave it unmaterialized.

    Returns:
        The ``LlamaForCausalLM``.
    """
    config = preset_config(preset, method, vocab_size, seq_len)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    return model if device == "meta" else materialize_model(model, seed=seed, device=device)


def targets_for(config: PretrainedConfig) -> list[str] | str:
    """The block linears POET, OFT, LoRA and GaLore train for ``config``'s family (`DEFAULT_TARGET_MODULES`).

    Raises:
        ValueError: the family is not one POET knows (the message lists those it does).
    """
    model_type = getattr(config, "model_type", None)
    if model_type not in DEFAULT_TARGET_MODULES:
        raise ValueError(
            f"`model_type`={model_type!r} has no default target modules; pretraining supports "
            f"{', '.join(sorted(DEFAULT_TARGET_MODULES))}"
        )
    return DEFAULT_TARGET_MODULES[model_type]


def non_target_modules(model: nn.Module, targets: list[str] | str) -> list[str]:
    """The last name of every module outside the targets that holds parameters of its own (embeddings, norms, head).

    What POET's ``train_other_params`` trains in full beside the rotations, and LoRA's ``modules_to_save``."""

    def is_target(name: str) -> bool:
        if isinstance(targets, str):
            return re.fullmatch(targets, name) is not None
        return name.rsplit(".", 1)[-1] in targets

    names = {
        name.rsplit(".", 1)[-1]
        for name, module in model.named_modules()
        if name and not is_target(name) and any(True for _ in module.parameters(recurse=False))
    }
    return sorted(names)


def apply_recipe(
    model: torch.nn.Module, recipe: PretrainRecipe, base_init: str | None = "recipe", seed: int = 0
) -> torch.nn.Module:
    """Wrap the model for the recipe's method (`recipe_peft_config`): POET and LoRA via PEFT, the others unchanged.

    Args:
        model: the causal LM to wrap.
        recipe: a resolved recipe (``method`` and the method's settings).
        base_init: POET's ``W0`` initialisation; ``"recipe"``: the recipe's.
        seed: the adapter's seed.

    Returns:
        The model to train.

    Raises:
        ValueError: the model's family has no default targets (`targets_for`).
        SystemExit: ``method="galore"`` without the ``galore-torch`` package.
    """
    from ..tuners.tuner_base import get_peft_model_quietly

    config = recipe_peft_config(model, recipe, base_init, seed)
    return model if config is None else get_peft_model_quietly(model, config)


def recipe_peft_config(
    model: torch.nn.Module, recipe: PretrainRecipe, base_init: str | None = "recipe", seed: int = 0
) -> PeftConfig | None:
    """The PEFT config that wraps ``model`` for the recipe's method; ``None`` for AdamW and GaLore.

    POET's is the recipe's `PoetConfig`, training the other parameters in full (``train_other_params``). LoRA targets
    the family's block linears (`targets_for`) and trains the other modules with parameters in full
    (`non_target_modules`: embeddings, norms, head), as the paper's LoRA baseline does.

    Args:
        model: the causal LM to wrap.
        recipe: a resolved recipe.
        base_init: POET's ``W0`` initialisation; ``"recipe"``: the recipe's.
        seed: the adapter's seed.

    Returns:
        The config, or ``None`` where the method trains the plain model.

    Raises:
        ValueError: the model's family has no default targets (`targets_for`).
        SystemExit: ``method="galore"`` without the ``galore-torch`` package.
    """
    from peft import LoraConfig

    targets = targets_for(cast(PretrainedConfig, model.config))  # a family the recipes know, for every method
    rotation = recipe.rotation
    if rotation is not None:
        initial = rotation.config.base_init if base_init == "recipe" else base_init
        return replace(rotation.config, seed=seed, base_init=initial, train_other_params=True)
    if recipe.method == "lora":
        rank = cast(int, recipe.lora_rank)
        return LoraConfig(
            r=rank, lora_alpha=rank, target_modules=targets, modules_to_save=non_target_modules(model, targets)
        )
    if recipe.method == "galore":
        try:
            import galore_torch  # noqa: F401
        except ImportError as error:
            raise SystemExit("--method galore needs the `galore-torch` package: pip install galore-torch") from error
    return None


def count_trainable(model: nn.Module) -> dict[str, int]:
    """Trainable parameters in total and inside the transformer blocks (the paper's Table 2 convention).

    Args:
        model: the model.

    Returns:
        ``{"trainable_params", "trainable_block_params"}``.
    """
    trainable = [(n, p.numel()) for n, p in model.named_parameters() if p.requires_grad]
    in_block = re.compile(r"\.\d+\.(?!.*(norm|ln_))")  # inside a numbered block, not one of its norms
    return {
        "trainable_params": sum(n for _, n in trainable),
        "trainable_block_params": sum(n for name, n in trainable if in_block.search(name)),
    }


def recipe_parameter_counts(
    recipe: PretrainRecipe, vocab_size: int, config: PretrainedConfig | None = None
) -> dict[str, object]:
    """What a recipe's method trains, counted on a model built on the ``meta`` device (`parameter_counts`).

    Args:
        recipe: a resolved recipe (``preset``, ``method``, ``model.seq_len`` and the method's settings).
        vocab_size: the vocabulary size (of a preset's model).
        config: the model's config; ``None``: the preset's LLaMA.

    Returns:
        `parameter_counts` of the recipe's model.
    """
    preset = PRESETS[recipe.preset]
    config = config or preset_config(preset, recipe.method, vocab_size, recipe.model["seq_len"])
    model = meta_recipe_model(recipe, config)
    return parameter_counts(model, recipe, config)


def meta_recipe_model(recipe: PretrainRecipe, config: PretrainedConfig) -> nn.Module:
    """The recipe's model on the ``meta`` device, wrapped for its method (`apply_recipe`), to count and plan.

    Its ``W0`` stays unquantised: a storage kind changes what ``W0`` occupies, which the planner reads from the kind,
    not which parameters exist.

    Args:
        recipe: a resolved recipe.
        config: the model's config.

    Returns:
        The wrapped model, nothing initialised.
    """
    unquantized = (
        replace(recipe.rotation, config=replace(recipe.rotation.config, base_quantization=None))
        if recipe.rotation is not None
        else None
    )
    return apply_recipe(meta_model(config), replace(recipe, rotation=unquantized), None)


def parameter_counts(model: nn.Module, recipe: PretrainRecipe, config: PretrainedConfig) -> dict[str, object]:
    """What ``model``, wrapped for ``recipe`` (`apply_recipe`), trains.

    Args:
        model: the wrapped model, on any device (``meta`` too).
        recipe: its recipe.
        config: the model's config.

    Returns:
        `count_trainable`'s counts; ``targets`` (the block linears the method adapts); ``trained_in_full`` (the last
        names of the other modules whose weights train, e.g. embeddings, norms, head); for POET-BS
        ``block_sizes``, each target's ``{"input": b, "output": b}`` by its name inside a block (``self_attn.q_proj``)
        as the layers resolved them (a size that does not divide a side becomes its nearest divisor).
    """
    from ..tuners.rotation.layer import rotation_layers

    targets = targets_for(config)
    report: dict[str, object] = {**count_trainable(model), "targets": targets}
    report["trained_in_full"] = sorted(
        {_module_of(name) for name, p in model.named_parameters() if p.requires_grad and not _in_adapter(name)}
    )
    if recipe.rotation is not None and recipe.rotation.config.spo == "block":
        report["block_sizes"] = {
            re.split(r"\.\d+\.", name)[-1]: {side: spec.block for side, spec in layer.sides("default").items()}
            for name, layer in rotation_layers(model)
        }
    return report


def _module_of(parameter_name: str) -> str:
    """The last module name of a parameter's (``model.layers.0.input_layernorm.weight`` → ``input_layernorm``)."""
    parts = [p for p in parameter_name.split(".")[:-1] if p not in ("modules_to_save", "default", "original_module")]
    return parts[-1]


def _in_adapter(parameter_name: str) -> bool:
    return any(key in parameter_name for key in ("lora_", "poet_"))


def without_zero3_init() -> contextlib.AbstractContextManager:
    """transformers' own switch that skips ``deepspeed.zero.Init`` while a model is built or loaded.

    Under DeepSpeed ZeRO-3 transformers partitions each model it builds; the scripts build POET's models whole (on
    ``meta``, then materialized, or loaded), and DeepSpeed partitions them when its engine wraps them."""
    from transformers.modeling_utils import set_zero3_state

    return set_zero3_state()


def meta_model(config: PretrainedConfig) -> PreTrainedModel:
    """The causal LM of ``config`` on the ``meta`` device: no memory, nothing initialised (`without_zero3_init`).

    In float32 whatever the config's ``torch_dtype`` says (Llama-2's says float16), as a checkpoint's weights are read:
    a run trains float32 weights, and ``--bf16`` computes in bfloat16 under autocast."""
    with torch.device("meta"), without_zero3_init():
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)
