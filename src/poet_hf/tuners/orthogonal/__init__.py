"""Deprecated name of [`poet_hf.tuners.orthogonal_layers`][poet_hf.tuners.orthogonal_layers], kept for one release."""

import sys
import warnings

from ..orthogonal_layers import (
    Conv2d,
    Linear,
    OrthogonalConfig,
    OrthogonalLayer,
    OrthogonalModel,
    config,
    layer,
    model,
    polar_factor,
)

warnings.warn(
    "`poet_hf.tuners.orthogonal` is deprecated and will be removed in the next release; it shared its name with "
    "the mathematics in `poet_hf.orthogonal`. Import from `poet_hf.tuners.orthogonal_layers` "
    "(or `poet_hf.OrthogonalConfig`)",
    FutureWarning,
    stacklevel=2,
)
for _name, _module in (("config", config), ("layer", layer), ("model", model)):
    sys.modules[f"{__name__}.{_name}"] = _module

__all__ = ["OrthogonalConfig", "OrthogonalModel", "OrthogonalLayer", "Linear", "Conv2d", "polar_factor"]
