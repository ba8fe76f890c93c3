"""Per-process memory of fused optimizer steps under DDP, against one process and the memory planner.

The training rows of `benchmarks.suites.fsdp` (a llama-shaped POET-BS 256 model, ``base_init="normalized"``, batch
2 × 256 per process, torch's AdamW, ``torchrun`` with gloo, glibc's mmap threshold fixed) with the optimizer of
`poet_hf.training.create_poet_optimizer`, four ways: unfused on 2 DDP processes; fused steps
(`poet_hf.training.FusedStepOptimizer`) on 1 process and on 2 DDP processes, where each DDP bucket steps right after
its all-reduce (`FusedStepOptimizer.attach_to_ddp`); and fused on 2 DDP processes with the untied head and input
embeddings stored in bfloat16 (``vocab_weights_dtype``), whose row chunks DDP does not hold. The loop is the
Trainer's (`PoetTrainer.training_step`: ``before_backward``, the loss noted, the backward, ``step``, ``zero_grad``),
the clip on (``max_grad_norm`` 1.0). Per process: the steady-state peak (the highest RSS sampled every millisecond
after the first optimizer step, minus the RSS after the imports), beside `poet_hf.plan_memory`'s total for the same
run; the step time is not reported (2 processes share this CPU's 2 cores).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch

from benchmarks.common import status_mb
from benchmarks.suites.fsdp import SEQ, VOCAB, _build, _RssSampler, _torchrun, planned_mb

BATCH, STEPS = 2, 3
# (processes, fused steps, the head's and embeddings' dtype)
LAUNCHES = [(2, False, "float32"), (1, True, "float32"), (2, True, "float32"), (2, True, "bfloat16")]


def worker(out: str, preset_name: str, steps: int, fused: bool, vocab_dtype: str) -> None:
    """Run under torchrun: build the model whole, make its optimizer, wrap it in DDP (several processes), train
    ``steps`` steps after a first; write this process's report."""
    import torch.distributed as dist
    from transformers import Trainer  # noqa: F401  (an import of a user's run: create_poet_optimizer's, lazily)

    from poet_hf.recipes.presets import PRESETS
    from poet_hf.training import create_poet_optimizer

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    after_imports = status_mb("VmRSS")
    model, _ = _build(PRESETS[preset_name], "none")
    args = SimpleNamespace(
        optim="adamw_torch",
        learning_rate=1e-3,
        poet_learning_rate=1e-3,
        weight_decay=0.0,
        fp16=False,
        world_size=world,
        max_grad_norm=1.0,
        vocab_weights_dtype=vocab_dtype,
    )
    optimizer = create_poet_optimizer(
        model, args, optimizer_cls_and_kwargs=(torch.optim.AdamW, {"lr": 1e-3}), fused_step=fused
    )
    trained = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(rank))
    sampler = _RssSampler()
    for step in range(steps + 1):
        if fused:
            optimizer.before_backward(trained, last_micro_batch=True)
        loss = trained(input_ids=ids, labels=ids).loss
        if fused:
            optimizer.note_loss(loss)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step == 0:  # the steady state: everything after the first optimizer step
            sampler.start()
    report = {"world": world, "steady_peak_mb": sampler.stop() - after_imports, "loss": float(loss)}
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))
    dist.barrier()  # no rank tears gloo down while its peer still talks to it
    dist.destroy_process_group()


def rows_for(preset: str, steps: int) -> list[dict]:
    """One row per launch of `LAUNCHES`, the worst process of each."""
    rows = []
    for processes, fused, vocab_dtype in LAUNCHES:
        call = f"worker({preset!r}, {steps}, {fused!r}, {vocab_dtype!r})"
        reports = _torchrun(processes, call, suite="ddp_fused")
        worst = max(reports, key=lambda report: report["steady_peak_mb"])
        planned = planned_mb(
            preset,
            batch_size=BATCH,
            processes=processes,
            sharding="ddp",
            fused_step=fused,
            vocab_weights_dtype=vocab_dtype,
        )
        rows.append(
            {
                "preset": preset,
                "batch / process": f"{BATCH}x{SEQ}",
                "processes": processes,
                "sharding": "ddp" if processes > 1 else "none",
                "fused steps": fused,
                "head and embeddings": vocab_dtype,
                "steady-state peak MB / process": worst["steady_peak_mb"],
                "planned MB / process": planned,
                "steady / planned": worst["steady_peak_mb"] / planned,
            }
        )
    unfused = rows[0]["steady-state peak MB / process"]
    for row in rows:
        row["steady / unfused DDP steady"] = row["steady-state peak MB / process"] / unfused
    return rows


def run(quick: bool = False, presets: tuple[str, ...] = ("llama-60m", "llama-130m")) -> list[dict]:
    if quick:
        return rows_for("tiny", 1)
    return [row for preset in presets for row in rows_for(preset, STEPS)]
