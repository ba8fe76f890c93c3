"""Where error feedback keeps a fold's rounding residual between merges: on the layer, in host memory, or in a file.

Error feedback (``requantize="feedback"``) keeps what a fold's rounding of ``W0`` dropped and adds it back at the next
fold (`poet_hf.tuners.rotation.quantization.requantize`, `poet_hf.tuners.rotation.low_precision.store`). The residual
is read and written only at a fold, once every ``merge_every`` steps, so it need not share the training steps' memory:

- ``"layer"``: buffers on the base layer, beside the weight (1.06 bytes per entry of a 4-bit ``W0``, 1 of a 16-bit
  one);
- ``"cpu"``: host memory, for a ``W0`` on an accelerator (the accelerator holds only the codes);
- ``"disk"``: one ``safetensors`` file per layer in the model's residual folder
  (`residual_folder.ResidualFolder`: under the system temp folder unless ``residual_folder`` names another),
  deleted with the layer; a fold reads one layer's residual into memory and frees it, so the process holds at most
  one layer's residual at a time. Before the first file is written, the disk's free space is checked against what
  every layer's file will take;
- ``"auto"`` (the default): ``"cpu"`` for a ``W0`` on an accelerator, ``"disk"`` for one on the CPU.

Wherever it lives, the residual is part of the layer's ``state_dict`` (read from its store when saved, put back
into it when loaded), so checkpoints and resumed runs are the same as with ``"layer"``.
"""

from __future__ import annotations

import os
import tempfile
import weakref
from pathlib import Path
from typing import cast

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save_file
from torch import nn

from .residual_folder import ResidualFolder

__all__ = [
    "RESIDUAL_STORAGES",
    "ResidualStore",
    "attach",
    "carry",
    "drop",
    "keep",
    "load_from_state_dict",
    "read",
    "resident_bytes",
]

RESIDUAL_STORAGES = ("auto", "layer", "cpu", "disk")
STORE_ATTRIBUTE = "poet_residual_store"


class ResidualStore:
    """A base layer's rounding residual, kept off the layer: in host memory (``"cpu"``) or in a file (``"disk"``).

    ``"auto"`` picks by the device of the residual it is given (`RESIDUAL_STORAGES`); a file goes into ``folder``,
    the model's, which counts the store in its free-space check."""

    def __init__(self, storage: str, folder: ResidualFolder, expected_bytes: int = 0) -> None:
        self.storage = storage
        self.folder = folder
        self.expected_bytes = expected_bytes  # what the residual will take (the free-space check counts it)
        self.module: weakref.ref[nn.Module] | None = None  # the base layer it serves (`_install`)
        self._tensors: dict[str, torch.Tensor] | None = None
        self._path: Path | None = None
        self._kept = False
        folder.register(self)

    @property
    def on_disk(self) -> bool:
        """Whether its residual goes to a file: ``"disk"``, or ``"auto"`` for a layer whose weight is on the CPU."""
        if self.storage != "auto":
            return self.storage == "disk"
        module = self.module() if self.module is not None else None
        weight = getattr(module, "weight", None)
        return not isinstance(weight, torch.Tensor) or weight.device.type in ("cpu", "meta")

    def file_bytes(self) -> int:
        """Bytes its file holds now (0 without one)."""
        return self._path.stat().st_size if self._path is not None and self._path.exists() else 0

    def put(self, tensors: dict[str, torch.Tensor]) -> None:
        """Keep ``tensors`` (replacing what was kept)."""
        device = next(iter(tensors.values())).device
        self.clear()
        self._kept = True
        if self.storage == "cpu" or (self.storage == "auto" and device.type != "cpu"):
            pin = torch.cuda.is_available()
            self._tensors = {name: t.detach().to("cpu", copy=True) for name, t in tensors.items()}
            if pin:
                self._tensors = {name: t.pin_memory() for name, t in self._tensors.items()}
            return
        if self._path is None:
            self.folder.check_disk_space_once()
            handle, path = tempfile.mkstemp(prefix="residual-", suffix=".safetensors", dir=str(self.folder.path()))
            os.close(handle)
            self._path = Path(path)
            weakref.finalize(self, self._path.unlink, missing_ok=True)
        save_file({name: t.detach().contiguous().cpu() for name, t in tensors.items()}, str(self._path))

    def get(self, device: torch.device | None = None) -> dict[str, torch.Tensor] | None:
        """The kept tensors on ``device`` (default the CPU); ``None`` if nothing is kept.

        ``"disk"`` reads them whole from the file."""
        if self._tensors is not None:
            tensors = self._tensors
        elif self._kept and self._path is not None:
            tensors = load_safetensors(self._path.read_bytes())  # an anonymous copy: no file pages stay mapped
        else:
            return None
        return {name: t.to(device or "cpu", non_blocking=True) for name, t in tensors.items()}

    def __getstate__(self) -> dict:
        """Pickled and deep-copied with the tensors it keeps: a copy gets a file of its own."""
        return {
            "storage": self.storage,
            "folder": self.folder,
            "expected_bytes": self.expected_bytes,
            "tensors": self.get(),
        }

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["storage"], state["folder"], state["expected_bytes"])  # type: ignore[misc]
        if state["tensors"] is not None:
            self.put(state["tensors"])

    def clear(self) -> None:
        """Forget what is kept (its file stays, to be overwritten, until the store is deleted)."""
        self._tensors, self._kept = None, False
        if self._path is not None:
            self._path.write_bytes(b"")


