"""The storage kinds of a quantised ``W0`` (poet_hf.tuners.rotation.storage_kinds) own their facts.

References: the bytes of a real bitsandbytes layer's ``state_dict`` (what is saved, and what the layer holds), and the
source files (each kind's name is spelled in the registry and the config only)."""

from __future__ import annotations

import ast
from pathlib import Path

import bitsandbytes  # noqa: F401  (the `quant` extra, part of `dev`)
import pytest
import torch
from torch import nn

import poet_hf  # noqa: F401
from poet_hf.tuners.rotation.quantization import quantization_of, quantize_linear
from poet_hf.tuners.rotation.shardable_quantized import ShardableQuantizedLinear
from poet_hf.tuners.rotation.storage_kinds import BASE_QUANTIZATIONS, KINDS, storage_kind

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "poet_hf"


BITSANDBYTES_KINDS = [name for name, kind in KINDS.items() if not kind.shardable]
SHARDABLE_KINDS = [name for name, kind in KINDS.items() if kind.shardable]


@pytest.mark.parametrize("name", BITSANDBYTES_KINDS)
@pytest.mark.parametrize("shape", [(192, 256), (1024, 512)])
def test_a_kind_counts_the_bytes_of_a_real_bitsandbytes_layer(name: str, shape: tuple[int, int]):
    """Codes, scales and code books as the layer's ``state_dict`` holds them; within 2 bytes (the length of 4-bit's
    packed quant-state header, 169–171 B, and int8's one-byte format tag)."""
    rows, cols = shape
    layer = quantize_linear(nn.Linear(cols, rows, bias=False), name)
    held = sum(t.numel() * t.element_size() for t in layer.state_dict().values() if torch.is_tensor(t))
    assert quantization_of(layer) == name
    assert storage_kind(name).stored_bytes(rows, rows * cols) == pytest.approx(held, abs=2)


@pytest.mark.parametrize("name", SHARDABLE_KINDS)
@pytest.mark.parametrize("shape", [(192, 256), (96, 100)])
def test_a_shardable_kind_counts_the_bytes_of_its_layer(name: str, shape: tuple[int, int]):
    """Exactly the codes and scales the layer's ``state_dict`` holds (a 100-wide row pads to two 4-bit blocks)."""
    rows, cols = shape
    layer = ShardableQuantizedLinear.from_linear(nn.Linear(cols, rows, bias=False), name)
    held = sum(t.numel() * t.element_size() for t in layer.state_dict().values())
    assert storage_kind(name).stored_bytes(rows, rows * cols) == held


def test_an_unknown_kind_names_the_allowed_ones():
    with pytest.raises(
        ValueError,
        match=r"`base_quantization` must be one of \(None, 'nf4', 'fp4', 'int8', 'nf4-shardable', 'int8-shardable'\)",
    ):
        storage_kind("int4")
    assert BASE_QUANTIZATIONS == tuple(KINDS)


def _spelled(name: str) -> list[str]:
    """Source files with ``name`` as a string constant."""
    found = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value == name:
                found.add(str(path.relative_to(PACKAGE)))
    return sorted(found)


@pytest.mark.parametrize("name", ["nf4", "fp4"])
def test_a_kind_is_named_in_the_registry_and_the_config_only(name: str):
    assert _spelled(name) == ["tuners/poet/config.py", "tuners/rotation/storage_kinds.py"]
