"""Orthogonal-layer tuner layers: ``nn.Linear`` (four parameterisations) and ``nn.Conv2d`` (ECO).

Unlike POET/OFT, these layers *replace* the weight by an orthogonal one instead of rotating it: a Linear starts at
the orthogonal polar factor ``O0`` of its weight ``W0`` (torch orientation, out x in), which is the orthogonal
matrix nearest to ``W0``. ``O0`` has orthonormal rows when ``out <= in`` and orthonormal columns otherwise, and
rotating it on its larger side (``O0 R`` or ``R O0``, ``R`` in SO(d), ``d = max(in, out)``) reaches every such
matrix, so the Cayley and Householder parameterisations act there.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from peft.tuners._buffer_dict import BufferDict
from peft.tuners.tuners_utils import BaseTunerLayer, check_adapters_to_merge
from torch import nn

from ...orthogonal import auxiliary_reflection, polar_factor, spo_generator
from ...orthogonal.map_protocol import OrthogonalMap
from ...orthogonal.maps import MAPS, map_from_config
from ..tuner_base import ModuleMixin

if TYPE_CHECKING:
    from ...orthogonal.eco import EcoConv2d
    from .config import OrthogonalConfig

logger = logging.getLogger(__name__)


def _relative_change(new: torch.Tensor, old: torch.Tensor) -> float:
    old = old.double()
    return float(torch.linalg.norm(new.double() - old) / torch.linalg.norm(old).clamp_min(1e-30))


@dataclass(frozen=True)
class OrthogonalSettings:
    """What a layer keeps of an adapter's config: its parameterization and, for a rotation, the map."""

    parameterization: str  # an orthogonal map's name, "reflection", "fgd" or "eco"
    layer_name: str
    orthogonal_map: OrthogonalMap | None = None  # where the parameterization is a registered map


class OrthogonalLayer(BaseTunerLayer, ModuleMixin):
    """Adapter state of one rewritten module; one adapter can be active at a time (each replaces the weight)."""

    adapter_layer_names = ("orthogonal_weight", "orthogonal_eco")
    other_param_names = ("orthogonal_polar", "orthogonal_init_change", "orthogonal_settings")

    def __init__(self, base_layer: nn.Module, **kwargs: Any) -> None:
        self.base_layer = base_layer
        self.orthogonal_weight = nn.ParameterDict({})
        self.orthogonal_eco = nn.ModuleDict({})
        self.orthogonal_polar = BufferDict({}, persistent=True)
        self.orthogonal_init_change = BufferDict({}, persistent=True)
        self.orthogonal_settings: dict[str, OrthogonalSettings] = {}
        self._stash: dict[str, dict[str, Any]] = {}
        self._disable_adapters = False
        self.merged_adapters: list[str] = []
        self.kwargs = kwargs
        weight = cast(torch.Tensor, base_layer.weight)
        self.out_features: int = weight.shape[0]
        self.in_features: int = weight[0].numel()

    def _active(self) -> str | None:
        active = [a for a in self.active_adapters if a in self.orthogonal_settings]
        if len(active) > 1:
            raise ValueError(
                f"only one orthogonal adapter can be active in a layer (each replaces the weight), got {active}"
            )
        return active[0] if active else None

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.disable_adapters:
            if self.merged:
                self.unmerge()
            return self.base_layer(x, *args, **kwargs)
        adapter = self._active()
        if self.merged or adapter is None:
            return self.base_layer(x, *args, **kwargs)
        return self._orthogonal_forward(x, adapter)

    def _orthogonal_forward(self, x: torch.Tensor, adapter_name: str) -> torch.Tensor:
        raise NotImplementedError

    def update_layer(self, adapter_name: str, config: OrthogonalConfig, layer_name: str) -> None:
        """Add ``adapter_name`` from the tuner's ``config`` (Linear and Conv2d build their own)."""
        raise NotImplementedError

    def init_change(self, adapter_name: str) -> float:
        """``||O_init - W0||_F / ||W0||_F`` recorded when the adapter was created."""
        return float(self.orthogonal_init_change[adapter_name])

    def extra_repr(self) -> str:
        parts = [
            f"{a}: {s.parameterization}, init_change={self.init_change(a):.3g}"
            for a, s in self.orthogonal_settings.items()
        ]
        return "; ".join(parts)

    def unmerge(self) -> None:
        """Restore the base layer exactly as it was before `merge` (a stashed copy, not an inverse)."""
        while self.merged_adapters:
            adapter = self.merged_adapters.pop()
            stash = self._stash.pop(adapter)
            base = self.get_base_layer()
            cast(torch.Tensor, base.weight).data = stash.pop("weight")
            for key, value in stash.items():
                setattr(base, key, value)

    def _adapters_to_merge(self, adapter_names: list[str] | None) -> list[str]:
        """PEFT's selection of adapters to merge, restricted to ours; at most one, since each replaces the weight."""
        adapter_names = [a for a in check_adapters_to_merge(self, adapter_names) if a in self.orthogonal_settings]
        if len(adapter_names) + len(self.merged_adapters) > 1:
            raise ValueError("only one orthogonal adapter can be merged into a layer (each replaces the weight)")
        return adapter_names


