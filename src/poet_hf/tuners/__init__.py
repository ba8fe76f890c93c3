"""PEFT tuners: one folder per method, each in PEFT's config/layer/model shape.

`poet` and `oft` are thin siblings over the rotation family (`rotation`); `orthogonal_layers` makes weights
orthogonal in place. Modules of the last release that moved into `rotation` (or merged into `config_utils` and
`tuner_base`) still import under their old names for one release, with a ``FutureWarning`` naming the new one.
"""

from __future__ import annotations

from .._moved import install_moved_modules

MOVED_MODULES = {  # old name under poet_hf.tuners -> where it lives now
    "base_weight": "rotation.base_weight",
    "block_sizes": "rotation.block_sizes",
    "bnb": "rotation.quantization",
    "bnb_rows": "rotation.quantized_rows",
    "dense_reload": "rotation.dense_reload",
    "fused_forward": "rotation.forward",
    "low_precision": "rotation.low_precision",
    "residual_folder": "rotation.residual_folder",
    "residual_store": "rotation.residual_store",
    "rotation_cache": "rotation.caches",
    "rotation_layer": "rotation.layer",
    "rotation_model": "rotation.model",
    "row_fold": "rotation.row_fold",
    "state_checks": "rotation.state_checks",
    "constants": "config_utils",
    "module_mixin": "tuner_base",
    "peft_utils": "tuner_base",
    "orthogonal": "orthogonal_layers",  # the tuner shared its name with the mathematics in poet_hf.orthogonal
    "orthogonal.config": "orthogonal_layers.config",
    "orthogonal.layer": "orthogonal_layers.layer",
    "orthogonal.model": "orthogonal_layers.model",
}


install_moved_modules(__name__, MOVED_MODULES)
