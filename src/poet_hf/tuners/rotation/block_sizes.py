"""Block sizes that fit every targeted layer: a size that does not divide a side becomes its nearest divisor.

A config's ``block_size`` is what the user asked for; each layer resolves it per side with `resolve_block_size`:

1. an entry of ``block_size_pattern`` for the layer wins (a size recorded when the adapter was built, or one the user
   set), and must divide the side;
2. a ``block_size`` that divides the side is used as it is;
3. otherwise, with ``strict_block_size=True``, the layer is refused with an error naming the field; without it the
   size becomes the nearest divisor (`nearest_divisor`, PEFT's rule for OFT) and is recorded in
   ``block_size_pattern``, so ``save_pretrained`` writes it to ``adapter_config.json`` and a reload builds the same
   blocks whatever a later release's rule.

The tuner warns once per ``get_peft_model`` / ``add_adapter`` (`warn_adjusted_block_sizes`), listing the layers and the
sizes used.
"""

from __future__ import annotations

import warnings
from typing import Any

from ...orthogonal.spo import nearest_divisor

PATTERN_FIELD = "block_size_pattern"


class BlockSizeAdjustedWarning(UserWarning):
    """A requested block size did not divide some targeted layers and was replaced by the nearest divisor."""


def check_block_size_pattern(pattern: object, per_side_allowed: bool) -> None:
    """Validate a ``block_size_pattern``: module name → block size (>= 2), or per side for POET.

    Args:
        pattern: the field's value.
        per_side_allowed: whether a value may be ``{"input": b, "output": b}`` (POET's two sides).

    Raises:
        ValueError: a key is not a string, or a size is not an integer >= 2.
    """
    if not isinstance(pattern, dict):
        raise ValueError(f"`{PATTERN_FIELD}` must be a dict of module name -> block size, got {pattern!r}")
    for name, value in pattern.items():
        sizes = value if per_side_allowed and isinstance(value, dict) else {"": value}
        if not isinstance(name, str) or (isinstance(value, dict) and set(value) - {"input", "output"}):
            raise ValueError(f"`{PATTERN_FIELD}` entry {name!r}: {value!r} is not a module name -> block size")
        for size in sizes.values():
            if not isinstance(size, int) or isinstance(size, bool) or size < 2:
                raise ValueError(f"`{PATTERN_FIELD}[{name!r}]` must hold integers >= 2, got {value!r}")


def resolve_block_size(
    config: Any, layer_name: str, side: str, dim: int, requested: int, field: str, per_side: bool
) -> int:
    """The block size of one side of ``layer_name``, following the rules of this module's docstring.

    Args:
        config: a ``PoetConfig`` or ``OftConfig`` (its ``block_size_pattern`` and ``strict_block_size``).
        layer_name: the module's name in the base model (the pattern's key).
        side: ``"input"`` (R) or ``"output"`` (P).
        dim: the side's dimension.
        requested: the size the config asks for on this side.
        field: the config field to name in an error (``"block_size"``, ``"r"``, …).
        per_side: record an adjusted size per side (POET) rather than as one int (OFT, the input side only).

    Returns:
        A block size that divides ``dim``.

    Raises:
        ValueError: a pattern entry does not divide ``dim``, or ``strict_block_size`` is set and ``requested`` does not.
    """
    pattern = getattr(config, PATTERN_FIELD)
    entry = pattern.get(layer_name)
    size = entry.get(side) if isinstance(entry, dict) else entry
    if size is not None:
        if dim % size:
            raise ValueError(
                f"`{PATTERN_FIELD}[{layer_name!r}]`={entry!r} does not divide the {dim}-dimensional {side} side of "
                f"that module; give a divisor of {dim}"
            )
        return size
    if dim % requested == 0:
        return requested
    if config.strict_block_size:
        raise ValueError(
            f"`{field}`={requested} does not divide the {dim}-dimensional {side} side of target module "
            f"'{layer_name}'; choose a block size that divides every targeted dimension, or set "
            "`strict_block_size`=False to use the nearest divisor"
        )
    size = nearest_divisor(dim, requested)
    if per_side:
        pattern.setdefault(layer_name, {})[side] = size
    else:
        pattern[layer_name] = size
    return size


def warn_adjusted_block_sizes(config: Any, before: dict[str, Any], dims: dict[str, dict[str, int]]) -> None:
    """One warning listing the layers whose block size was adjusted since ``before`` (a copy of the pattern).

    Args:
        config: the adapter's config, whose pattern the layers filled.
        before: the pattern as it was before the adapter was injected.
        dims: layer name → side → dimension, for the message.
    """
    pattern = getattr(config, PATTERN_FIELD)
    added = {name: entry for name, entry in pattern.items() if name not in before}
    if not added:
        return
    groups: dict[tuple[str, int, int], list[str]] = {}
    for name, entry in added.items():
        for side, size in entry.items() if isinstance(entry, dict) else [("input", entry)]:
            groups.setdefault((side, dims.get(name, {}).get(side, 0), size), []).append(name)
    lines = [
        f"  {side} side {dim} -> block {size}: {len(names)} layer(s): {', '.join(names)}"
        for (side, dim, size), names in sorted(groups.items())
    ]
    asked = f"`r`={config.r}" if getattr(config, "r", 0) else f"`block_size`={config.block_size!r}"
    warnings.warn(
        f"{asked} does not divide every targeted dimension; the nearest divisor is used instead (PEFT's rule for "
        f"OFT), in {len(added)} layer(s):\n" + "\n".join(lines) + "\nThe sizes are "
        f"recorded in `{PATTERN_FIELD}` and saved with the adapter; set `strict_block_size=True` to make this an "
        "error.",
        BlockSizeAdjustedWarning,
        stacklevel=4,
    )
