"""Timing helpers shared by the benchmark suites."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils import benchmark

# glibc's mmap threshold grows to the largest block freed (up to 32 MB), after which freed blocks stay in its heap and
# in the resident set: peak RSS then carries several hundred MB of slack that moves with allocation order, not with
# tensors. Memory is therefore measured with the threshold fixed (every method alike); time under the default.
FIXED_MMAP = {"MALLOC_MMAP_THRESHOLD_": "131072"}

# plan_memory's settings for POET with every memory saving on (nf4 W0, fused steps, 8-bit states, checkpointing).
PLAN_EVERYTHING_ON = {"checkpointing": True, "base_quantization": "nf4", "fused_step": True, "optimizer_bits": 8}


def status_mb(field: str) -> float:
    """A memory figure of this process from ``/proc/self/status`` (``VmRSS``: now, ``VmHWM``: its peak), in MB."""
    with open("/proc/self/status") as handle:
        line = next(line for line in handle if line.startswith(field))
    return int(line.split()[1]) / 1024


def reset_peak_rss() -> None:
    """Restart this process's peak RSS (``VmHWM``) at its present RSS (Linux's ``clear_refs``), so that the next
    peak is a phase's own."""
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")


def time_call(fn: Callable[[], object], min_run_time: float = 1.0, num_threads: int = 1) -> float:
    """Median seconds per call of ``fn`` (``torch.utils.benchmark``, which synchronises CUDA), on ``num_threads``
    threads (``torch.utils.benchmark``'s default, 1; ``torch.get_num_threads()`` times it as a user's run)."""
    return time_alternating({"fn": fn}, min_run_time, num_threads, rounds=1)["fn"]


def time_alternating(
    fns: dict[str, Callable[[], object]], min_run_time: float = 1.0, num_threads: int = 1, rounds: int = 5
) -> dict[str, float]:
    """Median seconds per call of each of ``fns``, timed in turn for ``rounds`` rounds of ``min_run_time / rounds``
    each (``torch.utils.benchmark``'s timer), so that a slow spell of a shared machine falls on every one alike; the
    median of a function's rounds is its time."""
    for fn in fns.values():
        fn()  # warm-up
    timers = {
        name: benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=num_threads) for name, fn in fns.items()
    }
    medians: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, timer in timers.items():
            medians[name].append(timer.blocked_autorange(min_run_time=min_run_time / rounds).median)
    return {name: statistics.median(times) for name, times in medians.items()}


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def optimizer_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, loss_of: Callable[[], torch.Tensor], accumulation: int = 1
) -> dict:
    """One optimizer step over ``accumulation`` micro-batches, the way a plain loop accumulates with poet_hf: every
    micro-batch but the last under :func:`poet_hf.defer_rotation_grads` (a no-op for models without rotations).
    Returns ``{"cache_mb": the rotation caches' size after the first micro-batch}``."""
    import contextlib

    from poet_hf import defer_rotation_grads
    from poet_hf.tuners.rotation.layer import rotation_layers

    cache_mb = 0.0
    for i in range(accumulation):
        with defer_rotation_grads() if i < accumulation - 1 else contextlib.nullcontext():
            (loss_of() / accumulation).backward()
        if i == 0:
            cache_mb = sum(layer.rotation_cache_bytes() for _, layer in rotation_layers(model)) / 2**20
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {"cache_mb": cache_mb}


def timed_seconds(step: Callable[[], object], device: torch.device) -> float:
    """Seconds one call of ``step`` takes: CUDA events around it on a GPU (the kernels' time, synchronised once),
    the wall clock on a CPU."""
    import time

    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1000
    began = time.perf_counter()
    step()
    return time.perf_counter() - began


def to_markdown(rows: list[dict]) -> str:
    """A Markdown table of benchmark rows (the union of their keys as columns; floats to 3 significant digits)."""
    if not rows:
        return "(no rows)"
    columns = list(dict.fromkeys(key for row in rows for key in row))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = [f"{row.get(c):.3g}" if isinstance(row.get(c), float) else str(row.get(c, "")) for c in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def readme_job_results(extra_args: list[str], quick: bool = False) -> dict:
    """``results.json`` of the README's main job (``scripts/pretrain.py``: tiny preset, embedded corpus, 200 steps,
    4 merges; 20 steps and a merge every 5 when ``quick``) run with ``extra_args``, in its own process."""
    import tempfile

    root = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory() as out:
        extra = [*extra_args, *(["--max_steps", "20", "--merge_every", "5"] if quick else [])]
        subprocess.run(
            [sys.executable, str(root / "scripts" / "pretrain.py"), "--output_dir", out, *extra],
            check=True,
            capture_output=True,
        )
        return json.loads((Path(out) / "results.json").read_text())


def readme_job_rows(column: str, variants: dict[str, list[str]], quick: bool = False) -> list[dict]:
    """The README's main job once per variant (``{name: extra flags}``, the first the reference): a row each with
    ``column`` = the name, the steps, the merges, the validation perplexity and its ratio to the first's, less 1."""
    rows, reference = [], None
    for name, extra_args in variants.items():
        results = readme_job_results(extra_args, quick)
        perplexity = results["val_perplexity"]
        reference = reference or perplexity
        rows.append(
            {
                column: name,
                "steps": results["steps"],
                "merges": results["merges"],
                "val perplexity": perplexity,
                f"vs {next(iter(variants))}": perplexity / reference - 1,
            }
        )
    return rows


def measure_as_a_user(suite: str, **options: Any) -> dict[str, Any]:
    """``benchmarks.suites.<suite>.measure(**options)`` in a fresh process started as a user starts one: no allocator
    variable in its environment (the package sets what it sets). Its JSON result."""
    root = Path(__file__).resolve().parent.parent
    code = (
        f"import json, sys; sys.path.insert(0, {str(root)!r}); from benchmarks.suites.{suite} import measure; "
        f"print(json.dumps(measure(**{options!r})))"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("MALLOC_MMAP_THRESHOLD_", "POET_HF_ALLOCATOR")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])
