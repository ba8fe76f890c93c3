"""`OrthogonalConfig`: rewrite target Linear / Conv2d modules into orthogonal layers (PEFT tuner ``"orthogonal"``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from peft.config import PeftConfig

from ...orthogonal.eco import ECO_MAPS, EcoMap
from ...orthogonal.maps import MAPS, map_from_config
from ..config_utils import BIAS_CHOICES, check_choice, check_positive_int, normalize_peft_target_fields, peft_field
from ..registry import peft_type_member

ORTHOGONAL_PEFT_TYPE = "ORTHOGONAL"
PARAMETERIZATIONS = (*sorted(MAPS), "reflection", "fgd")  # a registered orthogonal map, or one of two layers


@dataclass
class OrthogonalConfig(PeftConfig):
    """Configuration of an orthogonal-layers adapter.

    Every target ``nn.Linear`` becomes an orthogonal (semi-orthogonal if rectangular) layer that starts at the
    orthogonal polar factor ``O0 = U V^T`` of its weight ``W0 = U S V^T``, the orthogonal matrix nearest to ``W0``
    in Frobenius norm. The relative change ``||O0 - W0||_F / ||W0||_F`` of every layer is recorded and printed by
    ``OrthogonalModel.init_change_report()``. Every target ``nn.Conv2d`` becomes an ECO orthogonal convolution
    (``poet_hf.orthogonal.eco.EcoConv2d``; circular padding, for the fixed ``conv_input_size``).

    ``parameterization`` (Linear targets), with ``d = max(in, out)``:

    - an orthogonal map of `poet_hf.orthogonal.maps` (``"cayley_neumann"``, ``"householder"``): ``O = O0 R`` (or
      ``R O0`` when ``out > in``), ``R`` the map's ``d x d`` rotation: the Cayley transform of a skew matrix
      (``neumann_terms``, exact by default), or a product of ``num_reflections`` Householder reflections
      (compact-WY blocks of ``householder_block_size``);
    - ``"reflection"``: ``y = -O0 H(W x) x`` with one auxiliary reflection on the input (``W = I`` at start, where
      ``H(x) x = -x``). Input-dependent, so it cannot be merged into a plain weight;
    - ``"fgd"``: a plain weight ``O0``, kept orthogonal by [`FeedbackGD`][poet_hf.orthogonal.FeedbackGD] (pass
      ``OrthogonalModel.stiefel_parameters()`` as its ``stiefel_params``).
    """

    target_modules: list[str] | set[str] | str | None = field(
        default=None,
        metadata={"help": "Module names or a regex to rewrite; default per model_type (the Linears of the blocks)."},
    )
    exclude_modules: list[str] | set[str] | str | None = field(default=None, metadata={"help": "Modules to leave out."})
    parameterization: str = field(
        default="cayley_neumann", metadata={"help": f"One of {PARAMETERIZATIONS}; see the class docstring."}
    )
    neumann_terms: int = field(
        default=0,
        metadata={
            "help": "cayley_neumann: 0 = exact Cayley transform (orthogonal to rounding); n >= 2 = Neumann terms."
        },
    )
    num_reflections: int | None = field(
        default=None,
        metadata={"help": "householder: reflections per layer, even; None = the largest even number <= d."},
    )
    householder_block_size: int = field(default=32, metadata={"help": "householder: reflections per WY block."})
    conv_input_size: int | dict[str, int] | None = field(
        default=None,
        metadata={
            "help": "Spatial input size seen by the Conv2d targets (ECO builds the conv for one size): an int "
            "for all, or {module-name suffix: size}. Required when a Conv2d is targeted."
        },
    )
    eco_orthogonal_map: EcoMap = field(
        default="matrix_exp",
        metadata={"help": "ECO's training map: 'matrix_exp' (exactly orthogonal) or 'taylor' (5 terms, the paper's)."},
    )
    seed: int = field(default=0, metadata={"help": "Seed of random (init_weights=False) adapters and ECO kernels."})
    init_weights: bool = field(
        default=True,
        metadata={
            "help": "True: each layer starts at the polar factor of its weight. False: a random orthogonal "
            "perturbation of it, for tests."
        },
    )
    bias: Literal["none", "all", "orthogonal_only"] = field(default="none", metadata={"help": "Which biases to train."})
    layers_to_transform: list[int] | int | None = peft_field("layers_to_transform")
    layers_pattern: list[str] | str | None = peft_field("layers_pattern")
    modules_to_save: list[str] | None = peft_field("modules_to_save")

    def __post_init__(self) -> None:
        super().__post_init__()
        self.peft_type = peft_type_member(ORTHOGONAL_PEFT_TYPE)  # the enum member; adapter_config.json keeps the string
        normalize_peft_target_fields(self)
        check_choice("parameterization", self.parameterization, PARAMETERIZATIONS)
        if self.num_reflections is not None:
            check_positive_int("num_reflections", self.num_reflections)
        check_positive_int("householder_block_size", self.householder_block_size)
        if self.parameterization in MAPS:
            map_from_config(self, self.parameterization)  # the map checks the settings it reads
        if self.conv_input_size is not None and not isinstance(self.conv_input_size, dict):
            check_positive_int("conv_input_size", self.conv_input_size)
        if isinstance(self.conv_input_size, dict):
            for key, value in self.conv_input_size.items():
                check_positive_int(f"conv_input_size[{key!r}]", value)
        check_choice("eco_orthogonal_map", self.eco_orthogonal_map, ECO_MAPS)
        check_choice("bias", self.bias, BIAS_CHOICES["orthogonal"])
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"`seed` must be an integer, got {self.seed!r}")

    def input_size_for(self, layer_name: str) -> int | None:
        """The ``conv_input_size`` that applies to ``layer_name`` (exact name or dotted suffix), if any.

        Args:
            layer_name: the module's name.

        Returns:
            The spatial size, or ``None``.
        """
        if isinstance(self.conv_input_size, dict):
            for key, value in self.conv_input_size.items():
                if layer_name == key or layer_name.endswith("." + key):
                    return value
            return None
        return self.conv_input_size
