"""Keep the imports of optional third-party packages quiet: nothing imported that no feature asked for, nothing printed.

``import poet_hf`` imports neither PEFT nor transformers' models (its public names load on first use, PEP 562), so it
imports none of bitsandbytes, torchao, DeepSpeed or kernels. Its tuners register with PEFT once PEFT loads, whoever
imports it: `run_after_peft_loads` arms a one-shot import hook for that, or runs the registration at once when PEFT is
already loaded.

While PEFT loads through that hook:
- its ``peft.helpers`` module is loaded without bitsandbytes. PEFT 0.21 imports bitsandbytes there eagerly (for its
  condition-number helper alone), undoing its own lazy import of bitsandbytes (huggingface/peft#1230). Importing
  bitsandbytes costs about a second, and on a CPU with AVX-512 BF16 it asks the Hub at ``HF_ENDPOINT`` about a
  kernel publisher: a request to the user's Hub from a run that stores nothing in bitsandbytes. bitsandbytes loads
  where a quantized ``W0`` or 8-bit states use it; that helper then treats a bitsandbytes weight as a float one.
- `IMPORT_TIME_LOGGERS` are held at ``ERROR``: transformers' model code, which PEFT imports, imports torchao where
  it is installed (the ``[torchao]`` extra), and torchao logs at import that its CUDA extensions did not load and,
  through torch, that it registers enums with ``torch.compile``'s pytree the deprecated way. None of it is a POET
  user's to act on; the levels are restored after the import, so nothing later is hidden.

A package's public names load on first use through `lazy_attributes` (PEP 562): the package and ``poet_hf.training``.

Building a ``transformers.Trainer`` has Accelerate import DeepSpeed where it is installed (the ``[deepspeed]``
extra), and DeepSpeed's import warns, on a machine without CUDA, that it sets its accelerator to the CPU, whether or
not the run uses DeepSpeed. `quiet_deepspeed_probe` drops that one record while a trainer is built.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import logging
import sys
from collections.abc import Callable, Iterator
from types import ModuleType

IMPORT_TIME_LOGGERS = ("torchao", "torch.utils._pytree")
DEEPSPEED_PROBE = ("DeepSpeed", "Setting accelerator to CPU.")  # (logger, the record's first words)
DEFERRED_BY_PEFT_MODULE = {"peft.helpers": "bitsandbytes"}  # the PEFT module, the package it imports eagerly


@contextlib.contextmanager
def quiet_optional_kernels() -> Iterator[None]:
    """Hold `IMPORT_TIME_LOGGERS` at ``ERROR`` inside the block, then restore each logger's own level."""
    loggers = [logging.getLogger(name) for name in IMPORT_TIME_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


@contextlib.contextmanager
def without_package(name: str) -> Iterator[None]:
    """Inside the block, ``import name`` raises ``ImportError`` (a ``None`` entry in ``sys.modules``, as the import
    system documents); a package already imported stays as it is."""
    if name in sys.modules:
        yield
        return
    sys.modules[name] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        if name in sys.modules and sys.modules[name] is None:
            del sys.modules[name]


class _ExecThen(importlib.abc.Loader):
    """Wraps a module's loader: executes it inside ``context`` and calls ``after`` once it is loaded."""

    def __init__(
        self, loader: importlib.abc.Loader, context: contextlib.AbstractContextManager, after: Callable[[], None]
    ):
        self.loader, self.context, self.after = loader, context, after

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = self.loader  # the module keeps its own loader, as if never wrapped
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        with self.context:
            self.loader.exec_module(module)
        self.after()


class PeftLoadHook(importlib.abc.MetaPathFinder):
    """A one-shot import hook: loads ``peft`` quietly, ``peft.helpers`` without bitsandbytes, then runs ``callback``
    and leaves ``sys.meta_path``."""

    def __init__(self, callback: Callable[[], None]):
        self.callback = callback

    def find_spec(
        self, fullname: str, path: object = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "peft" and fullname not in DEFERRED_BY_PEFT_MODULE:
            return None
        spec = self._spec_of_the_other_finders(fullname, path, target)
        if spec is None or spec.loader is None:
            return spec
        if fullname == "peft":
            spec.loader = _ExecThen(spec.loader, quiet_optional_kernels(), self._peft_loaded)
        else:
            spec.loader = _ExecThen(spec.loader, without_package(DEFERRED_BY_PEFT_MODULE[fullname]), lambda: None)
        return spec

    def _spec_of_the_other_finders(
        self, fullname: str, path: object, target: ModuleType | None
    ) -> importlib.machinery.ModuleSpec | None:
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)  # type: ignore[arg-type]
            if spec is not None:
                return spec
        return None

    def _peft_loaded(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        self.callback()


def run_after_peft_loads(callback: Callable[[], None]) -> None:
    """Run ``callback`` now if PEFT is loaded, else right after PEFT's import completes (`PeftLoadHook`)."""
    if "peft" in sys.modules:
        callback()
    elif not any(isinstance(finder, PeftLoadHook) for finder in sys.meta_path):
        sys.meta_path.insert(0, PeftLoadHook(callback))


def lazy_attributes(package: str, exports: dict[str, str]) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """A package's ``__getattr__`` and ``__dir__`` (PEP 562) for ``exports``, each public name and the module it
    loads from on first use; the name is then cached in the package's namespace."""
    namespace = sys.modules[package].__dict__

    def __getattr__(name: str) -> object:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name]), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__


def _not_the_probe(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith(DEEPSPEED_PROBE[1])


@contextlib.contextmanager
def quiet_deepspeed_probe() -> Iterator[None]:
    """Drop DeepSpeed's "Setting accelerator to CPU" record inside the block; every other record passes.

    DeepSpeed sets its logger's level when it is first imported, so the record is filtered, not the level held."""
    logger = logging.getLogger(DEEPSPEED_PROBE[0])
    logger.addFilter(_not_the_probe)
    try:
        yield
    finally:
        logger.removeFilter(_not_the_probe)
