"""Timing helpers shared by the benchmark suites."""

from __future__ import annotations

from typing import Callable

import torch
from torch.utils import benchmark


def time_call(fn: Callable[[], object], min_run_time: float = 1.0) -> float:
    """Median seconds per call of ``fn`` (``torch.utils.benchmark``, which synchronises CUDA)."""
    fn()  # warm-up
    return benchmark.Timer(stmt="fn()", globals={"fn": fn}).blocked_autorange(min_run_time=min_run_time).median


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
