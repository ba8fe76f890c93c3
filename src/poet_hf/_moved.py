"""Old module names that still import, for one release, as the modules they moved to (with a ``FutureWarning``)."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType


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


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Finds ``<package>.<old>`` for each old name of ``moved`` (old → new, both relative to ``package``)."""

    def __init__(self, package: str, moved: dict[str, str]) -> None:
        self.package = package
        self.moved = moved

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        prefix = self.package + "."
        old = fullname[len(prefix) :] if fullname.startswith(prefix) else None
        if old not in self.moved:
            return None
        return importlib.machinery.ModuleSpec(fullname, _MovedModuleLoader(f"{prefix}{self.moved[old]}"))


def install_moved_modules(package: str, moved: dict[str, str]) -> None:
    """Let the old names of ``moved`` under ``package`` import as their new modules (once per package).

    The finder goes first on ``sys.meta_path`` (it costs one string comparison per import): an old package name
    aliases a package that exists, in whose folder the path finder would otherwise load a second copy of a moved
    module under its old name."""
    if not any(isinstance(f, MovedModuleFinder) and f.package == package for f in sys.meta_path):
        sys.meta_path.insert(0, MovedModuleFinder(package, moved))
