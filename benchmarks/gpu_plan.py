"""The GPU check: what a lent CUDA machine runs, in one go and well under 8 minutes.

1. The CUDA tests: the fused layers against the float64 CPU reference and a bf16 training step on the GPU
   (tests/test_devices.py), and Accelerate's FSDP2 run of ``scripts/pretrain.py`` (tests/test_fsdp.py), which skips
   without an accelerator.
2. ``pretrain_step`` on the paper's llama-130m at 16 × 256 and ``finetune_step`` at SmolLM-135M's shape, 8 × 128,
   in bf16 autocast: each method in its own process, ``torch.cuda.max_memory_allocated`` and CUDA-event timing,
   ratios against AdamW (pretraining) and OFT (fine-tuning, beside LoRA) in the same run.
3. ``poet_layer``'s 7B-class rows: one POET-BS 256 layer at 4096 × 4096 and 4096 × 14336, 2048 tokens, forward and
   backward under bfloat16 autocast against a trainable ``nn.Linear`` under the same autocast (the figure POET-X
   gives for its bfloat16 kernels at 4096 × 4096: 1.24× on an H100).

It writes ``gpu_check.json`` (the device, each step's outcome and seconds, the suites' rows) and ``gpu_check.md`` (a
short summary with the tables) into ``--out``. ``--dry_run`` prints the plan and runs nothing, on any machine.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CUDA_TESTS = (
    "tests/test_devices.py",
    "tests/test_fsdp.py::test_accelerate_fsdp2_config_trains_pretrain_script_with_merges",
)
PRETRAIN_CONFIGS = [("llama-130m", 16, 5, 1)]  # (preset, micro-batch, timed steps, accumulation)
BUDGET_S = 8 * 60


@dataclass
class CheckStep:
    """One step of the check: a name, and a pytest command line or a benchmark suite call."""

    name: str
    command: list[str] = field(default_factory=list)
    suite: str | None = None
    options: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        if self.command:
            return " ".join(self.command)
        return f"benchmarks.{self.suite}.run(**{self.options!r})"


def plan() -> list[CheckStep]:
    """The steps, in order."""
    return [
        CheckStep("cuda tests", [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "0", *CUDA_TESTS]),
        CheckStep("pretrain step", suite="pretrain_step", options={"configs": PRETRAIN_CONFIGS}),
        CheckStep("fine-tune step", suite="finetune_step", options={"repeats": 1}),
        CheckStep("wide layer", suite="poet_layer", options={"wide_only": True, "autocast": "bfloat16"}),
    ]


def device_name() -> str:
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device"
    props = torch.cuda.get_device_properties(0)
    return f"{props.name} ({props.total_memory / 2**30:.0f} GiB), torch {torch.__version__}, CUDA {torch.version.cuda}"


def run_step(step: CheckStep) -> dict[str, Any]:
    """Run one step; its outcome, seconds and rows (a suite) or output tail (tests)."""
    import importlib

    start = time.perf_counter()
    if step.command:
        done = subprocess.run(step.command, cwd=ROOT, capture_output=True, text=True)
        result: dict[str, Any] = {"ok": done.returncode == 0, "output": (done.stdout + done.stderr)[-4000:]}
    else:
        rows = importlib.import_module(f"benchmarks.suites.{step.suite}").run(**step.options)
        result = {"ok": True, "rows": rows}
    return {"name": step.name, "seconds": time.perf_counter() - start, **result}


def summary(device: str, results: list[dict[str, Any]]) -> str:
    """The Markdown summary: the device, each step's outcome, then the suites' tables."""
    from benchmarks.common import to_markdown

    lines = [f"# GPU check on {device}", ""]
    lines += [f"- {r['name']}: {'ok' if r['ok'] else 'FAILED'} in {r['seconds']:.0f} s" for r in results]
    for result in results:
        if result.get("rows"):
            lines += ["", f"## {result['name']}", "", to_markdown(result["rows"])]
    return "\n".join(lines) + "\n"


def check(out: Path, dry_run: bool = False) -> list[dict[str, Any]]:
    """Run (or, with ``dry_run``, print) the plan; write ``gpu_check.json`` and ``gpu_check.md`` into ``out``.

    Raises:
        RuntimeError: not ``dry_run`` and no CUDA device.
    """
    steps = plan()
    if dry_run:
        for step in steps:
            print(f"{step.name}: {step.describe()}")
        return []
    device = device_name()
    if device == "no CUDA device":
        raise RuntimeError("the GPU check needs a CUDA device; --dry_run prints what it would run")
    results, began = [], time.perf_counter()
    for step in steps:
        if time.perf_counter() - began > BUDGET_S:
            results.append({"name": step.name, "ok": False, "seconds": 0.0, "output": "skipped: over the budget"})
            continue
        results.append(run_step(step))
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps({"device": device, "results": results}, indent=2, default=str))
    (out / "gpu_check.md").write_text(summary(device, results))
    return results
