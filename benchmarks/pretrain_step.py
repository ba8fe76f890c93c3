"""One training step (forward, backward, AdamW) of the llama-60m preset at batch 8 × 256: POET-BS (b=256)
against AdamW, plus the cost of one merge_and_reinit as a fraction of ``merge_every`` steps (issue 3).

Each method runs in a fresh subprocess so that its peak memory (``ru_maxrss`` on CPU, the CUDA allocator's
peak on GPU) is its own.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent

BATCH, SEQ = 8, 256


def measure(method: str, preset_name: str, steps: int) -> dict:
    """Run in the child process: build, then time ``steps`` optimizer steps (after one warm-up step)."""
    from peft import get_peft_model

    import poet_hf  # noqa: F401
    from poet_hf import PoetConfig, merge_and_reinit
    from poet_hf.training.pretrain import PRESETS, build_llama
    from poet_hf.training import poet_param_groups

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    preset = PRESETS[preset_name]
    model = build_llama(preset, "poet-bs" if method == "poet" else "adamw", 32000, SEQ, seed=0)
    if method == "poet":
        model = get_peft_model(model, PoetConfig(block_size=preset.block_size, base_init="normalized"))
    model.to(dev)
    groups = poet_param_groups(model, 1e-3, 1e-3, 0.0, [])
    optimizer = torch.optim.AdamW(groups)
    ids = torch.randint(0, 32000, (BATCH, SEQ), device=dev)

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    result = {"step_s": (time.perf_counter() - start) / steps,
              "optimizer_state_mb": sum(t.numel() * t.element_size() for s in optimizer.state.values()
                                        for t in s.values() if torch.is_tensor(t)) / 2**20}
    if method == "poet":
        start = time.perf_counter()
        merge_and_reinit(model)
        sync()
        result["merge_s"] = time.perf_counter() - start
    result["peak_mb"] = (torch.cuda.max_memory_allocated() / 2**20 if dev.type == "cuda"
                         else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    return result


def run(quick: bool = False) -> list[dict]:
    preset, steps = ("tiny", 3) if quick else ("llama-60m", 3)
    results = {}
    for method in ("adamw", "poet"):
        code = (f"import json, sys; sys.path.insert(0, {str(ROOT)!r}); from benchmarks.pretrain_step import measure; "
                f"print(json.dumps(measure({method!r}, {preset!r}, {steps})))")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
        results[method] = json.loads(out.strip().splitlines()[-1])
    poet, adamw = results["poet"], results["adamw"]
    merge_every = 200
    return [{
        "preset": preset, "batch": f"{BATCH}x{SEQ}",
        "adamw step s": adamw["step_s"], "poet step s": poet["step_s"], "time poet/adamw": poet["step_s"] / adamw["step_s"],
        "peak MB adamw": adamw["peak_mb"], "peak MB poet": poet["peak_mb"],
        "peak poet/adamw": poet["peak_mb"] / adamw["peak_mb"],
        "optimizer state MB adamw": adamw["optimizer_state_mb"], "optimizer state MB poet": poet["optimizer_state_mb"],
        "merge s": poet["merge_s"], f"merge / ({merge_every} steps)": poet["merge_s"] / (merge_every * poet["step_s"]),
    }]
