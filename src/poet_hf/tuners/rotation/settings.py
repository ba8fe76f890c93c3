"""`RotationSettings`: what a rotation layer keeps of its adapter's config, per adapter."""

from __future__ import annotations

from dataclasses import dataclass

from ...orthogonal.map_protocol import OrthogonalMap
from ...orthogonal.maps import map_from_config
from .config import RotationConfig


@dataclass(frozen=True)
class RotationSettings:
    """What a layer keeps of an adapter's config: how to build its rotations and draw its indices."""

    layer_name: str
    seed: int
    orthogonal_map: OrthogonalMap  # the blocks' map, with its own settings (orthogonal/maps.py)
    forward: str  # "auto", "weight", "activation" or "activation-recompute"
    source: str | None = None  # the adapter file it was loaded from, for errors that name the file
    requantize: str = "feedback"  # how a fold rounds a quantised or 16-bit W0 (quantization.py, low_precision.py)
    residual_storage: str = "auto"  # where feedback keeps its residual between folds (residual_store.py)
    cache_rotations: bool | str = "auto"  # one build and one VJP per optimizer step under accumulation (caches.py)
    init_weights: bool = True  # False: a random, non-identity adapter (PEFT's convention)
    base_init: str | None = None  # POET's re-initialisation of W0 (orthogonal/base_init.py)

    @classmethod
    def from_config(cls, config: RotationConfig, layer_name: str) -> RotationSettings:
        """What a layer keeps of a ``PoetConfig`` or ``OftConfig`` (OFT has no ``base_init``)."""
        return cls(
            layer_name=layer_name,
            seed=config.seed,
            orthogonal_map=map_from_config(config),
            forward=config.forward,
            source=getattr(config, "loaded_from", None),
            requantize=config.requantize,
            residual_storage=config.residual_storage,
            cache_rotations=config.cache_rotations,
            init_weights=config.init_weights,
            base_init=getattr(config, "base_init", None),
        )
