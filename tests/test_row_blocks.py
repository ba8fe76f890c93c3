"""A frozen ``W0`` read a block of rows at a time (`poet_hf.tuners.rotation.quantized_rows`, the activation strategies):
the blocks of a 4-bit ``W0`` are bitsandbytes' own whole dequantisation, bit for bit, and a layer that reads ``W0`` by
blocks computes the dense function and its gradients (float64 reference, gradcheck)."""

from __future__ import annotations

import bitsandbytes  # noqa: F401  (the `quant` extra, part of `dev`: these tests run, they never skip)
import pytest
import torch
from peft.utils.integrations import dequantize_bnb_weight
from reference import block_rotation_dense, neumann_series, skew_dense
from torch import nn

from poet_hf.orthogonal import CayleyNeumann
from poet_hf.orthogonal.rotated_linear import RotatedPass, SideRotation
from poet_hf.orthogonal.spo import SideSpec
from poet_hf.tuners.rotation import quantization as quant
from poet_hf.tuners.rotation import quantized_rows as bnb_rows


class RowBlockWeight:
    """A DenseWeight read by blocks of ``rows`` rows, recording the blocks; a whole call fails the test."""

    def __init__(self, matrix: torch.Tensor, rows: int) -> None:
        self.matrix, self.rows, self.dtype, self.dequantize_cost = matrix, rows, matrix.dtype, 1.0
        self.blocks: list[tuple[int, int]] = []

    def __call__(self) -> torch.Tensor:
        raise AssertionError("W0 was read whole")

    def row_blocks(self):
        for start in range(0, self.matrix.shape[0], self.rows):
            stop = min(start + self.rows, self.matrix.shape[0])
            self.blocks.append((start, stop))
            yield start, stop, self.matrix[start:stop].clone()


def dense_rotation_of(side: SideRotation, vec: torch.Tensor) -> torch.Tensor:
    blocks = torch.stack(
        [neumann_series(skew_dense(row, side.spec.block), side.orthogonal_map.terms) for row in vec.detach()]
    )
    return block_rotation_dense(side.index, blocks)


@pytest.mark.numerics
@pytest.mark.parametrize("strategy", ["activation", "activation-recompute"])
def test_a_weight_read_by_row_blocks_gives_the_dense_function_and_gradients(strategy):
    """``W0`` (8 × 12) in blocks of 3 rows, both sides block-stochastic with permutations: the output is
    ``x R W0ᵀ P`` of the dense matrices and the gradients pass gradcheck, with no whole ``W0`` ever read."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(8, 12, dtype=torch.float64, generator=gen)
    bias = torch.randn(8, dtype=torch.float64, generator=gen)
    sides = [SideRotation(SideSpec("block", d, 4), torch.randperm(d, generator=gen), CayleyNeumann(5)) for d in (12, 8)]
    vecs = [
        torch.randn(spec.spec.num_blocks, 6, dtype=torch.float64, generator=gen).mul(0.05).requires_grad_()
        for spec in sides
    ]
    x = torch.randn(3, 12, dtype=torch.float64, generator=gen, requires_grad=True)
    source = RowBlockWeight(weight, 3)
    for output_side in (sides[1], None):  # with the bias added after P, and fused into the product without P
        p_vec = vecs[1] if output_side is not None else None
        y = RotatedPass(strategy, sides[0], output_side)(x, source, bias, vecs[0], p_vec)
        r = dense_rotation_of(sides[0], vecs[0])
        p = dense_rotation_of(sides[1], vecs[1]) if output_side is not None else torch.eye(8, dtype=torch.float64)
        torch.testing.assert_close(y, x.detach() @ r @ weight.T @ p + bias, rtol=0, atol=1e-12)
        y.sum().backward()
        assert torch.autograd.gradcheck(
            lambda x_, r_, p_, side=output_side: RotatedPass(strategy, sides[0], side)(
                x_, RowBlockWeight(weight, 3), bias, r_, p_ if side is not None else None
            ),
            (x.detach().requires_grad_(), vecs[0], vecs[1]),
        )
    assert set(source.blocks) == {(0, 3), (3, 6), (6, 8)}


@pytest.mark.parametrize(
    ("quantization", "double_quant", "shape"), [("nf4", True, (96, 200)), ("fp4", False, (40, 320))]
)
def test_a_4bit_w0_by_row_blocks_is_its_whole_dequantisation_bit_for_bit(
    monkeypatch, quantization, double_quant, shape
):
    """Blocks of whole quantisation blocks (64 entries) and whole bytes, the double-quantised scales dequantised once:
    every entry is bitsandbytes' own dequantisation of the whole weight. 200 columns: 8 rows make whole blocks."""
    monkeypatch.setattr(bnb_rows, "ROW_BLOCK_ENTRIES", 1000)
    torch.manual_seed(0)
    layer = quant.quantize_linear(nn.Linear(shape[1], shape[0]), quantization, double_quant=double_quant)
    whole = dequantize_bnb_weight(layer.weight, state=layer.weight.quant_state)
    blocks = list(quant.QuantizedWeight(layer, torch.float32).row_blocks())
    rows = bnb_rows.rows_per_block(layer)
    assert rows is not None and (rows * shape[1]) % 64 == 0 and len(blocks) == -(-shape[0] // rows) > 1
    assert [stop - start for start, stop, _ in blocks][:-1] == [rows] * (len(blocks) - 1)
    assert torch.equal(torch.cat([block for _, _, block in blocks]), whole.float())


def test_int8_and_small_weights_come_whole():
    torch.manual_seed(0)
    int8 = quant.quantize_linear(nn.Linear(64, 32), "int8")
    small = quant.quantize_linear(nn.Linear(64, 32), "nf4")
    assert bnb_rows.rows_per_block(int8) is None and bnb_rows.rows_per_block(small) is None
    (start, stop, block), *rest = quant.QuantizedWeight(small, torch.float32).row_blocks()
    assert (start, stop, rest) == (0, 32, []) and block.shape == (32, 64)
