"""Activation-sized buffers that one fused call frees and takes again, so that each is paged in once.

A CPU allocator hands a large block back to the system when it is freed (glibc: every block of 32 MiB and more, a
``2048 × 4096`` float32 activation), and a fresh one costs a page fault for each page when it is first written:
on this project's CPU about 10 ms for 32 MiB, longer than the gather that fills it. The activation strategies chain
gathers and block products whose operands die one after another, so each result can take the memory of one that
died before it: a rotated layer at ``4096 × 4096`` pages in four fresh buffers per pass instead of seven (forward)
and eight (backward). A GPU's caching allocator reuses blocks by itself; there `Scratch` only hands them back to it.
"""

from __future__ import annotations

import math

import torch

__all__ = ["Scratch"]


class Scratch:
    """The buffers of one call: an `Allocate` for `poet_hf.orthogonal.spo`'s products, and `release` for the dead.

    A released buffer is taken by the next request of its size in bytes, else dropped then, so it outlives its
    last use only until the next request (which would have allocated anyway). Only the memory this object handed
    out is reused (it notes the addresses, not the tensors, which free as usual): a released tensor that was there
    before the call (its input, a saved tensor) is left alone.
    """

    def __init__(self) -> None:
        # Compiled, the graph plans its own memory, and addresses are not there to read.
        self.active = not torch.compiler.is_compiling()
        self._made: set[tuple[int, int]] = set()  # (address, bytes) of every buffer handed out
        self._dead: list[torch.Tensor] = []  # flat byte views of released buffers, until the next request

    @property
    def allocate(self) -> Scratch | None:
        """This object as the ``empty`` of `poet_hf.orthogonal.spo`'s products, or ``None`` under compilation."""
        return self if self.active else None

    def __call__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialised ``shape`` tensor: a released buffer of the same size, or a fresh one."""
        nbytes = math.prod(shape) * dtype.itemsize
        reused = next((buffer for buffer in self._dead if buffer.numel() == nbytes and buffer.device == device), None)
        self._dead = []  # the rest are freed before anything is allocated
        if reused is None:
            reused = torch.empty(nbytes, dtype=torch.uint8, device=device)
            if reused.device.type != "meta":
                self._made.add((reused.data_ptr(), nbytes))
        return reused.view(dtype).view(shape)

    def release(self, dead: torch.Tensor | None, result: torch.Tensor | None = None) -> None:
        """Offer ``dead``'s memory to the next request, unless ``result`` (what was made from it) shares it.

        Args:
            dead: a tensor the caller no longer reads; ignored unless its memory was handed out here.
            result: the tensor computed from ``dead``, which an identity step (a side without a permutation)
                returns as ``dead`` itself.
        """
        if dead is None or dead.device.type == "meta" or not self.active:
            return
        storage = dead.untyped_storage()
        if (storage.data_ptr(), storage.nbytes()) not in self._made:
            return
        if result is not None and result.untyped_storage().data_ptr() == storage.data_ptr():
            return
        if all(buffer.data_ptr() != storage.data_ptr() for buffer in self._dead):
            self._dead.append(torch.empty(0, dtype=torch.uint8, device=dead.device).set_(storage))
