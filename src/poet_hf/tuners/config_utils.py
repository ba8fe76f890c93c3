"""What the tuner configs share: their choices, the default target modules, and validation whose errors name the
field and the allowed values."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import field
from typing import Any, Literal, Protocol, TypeVar

from peft.config import PeftConfig

from .rotation.state_checks import check_safetensors_file

ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"  # PEFT's SAFETENSORS_WEIGHTS_NAME

SIDE_INPUT = "input"  # R, acts on the in dimension
SIDE_OUTPUT = "output"  # P, acts on the out dimension
SIDES = (SIDE_INPUT, SIDE_OUTPUT)

SPO_CHOICES = ("block", "full", "contiguous")
SIDES_CHOICES = ("both", "input", "output")
FORWARD_CHOICES = ("auto", "weight", "activation", "activation-recompute")
BIAS_CHOICES = {name: ("none", "all", f"{name}_only") for name in ("poet", "oft", "orthogonal")}

_LLAMA_LIKE = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# BERT-like encoders name their block linears `dense` too, like the pooler and heads outside the blocks,
# so they are matched by a regex anchored in `encoder.layer.<i>`.
_ENCODER_BLOCKS = (
    r".*encoder\.layer\.\d+\."
    r"(attention\.(self|attention)\.(query|key|value)|attention\.output\.dense|intermediate\.dense|output\.dense)"
)
# ViT in transformers 5 names its block linears like LLaMA's attention plus fc1/fc2; the pooler is outside.
_VIT_BLOCKS = r".*layers\.\d+\.(attention\.(q_proj|k_proj|v_proj|o_proj)|mlp\.(fc1|fc2))"

# Every Linear inside the transformer blocks, never embeddings or lm_head (POET §3.3).
DEFAULT_TARGET_MODULES: dict[str, list[str] | str] = {
    "llama": _LLAMA_LIKE,
    "mistral": _LLAMA_LIKE,
    "mixtral": ["q_proj", "k_proj", "v_proj", "o_proj", "w1", "w2", "w3"],
    "qwen2": _LLAMA_LIKE,
    "qwen3": _LLAMA_LIKE,
    "gemma": _LLAMA_LIKE,
    "gemma2": _LLAMA_LIKE,
    "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
    "gpt2": ["c_attn", "c_proj", "c_fc"],
    "gpt_neox": ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"],
    "bert": _ENCODER_BLOCKS,
    "roberta": _ENCODER_BLOCKS,
    "vit": _VIT_BLOCKS,
    "bart": ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"],
    "t5": ["q", "k", "v", "o", "wi", "wo", "wi_0", "wi_1"],
}


def check_choice(field_name: str, value: object, choices: tuple) -> None:
    """Raise a ``ValueError`` naming the field and its allowed values."""
    if value not in choices:
        raise ValueError(f"`{field_name}` must be one of {choices}, got {value!r}")


def check_positive_int(field_name: str, value: object, minimum: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"`{field_name}` must be an integer >= {minimum}, got {value!r}")


def check_budget(value: object, field_name: str = "budget", absolute: bool = False) -> None:
    """A fraction in (0, 1]; with ``absolute``, an int >= 2 (an absolute index-set size) too."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        valid = False
    else:
        valid = 0 < value <= 1 or (absolute and isinstance(value, int) and value >= 2)
    if not valid:
        allowed = "a fraction in (0, 1] or an absolute size (an int >= 2)" if absolute else "a fraction in (0, 1]"
        raise ValueError(f"`{field_name}` must be {allowed}, got {value!r}")


SIDE_NAMES = ("input", "output")


_SideValue = TypeVar("_SideValue")


def check_bool(field_name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"`{field_name}` must be True or False, got {value!r}")


# The values of the rotation configs' fields defined here.
Requantize = Literal["feedback", "nearest", "stochastic"]
ResidualStorage = Literal["auto", "layer", "cpu", "disk"]
CacheRotations = bool | Literal["auto"]


def requantize_field() -> Requantize:
    """The ``requantize`` field of the rotation configs: how a fold into a quantised or 16-bit ``W0`` rounds.

    See `poet_hf.tuners.rotation.quantization.requantize` and `poet_hf.tuners.rotation.low_precision.store`."""
    return field(
        default="feedback",
        metadata={
            "help": "How a fold (merge_and_reinit, merge, unmerge) rounds a quantised (nf4, fp4, int8) or 16-bit "
            "(bfloat16, float16) W0: 'feedback' (to nearest, and the rounding residual is kept, int8, 1 byte per "
            "entry, and added back at the next fold, so the error stays one rounding however many merges), "
            "'nearest' (no residual: the error grows like the square root of the merges) or 'stochastic' "
            "(unbiased random rounding, seeded per layer and merge). Ignored for a float32 W0, and a 16-bit W0 "
            "sharded by FSDP2 rounds to nearest."
        },
    )


def residual_storage_field() -> ResidualStorage:
    """The ``residual_storage`` field of the rotation configs: where error feedback keeps its residual.

    See `poet_hf.tuners.rotation.residual_store`."""
    return field(
        default="auto",
        metadata={
            "help": "Where requantize='feedback' keeps the rounding residual between folds: 'layer' (buffers beside "
            "W0, in the training steps' memory: 1.06 bytes per entry of a 4-bit W0, 1 of a 16-bit one), 'cpu' (host "
            "memory, for a W0 on an accelerator), 'disk' (a temporary file per layer, read one layer at a time at a "
            "fold) or 'auto' ('cpu' for a W0 on an accelerator, 'disk' on the CPU). It is saved with the model's "
            "state wherever it is kept."
        },
    )


