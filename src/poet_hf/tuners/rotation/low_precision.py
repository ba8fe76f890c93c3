"""Folds into a bfloat16 or float16 ``W0``: nearest, stochastic, or error-feedback rounding.

Every merge writes ``R·W0·P`` back into ``W0``; in a 16-bit dtype that rounds every entry again (bfloat16 keeps 8
significant bits, float16 11). With nearest rounding the errors of successive merges add up, and a rotation step
smaller than half a rounding step of an entry is lost altogether. Error feedback keeps what the rounding dropped,
``r = M − round(M)``, and adds it back at the next fold, so the stored weight stays within one rounding step of the
exact path however many merges there are (the scheme of the quantised bases, `poet_hf.tuners.rotation.quantization`).

The residual of an entry is at most half its rounding step ``ulp(round(M))``, so it is stored as an int8 fraction of
that step, ``round(254·r / ulp)``: one byte per entry, read back within ``ulp / 508``.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from . import residual_store

LOW_PRECISION_DTYPES = (torch.bfloat16, torch.float16)
ROUNDING_RESIDUAL = "poet_rounding_residual"  # int8 buffer on a 16-bit base layer (error feedback)
RESIDUAL_DTYPE = "poet_rounding_dtype"  # attribute: the dtype the weight was rounded to
_RESIDUAL_LEVELS = 254  # codes ±127 for a residual of ±ulp/2


def rounding_step(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of ``dtype``'s numbers at each of ``values``, as float32.

    ``values`` are representable in ``dtype``; the spacing is the distance to the next number away from zero, and the
    subnormal spacing at and near zero."""
    info = torch.finfo(dtype)
    precision = {torch.bfloat16: 8, torch.float16: 11}[dtype]  # significant bits, the implicit one included
    _, exponent = torch.frexp(values.float())
    lowest = int(torch.tensor(info.smallest_normal).log2()) + 1  # frexp's exponent of the smallest normal number
    exponent = torch.where(values == 0, lowest, exponent).clamp_min(lowest)
    return torch.ldexp(torch.ones_like(values, dtype=torch.float32), exponent - precision)


def encode_residual(residual: torch.Tensor, stored: torch.Tensor) -> torch.Tensor:
    """``residual`` (``|r| ≤ ulp(stored)/2``) as int8 codes of its fraction of ``stored``'s rounding step."""
    step = rounding_step(stored, stored.dtype)
    return torch.round(residual.float() / step * _RESIDUAL_LEVELS).clamp(-127, 127).to(torch.int8)


def decode_residual(codes: torch.Tensor, stored: torch.Tensor) -> torch.Tensor:
    """The float32 residual `encode_residual` stored for the 16-bit weight ``stored``."""
    return codes.float() * rounding_step(stored, stored.dtype) / _RESIDUAL_LEVELS


def stochastic_round(matrix: torch.Tensor, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """``matrix`` rounded to one of its two neighbours in ``dtype``, without bias.

    The farther one is taken with probability equal to its distance from the nearer over the step, so
    ``E[round(m)] = m``."""
    nearest = matrix.to(dtype)
    error = matrix.float() - nearest.float()
    step = rounding_step(nearest, dtype)
    draw = torch.rand(matrix.shape, generator=generator, device=matrix.device)
    other = nearest.float() + torch.sign(error) * step
    return torch.where(draw < error.abs() / step, other, nearest.float()).to(dtype)


def residual(module: nn.Module) -> torch.Tensor | None:
    """The rounding residual error feedback keeps on a 16-bit base layer (float32, the weight's shape), or ``None``.

    It is read against the weight in the dtype it was rounded to (`RESIDUAL_DTYPE`), also after the layer was cast
    to float32 (an export folds in float32)."""
    kept = residual_store.read(module, (ROUNDING_RESIDUAL,))
    if kept is None:
        return None
    weight = cast(torch.Tensor, module.weight)
    dtype = getattr(module, RESIDUAL_DTYPE, weight.dtype)
    return decode_residual(kept[ROUNDING_RESIDUAL], weight.detach().to(dtype))


def store(module: nn.Module, matrix: torch.Tensor, mode: str, generator: torch.Generator | None) -> torch.Tensor:
    """``matrix`` (in the weight's layout) rounded to the 16-bit weight dtype of ``module`` by ``mode``.

    ``"nearest"``, ``"stochastic"`` with ``generator``, or ``"feedback"``, which keeps the residual on ``module``.
    Returns the rounded matrix for the caller to write."""
    dtype = cast(torch.Tensor, module.weight).dtype
    if mode == "stochastic":
        if generator is None:
            raise ValueError("requantize='stochastic' needs a seeded generator")
        return stochastic_round(matrix, dtype, generator)
    rounded = matrix.to(dtype)
    if mode == "feedback":
        keep_residual(module, encode_residual(matrix.float() - rounded.float(), rounded))
    return rounded


def keep_residual(module: nn.Module, codes: torch.Tensor) -> None:
    """Keep ``codes`` as ``module``'s rounding residual (`residual_store`).

    They are read against its weight's present dtype."""
    residual_store.keep(module, {ROUNDING_RESIDUAL: codes})
    setattr(module, RESIDUAL_DTYPE, cast(torch.Tensor, module.weight).dtype)


def load_residual(module: nn.Module, state_dict: dict[str, torch.Tensor], prefix: str) -> None:
    """``load_state_dict`` pre-hook part: the rounding residual ``state_dict`` holds for ``module``.

    It goes to the store, or gets a buffer to be loaded into (`residual_store.load_from_state_dict`)."""
    if f"{prefix}{ROUNDING_RESIDUAL}" in state_dict:
        setattr(module, RESIDUAL_DTYPE, cast(torch.Tensor, module.weight).dtype)
        residual_store.load_from_state_dict(module, state_dict, prefix, (ROUNDING_RESIDUAL,))


def expected_residual_bytes(weight: torch.Tensor) -> int:
    """Bytes of the rounding residual error feedback keeps for ``weight``: an int8 code per entry of a 16-bit
    weight, none for any other."""
    return weight.numel() if weight.dtype in LOW_PRECISION_DTYPES else 0


def residual_bytes(module: nn.Module) -> int:
    """Bytes of the rounding residual held on ``module`` itself (0 without one, or when kept off it)."""
    return residual_store.resident_bytes(module, (ROUNDING_RESIDUAL,))


def drop_rounding_residual(module: nn.Module) -> None:
    """Remove the rounding residual from a 16-bit base (when it leaves its adapter)."""
    residual_store.drop(module, (ROUNDING_RESIDUAL,))
    if hasattr(module, RESIDUAL_DTYPE):
        delattr(module, RESIDUAL_DTYPE)
