"""Merge-then-reinitialize into a 4-bit ``W0`` a group of rows at a time (`poet_hf.tuners.rotation.row_fold`): rows
quantised alone are bitsandbytes' whole quantisation bit for bit, the groups apply the dense output side, and a fold
keeps the error-feedback contract against the float64 fold (``dequant(W_new) + E_new = Pᵀ (W0 + E) Rᵀ`` to the
residual's own rounding) without ever holding the dense ``W0``."""

from __future__ import annotations

import bitsandbytes  # noqa: F401  (the `quant` extra, part of `dev`: these tests run, they never skip)
import bitsandbytes.functional as functional
import pytest
import torch
from peft import get_peft_model
from peft.utils.integrations import dequantize_bnb_weight
from reference import block_rotation_dense, neumann_series, skew_dense, subset_rotation_dense
from tolerances import gamma
from torch import nn

import poet_hf  # noqa: F401
from poet_hf import OftConfig, PoetConfig, merge_and_reinit
from poet_hf.orthogonal.spo import SideSpec
from poet_hf.tuners.rotation import quantization as quant
from poet_hf.tuners.rotation import quantized_rows as bnb_rows
from poet_hf.tuners.rotation import residual_store, row_fold
from poet_hf.tuners.rotation.layer import rotation_layers

ROW_ENTRIES = 2048  # a group of about 2048 entries: 8 rows of the 256-wide layers below


@pytest.mark.parametrize(("quant_type", "nested"), [("nf4", True), ("fp4", False)])
def test_rows_quantised_alone_are_bitsandbytes_whole_quantisation_bit_for_bit(quant_type, nested):
    """Rows written in a shuffled order, 12 at a time, give the codes, scales, offset and 8-bit scale codes of
    ``quantize_4bit`` on the whole 96 × 256 matrix."""
    gen = torch.Generator().manual_seed(0)
    matrix = torch.randn(96, 256, generator=gen) * torch.rand(96, 1, generator=gen)
    codes, state = functional.quantize_4bit(matrix, blocksize=64, compress_statistics=nested, quant_type=quant_type)
    rows = bnb_rows.RequantizedRows(state, (96, 256), torch.float32)
    order = torch.randperm(96, generator=gen)
    for start in range(0, 96, 12):
        group = order[start : start + 12]
        rows.write(group, matrix[group])
    written = rows.finish()
    assert torch.equal(rows.codes.reshape(-1), codes.reshape(-1))
    assert torch.equal(written.absmax, state.absmax) and written.nested == nested
    if nested:
        assert torch.equal(written.offset, state.offset)
        assert torch.equal(written.state2.absmax, state.state2.absmax)
    whole = functional.dequantize_4bit(codes, state)
    assert torch.equal(functional.dequantize_4bit(rows.codes.reshape(-1, 1), written), whole)


