"""Timing helpers shared by the benchmark suites."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils import benchmark

# glibc's mmap threshold grows to the largest block freed (up to 32 MB), after which freed blocks stay in its heap and
# in the resident set: peak RSS then carries several hundred MB of slack that moves with allocation order, not with
# tensors. Memory is therefore measured with the threshold fixed (every method alike); time under the default.
FIXED_MMAP = {"MALLOC_MMAP_THRESHOLD_": "131072"}


def time_call(fn: Callable[[], object], min_run_time: float = 1.0) -> float:
    """Median seconds per call of ``fn`` (``torch.utils.benchmark``, which synchronises CUDA)."""
    fn()  # warm-up
    return benchmark.Timer(stmt="fn()", globals={"fn": fn}).blocked_autorange(min_run_time=min_run_time).median


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def optimizer_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, loss_of: Callable[[], torch.Tensor], accumulation: int = 1
) -> dict:
    """One optimizer step over ``accumulation`` micro-batches, the way a plain loop accumulates with poet_hf: every
    micro-batch but the last under :func:`poet_hf.defer_rotation_grads` (a no-op for models without rotations).
    Returns ``{"cache_mb": the rotation caches' size after the first micro-batch}``."""
    import contextlib

    from poet_hf import defer_rotation_grads
    from poet_hf.tuners.rotation_layer import rotation_layers

    cache_mb = 0.0
    for i in range(accumulation):
        with defer_rotation_grads() if i < accumulation - 1 else contextlib.nullcontext():
            (loss_of() / accumulation).backward()
        if i == 0:
            cache_mb = sum(layer.rotation_cache_bytes() for _, layer in rotation_layers(model)) / 2**20
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {"cache_mb": cache_mb}
