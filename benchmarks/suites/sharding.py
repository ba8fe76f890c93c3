"""Per-process memory of POET under DeepSpeed ZeRO-2 and ZeRO-3 beside one process, DDP and FSDP2, in one run.

The training rows of `benchmarks.suites.fsdp` (a llama-shaped POET-BS 256 model, ``base_init="normalized"``,
batch 2 × 256 per process, torch's AdamW, ``torchrun`` with gloo on a CPU), and the same model, batch and loop under
DeepSpeed: ``deepspeed.initialize`` with ZeRO stage 2 or 3 around the same AdamW (POET's parameter groups), each
rotation layer a ZeRO-3 leaf (`poet_hf.training.zero.prepare_for_zero`). Per process: the steady-state peak (the highest
RSS sampled every millisecond after the first optimizer step, minus the RSS after the imports), the step time, and one
merge (``merge_and_reinit`` with each layer gathered, then `poet_hf.training.zero.reset_rotation_partitions`): its time.
glibc's mmap threshold is fixed as in `benchmarks.suites.fsdp`, in every row alike. `poet_hf.plan_memory` does not model
ZeRO, so these rows carry no plan.

The ``"accumulate"`` rows (`accumulation_rows`) train POET-BS and AdamW under FSDP2 in 2 processes with gradient
accumulation, as ``Trainer`` runs it (gradient sync and the rotation gradients deferred on every micro-batch but the
last), each method in its own launch, the planner's prediction beside each.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import status_mb
from benchmarks.suites.fsdp import SEQ, VOCAB, _build, _RssSampler, _torchrun, planned_mb, training_rows

# (stage, ZeRO's sizes: DeepSpeed's defaults (None), those examples/cluster/deepspeed_zero3.json gets from the
# model's width ("sized"), or those and the live-parameter limits sized the same way ("live"))
ENGINES = {"zero2": (2, None), "zero3": (3, None), "zero3 sized": (3, "sized"), "zero3 sized, live": (3, "live")}


def zero_sizes(hidden: int, live: bool = False) -> dict[str, int]:
    """ZeRO's bucket, prefetch and persistence sizes for a model ``hidden`` wide, as accelerate and transformers fill
    a DeepSpeed config's ``"auto"`` entries (``examples/cluster/deepspeed_zero3.json``): ``hidden²``, ``0.9·hidden²``
    and ``10·hidden`` entries, where DeepSpeed's defaults (5e8, 5e7, 1e5) hold a small model's every gradient in one
    bucket and prefetch all of its parameters. ``live``: also ``stage3_max_live_parameters`` and
    ``stage3_max_reuse_distance`` at ``hidden²`` (no ``"auto"`` fills them; DeepSpeed's 1e9 keeps a small model's
    every gathered parameter alive)."""
    sizes = {
        "reduce_bucket_size": hidden * hidden,
        "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
        "stage3_param_persistence_threshold": 10 * hidden,
    }
    if live:
        sizes |= {"stage3_max_live_parameters": hidden * hidden, "stage3_max_reuse_distance": hidden * hidden}
    return sizes


def zero_worker(out: str, preset_name: str, batch: int, steps: int, stage: int, sizes: str | None = None) -> None:
    """Run under torchrun: build the model whole, wrap it in a DeepSpeed ZeRO engine, train, merge once; report.

    ``sizes``: ``"sized"``, ZeRO's bucket, prefetch and persistence sizes as `zero_sizes` sets them for the model's
    width (what accelerate fills in for ``"auto"``); ``"live"``, those and the live-parameter limits; ``None``,
    DeepSpeed's defaults."""
    import deepspeed
    import torch.distributed as dist

    from poet_hf import merge_and_reinit
    from poet_hf.recipes.presets import PRESETS
    from poet_hf.training import poet_param_groups
    from poet_hf.training.zero import gathered_layer, prepare_for_zero, reset_rotation_partitions

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    after_imports = status_mb("VmRSS")
    model, _ = _build(PRESETS[preset_name], "none")
    prepare_for_zero(model)
    hidden = PRESETS[preset_name].hidden
    optimizer = torch.optim.AdamW(poet_param_groups(model, 1e-3, 1e-3, 0.0, []))
    config = {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage, **(zero_sizes(hidden, sizes == "live") if sizes else {})},
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
    for sharding, (stage, sizes) in ENGINES.items():
        call = f"zero_worker({preset!r}, {batch}, {steps}, {stage}, sizes={sizes!r})"
        reports = _torchrun(2, call, suite="sharding")
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


