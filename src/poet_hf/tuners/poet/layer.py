"""POET tuner layers for ``nn.Linear``, ``transformers`` ``Conv1D`` and ``nn.Conv2d``.

The effective weight is ``P^T · W_t0 · R^T``: R (in×in) rotates inputs and P (out×out) rotates outputs,
``Y = ((X @ R) @ W_t0.T) @ P`` (POET eq. 3). Each side is block-stochastic (eq. 5) or fully stochastic (eq. 4);
the shared plumbing (merge, reference forward, statistics) is `RotationLayer`.
"""

from __future__ import annotations

from typing import Any, cast

from peft.tuners._buffer_dict import BufferDict
from torch import nn

from ...orthogonal import init_base_weight, spo_generator, subset_size
from ...orthogonal.spo import make_side_spec
from ..config_utils import SIDE_INPUT, SIDE_OUTPUT
from ..rotation.block_sizes import is_adjusted, resolve_block_size
from ..rotation.config import RotationConfig
from ..rotation.layer import RotationLayer, RotationSettings
from .config import PoetConfig


def side_values(config: PoetConfig, field_name: str) -> dict[str, Any]:
    """``config.<field_name>`` per side; a side a per-side dict leaves out takes the field's default."""
    value = getattr(config, field_name)
    if not isinstance(value, dict):
        return {SIDE_INPUT: value, SIDE_OUTPUT: value}
    default = type(config).__dataclass_fields__[field_name].default
    return {side: value.get(side, default) for side in (SIDE_INPUT, SIDE_OUTPUT)}


def index_set_size(dim: int, budget: float | int) -> int:
    """A fully stochastic side's ``b``: ``⌈budget·d⌉`` for a fraction, the budget itself for an absolute size."""
    return budget if isinstance(budget, int) and budget >= 2 else subset_size(dim, budget)


class PoetLayer(RotationLayer):
    """POET state of one wrapped module: skew parameters ``poet_R`` (input side) and ``poet_P`` (output side)."""

    adapter_layer_names = ("poet_R", "poet_P")
    other_param_names = ("poet_R_index", "poet_P_index", "poet_merge_count", "rotation_specs", "rotation_settings")

    def _init_containers(self) -> None:
        self.poet_R = nn.ParameterDict({})
        self.poet_P = nn.ParameterDict({})
        self.poet_R_index = BufferDict({}, persistent=True)
        self.poet_P_index = BufferDict({}, persistent=True)
        self.poet_merge_count = BufferDict({}, persistent=True)

    def side_containers(self, side: str) -> tuple[nn.ParameterDict, BufferDict]:
        return (self.poet_R, self.poet_R_index) if side == SIDE_INPUT else (self.poet_P, self.poet_P_index)

    @property
    def merge_counts(self) -> BufferDict:
        return self.poet_merge_count

    def update_layer(self, adapter_name: str, config: RotationConfig, layer_name: str) -> None:
        """Add adapter ``adapter_name`` described by a ``PoetConfig``."""
        config = cast(PoetConfig, config)  # the POET tuner builds POET layers only
        if config.forward.startswith("activation") and self.is_conv2d:
            raise ValueError(
                f"`forward`='{config.forward}' is not supported for Conv2d target '{layer_name}' (R rotates "
                "the in·kh·kw axis of the weight, not an activation space); use 'weight' or 'auto'"
            )
        dims = {SIDE_INPUT: self.in_features, SIDE_OUTPUT: self.out_features}
        wanted = {"both": (SIDE_INPUT, SIDE_OUTPUT), "input": (SIDE_INPUT,), "output": (SIDE_OUTPUT,)}[config.sides]
        field = "budget" if config.spo == "full" else "block_size"
        blocks, budgets = side_values(config, "block_size"), side_values(config, "budget")
        if config.spo != "full":
            adjusted = [side for side in wanted if is_adjusted(config, layer_name, side, dims[side], blocks[side])]
            blocks = {
                side: resolve_block_size(config, layer_name, side, dims[side], blocks[side], field) for side in wanted
            }
            if adjusted:
                self.adjusted_block_sizes[adapter_name] = {side: blocks[side] for side in adjusted}
        specs = {
            side: make_side_spec(
                config.spo, dims[side], blocks[side], index_set_size(dims[side], budgets[side]), layer_name, field
            )
            for side in wanted
        }
        settings = RotationSettings.from_config(config, layer_name)
        if config.base_quantization is not None:
            self.check_quantizable(config.base_quantization, layer_name)
        self.add_rotation_adapter(
            adapter_name, settings, specs, {side: spec.num_blocks for side, spec in specs.items()}
        )
        if config.base_quantization is not None:
            if self.base_weight().device.type == "meta":  # materialize_model quantises it, layer by layer
                self.pending_quantization = config.base_quantization
            else:
                self.quantize_base(config.base_quantization)

    def reset_rotation_state(self, adapter_name: str) -> None:
        """The adapter's initial state (`RotationLayer.reset_rotation_state`), and a fresh ``W0`` with ``base_init``.

        The ``W0`` is drawn from the generator keyed by (seed, adapter, layer)."""
        super().reset_rotation_state(adapter_name)
        settings = self.rotation_settings[adapter_name]
        if settings.base_init is not None:
            generator = spo_generator(settings.seed, 0, settings.layer_name, "base_init", adapter_name)
            self.set_weight_matrix(init_base_weight(self.weight_shape, settings.base_init, generator))


class Linear(nn.Module, PoetLayer):
    """POET around an ``nn.Linear`` (and, through the subclasses, ``Conv1D`` and ``nn.Conv2d``)."""

    def __init__(
        self, base_layer: nn.Module, adapter_name: str, config: RotationConfig, layer_name: str, **kwargs: Any
    ) -> None:
        super().__init__()
        PoetLayer.__init__(self, base_layer, **kwargs)
        self._active_adapter = adapter_name
        self.update_layer(adapter_name, config, layer_name)

    forward = PoetLayer.forward  # nn.Module precedes PoetLayer in the MRO, as in PEFT's own layers
    train = PoetLayer.train  # flushes deferred rotation gradients on eval()

    def __repr__(self) -> str:
        return "poet." + super().__repr__()


class Conv1D(Linear):
    """POET around a ``transformers`` ``Conv1D`` (GPT-2), whose weight is stored in × out."""


class Conv2d(Linear):
    """POET around an ``nn.Conv2d``, whose weight is the matrix out × (in·kh·kw).

    R rotates the ``in·kh·kw`` axis of the weight, which is not an activation-space rotation, so this layer
    always uses the weight strategy and calls the base convolution with the rotated weight.
    """

    def __init__(
        self, base_layer: nn.Module, adapter_name: str, config: RotationConfig, layer_name: str, **kwargs: Any
    ) -> None:
        if base_layer.groups != 1:
            raise ValueError(
                f"target module '{layer_name}' is a grouped Conv2d (groups={base_layer.groups}); POET needs groups=1 "
                "because P mixes output channels across groups"
            )
        super().__init__(base_layer, adapter_name, config, layer_name, **kwargs)
