"""Quiet the warnings of optional third-party packages that no POET user has to act on.

Importing PEFT imports transformers' quantizer registry, which imports torchao and bitsandbytes where they are
installed (the ``[torchao]`` and ``[quant]`` extras). On a machine their optional kernels do not suit, both log at
import, before any user code runs: torchao that its CUDA extensions did not load and, through torch, that it
registers enums with ``torch.compile``'s pytree the deprecated way; bitsandbytes that it could not fetch a CPU kernel
from the Hub. None of it concerns a POET run or is the user's to act on. Those loggers are held at ``ERROR`` for the
import only and restored after it, so the same messages show again wherever the user imports these packages first,
and nothing later is hidden.

Building a ``transformers.Trainer`` has Accelerate import DeepSpeed where it is installed (the ``[deepspeed]``
extra), and DeepSpeed's import warns, on a machine without CUDA, that it sets its accelerator to the CPU, whether or
not the run uses DeepSpeed. `quiet_deepspeed_probe` drops that one record while a trainer is built.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

IMPORT_TIME_LOGGERS = ("torchao", "torch.utils._pytree", "bitsandbytes.backends.cpu.ops")
DEEPSPEED_PROBE = ("DeepSpeed", "Setting accelerator to CPU.")  # (logger, the record's first words)


@contextlib.contextmanager
def quiet_optional_kernels() -> Iterator[None]:
    """Hold `IMPORT_TIME_LOGGERS` at ``ERROR`` inside the block, then restore each logger's own level."""
    loggers = [logging.getLogger(name) for name in IMPORT_TIME_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def _not_the_probe(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith(DEEPSPEED_PROBE[1])


@contextlib.contextmanager
def quiet_deepspeed_probe() -> Iterator[None]:
    """Drop DeepSpeed's "Setting accelerator to CPU" record inside the block; every other record passes.

    DeepSpeed sets its logger's level when it is first imported, so the record is filtered, not the level held."""
    logger = logging.getLogger(DEEPSPEED_PROBE[0])
    logger.addFilter(_not_the_probe)
    try:
        yield
    finally:
        logger.removeFilter(_not_the_probe)