class _OrthogonalModule(nn.Module, OrthogonalLayer):
    """What the Linear and Conv2d layers share: construction, forward and repr."""

    def __init__(
        self, base_layer: nn.Module, adapter_name: str, config: OrthogonalConfig, layer_name: str, **kwargs: Any
    ) -> None:
        super().__init__()
        OrthogonalLayer.__init__(self, base_layer, **kwargs)
        self._active_adapter = adapter_name
        self.update_layer(adapter_name, config, layer_name)

    forward = OrthogonalLayer.forward  # nn.Module precedes OrthogonalLayer in the MRO, as in PEFT's own layers
    extra_repr = OrthogonalLayer.extra_repr

    def __repr__(self) -> str:
        return "orthogonal." + super().__repr__()


class Linear(_OrthogonalModule):
    """An ``nn.Linear`` whose weight is replaced by an orthogonal one (see ``OrthogonalConfig.parameterization``)."""

    def _linear(self) -> nn.Linear:
        return cast(nn.Linear, self.get_base_layer())

    @property
    def rotation_dim(self) -> int:
        return max(self.in_features, self.out_features)

    def update_layer(self, adapter_name: str, config: OrthogonalConfig, layer_name: str) -> None:
        """Add ``adapter_name``: start at the polar factor of the base weight (or near it if not ``init_weights``)."""
        weight = self._linear().weight
        device = weight.device
        polar = polar_factor(weight.detach())
        kind = config.parameterization
        d = self.rotation_dim
        generator = spo_generator(config.seed, 0, layer_name, "orthogonal", adapter_name)
        settings = OrthogonalSettings(kind, layer_name, map_from_config(config, kind) if kind in MAPS else None)
        if settings.orthogonal_map is not None:  # R from the map's parameters: the identity, or near it
            orthogonal_map, shape = settings.orthogonal_map, (settings.orthogonal_map.num_params(d),)
            param = (
                orthogonal_map.identity_params(shape, d, generator)
                if config.init_weights
                else orthogonal_map.random_params(shape, d, generator, op_norm=0.1)
            )
        elif kind == "reflection":
            # -O0 H(W x) x with W = I is O0 x (H(x) x = -x) and has a non-zero gradient in W (W = 0 would not).
            param = torch.eye(self.in_features, dtype=torch.float64)
            if not config.init_weights:
                param = param + 0.1 * torch.randn(param.shape, generator=generator, dtype=torch.float64)
        else:  # fgd: the weight itself, kept on the Stiefel manifold by FeedbackGD
            param = polar.clone()
            if not config.init_weights:
                rot = polar_factor(
                    torch.eye(d, dtype=torch.float64)
                    + 0.1 * torch.randn(d, d, generator=generator, dtype=torch.float64)
                )
                param = self._rotate(polar, rot)
        self.orthogonal_settings[adapter_name] = settings
        self.orthogonal_weight[adapter_name] = nn.Parameter(param.float().to(device))
        self.orthogonal_polar[adapter_name] = polar.float().to(device)
        self.orthogonal_init_change[adapter_name] = torch.tensor(0.0, device=device)
        start = self._initial_map_matrix(adapter_name)
        self.orthogonal_init_change[adapter_name].fill_(_relative_change(start, weight.detach()))
        self._move_adapter_to_device_of_base_layer(adapter_name)  # PEFT then upcasts half adapters (autocast)
        self.set_adapter(self.active_adapters)

    def _initial_map_matrix(self, adapter_name: str) -> torch.Tensor:
        """The matrix the layer computes at creation (the reflection is linear there: ``O0`` or near it)."""
        if self.orthogonal_settings[adapter_name].parameterization != "reflection":
            return self.orthogonal_matrix(adapter_name).detach()
        eye = torch.eye(self.in_features, dtype=torch.float32, device=self.orthogonal_polar[adapter_name].device)
        return self._orthogonal_forward(eye, adapter_name, with_bias=False).detach().T

    def _rotate(self, polar: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
        # Rotate on the larger side, where O0 R (or R O0) covers every matrix with orthonormal rows (columns).
        polar = polar.to(rotation.dtype)
        return polar @ rotation if self.in_features >= self.out_features else rotation @ polar

    def rotation(self, adapter_name: str) -> torch.Tensor:
        """The ``d x d`` rotation ``R`` of a parameterization that is an orthogonal map (float32 or wider)."""
        settings = self.orthogonal_settings[adapter_name]
        if settings.orthogonal_map is None:
            raise ValueError(f"adapter '{adapter_name}' is {settings.parameterization!r}; it has no rotation R")
        param = self.orthogonal_weight[adapter_name]
        param = param.to(torch.promote_types(param.dtype, torch.float32))  # half-precision adapters: float32 math
        return settings.orthogonal_map.blocks(param, self.rotation_dim)

    def orthogonal_matrix(self, adapter_name: str) -> torch.Tensor:
        """The out x in orthogonal weight of a linear parameterisation (an orthogonal map, or fgd)."""
        kind = self.orthogonal_settings[adapter_name].parameterization
        if kind == "fgd":
            return self.orthogonal_weight[adapter_name]
        if kind == "reflection":
            raise ValueError(
                f"adapter '{adapter_name}' uses parameterization='reflection', an input-dependent map -O0 H(Wx) x; "
                "it has no single weight matrix (merge is not possible, use the layer itself)"
            )
        return self._rotate(self.orthogonal_polar[adapter_name], self.rotation(adapter_name))

    def _orthogonal_forward(self, x: torch.Tensor, adapter_name: str, with_bias: bool = True) -> torch.Tensor:
        base_bias = self._linear().bias if with_bias else None
        bias = None if base_bias is None else base_bias.to(x.dtype)
        kind = self.orthogonal_settings[adapter_name].parameterization
        if kind != "reflection":
            return F.linear(x, self.orthogonal_matrix(adapter_name).to(x.dtype), bias)
        compute = torch.promote_types(x.dtype, torch.float32)
        h = auxiliary_reflection(x.to(compute), self.orthogonal_weight[adapter_name].to(compute))
        return F.linear(h, -self.orthogonal_polar[adapter_name].to(compute), None).to(x.dtype) + (
            0 if bias is None else bias
        )

    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        """Write the orthogonal weight into the base layer (its old weight is kept for `unmerge`)."""
        for adapter_name in self._adapters_to_merge(adapter_names):
            with torch.no_grad():
                matrix = self.orthogonal_matrix(adapter_name).detach()
            if safe_merge and not torch.isfinite(matrix).all():
                raise ValueError(f"NaNs or infs found while merging orthogonal adapter '{adapter_name}'")
            base = self._linear()
            self._stash[adapter_name] = {"weight": base.weight.data}
            base.weight.data = matrix.to(base.weight.dtype).clone()
            self.merged_adapters.append(adapter_name)


class Conv2d(_OrthogonalModule):
    """An ``nn.Conv2d`` replaced by an ECO orthogonal convolution (circular padding, fixed input size)."""

    def _conv(self) -> nn.Conv2d:
        return cast(nn.Conv2d, self.get_base_layer())

    def _check_geometry(self, layer_name: str, size: int | None) -> tuple[int, int]:
        base = self._conv()
        kh, kw = base.kernel_size
        if size is None:
            raise ValueError(
                f"target module '{layer_name}' is a Conv2d: set `conv_input_size` (an int, or a dict of module names "
                "to sizes) to the spatial size it sees; ECO builds the orthogonal convolution for one size"
            )
        if base.groups != 1 or kh != kw or base.dilation != (1, 1) or base.stride[0] != base.stride[1]:
            raise ValueError(
                f"target module '{layer_name}': ECO needs groups=1, a square kernel, dilation 1 and equal strides; got "
                f"groups={base.groups}, kernel_size={base.kernel_size}, dilation={base.dilation}, stride={base.stride}"
            )
        stride = base.stride[0]
        if isinstance(base.padding, str):
            out = size if base.padding == "same" else (size - kh) // stride + 1
        else:
            out = (size + 2 * base.padding[0] - kh) // stride + 1
        if size % stride or out != size // stride:
            raise ValueError(
                f"target module '{layer_name}' maps {size}x{size} to {out}x{out}; ECO maps it to "
                f"{size // stride}x{size // stride} (stride {stride} must divide the size and the padding must keep it)"
            )
        return kh, stride

    def update_layer(self, adapter_name: str, config: OrthogonalConfig, layer_name: str) -> None:
        """Add ``adapter_name``: an ECO convolution with the base layer's channels, kernel size and stride."""
        from ...orthogonal.eco import EcoConv2d

        base = self._conv()
        size = config.input_size_for(layer_name)
        kernel, stride = self._check_geometry(layer_name, size)
        eco = EcoConv2d(
            base.in_channels,
            base.out_channels,
            kernel,
            stride,
            input_size=cast(int, size),  # _check_geometry refuses None
            bias=False,
            orthogonal_map=config.eco_orthogonal_map,
            device=base.weight.device,
        )
        eco.reset_parameters(spo_generator(config.seed, 0, layer_name, "eco", adapter_name))
        self.orthogonal_settings[adapter_name] = OrthogonalSettings("eco", layer_name)
        self.orthogonal_eco[adapter_name] = eco
        with torch.no_grad():
            eco.eval()
            kernel_now = eco.kernel()
            eco.train(base.training)
        # ECO starts from its own random orthogonal kernel (the polar factor of a convolution operator is not an
        # ECO kernel); record how far it is from the old kernel where the shapes agree.
        change = (
            _relative_change(kernel_now, base.weight.detach()) if kernel_now.shape == base.weight.shape else math.nan
        )
        self.orthogonal_init_change[adapter_name] = torch.tensor(change, device=base.weight.device)
        self._move_adapter_to_device_of_base_layer(adapter_name)  # PEFT then upcasts half adapters (autocast)
        self.set_adapter(self.active_adapters)

    def _orthogonal_forward(self, x: torch.Tensor, adapter_name: str) -> torch.Tensor:
        out = self.orthogonal_eco[adapter_name](x)
        bias = self._conv().bias
        return out if bias is None else out + bias.to(out.dtype).view(1, -1, 1, 1)

    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        """Turn the base Conv2d into the ECO operator: its kernel, dilation and circular padding (stride 1 only)."""
        for adapter_name in self._adapters_to_merge(adapter_names):
            eco = cast("EcoConv2d", self.orthogonal_eco[adapter_name])
            if eco.stride != 1:
                raise ValueError(
                    f"cannot merge ECO adapter '{adapter_name}' with stride {eco.stride} into a plain Conv2d: ECO "
                    "strides by pixel-unshuffle, which a Conv2d cannot express"
                )
            with torch.no_grad():
                kernel = eco.fold_kernel(eco.full_kernel("matrix_exp")).detach()
            if safe_merge and not torch.isfinite(kernel).all():
                raise ValueError(f"NaNs or infs found while merging orthogonal adapter '{adapter_name}'")
            base = self._conv()
            keys = ("padding", "dilation", "padding_mode", "_reversed_padding_repeated_twice", "kernel_size")
            self._stash[adapter_name] = {"weight": base.weight.data, **{k: getattr(base, k) for k in keys}}
            pl, pr, pt, pb = eco.padding
            base.weight.data = kernel.to(base.weight.dtype).clone()
            base.kernel_size = tuple(kernel.shape[-2:])
            base.dilation = tuple(eco.dilation)
            base.padding_mode = "circular"
            base.padding = (pt, pl)
            # nn.Conv2d pads non-zero modes with this (left, right, top, bottom) list, so asymmetric pads work.
            base._reversed_padding_repeated_twice = [pl, pr, pt, pb]
            self.merged_adapters.append(adapter_name)