_PEFT_FIELD_HELP = {
    "layers_to_transform": "Only these layer indices (an int or a list) are wrapped; None: all. Needs layers_pattern "
    "for models whose layer list has another name.",
    "layers_pattern": "The name of the layer list that layers_to_transform indexes (e.g. 'layers', 'h'); must be set "
    "with layers_to_transform.",
    "modules_to_save": "Modules (beside the adapters) that are trained fully and saved with the adapter, e.g. a new "
    "classification head.",
}


def peft_field(name: str) -> Any:
    """One of PEFT's standard config fields, default ``None``, with its help: one definition for the three tuners.

    They are ``layers_to_transform``, ``layers_pattern`` and ``modules_to_save``."""
    return field(default=None, metadata={"help": _PEFT_FIELD_HELP[name]})


def strict_block_size_field() -> bool:
    """The ``strict_block_size`` field of the rotation configs (`block_sizes`)."""
    return field(
        default=False,
        metadata={
            "help": "False (default): a block size (or OFT's r) that does not divide a targeted side becomes its "
            "nearest divisor (PEFT's rule for OFT; never 1), with one warning listing the layers, and the sizes are "
            "recorded in block_size_pattern. True: such a layer is an error."
        },
    )


def block_size_pattern_field() -> dict[str, int | dict[str, int]]:
    """The ``block_size_pattern`` field of the rotation configs (`block_sizes`)."""
    return field(
        default_factory=dict,
        metadata={
            "help": "Block size per target module, by its full name in the base model (e.g. "
            "'model.layers.0.mlp.down_proj'); POET may give {'input': b_R, 'output': b_P}. An entry overrides "
            "block_size for that module and must divide it. Filled when the model is built with the sizes that "
            "were adjusted to fit, and saved with the adapter, so a reload builds the same blocks."
        },
    )


def cache_rotations_field() -> CacheRotations:
    """The ``cache_rotations`` field of the rotation configs (`poet_hf.tuners.rotation.caches`)."""
    return field(
        default="auto",
        metadata={
            "help": "Under gradient accumulation, build each rotation once per optimizer step and run its "
            "Cayley-Neumann VJP once, on the sum of the micro-batches' gradients (Trainer, accelerate's accumulate, or "
            "poet_hf.defer_rotation_grads in a plain loop). The cache holds the rotation blocks (compute dtype) and "
            "their pending gradient (float32), rows·b² entries each per side, unsharded, across the window. 'auto' "
            "(default) decides per layer at its first accumulation window: on when the polynomial is at least 10% of "
            "the layer's multiply-adds per micro-batch and the cache holds at most 2x the rotations' state on the "
            "process (poet_hf.orthogonal.strategy_costs.rotation_cache_choice); the choice is logged. True always "
            "caches (less time, more memory), False never (the rotation is rebuilt per micro-batch). Without "
            "accumulation nothing changes."
        },
    )


def check_cache_rotations(value: object) -> None:
    """``cache_rotations`` is ``"auto"``, ``True`` or ``False``."""
    if value != "auto" and not isinstance(value, bool):
        raise ValueError(f"`cache_rotations` must be 'auto', True or False, got {value!r}")


def per_side(field_name: str, value: _SideValue | Mapping[str, _SideValue]) -> dict[str, _SideValue]:
    """``{"input": v, "output": v}`` from a scalar, or the validated per-side dict (R is "input", P "output")."""
    if not isinstance(value, Mapping):
        return dict.fromkeys(SIDE_NAMES, value)
    unknown = set(value) - set(SIDE_NAMES)
    if unknown or not value:
        raise ValueError(f"`{field_name}` per side must have keys among {SIDE_NAMES}, got {sorted(value)}")
    return dict(value)


class TargetingConfig(Protocol):
    """PEFT's standard targeting fields, which each of the three tuners' configs has."""

    target_modules: list[str] | set[str] | str | None
    exclude_modules: list[str] | set[str] | str | None
    layers_pattern: list[str] | str | None
    layers_to_transform: list[int] | int | None


def normalize_peft_target_fields(config: TargetingConfig) -> None:
    """Apply PEFT's conventions to the standard targeting fields.

    Lists become sets, and ``layers_pattern`` needs ``layers_to_transform``."""
    if isinstance(config.target_modules, list):
        config.target_modules = set(config.target_modules)
    if isinstance(config.exclude_modules, list):
        config.exclude_modules = set(config.exclude_modules)
    if config.layers_pattern and config.layers_to_transform is None:
        raise ValueError("`layers_to_transform` must be set when `layers_pattern` is set")


def holds_full_model(config: PeftConfig) -> bool:
    """Whether an adapter of ``config`` trains and saves every parameter of the model besides its rotations.

    So POET does when pretraining from scratch: its adapter file is then the whole model. False for OFT and
    orthogonal configs."""
    return bool(getattr(config, "trains_other_params", False))


class CheckedLoadConfig:
    """Mixin for a ``PeftConfig`` whose ``from_pretrained`` checks the adapter weights beside the config.

    They must be a whole safetensors file. Where they are is recorded (``loaded_from``, not serialized), so that the
    layers' load checks (`state_checks`) name the file when a tensor in it is wrong."""

    loaded_from: str | None = None

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str, subfolder: str | None = None, **kwargs: Any):
        config = super().from_pretrained(  # type: ignore[misc]  # a mixin: PeftConfig, after it in the MRO, has it
            pretrained_model_name_or_path, subfolder=subfolder, **kwargs
        )
        weights = os.path.join(str(pretrained_model_name_or_path), subfolder or "", ADAPTER_WEIGHTS_NAME)
        if os.path.isfile(weights):
            check_safetensors_file(weights)
        config.loaded_from = weights if os.path.isfile(weights) else str(pretrained_model_name_or_path)
        return config