def _store(module: nn.Module) -> ResidualStore | None:
    return getattr(module, STORE_ATTRIBUTE, None)


def _add_to_state_dict(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    store = _store(module)
    if store is not None:
        for name, tensor in (store.get() or {}).items():
            state_dict[f"{prefix}{name}"] = tensor


def _install(module: nn.Module, store: ResidualStore) -> None:
    if not hasattr(module, STORE_ATTRIBUTE):  # the first store of this module: its state_dict hook (kept for good)
        module.register_state_dict_post_hook(_add_to_state_dict)
    setattr(module, STORE_ATTRIBUTE, store)
    store.module = weakref.ref(module)


def attach(
    module: nn.Module, storage: str, names: tuple[str, ...], folder: ResidualFolder, expected_bytes: int = 0
) -> None:
    """Keep ``module``'s residual (its tensors ``names``) in ``storage`` from now on.

    ``storage`` is one of `RESIDUAL_STORAGES`; a residual the layer already holds moves there. ``folder``: the
    model's residual folder. ``expected_bytes``: what the residual will take (0: none is expected), counted by the
    free-space check of the files."""
    if storage not in RESIDUAL_STORAGES:
        raise ValueError(f"`residual_storage` must be one of {RESIDUAL_STORAGES}, got {storage!r}")
    current = _store(module)
    if (current.storage if current is not None else "layer") == storage:
        if current is not None:
            current.expected_bytes = expected_bytes
        return
    held = read(module, names)
    if current is not None:
        current.clear()
        setattr(module, STORE_ATTRIBUTE, None)
    if storage != "layer":
        _install(module, ResidualStore(storage, folder, expected_bytes))
    if held is not None:
        keep(module, held)


def carry(old: nn.Module, new: nn.Module) -> None:
    """Give ``new`` (a base layer that replaced ``old``) ``old``'s residual store."""
    store = _store(old)
    if store is not None and new is not old:
        _install(new, store)


def keep(module: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Keep ``tensors`` as ``module``'s residual: in its store, or as its buffers without one."""
    store = _store(module)
    if store is None:
        for name, tensor in tensors.items():
            module.register_buffer(name, tensor)
        return
    for name in tensors:
        if name in module._buffers:
            del module._buffers[name]
    store.put(tensors)


def read(module: nn.Module, names: tuple[str, ...]) -> dict[str, torch.Tensor] | None:
    """``module``'s residual tensors ``names`` (on its device), wherever they are kept; ``None`` without them."""
    buffers = {name: b for name in names if (b := module._buffers.get(name)) is not None}
    if buffers:
        return buffers
    store = _store(module)
    if store is None:
        return None
    weight = getattr(module, "weight", None)
    return store.get(weight.device if isinstance(weight, torch.Tensor) else None)


def load_from_state_dict(
    module: nn.Module, state_dict: dict[str, torch.Tensor], prefix: str, names: tuple[str, ...]
) -> None:
    """``load_state_dict`` pre-hook part: the residual tensors ``names`` that ``state_dict`` holds under ``prefix``.

    They go into ``module``'s store (their keys consumed), or, without a store, get empty buffers on the weight's
    device for the loader to copy into."""
    saved = {name: state_dict[f"{prefix}{name}"] for name in names if f"{prefix}{name}" in state_dict}
    if _store(module) is not None:
        for name in saved:
            del state_dict[f"{prefix}{name}"]
        if saved:
            keep(module, saved)
        return
    device = cast(torch.Tensor, module.weight).device
    for name, tensor in saved.items():
        if not hasattr(module, name):
            module.register_buffer(name, torch.empty_like(tensor, device=device))


def drop(module: nn.Module, names: tuple[str, ...]) -> None:
    """Remove ``module``'s residual (its buffers ``names`` and its store)."""
    for name in names:
        if hasattr(module, name):
            delattr(module, name)
    store = _store(module)
    if store is not None:
        store.clear()
        setattr(module, STORE_ATTRIBUTE, None)


def resident_bytes(module: nn.Module, names: tuple[str, ...]) -> int:
    """Bytes of the residual held on ``module`` itself (in the training steps' memory)."""
    return sum(b.numel() * b.element_size() for n in names if (b := module._buffers.get(n)) is not None)
