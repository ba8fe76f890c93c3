"""Where the time of the everything-on POET step goes, part by part, against AdamW's step with checkpointing.

The step of `benchmarks.suites.memory_peers`' "POET-BS, everything on" row (llama-130m, 4 × 256, float32, nf4
``W0`` with error feedback, bitsandbytes' 8-bit AdamW states, steps fused into the backward, activation checkpointing
per block) and AdamW's with the same checkpointing, each in its own process: one warm-up step, then one step under
``torch.profiler``, its operators' own CPU time summed by part (`PARTS`, first match wins). Recomputation is not an
operator: the checkpointed forward's products and element-wise work count in their parts, so the row "forward
recomputed" is the difference of one plain POET-BS step with and without checkpointing, timed the same way.
"""

from __future__ import annotations

from typing import Any

import torch

from benchmarks.common import measure_as_a_user

PRESET, BATCH = "llama-130m", 4
PARTS = (  # (part, substrings of the operator's name)
    ("optimizer steps", ("optimizer_update", "adam", "Optimizer.step")),
    ("dequantizing W0", ("dequantize", "quantize")),
    ("matrix products", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::linear", "aten::matmul")),
    ("gathers and copies", ("index_select", "gather", "copy_", "index_copy", "aten::cat", "clone", "contiguous")),
    ("attention", ("attention", "softmax")),
)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "AdamW, checkpointing": ("adamw", {"checkpointing": True}),
    "POET-BS, everything on": (
        "poet-bs",
        {"quantization": "nf4", "optim": "adamw_8bit", "fused_step": True, "checkpointing": True},
    ),
}
SETTINGS = {"profile": "torch.profiler, operators' own CPU time, one step after a warm-up, each in its own process"}


def part_of(name: str) -> str:
    """The part an operator's time counts in."""
    for part, keys in PARTS:
        if any(key in name for key in keys):
            return part
    return "element-wise and the rest"


def measure(method: str, **options: Any) -> dict[str, float]:
    """In the child process: ``benchmarks.suites.pretrain_step.measure`` with its timed step profiled; seconds per
    part."""
    from benchmarks.suites import pretrain_step

    parts: dict[str, float] = {}
    timed = pretrain_step.timed_seconds

    def profiled(step, device) -> float:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            seconds = timed(step, device)
        for event in profile.key_averages():
            parts[part_of(event.key)] = parts.get(part_of(event.key), 0.0) + event.self_cpu_time_total / 1e6
        return seconds

    pretrain_step.timed_seconds = profiled  # this child's own copy of the module: nothing else sees it
    result = pretrain_step.measure(method, PRESET, BATCH, 1, **options)
    return {"step_s": result["step_s"], **parts}


def run(quick: bool = False) -> list[dict]:
    """One row per part and variant, and the recomputation's cost from two plain POET-BS steps."""
    rows = []
    for variant, (method, options) in VARIANTS.items():
        result = measure_as_a_user("step_profile", method=method, **options)
        step = result.pop("step_s")
        total = sum(result.values())
        rows += [
            {"variant": variant, "part": part, "seconds": seconds, "share": seconds / total, "step_s": step}
            for part, seconds in sorted(result.items(), key=lambda item: -item[1])
        ]
    plain = {"method": "poet-bs", "preset_name": PRESET, "batch": BATCH, "steps": 2}  # the median of 2 steps
    with_checkpointing = measure_as_a_user("pretrain_step", **plain, checkpointing=True)
    without = measure_as_a_user("pretrain_step", **plain)
    rows.append(
        {
            "variant": "POET-BS, plain",
            "part": "forward recomputed (checkpointing on minus off)",
            "seconds": with_checkpointing["step_s"] - without["step_s"],
            "share": (with_checkpointing["step_s"] - without["step_s"]) / with_checkpointing["step_s"],
            "step_s": with_checkpointing["step_s"],
        }
    )
    return rows