def _dense_output_side(spec: SideSpec, index: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    if spec.kind == "full":
        return subset_rotation_dense(index, blocks[0], spec.dim)
    return block_rotation_dense(index if spec.kind == "block" else None, blocks)


@pytest.mark.parametrize("kind", ["block", "contiguous", "full", None])
def test_row_groups_cover_every_row_once_and_apply_the_dense_output_side(kind):
    """Groups of about 10 rows of a 48-row matrix, blocks of 8 (full: a 16-row subset): each row in one group, and
    the groups' products are ``G @ W`` of the dense float64 ``G``."""
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(48, 5, dtype=torch.float64, generator=gen)
    spec = index = blocks = None
    dense = torch.eye(48, dtype=torch.float64)
    if kind is not None:
        spec = SideSpec(kind, 48, 16 if kind == "full" else 8)
        index = spec.sample_index(gen)
        skews = torch.randn(spec.num_blocks, spec.block * (spec.block - 1) // 2, dtype=torch.float64, generator=gen)
        blocks = torch.stack([neumann_series(skew_dense(row * 0.1, spec.block), 5) for row in skews])
        dense = _dense_output_side(spec, index, blocks)
    result, seen = torch.full_like(weight, float("nan")), torch.zeros(48, dtype=torch.long)
    for group in row_fold.output_row_groups(spec, index, blocks, 48, 10):
        part = weight[group.rows]
        if group.blocks is not None:
            part = torch.bmm(group.blocks, part.view(group.blocks.shape[0], -1, 5)).view(part.shape)
        result[group.rows] = part
        seen[group.rows] += 1
    assert torch.equal(seen, torch.ones(48, dtype=torch.long))
    torch.testing.assert_close(result, dense @ weight, rtol=0, atol=1e-12)


class Up(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(256, 192)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(x)


def _dense_side(layer, side: str) -> torch.Tensor:
    """The layer's ``side`` rotation as a dense float64 matrix (block, contiguous or full)."""
    spec = layer.sides("default")[side]
    vec = layer.rotation_parameter("default", side).detach().double()
    terms = layer.rotation_settings["default"].orthogonal_map.terms
    blocks = torch.stack([neumann_series(skew_dense(row, spec.block), terms) for row in vec])
    index = layer.index_buffer("default", side)
    if spec.kind == "full":
        return subset_rotation_dense(index, blocks[0], spec.dim)
    return block_rotation_dense(index if spec.kind == "block" else None, blocks.expand(spec.num_blocks, -1, -1))


def _w0_and_residual(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """bitsandbytes' dequantisation of ``W0``, the decoded residual and its per-entry scale (zeros without one)."""
    weight = dequantize_bnb_weight(module.weight, state=module.weight.quant_state).double()
    kept = residual_store.read(module, quant.RESIDUAL_NAMES)
    if kept is None:
        return weight, torch.zeros_like(weight), torch.zeros_like(weight)
    codes, scales = kept[quant.RESIDUAL_CODES].double(), kept[quant.RESIDUAL_SCALES].double()
    per_entry = scales.repeat_interleave(quant.RESIDUAL_BLOCK).view(weight.shape)
    return weight, codes * per_entry, per_entry


CONFIGS = {
    "poet-bs": PoetConfig(target_modules=["up"], block_size=32, base_quantization="nf4", init_weights=False),
    "poet-fs": PoetConfig(target_modules=["up"], spo="full", budget=0.5, base_quantization="nf4", init_weights=False),
    "poet-input": PoetConfig(
        target_modules=["up"], block_size=32, sides="input", base_quantization="fp4", init_weights=False
    ),
    "oft": OftConfig(target_modules=["up"], block_size=32, r=0, spo="block", init_weights=False),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_folds_by_rows_keep_the_error_feedback_contract_against_the_float64_fold(monkeypatch, name):
    """Three folds of a 192 × 256 4-bit ``W0`` by groups of ~8 rows: after each, ``dequant(W_new) + E_new`` is
    ``Pᵀ (W0 + E) Rᵀ`` in float64 to within the residual's int8 rounding (half its block scale) and the float32
    rotation's error (``γ`` of the two sides' sums); the reported error is ``‖dequant(W_new) − M‖ / ‖M‖``; no whole
    dequantisation or requantisation runs, and no group exceeds one output block or ~2048 entries."""
    torch.manual_seed(0)
    base, config = Up(), CONFIGS[name]
    if isinstance(config, OftConfig):  # OFT on a 4-bit base: quantised first, the QLoRA way
        base.up = quant.quantize_linear(base.up, "nf4")
    model = get_peft_model(base, config)
    layer = rotation_layers(model)[0][1]
    module, sides = layer.get_base_layer(), layer.sides("default")
    monkeypatch.setattr(bnb_rows, "ROW_BLOCK_ENTRIES", ROW_ENTRIES)
    monkeypatch.setattr(quant, "dequantize", _refuse)
    monkeypatch.setattr(quant, "requantize", _refuse)
    largest = []
    read = row_fold.dequantize_rows
    monkeypatch.setattr(row_fold, "dequantize_rows", lambda *a: largest.append(a[2].numel()) or read(*a))
    generator = torch.Generator().manual_seed(3)
    for _ in range(3):
        with torch.no_grad():
            for side in layer.sides("default"):
                param = layer.rotation_parameter("default", side)
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
        w0, residual, _ = _w0_and_residual(module)
        p_t = _dense_side(layer, "output").T if "output" in sides else torch.eye(192, dtype=torch.float64)
        r_t = _dense_side(layer, "input").T if "input" in sides else torch.eye(256, dtype=torch.float64)
        exact = p_t @ (w0 + residual) @ r_t
        # float32: W0 + E (one rounding), then sums of b_in and b_out products
        terms = sum(spec.block for spec in sides.values()) + 1
        rounding = gamma(terms, torch.float32) * (p_t.abs() @ (w0.abs() + residual.abs()) @ r_t.abs())
        stats = merge_and_reinit(model)
        new_w0, new_residual, scale = _w0_and_residual(module)
        # the residual's int8 code: half its block's scale; its float32 subtraction and decoding: 2u · 127 scales
        bound = scale * (0.5 + 254 * 2**-24) + rounding
        gap = (new_w0 + new_residual - exact).abs()
        assert (gap <= bound).all(), float((gap - bound).max())
        measured = float((new_w0 - exact).norm() / exact.norm())
        assert stats["max_requantization_error"] == pytest.approx(measured, rel=1e-4)
    output_block = sides["output"].block if "output" in sides else 0
    assert len(largest) > 2 * 3 and max(largest) <= max(ROW_ENTRIES // 256, output_block)


def _refuse(*args, **kwargs):
    raise AssertionError("the whole W0 was dequantised or requantised")
