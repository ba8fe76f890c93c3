"""Bound the C allocator's slack where the memory savings run: glibc's mmap threshold, fixed.

glibc serves a block above its mmap threshold with its own ``mmap`` and returns it to the system when freed. The
threshold starts at 128 KiB and rises to the size of the largest such block freed (up to 32 MiB on 64-bit), after
which freed blocks of that size stay in the heap, in the resident set, and are reused only by blocks that fit. A
training step that frees and allocates tensors of many sizes (one layer's dequantized ``W0``, one gradient, one
8-bit update chunk) then keeps hundreds of MB of free heap resident: 1.2 GB at a 7B shape. Fixing the threshold
(``mallopt(M_MMAP_THRESHOLD, 128 KiB)``, what ``MALLOC_MMAP_THRESHOLD_=131072`` does from the environment) returns
every large block to the system when it is freed, so the resident set follows the live tensors, at the cost of a
page fault per fresh page of every large block.

The cost is real where a step allocates many large temporaries: a POET step of llama-60m on this project's 2-core
CPU takes about 1.5× as long with the threshold fixed (and holds about 15 % less). So only the paths a user takes to
save memory call `bound_allocator_slack`: `FusedStepOptimizer`, and `materialize_model` where it quantises a ``W0``
built on ``meta`` (``base_quantization``); a plain run keeps glibc's own setting. It does nothing where the C library
is not glibc, where ``MALLOC_MMAP_THRESHOLD_`` is set (the user's choice wins) or where ``POET_HF_ALLOCATOR=default``
asks to leave the allocator alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import platform

logger = logging.getLogger(__name__)

# glibc's malloc.h: the mallopt parameter of the mmap threshold, and its initial (and our fixed) value.
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 128 * 1024
OPT_OUT_VARIABLE = "POET_HF_ALLOCATOR"


@functools.cache  # one process-wide setting of the C library, made once
def bound_allocator_slack() -> bool:
    """Fix glibc's mmap threshold at 128 KiB for this process, once (the module docstring says why).

    Returns:
        Whether the threshold is fixed now (by this call or an earlier one); ``False`` where the C library is not
        glibc, ``MALLOC_MMAP_THRESHOLD_`` is set, or ``POET_HF_ALLOCATOR=default``.
    """
    if os.environ.get(OPT_OUT_VARIABLE) == "default" or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    bounded = bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    if bounded:
        logger.info(
            "glibc's mmap threshold fixed at %d bytes, so that freed tensors leave the resident set "
            "(%s=default keeps the allocator's own)",
            MMAP_THRESHOLD_BYTES,
            OPT_OUT_VARIABLE,
        )
    return bounded
