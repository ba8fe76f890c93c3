"""Checks of loaded adapter state: what the math needs of every tensor, before it is used.

A POET or OFT adapter is only a rotation if each side's index tensor is a permutation (block-stochastic) or a valid
sorted index subset (fully stochastic) of the right size, its skew parameter has the shape its block size implies, and
its merge count is a non-negative integer that agrees across the adapter's layers (they merge together). A file that
breaks any of these would otherwise load silently and compute a wrong, non-orthogonal function, or fail at the first
forward with a bare ``IndexError``. [`AdapterStateError`][poet_hf.tuners.rotation.state_checks.AdapterStateError] names
the file, the tensor and what is wrong.
"""

from __future__ import annotations

import functools
import json
import os
import struct
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from ...orthogonal.spo import BLOCK, FULL, SideSpec

if TYPE_CHECKING:
    from peft.tuners._buffer_dict import BufferDict


__all__ = ["AdapterStateError", "check_safetensors_file", "index_problem", "parameter_problem", "merge_count_problem"]


class AdapterStateError(ValueError):
    """A saved adapter or checkpoint that cannot be a valid rotation state (or a damaged file).

    Args:
        problem: what is wrong.
        source: the file it was read from, if known.
    """

    def __init__(self, problem: str, source: str | None = None) -> None:
        self.problem, self.source = problem, source
        super().__init__(f"{source}: {problem}" if source else problem)

    def in_file(self, source: str) -> AdapterStateError:
        """The same error naming ``source``, unless it names a file already.

        Args:
            source: the file.

        Returns:
            A new error, or this one.
        """
        return self if self.source else AdapterStateError(self.problem, source)


def check_safetensors_file(path: str | os.PathLike) -> None:
    """Raise an `AdapterStateError` unless ``path`` is a whole safetensors file.

    Its header must parse and the data it describes must end exactly at the end of the file, so a truncated or
    extended file fails. Only the header is read."""
    path = os.fspath(path)
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as handle:
            (header_len,) = struct.unpack("<Q", handle.read(8))
            if header_len > size - 8:
                raise ValueError(f"its header claims {header_len} bytes but the file has {size}")
            header = json.loads(handle.read(header_len))
    except (struct.error, ValueError, UnicodeDecodeError) as error:
        raise AdapterStateError(f"not a readable safetensors file (truncated or damaged): {error}", path) from None
    ends = [entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"]
    expected, held = max(ends, default=0), size - 8 - header_len
    if held != expected:
        raise AdapterStateError(
            f"truncated or damaged: its header describes {expected} bytes of tensor data, the file holds {held}", path
        )


def index_problem(index: torch.Tensor, spec: SideSpec) -> str | None:
    """What is wrong with ``index`` as the index tensor of a side of shape ``spec`` (``None`` if nothing)."""
    expected = {BLOCK: spec.dim, FULL: spec.block}.get(spec.kind, 0)
    what = {
        BLOCK: f"a permutation of 0..{spec.dim - 1}",
        FULL: f"a sorted subset of {spec.block} distinct indices in 0..{spec.dim - 1}",
    }.get(spec.kind, "empty (contiguous blocks)")
    if index.dtype.is_floating_point or index.dtype.is_complex or index.dtype == torch.bool:
        return f"has dtype {index.dtype}; it must be an integer tensor, {what}"
    if index.dim() != 1 or index.numel() != expected:
        return f"has shape {tuple(index.shape)}; it must be {what} (shape ({expected},))"
    if not index.numel():
        return None
    low, high = int(index.min()), int(index.max())
    if low < 0 or high >= spec.dim:
        return f"holds {low if low < 0 else high}, out of range; it must be {what}"
    if spec.kind == BLOCK:
        counts = torch.bincount(index.cpu(), minlength=spec.dim)
        if bool((counts != 1).any()):
            repeated = int(torch.nonzero(counts > 1)[0])
            return f"is not a permutation: {repeated} appears {int(counts[repeated])} times; it must be {what}"
    elif bool((index[1:] <= index[:-1]).any()):
        return f"is not strictly increasing (repeated or unsorted indices); it must be {what}"
    return None


def parameter_problem(param: torch.Tensor, expected_shape: torch.Size, spec: SideSpec) -> str | None:
    """What is wrong with a loaded rotation parameter against the shape the side's block size and map imply."""
    if tuple(param.shape) != tuple(expected_shape):
        return (
            f"has shape {tuple(param.shape)}, but block size {spec.block} on a {spec.dim}-dimensional side implies "
            f"{tuple(expected_shape)} (rows × the orthogonal map's parameters per block)"
        )
    if not param.dtype.is_floating_point:
        return f"has dtype {param.dtype}; rotation parameters are floating point"
    if not bool(torch.isfinite(param).all()):
        return "holds non-finite values"
    return None


def merge_count_problem(count: torch.Tensor) -> str | None:
    """What is wrong with a loaded merge count (a non-negative integer scalar)."""
    if count.numel() != 1 or count.dtype.is_floating_point or int(count.reshape(())) < 0:
        return f"must be a non-negative integer scalar, got {count.dtype} of shape {tuple(count.shape)}"
    return None


class NamesItsSource(Protocol):
    """What a load error reads of an adapter's settings: the file it was loaded from, if any."""

    @property
    def source(self) -> str | None: ...


class LoadCheckedLayer(Protocol):
    """A rotation layer as its ``load_state_dict`` check reads it: which tensors each adapter and side holds."""

    @property
    def rotation_specs(self) -> dict[str, dict[str, SideSpec]]: ...

    @property
    def rotation_settings(self) -> Mapping[str, NamesItsSource]: ...

    @property
    def merge_counts(self) -> BufferDict: ...

    def side_containers(self, side: str) -> tuple[nn.ParameterDict, BufferDict]: ...

    def named_children(self) -> Iterator[tuple[str, nn.Module]]: ...


def check_loaded_state(layer: LoadCheckedLayer, state_dict: dict[str, torch.Tensor], prefix: str, *args: Any) -> None:
    """A rotation layer's ``load_state_dict`` pre-hook: each incoming tensor must be what the math needs.

    Index, rotation-parameter and merge-count tensors are checked; raises
    [`AdapterStateError`][poet_hf.tuners.rotation.state_checks.AdapterStateError] naming the first that is not."""
    names = {id(child): name for name, child in layer.named_children()}
    for adapter_name, specs in layer.rotation_specs.items():
        checks: list[tuple[nn.Module, Callable[[torch.Tensor], str | None]]] = [
            (layer.merge_counts, merge_count_problem)
        ]
        for side, spec in specs.items():
            params, indices = layer.side_containers(side)
            checks.append((indices, functools.partial(index_problem, spec=spec)))
            shape = params[adapter_name].shape
            checks.append((params, functools.partial(parameter_problem, expected_shape=shape, spec=spec)))
        for container, problem_of in checks:
            key = f"{prefix}{names[id(container)]}.{adapter_name}"
            problem = problem_of(state_dict[key]) if key in state_dict else None
            if problem:
                raise AdapterStateError(f"tensor '{key}' {problem}", layer.rotation_settings[adapter_name].source)
