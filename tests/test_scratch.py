"""`Scratch`: the buffers one fused pass frees and takes again, and only its own."""

import torch

from poet_hf.orthogonal import CayleyNeumann
from poet_hf.orthogonal.rotated_linear import RotatedPass, SideRotation
from poet_hf.orthogonal.scratch import Scratch
from poet_hf.orthogonal.spo import SideSpec

CPU = torch.device("cpu")


def test_a_released_buffer_is_taken_by_the_next_request_of_its_size_in_any_shape_and_dtype():
    scratch = Scratch()
    first = scratch((4, 8), torch.float32, CPU)
    scratch.release(first)
    again = scratch((16, 4), torch.float16, CPU)  # 128 bytes, as the first
    assert again.data_ptr() == first.data_ptr() and again.shape == (16, 4) and again.dtype == torch.float16


def test_a_tensor_it_did_not_make_or_that_its_result_shares_is_never_handed_out():
    scratch = Scratch()
    outside = torch.zeros(32)
    scratch.release(outside)
    assert scratch((32,), torch.float32, CPU).data_ptr() != outside.data_ptr()
    made = scratch((32,), torch.float32, CPU)
    scratch.release(made, made.view(4, 8))  # the result is the released tensor itself: still alive
    assert scratch((32,), torch.float32, CPU).data_ptr() != made.data_ptr()


def test_a_buffer_not_taken_by_the_next_request_is_dropped():
    scratch = Scratch()
    scratch.release(scratch((8,), torch.float32, CPU))
    scratch((3,), torch.float32, CPU)  # another size: the released buffer is let go
    assert scratch._dead == []


def test_a_square_rotated_pass_pages_in_four_fresh_activation_buffers_each_way(monkeypatch):
    """Forward: the gathered input, its rotation, the rotated output and its scatter (the gather of ``x R`` back to
    natural order and of ``h`` to P's coordinates take dead ones); backward: four (of eight)."""
    d, block, tokens = 16, 4, 8
    fresh: list[int] = []
    make = torch.empty

    def counting_empty(*args, **kwargs):
        tensor = make(*args, **kwargs)
        if tensor.dtype == torch.uint8 and tensor.numel() == tokens * d * 4:
            fresh.append(tensor.numel())
        return tensor

    sides = [SideRotation(SideSpec("block", d, block), torch.randperm(d), CayleyNeumann(5)) for _ in range(2)]
    vecs = [torch.randn(d // block, block * (block - 1) // 2).mul_(0.1).requires_grad_() for _ in range(2)]
    x = torch.randn(tokens, d, requires_grad=True)
    monkeypatch.setattr("poet_hf.orthogonal.scratch.torch.empty", counting_empty)
    y = RotatedPass("activation", *sides)(x, torch.randn(d, d), None, *vecs)
    assert len(fresh) == 4
    y.backward(torch.randn_like(y))
    assert len(fresh) == 8
