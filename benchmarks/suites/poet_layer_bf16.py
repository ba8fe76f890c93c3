"""`poet_layer` under bfloat16 autocast: the same layers, strategies and ``auto`` pick, the plain layer under the same
autocast, so that the chooser is checked in the dtype mixed-precision training runs in."""

from __future__ import annotations

from . import poet_layer


def run(quick: bool = False) -> list[dict]:
    """Every row of `poet_layer`, under ``torch.autocast(dtype=torch.bfloat16)``."""
    return poet_layer.run(quick, autocast="bfloat16")
