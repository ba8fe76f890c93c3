"""Materializing a model built on the ``meta`` device, one module at a time.

The values do not depend on how the model is sharded.

Built under ``with torch.device("meta")``, a model (POET or OFT adapters included) holds no memory.
[`materialize_model`][poet_hf.initialization.materialize_model] then gives every tensor still on ``meta`` its storage
(under FSDP2 only the process's shard) and its value:

- tensors a checkpoint holds are read from it (``safetensors``); in a sharded model rank 0 reads each tensor and
  sends every process its shard (``loading="scatter"``) or the whole tensor (``"broadcast"``, what Accelerate's
  ``fsdp_cpu_ram_efficient_loading`` does), and each keeps its own shard;
- every other tensor of a ``transformers`` module is initialised by the model's own ``_init_weights`` (a plain
  ``nn.Module`` by its ``reset_parameters``), under a generator keyed by (seed, module name) instead of the global
  generator in construction order;
- POET and OFT adapters draw their index sets, skew vectors and ``base_init`` weights from their own keyed
  generators (`reset_rotation_state`), as they do on a real
  device.

Each value is computed whole on the CPU from its key alone, and each process keeps its shard of it, so a model
materialized by N processes equals, bit for bit, the one a single process materializes, and no process holds more
than one module's tensors whole.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch
import torch.distributed as dist
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn

from .allocator import bound_allocator_slack
from .orthogonal import spo_generator
from .sharded import write_full
from .tuners.rotation.layer import RotationLayer, rotation_layers
from .tuners.tuner_base import base_model_of

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["CHECKPOINT_LOADING", "has_meta_tensors", "materialize_model"]

_Module = TypeVar("_Module", bound=nn.Module)

CHECKPOINT_LOADING = ("scatter", "broadcast")
_PEFT_WRAPPERS = re.compile(r"\.(?:base_layer|original_module|modules_to_save\.[^.]+)(?=\.|$)")


def has_meta_tensors(module: nn.Module, recurse: bool = True) -> bool:
    """Whether any parameter or buffer of ``module`` is still on the ``meta`` device.

    Args:
        module: the module to inspect.
        recurse: look into submodules too.

    Returns:
        ``True`` when one is.
    """
    tensors = [*module.parameters(recurse=recurse), *module.buffers(recurse=recurse)]
    return any(t.device.type == "meta" for t in tensors)


def base_name(name: str) -> str:
    """A module's name in the model PEFT wraps, without ``base_model.model.`` nor PEFT's wrapper levels.

    A layer is so keyed (and found in a checkpoint) by the same name with or without adapters."""
    return _PEFT_WRAPPERS.sub("", name.removeprefix("base_model.model."))


def _keyed_seed(seed: int, name: str) -> int:
    return spo_generator(seed, 0, name, "materialize").initial_seed()


def _owners(model: nn.Module) -> dict[int, PreTrainedModel]:
    """Each module's nearest enclosing ``transformers`` ``PreTrainedModel`` (whose ``_init_weights`` applies)."""
    from transformers import PreTrainedModel

    owners: dict[int, PreTrainedModel] = {}

    def visit(module: nn.Module, owner: PreTrainedModel | None) -> None:
        owner = module if isinstance(module, PreTrainedModel) else owner
        if owner is not None:
            owners[id(module)] = owner
        for child in module.children():
            visit(child, owner)

    visit(model, None)
    return owners


@torch.no_grad()
def initial_values(module: nn.Module, owner: PreTrainedModel | None, key: str, seed: int) -> dict[str, torch.Tensor]:
    """Fresh values of ``module``'s own parameters and buffers, whole, on the CPU.

    They are drawn under a generator keyed by (``seed``, ``key``): ``owner._init_weights`` applied to a shallow copy of
    the module holding whole tensors, or, for what that leaves untouched (or without a ``transformers`` owner), the
    module's ``reset_parameters``.

    Raises:
        ValueError: a floating-point tensor of ``module`` is left uninitialised by both.
    """
    from torch.distributed.fsdp import FSDPModule

    plain_class = next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule))  # FSDP2's subclass aside
    shadow = cast(nn.Module, object.__new__(plain_class))
    shadow.__dict__.update(module.__dict__)
    shadow._parameters = {
        n: None if p is None else nn.Parameter(_unset(p), p.requires_grad) for n, p in module._parameters.items()
    }
    shadow._buffers = {n: None if b is None else _unset(b) for n, b in module._buffers.items()}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_keyed_seed(seed, key))
        if owner is not None:
            owner._init_weights(shadow)
        untouched = [n for n, t in _named_tensors(shadow) if t.is_floating_point() and t.isnan().all()]
        reset_parameters = getattr(shadow, "reset_parameters", None)
        if untouched and reset_parameters is not None:
            reset_parameters()
            untouched = [n for n, t in _named_tensors(shadow) if t.is_floating_point() and t.isnan().all()]
    if untouched:
        raise ValueError(
            f"'{key}' ({type(module).__name__}) is on the meta device, and neither its model's "
            f"_init_weights nor a reset_parameters method initialises its {untouched}; materialize it "
            "from a checkpoint, or give the module a reset_parameters"
        )
    return dict(_named_tensors(shadow))


