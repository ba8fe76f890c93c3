"""`OrthogonalModel`, the PEFT tuner that rewrites target modules into orthogonal layers."""

from __future__ import annotations

import logging
from typing import Any, cast

from peft.config import PeftConfig
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn

from ..config_utils import DEFAULT_TARGET_MODULES
from ..rotation.quantization import is_bnb_module
from ..tuner_base import LayerReplacingTuner
from .config import OrthogonalConfig
from .layer import Conv2d, Linear, OrthogonalLayer

logger = logging.getLogger(__name__)


def create_orthogonal_module(
    config: OrthogonalConfig, adapter_name: str, target: nn.Module, layer_name: str, **kwargs: Any
) -> OrthogonalLayer:
    """Wrap ``target`` in the orthogonal layer for its type, or raise a ``ValueError`` naming the type."""
    base_layer = target.get_base_layer() if isinstance(target, BaseTunerLayer) else target
    if is_bnb_module(base_layer):
        raise ValueError(
            f"`target_modules` matched '{layer_name}', a quantised {type(base_layer).__name__}; OrthogonalConfig "
            "replaces W0 by a trained orthogonal weight (its polar factor), so a frozen quantised base has nothing to "
            "keep: load the model without quantisation, or use PoetConfig / OftConfig, which train on a quantised W0"
        )
    if isinstance(base_layer, nn.Linear):
        return Linear(target, adapter_name, config=config, layer_name=layer_name, **kwargs)
    if isinstance(base_layer, nn.Conv2d):
        return Conv2d(target, adapter_name, config=config, layer_name=layer_name, **kwargs)
    raise ValueError(
        f"`target_modules` matched '{layer_name}', a {type(base_layer).__name__}; OrthogonalConfig supports "
        "torch.nn.Linear and torch.nn.Conv2d"
    )


class OrthogonalModel(LayerReplacingTuner):
    """Rewrites every target ``nn.Linear`` / ``nn.Conv2d`` into an orthogonal layer (``OrthogonalConfig``).

    Use it through PEFT: ``get_peft_model(model, OrthogonalConfig(...))``. ``merge_and_unload()`` gives plain
    layers holding the orthogonal weights (not possible for ``parameterization="reflection"``, an input-dependent
    map). `init_change_report` says how much each layer changed when it was made orthogonal.
    """

    prefix: str = "orthogonal_"
    tuner_layer_cls = OrthogonalLayer
    target_module_mapping = DEFAULT_TARGET_MODULES  # type: ignore[assignment]  # PEFT annotates lists; it matches regex strings too

    def create_layer(
        self, config: PeftConfig, adapter_name: str, target: nn.Module, layer_name: str
    ) -> OrthogonalLayer:
        return create_orthogonal_module(cast(OrthogonalConfig, config), adapter_name, target, layer_name)

    def after_layer_added(self, layer: nn.Module, adapter_name: str, layer_name: str) -> None:
        logger.info(
            "orthogonal adapter '%s' on %s: relative weight change at init %.4g",
            adapter_name,
            layer_name,
            cast(OrthogonalLayer, layer).init_change(adapter_name),
        )

    def init_change_report(self, adapter_name: str | None = None) -> dict[str, float]:
        """``{layer name: ||O_init - W0||_F / ||W0||_F}``: how much making each layer orthogonal changed it."""
        adapter_name = adapter_name or self.active_adapters[0]
        return {
            name: m.init_change(adapter_name)
            for name, m in self.model.named_modules()
            if isinstance(m, OrthogonalLayer) and adapter_name in m.orthogonal_settings
        }

    def stiefel_parameters(self, adapter_name: str | None = None) -> list[nn.Parameter]:
        """The weights of ``parameterization="fgd"`` layers, for ``FeedbackGD(..., stiefel_params=...)``."""
        adapter_name = adapter_name or self.active_adapters[0]
        return [
            m.orthogonal_weight[adapter_name]
            for m in self.model.modules()
            if isinstance(m, OrthogonalLayer)
            and adapter_name in m.orthogonal_settings
            and m.orthogonal_settings[adapter_name].parameterization == "fgd"
        ]
