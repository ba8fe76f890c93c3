"""One reading of a dtype's name for every option that takes one: ``bf16``/``bfloat16``, ``fp16``/``float16``,
``fp32``/``float32`` (and ``half``, ``float``, a ``torch.`` prefix) name the same dtype everywhere."""

from __future__ import annotations

import torch

DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
}
SPELLINGS = "bf16/bfloat16, fp16/float16, fp32/float32"
NAMES = ("float32", "bfloat16", "float16")  # what `dtype_name` returns: an option's ``choices`` after its ``type``


def parse_dtype(dtype: str | torch.dtype, field: str = "dtype") -> torch.dtype:
    """The floating ``torch.dtype`` that ``dtype`` names (a name of `DTYPES`, with or without ``torch.``, or a dtype).

    Args:
        dtype: the name, or a floating ``torch.dtype``.
        field: the option's name, for the error.

    Returns:
        The ``torch.dtype``.

    Raises:
        ValueError: ``dtype`` names none of `DTYPES`.
    """
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype
    name = dtype.lower().removeprefix("torch.") if isinstance(dtype, str) else None
    if name not in DTYPES:
        raise ValueError(f"`{field}` must be one of {SPELLINGS} (or a floating torch.dtype), got {dtype!r}")
    return DTYPES[name]


def dtype_name(dtype: str | torch.dtype, field: str = "dtype") -> str:
    """``dtype``'s torch name (``"bfloat16"``, ``"float16"``, ``"float32"``): what an option stores, whatever the
    spelling given (an ``argparse`` ``type``); ``field`` names the option in the error (`parse_dtype`)."""
    return str(parse_dtype(dtype, field)).removeprefix("torch.")
