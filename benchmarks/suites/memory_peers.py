"""POET with every memory saving on, against the low-memory pretraining optimizers, one llama step each.

llama-130m and llama-350m (the paper's shapes, vocabulary 32000), 4 × 256 tokens, float32, activation checkpointing
per block for every method, each method in its own process (`benchmarks.suites.pretrain_step.measure`), the peak of the
training steps alone (peak RSS minus the RSS after imports, the high-water mark reset once the model is built;
glibc's mmap threshold fixed, `benchmarks.common.FIXED_MMAP`):

- ``AdamW``: torch's AdamW on every parameter;
- ``AdamW 8-bit``: bitsandbytes' AdamW8bit on every parameter;
- ``GaLore 8-bit, layer-wise``: galore-torch's GaLoreAdamW8bit on the attention and MLP weights (rank 256, the GaLore
  paper's for these sizes, projection updated every 200 steps, scale 0.25), AdamW8bit on the rest, each parameter
  stepping in the backward as transformers' ``galore_adamw_8bit_layerwise`` does (on a CPU its step's
  ``torch.cuda.synchronize()`` is made a no-op);
- ``APOLLO-Mini, layer-wise``: apollo-torch's APOLLOAdamW with the paper's Mini settings (rank 1, random
  projection, tensor-wise scaling, scale 128) on the same weights, AdamW on the rest, layer-wise;
- ``POET-BS, everything on``: block size 256, nf4 ``W0`` with error feedback (its residual off the steps' memory),
  8-bit states, steps fused into the backward.

Each row carries its ratio to AdamW's peak and `poet_hf.plan_memory`'s figure for POET.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Any

import torch

from benchmarks.common import FIXED_MMAP, PLAN_EVERYTHING_ON
from benchmarks.suites.pretrain_step import _child

CONFIGS = [("llama-130m", 4), ("llama-350m", 4)]
QUICK_CONFIGS = [("tiny", 4)]
METHODS: dict[str, tuple[str, dict[str, Any]]] = {
    "AdamW": ("adamw", {}),
    "AdamW 8-bit": ("adamw", {"optim": "adamw_8bit"}),
    "GaLore 8-bit, layer-wise": ("adamw", {"optim": "galore_8bit_layerwise"}),
    "APOLLO-Mini, layer-wise": ("adamw", {"optim": "apollo_mini_layerwise"}),
    "POET-BS, everything on": ("poet-bs", {"quantization": "nf4", "optim": "adamw_8bit", "fused_step": True}),
}


def _planned_mb(preset: str, batch: int) -> float:
    from poet_hf import plan_memory
    from poet_hf.recipes.presets import PRESETS

    plan = plan_memory(
        preset,
        "poet-bs",
        block_size=PRESETS[preset].block_size,
        batch_size=batch,
        seq_len=256,
        **PLAN_EVERYTHING_ON,
    )
    return plan.total_bytes / 2**20


def run(quick: bool = False, repeats: int = 3, steps: int = 1) -> list[dict]:
    """One row per (shape, method): the steps' peak (median of ``repeats`` processes), its ratio to AdamW's, the
    step time in the same process (with the fixed mmap threshold, so slower than the default allocator's); then the
    8-bit state implementations' step on the largest 7B tensor (`state_step_rows`). The quality of the savings is
    `benchmarks.suites.savings_quality`'s."""
    rows = [] if quick else state_step_rows()
    for preset, batch in QUICK_CONFIGS if quick else CONFIGS:
        measured = {}
        for name, (method, options) in METHODS.items():
            runs = [
                _child(
                    method,
                    preset,
                    batch,
                    steps,
                    env=FIXED_MMAP,
                    checkpointing=True,
                    peak_after_build=True,
                    **options,
                )
                for _ in range(1 if quick else repeats)
            ]
            measured[name] = {key: statistics.median(r[key] for r in runs) for key in ("peak_mb", "step_s")}
        adamw = measured["AdamW"]["peak_mb"]
        for name, result in measured.items():
            rows.append(
                {
                    "preset": preset,
                    "batch": f"{batch}x256",
                    "method": name,
                    "peak MB": result["peak_mb"],
                    "peak / AdamW": result["peak_mb"] / adamw,
                    "step s": result["step_s"],
                    "planned MB": _planned_mb(preset, batch) if name.startswith("POET") else None,
                }
            )
    return rows


STATE_SHAPE = (32000, 4096)  # Llama-2-7B's embedding: the largest tensor a 7B run steps
STATE_VARIANTS = ("bitsandbytes, whole tensor", "bitsandbytes, chunked", "torchao")


def state_step(variant: str, repeats: int = 3) -> dict[str, float]:
    """In the child process: one 8-bit AdamW step of a `STATE_SHAPE` float32 parameter (after a first step that
    allocates the states): median seconds, and the step's transient memory (high-water mark above the RSS before
    it)."""
    from benchmarks.common import reset_peak_rss, status_mb

    generator = torch.Generator().manual_seed(0)
    param = torch.nn.Parameter(torch.randn(STATE_SHAPE, generator=generator) * 0.02)
    param.grad = torch.randn(STATE_SHAPE, generator=generator) * 1e-3
    if variant == "torchao":
        from torchao.optim import AdamW8bit

        optimizer: torch.optim.Optimizer = AdamW8bit([param], lr=1e-3)
    else:
        import bitsandbytes

        optimizer = bitsandbytes.optim.AdamW8bit([param], lr=1e-3)
    from poet_hf.training.eight_bit import chunked_cpu_updates

    scope = chunked_cpu_updates if variant == "bitsandbytes, chunked" else contextlib.nullcontext
    with scope():
        optimizer.step()
    times, transient = [], []
    for _ in range(repeats):
        reset_peak_rss()
        before = status_mb("VmRSS")
        start = time.perf_counter()
        with scope():
            optimizer.step()
        times.append(time.perf_counter() - start)
        transient.append(status_mb("VmHWM") - before)
    return {"step_s": statistics.median(times), "transient_mb": statistics.median(transient)}


def state_step_rows() -> list[dict]:
    """One row per 8-bit state implementation (`STATE_VARIANTS`), each in its own process."""
    import json
    import os
    import subprocess
    import sys

    from benchmarks.suites.pretrain_step import ROOT

    rows = []
    for variant in STATE_VARIANTS:
        code = (
            f"import json, sys; sys.path.insert(0, {str(ROOT)!r}); "
            "from benchmarks.suites.memory_peers import state_step; "
            f"print(json.dumps(state_step({variant!r})))"
        )
        env = {**os.environ, **FIXED_MMAP}
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
        result = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append({"table": "8-bit state step", "implementation": variant, **result})
    return rows