def accumulation_worker(out: str, preset_name: str, batch: int, steps: int, accumulation: int, method: str) -> None:
    """Run under torchrun: ``method`` (``"poet-bs"`` or ``"adamw"``) sharded by FSDP2, ``accumulation`` micro-batches
    per optimizer step; report the steady-state peak, the step time and what ``cache_rotations`` chose."""
    import torch.distributed as dist

    from benchmarks.suites.fsdp import _poet
    from poet_hf import defer_rotation_grads
    from poet_hf.recipes.presets import PRESETS, build_llama
    from poet_hf.training.distributed import shard_model
    from poet_hf.tuners.rotation.layer import rotation_layers

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    after_imports = status_mb("VmRSS")
    preset = PRESETS[preset_name]
    model = build_llama(preset, method, VOCAB, SEQ, seed=0, device="meta")
    model = shard_model(_poet(model, block_size=preset.block_size) if method == "poet-bs" else model, seed=0)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    ids = torch.randint(0, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(rank))
    times, sampler = [], None
    for step in range(steps + 1):
        start = time.perf_counter()
        for i in range(accumulation):
            last = i == accumulation - 1
            model.set_requires_gradient_sync(last)
            with contextlib.nullcontext() if last else defer_rotation_grads():
                (model(input_ids=ids, labels=ids).loss / accumulation).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        if step == 0:  # the steady state: everything after the first optimizer step
            sampler = _RssSampler()
            sampler.start()
    assert sampler is not None
    layers = rotation_layers(model)
    report = {
        "steady_peak_mb": sampler.stop() - after_imports,
        "step_s": statistics.median(times[1:]),
        "cache": layers[0][1].step_state.cache_summary()["summary"] if layers else "",
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


ACCUMULATION = 4  # micro-batches per optimizer step in the accumulation rows


def accumulation_rows(preset: str, batch: int, steps: int) -> list[dict[str, Any]]:
    """POET-BS and AdamW under FSDP2 in 2 processes with accumulation: the worst process's steady-state peak, and
    the plan."""
    rows = []
    for method in ("poet-bs", "adamw"):
        call = f"accumulation_worker({preset!r}, {batch}, {steps}, {ACCUMULATION}, {method!r})"
        reports = _torchrun(2, call, suite="sharding")
        worst = max(reports, key=lambda r: r["steady_peak_mb"])
        planned = planned_mb(preset, method, batch_size=batch, processes=2, sharding="fsdp2", accumulation=ACCUMULATION)
        rows.append(
            {
                "measurement": "accumulate",
                "preset": preset,
                "method": method,
                "batch / process": f"{batch}x{SEQ}",
                "accumulation": ACCUMULATION,
                "processes": 2,
                "sharding": "fsdp2",
                "steady-state peak MB / process": worst["steady_peak_mb"],
                "planned MB / process": planned,
                "steady / planned": worst["steady_peak_mb"] / planned,
                "step s": worst["step_s"],
                "rotation caches": worst["cache"],
            }
        )
    rows[0]["POET / AdamW"] = rows[0]["steady-state peak MB / process"] / rows[1]["steady-state peak MB / process"]
    return rows


def run(quick: bool = False, presets: tuple[str, ...] = ("llama-60m", "llama-130m")) -> list[dict]:
    """The `benchmarks.suites.fsdp` training rows and the ZeRO rows of each preset (``quick``: llama-60m, 2 steps), then
    the accumulation rows of the first preset."""
    rows = []
    for preset in presets[:1] if quick else presets:
        steps = 2 if quick else 4
        engines = training_rows(preset, 2, steps) + zero_rows(preset, 2, steps)
        alone = engines[0]["steady-state peak MB / process"]
        for row in engines:
            row["steady / 1-process steady"] = row["steady-state peak MB / process"] / alone
        rows += engines
    return rows + accumulation_rows(presets[0], 2, 2)
