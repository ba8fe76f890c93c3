"""The registry of orthogonal maps: a tuner's ``orthogonal_map`` names one of `MAPS`.

A new map is one file with a class following [`OrthogonalMap`][poet_hf.orthogonal.map_protocol.OrthogonalMap]
(and a ``from_config`` classmethod) and one line in `MAPS`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .cayley_map import CayleyNeumann
from .householder_map import HouseholderProduct
from .map_protocol import OrthogonalMap

__all__ = ["MAPS", "DEFAULT_MAP", "check_orthogonal_map", "map_from_config"]

# name -> the map a config asks for; each map reads its own settings from the config
MAPS: dict[str, Callable[[Any], OrthogonalMap]] = {
    CayleyNeumann.name: CayleyNeumann.from_config,
    HouseholderProduct.name: HouseholderProduct.from_config,
}
DEFAULT_MAP = CayleyNeumann.name


def check_orthogonal_map(name: object, field: str = "orthogonal_map") -> None:
    """Raise ``ValueError`` unless ``name`` is a registered map.

    Args:
        name: the value to check.
        field: the setting's name, for the message.

    Raises:
        ValueError: ``name`` is not one of `MAPS`.
    """
    if name not in MAPS:
        raise ValueError(f"`{field}` must be one of {sorted(MAPS)}, got {name!r}")


def map_from_config(config: Any, name: str | None = None) -> OrthogonalMap:
    """The orthogonal map ``config.orthogonal_map`` (or ``name``) names, with the settings it reads from ``config``.

    Args:
        config: a tuner's config (``PoetConfig``, ``OftConfig``, ``OrthogonalConfig``).
        name: the map's name where the config keeps it under another field (``OrthogonalConfig.parameterization``).

    Returns:
        The map.

    Raises:
        ValueError: the name is not registered, or the map refuses its settings.
    """
    name = config.orthogonal_map if name is None else name
    check_orthogonal_map(name)
    return MAPS[name](config)
