"""PEFT tuners: one folder per method, each in PEFT's config/layer/model shape.

`poet` and `oft` are thin siblings over the rotation family (`rotation`); `orthogonal_layers` makes weights
orthogonal in place. Modules of the last release that moved into `rotation` (or merged into `config_utils` and
`tuner_base`) still import under their old names for one release, with a ``FutureWarning`` naming the new one.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

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
}


class _MovedModuleLoader(importlib.abc.Loader):
    """Loads an old module name as the module it moved to, with a ``FutureWarning``."""

    def __init__(self, new_name: str) -> None:
        self.new_name = new_name

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(
            f"`{spec.name}` moved to `{self.new_name}`; the old name will be removed in the next release",
            FutureWarning,
            stacklevel=2,
        )
        return importlib.import_module(self.new_name)

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the module is the one already imported under its new name."""


class _MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Finds ``poet_hf.tuners.<old>`` for each old name of `MOVED_MODULES`."""

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        package, _, leaf = fullname.rpartition(".")
        if package != __name__ or leaf not in MOVED_MODULES:
            return None
        return importlib.machinery.ModuleSpec(fullname, _MovedModuleLoader(f"{__name__}.{MOVED_MODULES[leaf]}"))


# Last on the path: the old names exist nowhere on disk, so only imports the other finders could not place reach it.
if not any(isinstance(finder, _MovedModuleFinder) for finder in sys.meta_path):
    sys.meta_path.append(_MovedModuleFinder())