def _unset(tensor: torch.Tensor) -> torch.Tensor:
    """A whole CPU tensor shaped like ``tensor``, NaN where it is floating-point.

    What no initialisation writes is then seen."""
    fresh = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
    return fresh.fill_(float("nan")) if fresh.is_floating_point() else fresh


class SafetensorsCheckpoint:
    """The tensors of a ``save_pretrained`` folder or of one ``.safetensors`` file, read one at a time.

    A folder holds ``model.safetensors`` or its sharded index."""

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        if path.is_dir():
            index = path / "model.safetensors.index.json"
            single = path / "model.safetensors"
            if index.exists():
                files = json.loads(index.read_text())["weight_map"]
                self.files = {key: path / name for key, name in files.items()}
            elif single.exists():
                self.files = dict.fromkeys(self._keys_of(single), single)
            else:
                raise FileNotFoundError(
                    f"`checkpoint` folder {path} holds neither model.safetensors nor model.safetensors.index.json"
                )
        elif path.suffix == ".safetensors" and path.exists():
            self.files = dict.fromkeys(self._keys_of(path), path)
        else:
            raise FileNotFoundError(
                f"`checkpoint` {path} is neither a folder written by save_pretrained nor a .safetensors file"
            )

    @staticmethod
    def _keys_of(file: Path) -> list[str]:
        from safetensors import safe_open

        with safe_open(str(file), framework="pt") as handle:
            return list(handle.keys())

    def find(self, key: str, prefix: str = "") -> str | None:
        """The checkpoint's name for ``key``: itself, or with / without the model's ``base_model_prefix``."""
        candidates = [key]
        if prefix:
            candidates += [key.removeprefix(prefix + "."), f"{prefix}.{key}"]
        return next((c for c in candidates if c in self.files), None)

    def read(self, key: str) -> torch.Tensor:
        """The tensor ``key``, read with the file opened for this one read.

        ``safe_open`` maps the file, and every page read through a mapping that stays open stays resident, so an open
        handle would end up holding the whole checkpoint in memory."""
        from safetensors import safe_open

        with safe_open(str(self.files[key]), framework="pt") as handle:
            return handle.get_tensor(key)


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


