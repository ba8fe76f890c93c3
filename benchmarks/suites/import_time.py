"""Wall time of ``import poet_hf`` against ``import peft`` (the baseline), each in a fresh interpreter.

``import poet_hf`` registers the tuners with PEFT and defines the config classes; everything else loads on first
use. Its floor is therefore ``import peft`` itself plus the tuner modules, a ratio a little above 1. Interpreters
alternate between the two imports so that drift on a shared machine hits both alike; the median of the repeats
is reported.
"""

from __future__ import annotations

import statistics
import subprocess
import sys

MODULES = ("peft", "poet_hf")
_TIMER = "import time; t = time.perf_counter(); import {module}; print(time.perf_counter() - t)"


def import_seconds(module: str) -> float:
    """Seconds to import ``module`` in a new interpreter (the interpreter's own start-up excluded)."""
    out = subprocess.run(
        [sys.executable, "-c", _TIMER.format(module=module)], capture_output=True, text=True, check=True
    )
    return float(out.stdout.strip().splitlines()[-1])


def run(quick: bool = False) -> list[dict]:
    repeats = 2 if quick else 7
    times: dict[str, list[float]] = {module: [] for module in MODULES}
    for _ in range(repeats):
        for module in MODULES:
            times[module].append(import_seconds(module))
    peft_s, poet_s = (statistics.median(times[module]) for module in MODULES)
    return [{"repeats": repeats, "peft_s": peft_s, "poet_hf_s": poet_s, "poet_hf/peft": poet_s / peft_s}]
