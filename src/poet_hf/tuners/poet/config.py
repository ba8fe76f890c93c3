"""`PoetConfig`: the PEFT config of POET (Reparameterized Training via Orthogonal Equivalence Transformation)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from ...orthogonal import BASE_INIT_SCHEMES
from ..config_utils import (
    BIAS_CHOICES,
    SIDES_CHOICES,
    SPO_CHOICES,
    check_budget,
    check_choice,
    check_positive_int,
    per_side,
)
from ..registry import peft_type_member
from ..rotation.config import RotationConfig
from ..rotation.storage_kinds import BASE_QUANTIZATIONS

POET_PEFT_TYPE = "POET"
# The storage kinds of `W0` (`poet_hf.tuners.rotation.storage_kinds.KINDS`), as the field types them.
BaseQuantization = Literal["nf4", "fp4", "int8", "nf4-shardable", "int8-shardable"]


@dataclass(frozen=True)
class PoetFinetuneRecipe:
    """A fine-tuning recipe for POET: the adapter's fields and the rotations' learning rate.

    Args:
        config: `PoetConfig` fields; the others keep their defaults.
        learning_rate: the rotations' rate at a ``reference_block`` side (``poet_learning_rate``; other trainable
            parameters, such as a new classification head, keep the Trainer's ``learning_rate``).
        reference_block: a side of block size ``b`` trains at ``learning_rate · reference_block / b``
            (``poet_reference_block`` of `PoetTrainingArguments` and `create_poet_optimizer`).
    """

    config: dict[str, Any]
    learning_rate: float = 5e-4
    reference_block: int = 32


# "default": 32-blocks on both sides in OFT's contiguous layout (a fine-tuning run rarely reaches a merge, where a
# permutation would pay off), each side at half OFT's rate, so that its two rotations turn the model about as fast as
# OFT's one; "paper": the POET paper's Table 6 setting, its pretraining configuration (fully stochastic, budget 1/2).
# docs/finetuning.md has the sweep on trained models that the rate comes from.
POET_FINETUNE_RECIPES: dict[str, PoetFinetuneRecipe] = {
    "default": PoetFinetuneRecipe({"spo": "contiguous", "block_size": 32}),
    "paper": PoetFinetuneRecipe({"spo": "full", "budget": 0.5}),
}


@dataclass
class PoetConfig(RotationConfig):
    """Configuration of a POET adapter: every target weight becomes ``R·W0·P`` (torch: ``P^T W0 R^T``).

    ``W0`` is frozen; ``R`` (in×in) and ``P`` (out×out) are orthogonal, built blockwise by the ``orthogonal_map``
    (POET eq. 6's Cayley–Neumann map by default, from skew-symmetric blocks) from parameters that start at the
    identity, so the wrapped model starts as the base model. Every
    ``merge_every`` optimizer steps [`merge_and_reinit`][poet_hf.merge_and_reinit] folds them into ``W0`` and draws new
    permutations / index sets.

    The Cayley–Neumann term count (declared by `RotationConfig`) counts as PEFT does (``R = I + 2Q + … + 2Q^(n−2) +
    Q^(n−1)``, ``n`` terms); the POET paper's eq. 6 counts ``k = n − 2``. Its default 6 is the paper's recipe
    ``k = 4`` (appendix J); ``merge_every=400`` is its §5.2 default. ``block_size`` and ``budget`` may differ per
    side (``{"input": …, "output": …}``, R and P), as in the paper's Fig. 5; a ``budget`` may be a fraction of the
    dimension or an absolute index-set size.
    """

    per_side_block_sizes: ClassVar[bool] = True

    spo: Literal["block", "full", "contiguous"] = field(
        default="block",
        metadata={
            "help": "'block': permuted block-diagonal rotations (POET-BS); 'full': one b×b block on a random "
            "index subset (POET-FS); 'contiguous': block-diagonal on fixed contiguous blocks, no permutation "
            "(OFT's layout, no gathers: the fine-tuning default, where runs rarely reach a merge)."
        },
    )
    block_size: int | dict[str, int] = field(
        default=256,
        metadata={
            "help": "Block size b for spo='block' or 'contiguous', or per side: {'input': b_R, 'output': b_P}. "
            "Where b does not divide a side, that side uses the nearest divisor (see strict_block_size)."
        },
    )
    budget: float | int | dict[str, float | int] = field(
        default=0.5,
        metadata={
            "help": "For spo='full': the index-set size per side, as a fraction of the dimension "
            "(a float in (0, 1]: b = ⌈budget·d⌉) or an absolute size (an int >= 2, Table 1's b); or "
            "per side: {'input': …, 'output': …} (Fig. 5's R:P splits)."
        },
    )
    sides: Literal["both", "input", "output"] = field(
        default="both", metadata={"help": "'both' (R and P), 'input' (R only, OFT-like) or 'output' (P only)."}
    )
    merge_every: int | None = field(
        default=400,
        metadata={
            "help": "Optimizer steps between merge-then-reinitialize (the default is the paper's §5.2 value); "
            "PoetTrainingArguments.merge_every overrides it for one run."
        },
    )
    rotation_learning_rate: float | None = field(
        default=None,
        metadata={
            "help": "The rotations' learning rate this adapter is built for: what PoetTrainer and "
            "create_poet_optimizer use when the training arguments give no poet_learning_rate (each side scaled by "
            "rotation_reference_block / b). for_finetuning sets its recipe's; None: the pretraining recipe's, 1e-3 "
            "at a 256-block side (the POET paper's Tables 8–9: 1e-3·256/b), 1e-3·½/budget for spo='full'."
        },
    )
    rotation_reference_block: int | None = field(
        default=None,
        metadata={
            "help": "With rotation_learning_rate: a side of block size b trains at rotation_learning_rate · "
            "rotation_reference_block / b; None: one rate for every side."
        },
    )
    base_init: str | None = field(
        default=None,
        metadata={"help": f"None keeps W0; one of {BASE_INIT_SCHEMES} re-initialises it (pretraining)."},
    )
    base_quantization: BaseQuantization | None = field(
        default=None,
        metadata={
            "help": "Quantise every target W0 with bitsandbytes after base_init (QPOET pretraining; needs the "
            "`quant` extra): 'nf4' or 'fp4' (4-bit, blocks of 64, double quantisation) or 'int8' (per row), as "
            "bitsandbytes layers; 'nf4-shardable' or 'int8-shardable', the same codes as plain tensors by row (4-bit "
            "without double quantisation), which FSDP2 and ZeRO-3 shard. None keeps W0 as it is; a base that is "
            "already quantised (BitsAndBytesConfig) needs nothing here."
        },
    )
    train_other_params: bool | None = field(
        default=None,
        metadata={
            "help": "Keep non-targeted parameters (embeddings, norms, lm_head) trainable and save them. "
            "None means True when base_init is set (pretraining from scratch), else False."
        },
    )
    bias: Literal["none", "all", "poet_only"] = field(default="none", metadata={"help": "Which biases to train."})

    def __post_init__(self) -> None:
        super().__post_init__()
        self.peft_type = peft_type_member(POET_PEFT_TYPE)  # the enum member; adapter_config.json keeps the string
        check_choice("spo", self.spo, SPO_CHOICES)
        for side, value in per_side("budget", self.budget).items():
            check_budget(value, f"budget[{side!r}]" if isinstance(self.budget, dict) else "budget", absolute=True)
        check_choice("sides", self.sides, SIDES_CHOICES)
        check_positive_int("merge_every", self.merge_every)  # POET merges; only OFT may say None
        if self.rotation_learning_rate is not None and not self.rotation_learning_rate > 0:
            raise ValueError(f"`rotation_learning_rate` must be > 0 or None, got {self.rotation_learning_rate!r}")
        if self.rotation_reference_block is not None:
            check_positive_int("rotation_reference_block", self.rotation_reference_block, minimum=2)
        check_choice("base_init", self.base_init, (None, *BASE_INIT_SCHEMES))
        check_choice("base_quantization", self.base_quantization, (None, *BASE_QUANTIZATIONS))
        check_choice("bias", self.bias, BIAS_CHOICES["poet"])

    def check_block_size(self) -> None:
        """``block_size`` is an integer >= 2, or one per side (``{"input": b_R, "output": b_P}``).

        Raises:
            ValueError: naming ``block_size`` (or its side) and what it may be.
        """
        for side, value in per_side("block_size", self.block_size).items():
            check_positive_int(
                f"block_size[{side!r}]" if isinstance(self.block_size, dict) else "block_size", value, minimum=2
            )

    @classmethod
    def for_finetuning(cls, recipe: str = "default", **overrides: Any) -> PoetConfig:
        """The config of a POET fine-tuning recipe (`POET_FINETUNE_RECIPES`), for a pretrained model.

        ``"default"`` is contiguous 32-blocks on both sides, whose rotations train at 5e-4 (half OFT's rate on each of
        its two sides) at a 32-block side, as ``POET_FINETUNE_RECIPES[recipe]`` records. ``"paper"`` is the POET
        paper's Table 6 setting (fully stochastic, budget ½). The config carries the recipe's rate
        (``rotation_learning_rate``, ``rotation_reference_block``): `PoetTrainer` and
        [`create_poet_optimizer`][poet_hf.training.create_poet_optimizer] train at it unless the training arguments
        set ``poet_learning_rate`` (and ``poet_reference_block``).

        Args:
            recipe: ``"default"`` or ``"paper"``.
            **overrides: fields to set differently (``target_modules``, ``task_type``, …).

        Returns:
            The config.

        Raises:
            ValueError: an unknown recipe.
        """
        check_choice("recipe", recipe, tuple(POET_FINETUNE_RECIPES))
        chosen = POET_FINETUNE_RECIPES[recipe]
        rates = {"rotation_learning_rate": chosen.learning_rate, "rotation_reference_block": chosen.reference_block}
        return cls(**{**chosen.config, **rates, **overrides})

    @property
    def trains_other_params(self) -> bool:
        """Whether non-targeted parameters stay trainable (pretraining)."""
        return self.base_init is not None if self.train_other_params is None else self.train_other_params
