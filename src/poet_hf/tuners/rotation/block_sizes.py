"""Block sizes that fit every targeted layer: a size that does not divide a side becomes its nearest divisor.

A config's ``block_size`` is what the user asked for; each layer resolves it per side with `resolve_block_size`:

1. an entry of ``block_size_pattern`` for the layer wins (a size recorded when the adapter was built, or one the user
   set), and must divide the side;
2. a ``block_size`` that divides the side is used as it is;
3. otherwise, with ``strict_block_size=True``, the layer is refused with an error naming the field; without it the
   size becomes the nearest divisor (`nearest_divisor`, PEFT's rule for OFT).

Layers only read the config. Once the adapter is injected, the tuner records every adjusted size in
``block_size_pattern`` (`record_adjusted_block_sizes`), so ``save_pretrained`` writes it to ``adapter_config.json``
and a reload builds the same blocks whatever a later release's rule, and warns once, listing the layers and the sizes
used.
"""

from __future__ import annotations

import warnings

from ...orthogonal.spo import nearest_divisor
from .config import PATTERN_FIELD, RotationConfig


class BlockSizeAdjustedWarning(UserWarning):
    """A requested block size did not divide some targeted layers and was replaced by the nearest divisor."""


def resolve_block_size(config: RotationConfig, layer_name: str, side: str, dim: int, requested: int, field: str) -> int:
    """The block size of one side of ``layer_name``, following the rules of this module's docstring.

    Nothing is written: the tuner records the sizes that were adjusted (`record_adjusted_block_sizes`) once the
    adapter is injected.

    Args:
        config: a ``PoetConfig`` or ``OftConfig`` (its ``block_size_pattern`` and ``strict_block_size``).
        layer_name: the module's name in the base model (the pattern's key).
        side: ``"input"`` (R) or ``"output"`` (P).
        dim: the side's dimension.
        requested: the size the config asks for on this side.
        field: the config field to name in an error (``"block_size"``, ``"r"``, …).

    Returns:
        A block size that divides ``dim``.

    Raises:
        ValueError: a pattern entry does not divide ``dim``, or ``strict_block_size`` is set and ``requested`` does not.
    """
    size = _pattern_size(config, layer_name, side)
    if size is not None:
        if dim % size:
            entry = config.block_size_pattern[layer_name]
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
    return nearest_divisor(dim, requested)


def is_adjusted(config: RotationConfig, layer_name: str, side: str, dim: int, requested: int) -> bool:
    """Whether `resolve_block_size` replaces ``requested`` (a size, or OFT's ``r``) for this side by a divisor."""
    return _pattern_size(config, layer_name, side) is None and dim % requested != 0


def _pattern_size(config: RotationConfig, layer_name: str, side: str) -> int | None:
    """The size ``block_size_pattern`` gives this side of ``layer_name`` (one int for both sides, or per side)."""
    entry = config.block_size_pattern.get(layer_name)
    return entry.get(side) if isinstance(entry, dict) else entry


def record_adjusted_block_sizes(
    config: RotationConfig, adjusted: dict[str, dict[str, int]], dims: dict[str, dict[str, int]]
) -> None:
    """Record the sizes the layers adjusted in ``config.block_size_pattern`` and say so in one warning.

    The pattern is saved with the adapter (``adapter_config.json``), so a reload builds the same blocks.

    Args:
        config: the adapter's config.
        adjusted: layer name → side → the block size used instead of the requested one.
        dims: layer name → side → dimension, for the message.
    """
    if not adjusted:
        return
    for name, sizes in adjusted.items():
        if config.per_side_block_sizes:  # beside a size the user gave for the other side
            entry = config.block_size_pattern.get(name, {})
            config.block_size_pattern[name] = {**(entry if isinstance(entry, dict) else {}), **sizes}
        else:
            config.block_size_pattern[name] = sizes["input"]
    groups: dict[tuple[str, int, int], list[str]] = {}
    for name, sizes in adjusted.items():
        for side, size in sizes.items():
            groups.setdefault((side, dims.get(name, {}).get(side, 0), size), []).append(name)
    lines = [
        f"  {side} side {dim} -> block {size}: {len(names)} layer(s): {', '.join(names)}"
        for (side, dim, size), names in sorted(groups.items())
    ]
    blocks = getattr(config, "r", 0)  # OFT may ask for a number of blocks instead
    asked = f"`r`={blocks}" if blocks else f"`block_size`={config.block_size!r}"
    warnings.warn(
        f"{asked} does not divide every targeted dimension; the nearest divisor is used instead (PEFT's rule for "
        f"OFT), in {len(adjusted)} layer(s):\n" + "\n".join(lines) + "\nThe sizes are "
        f"recorded in `{PATTERN_FIELD}` and saved with the adapter; set `strict_block_size=True` to make this an "
        "error.",
        BlockSizeAdjustedWarning,
        stacklevel=4,
    )
