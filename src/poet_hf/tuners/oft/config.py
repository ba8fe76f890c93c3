"""`OftConfig`: orthogonal fine-tuning (OFT), the one-sided form of POET (``P = I``), as a PEFT config."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, cast

from ...orthogonal.cayley_map import CayleyNeumann
from ...orthogonal.spo import nearest_divisor
from ..config_utils import (
    BIAS_CHOICES,
    check_bool,
    check_choice,
    check_positive_int,
)
from ..registry import peft_type_member
from ..rotation.block_sizes import resolve_block_size
from ..rotation.config import RotationConfig

if TYPE_CHECKING:
    from peft import OFTConfig

OFT_PEFT_TYPE = "POET_OFT"  # PEFT already owns "OFT"; ours is registered beside it as "poet_oft"
OFT_SPO_CHOICES = ("contiguous", "block")


@dataclass
class OftConfig(RotationConfig):
    """Configuration of an OFT adapter: every target weight ``W0`` is used as ``W0 · R^T`` (torch orientation).

    ``R`` (in×in) is block-diagonal with orthogonal ``b×b`` blocks from the Cayley–Neumann map of skew-symmetric
    matrices that start at zero, so the wrapped model starts as the base model. ``R`` rotates every neuron (row
    of the torch weight) alike, so the pairwise angles between neurons, and hence the hyperspherical energy of the
    pretrained layer, are preserved (exactly for the exact Cayley transform, to the Neumann error otherwise).

    The field names follow PEFT's ``OFTConfig`` where the meaning is the same (``r``, ``module_dropout``, ``coft``,
    ``eps``, ``block_share``, ``bias``, …); ``block_size`` is PEFT's ``oft_block_size`` and ``neumann_terms`` its
    ``num_cayley_neumann_terms`` (0 = exact Cayley, PEFT's ``use_cayley_neumann=False``). Use
    [`from_peft_config`][poet_hf.OftConfig.from_peft_config] to convert a PEFT config and
    [`peft_oft_state_dict_to_ours`][poet_hf.tuners.oft.peft_oft_state_dict_to_ours]
    to convert its weights.
    """

    r: int = field(
        default=0,
        metadata={
            "help": "Number of blocks per layer (block_size = in_features / r; where r does not divide, the "
            "nearest divisor, see strict_block_size). Set exactly one of `r` and `block_size`."
        },
    )
    neumann_terms: int = field(
        default=5,
        metadata={
            "help": "orthogonal_map='cayley_neumann': the terms n, PEFT's num_cayley_neumann_terms and its default "
            "(R = I + 2Q + … + 2Q^(n-2) + Q^(n-1); 0 = the exact Cayley transform, PEFT's use_cayley_neumann=False)."
        },
    )

    block_share: bool = field(default=False, metadata={"help": "One skew block shared by all blocks of a layer."})
    coft: bool = field(default=False, metadata={"help": "Constrained OFT: keep each skew block in a Frobenius ball."})
    eps: float = field(
        default=6e-5,
        metadata={
            "help": "COFT radius, divided by sqrt(number of parameter blocks) as in PEFT. Only used with coft=True."
        },
    )
    module_dropout: float = field(
        default=0.0,
        metadata={
            "help": "Multiplicative dropout: in training, int(p·blocks) random blocks of R are "
            "replaced by the identity at each forward."
        },
    )
    spo: Literal["contiguous", "block"] = field(
        default="contiguous",
        metadata={
            "help": "'contiguous': the fixed contiguous blocks of PEFT's OFT. 'block': block-stochastic, "
            "the blocks act on a random permutation of the input dimension, resampled at every "
            "merge-then-reinitialize."
        },
    )

    bias: Literal["none", "all", "oft_only"] = field(default="none", metadata={"help": "Which biases to train."})

    def __post_init__(self) -> None:
        super().__post_init__()
        self.peft_type = peft_type_member(OFT_PEFT_TYPE)  # the enum member; adapter_config.json keeps the string
        for name in ("block_share", "coft"):
            check_bool(name, getattr(self, name))
        if not isinstance(self.eps, (int, float)) or isinstance(self.eps, bool) or not self.eps > 0:
            raise ValueError(f"`eps` must be a positive number, got {self.eps!r}")
        if (
            not isinstance(self.module_dropout, (int, float))
            or isinstance(self.module_dropout, bool)
            or not 0 <= self.module_dropout < 1
        ):
            raise ValueError(f"`module_dropout` must be a probability in [0, 1), got {self.module_dropout!r}")
        if self.block_share and self.module_dropout > 0:
            raise ValueError("`module_dropout` has no effect with `block_share`=True (one shared block); set it to 0")
        check_choice("spo", self.spo, OFT_SPO_CHOICES)
        check_choice("bias", self.bias, BIAS_CHOICES["oft"])
        if self.coft and self.orthogonal_map != CayleyNeumann.name:
            raise ValueError(
                f"`coft`=True keeps each skew block Q in a ball: it needs orthogonal_map='{CayleyNeumann.name}', "
                f"got orthogonal_map={self.orthogonal_map!r}"
            )

    @property
    def side_block_size(self) -> int:
        """``block_size``, an integer here: OFT rotates one side (`check_block_size` refuses a per-side mapping)."""
        return cast(int, self.block_size)

    def check_block_size(self) -> None:
        """Exactly one of ``r`` and ``block_size`` is non-zero, and a block size is at least 2.

        Raises:
            ValueError: naming ``r`` or ``block_size`` and what they may be.
        """
        check_positive_int("r", self.r, minimum=0)
        check_positive_int("block_size", self.block_size, minimum=0)
        if (self.r == 0) == (self.block_size == 0):
            raise ValueError(
                f"set exactly one of `r` (blocks per layer) and `block_size` to a non-zero value, got "
                f"r={self.r}, block_size={self.block_size}; e.g. OftConfig(r=8, block_size=0)"
            )
        if self.block_size == 1:
            raise ValueError("`block_size` must be 0 (use `r`) or an integer >= 2, got 1 (a 1×1 rotation is ±1)")

    def resolve_block_size(self, dim: int, layer_name: str) -> int:
        """The block size for a target whose rotated (input) dimension is ``dim`` (`block_sizes`).

        ``block_size``, or ``dim / r``, where it divides ``dim``; otherwise, as PEFT's OFT does, the nearest divisor
        (with ``strict_block_size``, an error), which the tuner records in ``block_size_pattern``. ``r`` is fitted as
        a number of blocks, so the result is ``dim`` over the divisor of ``dim`` nearest to ``r``.

        Args:
            dim: the rotated (input) dimension.
            layer_name: the module's name, the key of ``block_size_pattern``.

        Returns:
            The block size, a divisor of ``dim`` of at least 2.

        Raises:
            ValueError: with ``strict_block_size``, the size (or ``r``) does not divide ``dim``; or a
                ``block_size_pattern`` entry does not; or ``r`` gives 1 × 1 blocks.
        """
        if not self.r or layer_name in self.block_size_pattern:
            return resolve_block_size(self, layer_name, "input", dim, self.side_block_size or dim, "block_size")
        if dim % self.r and self.strict_block_size:
            raise ValueError(
                f"`r`={self.r} does not divide the {dim}-dimensional input side of target module '{layer_name}'; "
                "choose a number of blocks that divides every targeted input dimension, or set "
                "`strict_block_size`=False to use the nearest divisor"
            )
        blocks = self.r if dim % self.r == 0 else nearest_divisor(dim, self.r)
        if blocks * 2 > dim:
            raise ValueError(
                f"`r`={self.r} gives blocks of size {dim // blocks} for target module '{layer_name}' "
                f"(input dimension {dim}); use fewer blocks"
            )
        return dim // blocks

    @classmethod
    def from_peft_config(cls, peft_config: OFTConfig, **overrides: Any) -> OftConfig:
        """The ``OftConfig`` that computes what PEFT's ``OFTConfig`` computes (for Linear / Conv1D targets).

        Mapping: ``oft_block_size → block_size``, ``num_cayley_neumann_terms → neumann_terms`` (0 when
        ``use_cayley_neumann=False``), the other fields by name. PEFT's 3-term series is really the 4-term polynomial
        ``I + 2Q + 2Q² + Q³`` (its loop adds one term too many there), so 3 maps to 4; PEFT's 1 and 2 terms give
        ``I`` and ``I + 2Q``, which are no Cayley–Neumann truncation and are refused. PEFT's default target modules
        (q_proj, v_proj for LLaMA) differ from ours, so the targets are copied explicitly.

        Args:
            peft_config: PEFT's ``OFTConfig``.
            **overrides: fields to set differently.

        Returns:
            The ``OftConfig``.

        Raises:
            ValueError: PEFT's 1- or 2-term series (not a rotation).
        """
        if peft_config.use_cayley_neumann:
            terms = peft_config.num_cayley_neumann_terms
            if terms < 3:
                raise ValueError(
                    f"PEFT `num_cayley_neumann_terms`={terms} computes {'I' if terms < 2 else 'I + 2Q'}, which is not "
                    "a Cayley–Neumann rotation; OftConfig supports PEFT's 3 or more terms"
                )
            terms = max(terms, 4)
        else:
            terms = 0
        module_dropout = 0.0 if peft_config.block_share else peft_config.module_dropout  # PEFT ignores it there
        fields: dict[str, Any] = {
            "target_modules": peft_config.target_modules,
            "exclude_modules": peft_config.exclude_modules,
            "r": peft_config.r,
            "block_size": peft_config.oft_block_size,
            "neumann_terms": terms,
            "block_share": peft_config.block_share,
            "coft": peft_config.coft,
            "eps": peft_config.eps,
            "module_dropout": module_dropout,
            "init_weights": peft_config.init_weights,
            "bias": peft_config.bias,
            "layers_to_transform": peft_config.layers_to_transform,
            "layers_pattern": peft_config.layers_pattern,
            "modules_to_save": peft_config.modules_to_save,
            "task_type": peft_config.task_type,
            "base_model_name_or_path": peft_config.base_model_name_or_path,
            "inference_mode": peft_config.inference_mode,
        }
        if isinstance(fields["target_modules"], set):
            fields["target_modules"] = sorted(fields["target_modules"])
        if isinstance(fields["exclude_modules"], set):
            fields["exclude_modules"] = sorted(fields["exclude_modules"])
        fields.update(overrides)
        return cls(**fields)
