"""The training modes GPU users combine, on this machine: ``torch.compile``, activation checkpointing and 8-bit
optimizer states, for POET-BS and AdamW, in the same run.

Every (preset, method, mode) is one pretraining step of `benchmarks.suites.pretrain_step.measure` in its own processes,
started as a user starts one (glibc's default allocator; the fused steps fix its mmap threshold themselves,
`poet_hf.allocator`), memory and time from the same processes, the median of ``REPEATS``. Each row
gives the mode against the eager float32 step of the same method (time and peak), and POET against AdamW in the
same mode. ``compile s`` is the warm-up step that compiles (Inductor), paid once per run; the peak of a compiled
run includes what compiling took. The shape is the README's tiny preset: Inductor compiles a POET model of the
paper's shapes in several minutes per process on a 2-core CPU.

- compiled: ``torch.compile(model)``, Inductor; the adapter layers add no graph break (tests/test_compile.py).
- checkpointing: non-reentrant activation checkpointing of every block (the gradients are those of the plain step,
  tests/test_low_precision.py).
- 8-bit states: bitsandbytes' ``AdamW8bit`` (``--optim adamw_bnb_8bit``) with POET's two rates; tensors of fewer
  than 4096 entries (most skew vectors) keep 32-bit states, bitsandbytes' default.
- fused step: every parameter steps in the backward and frees its gradient (``--fused_optimizer_step``).
"""

from __future__ import annotations

import statistics

from benchmarks.common import readme_job_rows
from benchmarks.suites.pretrain_step import SEQ, _child

MODES = {
    "eager": {},
    "compiled": {"compiled": True},
    "checkpointing": {"checkpointing": True},
    "8-bit states": {"optim": "adamw_8bit"},
    "fused step": {"fused_step": True},
    "checkpointing + fused step": {"checkpointing": True, "fused_step": True},
}
METHODS = ("adamw", "poet-bs")
UNCOMPILED = ("eager", "checkpointing", "fused step", "checkpointing + fused step")
# (preset, micro-batch of 256-token sequences, optimizer steps timed, modes): every mode on the tiny preset, and the
# ones that need no compilation at the paper's llama-60m.
CONFIGS = [("tiny", 4, 5, tuple(MODES)), ("llama-60m", 4, 3, UNCOMPILED)]
QUICK_CONFIGS = [("tiny", 4, 2, tuple(MODES))]
REPEATS = 3
SETTINGS = {"allocator": "glibc default, as a user runs it", "repeats": f"median of {REPEATS}"}


def _median_run(method: str, preset: str, batch: int, steps: int, repeats: int, options: dict) -> dict:
    runs = [_child(method, preset, batch, steps, **options) for _ in range(repeats)]
    return {key: statistics.median(run[key] for run in runs) for key in ("peak_mb", "states_mb", "step_s", "compile_s")}


def quality_rows(quick: bool = False) -> list[dict]:
    """The README's main job with 32-bit and with bitsandbytes' 8-bit Adam states (``--optim adamw_bnb_8bit``, POET's
    two rates and the reset at merges): validation perplexity at the same steps."""
    variants = {"adamw_torch": ["--optim", "adamw_torch"], "adamw_bnb_8bit": ["--optim", "adamw_bnb_8bit"]}
    return [{"table": "quality", **row} for row in readme_job_rows("optim", variants, quick)]


def run(quick: bool = False, repeats: int = REPEATS) -> list[dict]:
    return step_rows(quick, repeats) + quality_rows(quick)


def step_rows(quick: bool = False, repeats: int = REPEATS) -> list[dict]:
    """One row per (preset, method, mode): time and peak against the eager step and against AdamW."""
    rows = []
    for preset, batch, steps, modes in QUICK_CONFIGS if quick else CONFIGS:
        results = {
            (method, mode): _median_run(method, preset, batch, steps, 1 if quick else repeats, MODES[mode])
            for method in METHODS
            for mode in modes
        }
        for method in METHODS:
            eager = results[(method, "eager")]
            for mode in modes:
                result, adamw = results[(method, mode)], results[("adamw", mode)]
                rows.append(
                    {
                        "table": "step",
                        "preset": preset,
                        "batch": f"{batch}x{SEQ}",
                        "method": method,
                        "mode": mode,
                        "step s": result["step_s"],
                        "peak MB": result["peak_mb"],
                        "states MB": result["states_mb"],
                        "compile s": result["compile_s"],
                        "time vs eager": result["step_s"] / eager["step_s"],
                        "memory vs eager": result["peak_mb"] / eager["peak_mb"],
                        "time vs AdamW": result["step_s"] / adamw["step_s"],
                        "memory vs AdamW": result["peak_mb"] / adamw["peak_mb"],
                    }
                )
    return rows