@torch.no_grad()
def _receive_from_rank0(target: torch.Tensor, full: torch.Tensor | None, loading: str) -> None:
    """Fill ``target`` from ``full``, which only rank 0 has.

    ``target`` is a sharded ``DTensor`` or a plain tensor every process holds. ``"scatter"`` sends each process its
    shard, ``"broadcast"`` the whole tensor (each keeps its shard)."""
    from torch.distributed.tensor import DTensor, Shard

    device = target.device
    if full is not None:
        full = full.to(device=device, dtype=target.dtype)
    placements: tuple[Any, ...] = getattr(target, "placements", ())
    if (
        not isinstance(target, DTensor)
        or loading == "broadcast"
        or len(placements) != 1
        or not isinstance(placements[0], Shard)
    ):
        whole = full if full is not None else torch.empty(target.shape, dtype=target.dtype, device=device)
        dist.broadcast(whole, src=0)
        write_full(target, whole)
        return
    dim, world = placements[0].dim, target.device_mesh.size()
    rows = -(-target.shape[dim] // world)  # torch.chunk's chunk size: every process's shard, padded to it
    padded_shape = list(target.shape)
    padded_shape[dim] = rows
    local = target.to_local()
    # received in place where the shard is a whole, contiguous chunk; else through a padded buffer
    direct = list(local.shape) == padded_shape and local.is_contiguous()
    received = local if direct else torch.empty(padded_shape, dtype=target.dtype, device=device)
    chunks = None
    if full is not None:
        chunks = [
            part if part.shape[dim] == rows and part.is_contiguous() else _padded(part, padded_shape, dim)
            for part in torch.chunk(full, world, dim=dim)
        ]
        chunks += [torch.zeros(padded_shape, dtype=target.dtype, device=device)] * (world - len(chunks))
    group = target.device_mesh.get_group()
    dist.scatter(received, chunks, src=dist.get_global_rank(group, 0), group=group)
    if not direct:
        local.copy_(received.narrow(dim, 0, local.shape[dim]))


def _padded(part: torch.Tensor, shape: list[int], dim: int) -> torch.Tensor:
    padded = torch.zeros(shape, dtype=part.dtype, device=part.device)
    padded.narrow(dim, 0, part.shape[dim]).copy_(part)
    return padded


def _named_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from ((n, p) for n, p in module._parameters.items() if p is not None)
    yield from ((n, b) for n, b in module._buffers.items() if b is not None)


@torch.no_grad()
def materialize_model(
    model: _Module,
    seed: int = 0,
    device: str | torch.device | None = None,
    checkpoint: str | Path | None = None,
    loading: str = "scatter",
) -> _Module:
    """Give every tensor of ``model`` still on the ``meta`` device its storage on ``device`` and its value.

    The model is changed in place and returned; tensors already materialized are left as they are.

    Args:
        model: a model built under ``torch.device("meta")``, with or without POET / OFT adapters, sharded by FSDP2
            (``fully_shard`` on the meta model) or not.
        seed: the seed the keyed initialisation of the base model's modules derives from (the adapters use their
            config's ``seed``).
        device: where the tensors go; default the accelerator when one is present, else the CPU.
        checkpoint: a ``save_pretrained`` folder or ``.safetensors`` file of the base model: the tensors it holds are
            read from it (names as in the base model; a ``base_model_prefix`` more or less is accepted). Only the
            tensors an initialisation would give (adapters, non-persistent buffers) may be missing from it.
        loading: for a sharded model, how rank 0 hands out what it reads: ``"scatter"`` (each process receives its
            shard) or ``"broadcast"`` (each receives the whole tensor and keeps its shard).

    Returns:
        ``model``, materialized in place.

    Raises:
        ValueError: ``loading`` is not one of [`CHECKPOINT_LOADING`][poet_hf.initialization.CHECKPOINT_LOADING]; a meta
            module holds another PEFT method's adapter or a quantised layer, whose initialisation this cannot reproduce,
            or a tensor no initialisation writes (`initial_values`); or ``checkpoint`` lacks a persistent tensor of the
            base model.
        FileNotFoundError: ``checkpoint`` is not a folder or file with safetensors weights.
    """
    from torch.distributed.tensor import DTensor

    if loading not in CHECKPOINT_LOADING:
        raise ValueError(f"`loading` must be one of {CHECKPOINT_LOADING}, got {loading!r}")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    sharded = any(isinstance(p, DTensor) for p in model.parameters())
    layers = [layer for _, layer in rotation_layers(model) if has_meta_tensors(cast(nn.Module, layer))]
    if any(layer.pending_quantization is not None for layer in layers):
        bound_allocator_slack()  # each layer's float32 build, freed once quantised: off the resident set at once
    adapter_state = {
        id(m)
        for layer in layers
        for child in cast(nn.Module, layer).children()
        if child is not layer.base_layer
        for m in child.modules()
    }  # drawn by the layer's reset_rotation_state
    for name, module in model.named_modules():
        _refuse_foreign(name, module)
    pending = [(name, m) for name, m in model.named_modules() if has_meta_tensors(m, recurse=False)]
    modules = [(base_name(name), m) for name, m in pending if id(m) not in adapter_state]
    stored = _checkpoint_names(model, modules, checkpoint, sharded)
    owners = _owners(model)

    groups = list(_groups_by_layer(pending, layers))
    del pending, modules  # a quantised layer's float32 base is freed as soon as its group is done
    for group, layer in groups:  # a rotation layer whole, then quantised: one at a time
        for _, module in group:
            module.to_empty(device=device, recurse=False)
        for name, module in group:
            if id(module) not in adapter_state:
                _fill(module, base_name(name), stored, owners.get(id(module)), seed, sharded, loading)
        if layer is not None:
            _finish_layer(layer, sharded)
        group.clear()
    base = base_model_of(model)
    if hasattr(base, "tie_weights"):
        base.tie_weights()
    return model


def _fill(module: nn.Module, key: str, stored: Any, owner: Any, seed: int, sharded: bool, loading: str) -> None:
    """Write one module's tensors: from the checkpoint where it holds them, else their keyed initial values."""
    values = None
    for tensor_name, target in _named_tensors(module):
        full_key = f"{key}.{tensor_name}" if key else tensor_name
        if full_key in stored:
            source = stored.source
            value = source.read(stored[full_key]) if source is not None else None
            if sharded:
                _receive_from_rank0(target, value, loading)
            else:
                assert value is not None  # one process: the checkpoint is read here
                write_full(target, value)
            continue
        values = values or initial_values(module, owner, key, seed)
        write_full(target, values[tensor_name])


def _groups_by_layer(
    pending: list[tuple[str, nn.Module]], layers: list[RotationLayer]
) -> Iterator[tuple[list[tuple[str, nn.Module]], RotationLayer | None]]:
    """``pending`` in order, as groups to materialize together.

    A group is every module of one rotation layer (with the layer), or one other module alone."""
    owner = {id(m): layer for layer in layers for m in cast(nn.Module, layer).modules()}
    groups: dict[int, list[tuple[str, nn.Module]]] = {}
    order: list[tuple[list[tuple[str, nn.Module]], RotationLayer | None]] = []
    for name, module in pending:
        layer = owner.get(id(module))
        if layer is None:
            order.append(([(name, module)], None))
        elif id(layer) in groups:
            groups[id(layer)].append((name, module))
        else:
            groups[id(layer)] = [(name, module)]
            order.append((groups[id(layer)], layer))
    yield from order


def _finish_layer(layer: RotationLayer, sharded: bool) -> None:
    """Give a materialized rotation layer its adapter state, then the quantisation its config asked for.

    The state is `reset_rotation_state`'s; the quantisation waited while the layer was on the meta device."""
    for adapter_name in layer.rotation_specs:
        layer.reset_rotation_state(adapter_name)
    if layer.pending_quantization is not None:
        if sharded:
            raise ValueError(
                f"`base_quantization`={layer.pending_quantization!r} cannot be combined with FSDP2 sharding: "
                "bitsandbytes parameters cannot be sharded; use 'nf4-shardable' or 'int8-shardable'"
            )
        layer.quantize_base(layer.pending_quantization)


class _StoredNames(dict):
    """Model tensor name → checkpoint tensor name, for what the checkpoint holds.

    ``source`` reads them; it is ``None`` on the processes of a sharded model that receive rather than read."""

    source: SafetensorsCheckpoint | None = None


def _checkpoint_names(
    model: nn.Module, modules: list[tuple[str, nn.Module]], checkpoint: str | Path | None, sharded: bool
) -> _StoredNames:
    """Which persistent tensors of ``modules`` to read from ``checkpoint``, and under which names.

    In a sharded model rank 0 reads the checkpoint's index and tells the other processes; a persistent tensor it lacks
    is an error."""
    stored = _StoredNames()
    if checkpoint is None:
        return stored
    if not sharded or _rank() == 0:
        stored.source = SafetensorsCheckpoint(checkpoint)
        base = base_model_of(model)
        prefix = getattr(base, "base_model_prefix", "")
        tied = set(getattr(base, "all_tied_weights_keys", None) or {})  # restored by tie_weights, never saved
        missing = []
        for key, module in modules:
            persistent = [
                n
                for n, t in _named_tensors(module)
                if n in module._parameters or n not in module._non_persistent_buffers_set
            ]
            for tensor_name in persistent:
                full_key = f"{key}.{tensor_name}" if key else tensor_name
                found = stored.source.find(full_key, prefix)
                if found is None and full_key not in tied:
                    missing.append(full_key)
                elif found is not None:
                    stored[full_key] = found
        problem = (
            f"`checkpoint` {checkpoint} lacks {len(missing)} tensors of the model, e.g. {missing[:5]}"
            if missing
            else None
        )
    if sharded:
        box = [(dict(stored), problem) if _rank() == 0 else None]
        dist.broadcast_object_list(box, src=0)
        names, problem = cast(tuple[dict[str, Any], str | None], box[0])  # every rank has rank 0's now
        stored.update(names)
    if problem:
        raise ValueError(problem)
    return stored


def _refuse_foreign(name: str, module: nn.Module) -> None:
    from .tuners.rotation.quantization import is_bnb_module

    if isinstance(module, BaseTunerLayer) and not isinstance(module, RotationLayer) and has_meta_tensors(module):
        raise ValueError(
            f"'{name}' is a {type(module).__name__} adapter on the meta device; materialize_model "
            "initialises POET and OFT adapters only: materialize the base model first, then add it"
        )
    if is_bnb_module(module) and has_meta_tensors(module):
        raise ValueError(f"'{name}' is a quantised layer on the meta device; quantise a materialized model instead")
