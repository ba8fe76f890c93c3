"""Validation shared by the tuner configs: errors name the field and the allowed values."""

from __future__ import annotations

from typing import Any


def check_choice(field_name: str, value: object, choices: tuple) -> None:
    """Raise a ``ValueError`` naming the field and its allowed values."""
    if value not in choices:
        raise ValueError(f"`{field_name}` must be one of {choices}, got {value!r}")


def check_positive_int(field_name: str, value: object, minimum: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"`{field_name}` must be an integer >= {minimum}, got {value!r}")


def check_budget(value: object, field_name: str = "budget") -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value <= 1:
        raise ValueError(f"`{field_name}` must be a fraction in (0, 1], got {value!r}")


def normalize_peft_target_fields(config: Any) -> None:
    """PEFT's conventions for the standard targeting fields: lists become sets, and ``layers_pattern`` needs
    ``layers_to_transform``."""
    if isinstance(config.target_modules, list):
        config.target_modules = set(config.target_modules)
    if isinstance(config.exclude_modules, list):
        config.exclude_modules = set(config.exclude_modules)
    if config.layers_pattern and config.layers_to_transform is None:
        raise ValueError("`layers_to_transform` must be set when `layers_pattern` is set")
