"""Rounding bounds for the tests' tolerances, from the standard error analysis (Higham, *Accuracy and Stability of
Numerical Algorithms*, ch. 3): they hold whatever kernel, summation order or thread count a machine uses."""

from __future__ import annotations

import torch


def unit_roundoff(dtype: torch.dtype) -> float:
    """``u``: half the distance from 1 to the next representable number."""
    return torch.finfo(dtype).eps / 2


def gamma(n: int, dtype: torch.dtype) -> float:
    """``γ_n = n·u / (1 − n·u)``: a sum or dot product of ``n`` terms, in any order, is off by at most ``γ_n`` times
    the sum of the terms' magnitudes."""
    u = unit_roundoff(dtype)
    return n * u / (1 - n * u)


# The tests' tiny 2-block models (tests/helpers/models.py: hidden ≤ 64, MLP ≤ 256, vocabulary 128, ≤ 24 tokens) sum
# fewer than 2048 terms along any path of a forward (per block: attention projections 64 each, scores and values ≤ 24,
# the MLP's two products ≤ 64 + 256; then lm_head 64 and the softmax's 128), a backward as many again, and a weight
# gradient sums its tokens.
FORWARD_TERMS = 2048
STEP_TERMS = 2 * FORWARD_TERMS + 64


def tiny_model_tolerance(dtype: torch.dtype, backward: bool = False) -> float:
    """Relative gap allowed, to first order, between two evaluations of a tiny test model that differ only in how
    they associate the same products: each is within ``γ_N`` of exact, ``N`` the longest chain of sums."""
    return 2 * gamma(STEP_TERMS if backward else FORWARD_TERMS, dtype)
