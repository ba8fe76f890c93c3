"""Per-process memory of POET under DeepSpeed ZeRO-2 and ZeRO-3 beside one process, DDP and FSDP2, in one run.

The training rows of `benchmarks.fsdp` (a llama-shaped POET-BS 256 model, ``base_init="normalized"``, batch 2 × 256
per process, torch's AdamW, ``torchrun`` with gloo on a CPU), and the same model, batch and loop under DeepSpeed:
``deepspeed.initialize`` with ZeRO stage 2 or 3 around the same AdamW (POET's parameter groups), each rotation layer
a ZeRO-3 leaf (`poet_hf.training.zero.mark_leaf_layers`). Per process: the steady-state peak (the highest RSS sampled
every millisecond after the first optimizer step, minus the RSS after the imports), the step time, and one merge
(``merge_and_reinit`` with each layer gathered, then `poet_hf.training.zero.reset_rotation_partitions`): its time.
glibc's mmap threshold is fixed as in `benchmarks.fsdp`, in every row alike. `poet_hf.plan_memory` does not model
ZeRO, so these rows carry no plan.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import status_mb
from benchmarks.fsdp import SEQ, VOCAB, _build, _RssSampler, _torchrun, training_rows

ENGINES = {"zero2": 2, "zero3": 3}


def zero_worker(out: str, preset_name: str, batch: int, steps: int, stage: int) -> None:
    """Run under torchrun: build the model whole, wrap it in a DeepSpeed ZeRO engine, train, merge once; report."""
    import deepspeed
    import torch.distributed as dist

    from poet_hf import merge_and_reinit
    from poet_hf.recipes.presets import PRESETS
    from poet_hf.training import poet_param_groups
    from poet_hf.training.zero import gathered_layer, mark_leaf_layers, reset_rotation_partitions

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    after_imports = status_mb("VmRSS")
    model, _ = _build(PRESETS[preset_name], "none")
    mark_leaf_layers(model)
    optimizer = torch.optim.AdamW(poet_param_groups(model, 1e-3, 1e-3, 0.0, []))
    config = {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    ids = torch.randint(0, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(rank))
    times, sampler = [], None
    for step in range(steps + 1):
        start = time.perf_counter()
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        times.append(time.perf_counter() - start)
        if step == 0:  # the steady state: everything after the first optimizer step
            sampler = _RssSampler()
            sampler.start()
    steady_peak = sampler.stop() - after_imports
    start = time.perf_counter()
    merge_and_reinit(model, "default", gathered_layer)
    reset_rotation_partitions(engine.optimizer)
    report = {
        "world": dist.get_world_size(),
        "step_s": statistics.median(times[1:]),
        "steady_peak_mb": steady_peak,
        "merge_s": time.perf_counter() - start,
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


def zero_rows(preset: str, batch: int, steps: int) -> list[dict[str, Any]]:
    """2 processes under ZeRO-2 and ZeRO-3: the worst process's steady-state peak, step and merge time."""
    rows = []
    for sharding, stage in ENGINES.items():
        reports = _torchrun(2, f"zero_worker({preset!r}, {batch}, {steps}, {stage})", module="sharding")
        worst = max(reports, key=lambda r: r["steady_peak_mb"])
        rows.append(
            {
                "measurement": "train",
                "preset": preset,
                "batch / process": f"{batch}x{SEQ}",
                "processes": 2,
                "sharding": sharding,
                "steady-state peak MB / process": worst["steady_peak_mb"],
                "step s": worst["step_s"],
                "merge s": max(r["merge_s"] for r in reports),
            }
        )
    return rows


def run(quick: bool = False, presets: tuple[str, ...] = ("llama-60m", "llama-130m")) -> list[dict]:
    """The `benchmarks.fsdp` training rows and the ZeRO rows of each preset (``quick``: llama-60m, 2 steps)."""
    rows = []
    for preset in presets[:1] if quick else presets:
        steps = 2 if quick else 4
        engines = training_rows(preset, 2, steps) + zero_rows(preset, 2, steps)
        alone = engines[0]["steady-state peak MB / process"]
        for row in engines:
            row["steady / 1-process steady"] = row["steady-state peak MB / process"] / alone
        rows += engines
    return rows
