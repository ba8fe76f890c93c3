"""Registers poet_hf's tuners with stock PEFT, without touching PEFT's files on disk."""

from __future__ import annotations

import enum
import importlib
from typing import TYPE_CHECKING

import peft
from packaging.version import Version

if TYPE_CHECKING:
    from peft.utils.peft_types import PeftType

SUPPORTED_PEFT = (Version("0.21.0"), Version("0.22.0"))

# (PEFT method name, module holding `<Name>Config` and `<Name>Model`, class-name stem)
_TUNERS = [
    ("poet", "poet_hf.tuners.poet", "Poet"),
    # PEFT owns "oft" (its OFTConfig keeps working beside ours): ours is "poet_oft", prefix "poet_oft_".
    ("poet_oft", "poet_hf.tuners.oft", "Oft"),
    ("orthogonal", "poet_hf.tuners.orthogonal_layers", "Orthogonal"),
]


def check_peft_version(version: str = peft.__version__) -> None:
    """Raise ``ImportError`` unless ``version`` is one this package was built and tested against."""
    low, high = SUPPORTED_PEFT
    if not low <= Version(version) < high:
        raise ImportError(
            f"poet_hf supports peft>={low},<{high} (its tuner registration hooks changed in 0.21); found peft "
            f"{version}. Install a supported release: pip install 'peft>={low},<{high}'"
        )


def peft_type_member(name: str) -> PeftType:
    """``PeftType[name.upper()]``, added to PEFT's ``PeftType`` str-enum first if needed.

    A config's ``peft_type`` must be the enum member (PEFT's code reads ``.value``); as a ``str`` enum it is written
    to ``adapter_config.json`` as the plain string and pickles by value.
    """
    from peft.utils.peft_types import PeftType

    _add_peft_type(name)
    return PeftType(name.upper())


def _add_peft_type(name: str) -> None:
    """Add ``name.upper()`` to PEFT's ``PeftType`` str-enum, which ``register_peft_method`` requires."""
    from peft.utils.peft_types import PeftType

    key = name.upper()
    if key in PeftType.__members__:
        return
    member = str.__new__(PeftType, key)
    member._name_, member._value_ = key, key
    member.__objclass__ = PeftType  # type: ignore[attr-defined]  # what Enum sets on its own members
    PeftType._member_map_[key] = member
    PeftType._value2member_map_[key] = member
    PeftType._member_names_.append(key)
    type.__setattr__(PeftType, key, member)
    assert isinstance(PeftType(key), enum.Enum)


def register_tuners() -> None:
    """Register every tuner of this package with PEFT (idempotent)."""
    from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING
    from peft.utils import register_peft_method

    check_peft_version()
    for name, module_path, stem in _TUNERS:
        if name.upper() in PEFT_TYPE_TO_CONFIG_MAPPING:
            continue
        module = importlib.import_module(module_path)
        _add_peft_type(name)
        register_peft_method(
            name=name, config_cls=getattr(module, f"{stem}Config"), model_cls=getattr(module, f"{stem}Model")
        )
