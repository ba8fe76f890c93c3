"""`RotationConfig`: the PEFT config base POET and OFT share, its fields declared and validated once."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from peft.config import PeftConfig

from ...orthogonal.maps import DEFAULT_MAP, MAPS, map_from_config
from ..config_utils import (
    FORWARD_CHOICES,
    CacheRotations,
    CheckedLoadConfig,
    Requantize,
    ResidualStorage,
    block_size_pattern_field,
    cache_rotations_field,
    check_bool,
    check_cache_rotations,
    check_choice,
    check_positive_int,
    normalize_peft_target_fields,
    peft_field,
    requantize_field,
    residual_storage_field,
    strict_block_size_field,
)
from .quantization import REQUANTIZE_MODES
from .residual_store import RESIDUAL_STORAGES

PATTERN_FIELD = "block_size_pattern"


@dataclass
class RotationConfig(CheckedLoadConfig, PeftConfig):
    """What every rotation adapter's config holds: targets, block sizes, the orthogonal map, merges and folds.

    POET (`PoetConfig`) and OFT (`OftConfig`) subclass it, set their own defaults (POET's ``block_size`` and
    ``merge_every``, OFT's ``neumann_terms``), and add their own fields; `RotationSettings` is what a layer keeps of it.
    ``neumann_terms`` counts as PEFT does (``R = I + 2Q + … + 2Q^(n−2) + Q^(n−1)``, ``n`` terms); the POET paper's
    eq. 6 counts ``k = n − 2``.
    """

    per_side_block_sizes: ClassVar[bool] = False  # whether block_size may be {"input": b_R, "output": b_P}

    target_modules: list[str] | set[str] | str | None = field(
        default=None,
        metadata={
            "help": "Module names or a regex to wrap. Default per model_type: every Linear inside the transformer "
            "blocks, never embeddings or lm_head."
        },
    )
    exclude_modules: list[str] | set[str] | str | None = field(
        default=None, metadata={"help": "Module names or a regex to leave out."}
    )
    block_size: int | dict[str, int] = field(
        default=32,
        metadata={
            "help": "Block size b of a rotated side (OFT: of the input side, in·kh·kw for a Conv2d; set exactly one "
            "of `r` and `block_size`); where b does not divide the side, the nearest divisor is used (see "
            "strict_block_size)."
        },
    )
    strict_block_size: bool = strict_block_size_field()
    block_size_pattern: dict[str, int | dict[str, int]] = block_size_pattern_field()
    neumann_terms: int = field(
        default=6,
        metadata={
            "help": "orthogonal_map='cayley_neumann': the terms n, counted as PEFT's num_cayley_neumann_terms (R = "
            "I + 2Q + … + 2Q^(n-2) + Q^(n-1)); the POET paper's eq. 6 counts k = n − 2 (its recipe k = 4 is n = 6, "
            "POET's default). 0 = the exact Cayley transform."
        },
    )
    orthogonal_map: str = field(
        default=DEFAULT_MAP,
        metadata={
            "help": f"The map from parameters to orthogonal blocks, one of {sorted(MAPS)}: 'cayley_neumann' (POET "
            "eq. 6, with neumann_terms) or 'householder' (products of b Householder reflections per block, HRA's "
            "map). PEFT's OFT format holds 'cayley_neumann' only."
        },
    )
    merge_every: int | None = field(
        default=None,
        metadata={
            "help": "Optimizer steps between merge-then-reinitialize (fold the rotations into W0, reset them, "
            "resample); None: never merged during training. PoetTrainingArguments.merge_every overrides it for "
            "one run."
        },
    )
    requantize: Requantize = requantize_field()
    residual_storage: ResidualStorage = residual_storage_field()
    cache_rotations: CacheRotations = cache_rotations_field()
    seed: int = field(default=0, metadata={"help": "Seed of the permutations, index sets and random inits."})
    forward: Literal["auto", "weight", "activation", "activation-recompute"] = field(
        default="auto",
        metadata={
            "help": "'weight' materialises the rotated weight; 'activation' rotates activations around the base op "
            "and keeps the pre-rotation output h for the backward; 'activation-recompute' recomputes h instead; "
            "'auto' takes the fewest multiply-adds, keeping h only where that saves at least a tenth of the layer's "
            "work, h is at most half of W0 (tokens <= in_features / 2) and both widths are at least 2048 "
            "(strategy_costs.auto_strategy). Conv2d always uses 'weight'."
        },
    )
    init_weights: bool = field(
        default=True, metadata={"help": "True: identity adapter (Q = 0). False: random non-identity, for tests."}
    )
    layers_to_transform: list[int] | int | None = peft_field("layers_to_transform")
    layers_pattern: list[str] | str | None = peft_field("layers_pattern")
    modules_to_save: list[str] | None = peft_field("modules_to_save")

    def __post_init__(self) -> None:
        super().__post_init__()
        normalize_peft_target_fields(self)
        self.check_block_size()
        check_block_size_pattern(self.block_size_pattern, per_side_allowed=self.per_side_block_sizes)
        map_from_config(self)  # the map's name and the settings it reads (neumann_terms)
        if self.merge_every is not None:
            check_positive_int("merge_every", self.merge_every)
        check_choice("forward", self.forward, FORWARD_CHOICES)
        check_choice("requantize", self.requantize, REQUANTIZE_MODES)
        check_choice("residual_storage", self.residual_storage, RESIDUAL_STORAGES)
        for name in ("strict_block_size", "init_weights"):
            check_bool(name, getattr(self, name))
        check_cache_rotations(self.cache_rotations)
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"`seed` must be an integer, got {self.seed!r}")

    def check_block_size(self) -> None:
        """``block_size`` is an integer >= 2 (a subclass may allow more).

        Raises:
            ValueError: naming ``block_size`` and what it may be.
        """
        check_positive_int("block_size", self.block_size, minimum=2)


def check_block_size_pattern(pattern: object, per_side_allowed: bool) -> None:
    """Validate a ``block_size_pattern``: module name → block size (>= 2), or per side for POET.

    Args:
        pattern: the field's value.
        per_side_allowed: whether a value may be ``{"input": b, "output": b}`` (POET's two sides).

    Raises:
        ValueError: a key is not a string, or a size is not an integer >= 2.
    """
    if not isinstance(pattern, dict):
        raise ValueError(f"`{PATTERN_FIELD}` must be a dict of module name -> block size, got {pattern!r}")
    for name, value in pattern.items():
        sizes = value if per_side_allowed and isinstance(value, dict) else {"": value}
        if not isinstance(name, str) or (isinstance(value, dict) and set(value) - {"input", "output"}):
            raise ValueError(f"`{PATTERN_FIELD}` entry {name!r}: {value!r} is not a module name -> block size")
        for size in sizes.values():
            if not isinstance(size, int) or isinstance(size, bool) or size < 2:
                raise ValueError(f"`{PATTERN_FIELD}[{name!r}]` must hold integers >= 2, got {value!r}")
