"""Llama-2-7B's shape with every saving that composes with FSDP2, on 1 process and on 2: whole-process peaks beside
the planner's.

POET-BS 256 (``base_init="normalized"``), its ``W0`` stored as ``nf4-shardable`` (folded to nearest, as FSDP2 folds
it), torchao's 8-bit AdamW states through `create_poet_optimizer` (every tensor that fills whole 256-entry blocks, the
embeddings and head among them), transformers' activation checkpointing (non-reentrant), the loss chunked
(`poet_hf.training.chunked_loss`; under FSDP2 the head and the input embeddings stay split by vocabulary rows, never
gathered), 1 × 256 tokens per process, float32. The model is built on
``meta``: one process materializes it whole (each layer quantised as it is made), two FSDP2 processes shard it first
(`shard_model`) and materialize their shards. Each launch is ``torchrun`` with gloo, as a user starts it, glibc's mmap
threshold fixed as in `benchmarks.suites.fsdp`. Per process: the whole peak RSS (``VmHWM``, imports included), the
steady-state peak above the imports (sampled every millisecond after the first optimizer step; the imports are
those of a user's run, transformers' ``Trainer`` among them, which `create_poet_optimizer` imports) and the median
step time; beside them `poet_hf.plan_memory`'s total for the same run, which counts tensors. What the process holds
beyond its tensors (the kernels' code pages, torch.compile's kernels for torchao's step, the allocator's arenas) is
measured after the steps: its RSS above the imports less the bytes of every parameter shard, buffer, gradient and
optimizer state it holds. Merges are left to the tests (`tests/test_fsdp.py`
checks their codes against one process's): on this CPU a 7B merge quantises 6.5 G entries, minutes of work that
measure nothing here.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.common import status_mb
from benchmarks.suites.fsdp import _RssSampler, _torchrun, planned_mb

PRESET, BATCH, SEQ, STEPS, LOSS_CHUNK = "llama-2-7b", 1, 256, 1, 1024
SETTINGS = {
    "preset": PRESET,
    "batch / process": f"{BATCH}x{SEQ}",
    "W0": "nf4-shardable",
    "optimizer": "torchao AdamW8bit",
    "activation checkpointing": True,
    "loss_chunk_tokens": LOSS_CHUNK,
    "dtype": "float32",
}
LAUNCHES = ((1, "none"), (2, "fsdp2"))


def _model(preset_name: str, sharding: str) -> torch.nn.Module:
    """The POET model on ``meta``, checkpointed, then sharded (``fsdp2``) or made whole, quantised layer by layer."""
    from peft import get_peft_model

    from poet_hf import PoetConfig
    from poet_hf.initialization import materialize_model
    from poet_hf.recipes.presets import PRESETS, build_llama
    from poet_hf.training.distributed import shard_model

    preset = PRESETS[preset_name]
    config = PoetConfig(
        block_size=preset.block_size, base_init="normalized", base_quantization="nf4-shardable", requantize="nearest"
    )
    model = get_peft_model(build_llama(preset, "poet-bs", 32000, SEQ, seed=0, device="meta"), config)
    model.get_base_model().activation_checkpointing_enable({"use_reentrant": False})
    return shard_model(model, seed=0) if sharding == "fsdp2" else materialize_model(model, seed=0, device="cpu")


def worker(out: str, preset_name: str, steps: int, sharding: str) -> None:
    """Run under torchrun: build, train ``steps`` steps after a first; write this process's report."""
    from types import SimpleNamespace

    import torch.distributed as dist
    from torchao.optim import AdamW8bit
    from transformers import Trainer  # noqa: F401  (an import of a user's run: create_poet_optimizer's, lazily)

    from poet_hf.training import create_poet_optimizer
    from poet_hf.training.chunked_loss import causal_lm_loss

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    after_imports = status_mb("VmRSS")
    model = _model(preset_name, sharding)
    args = SimpleNamespace(optim="adamw_torch_8bit", learning_rate=1e-3, poet_learning_rate=1e-3, weight_decay=0.0)
    optimizer = create_poet_optimizer(model, args, optimizer_cls_and_kwargs=(AdamW8bit, {"lr": 1e-3}))
    ids = torch.randint(0, 32000, (BATCH, SEQ), generator=torch.Generator().manual_seed(rank))
    times, sampler = [], _RssSampler()
    for step in range(steps + 1):
        start = time.perf_counter()
        causal_lm_loss(model, {"input_ids": ids, "labels": ids}, LOSS_CHUNK).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        if step == 0:
            sampler.start()
    steady = sampler.stop() - after_imports
    tensors = _live_tensor_mb(model, optimizer)
    report = {
        "beyond_tensors_mb": status_mb("VmRSS") - after_imports - tensors,
        "world": world,
        "whole_peak_mb": status_mb("VmHWM"),
        "imports_mb": after_imports,
        "steady_peak_mb": steady,
        "step_s": statistics.median(times[1:]),
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


def _live_tensor_mb(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> float:
    """MB of the tensors this process holds between steps: parameters (their local shards), buffers, gradients and
    optimizer states (torchao's 8-bit states by their codes, scales and code tables), each storage once."""
    from torch.distributed.tensor import DTensor

    seen: set[int] = set()

    def stored(tensor: torch.Tensor) -> int:
        if isinstance(tensor, DTensor):
            return stored(tensor.to_local())
        if type(tensor) not in (torch.Tensor, torch.nn.Parameter):  # a tensor subclass: its inner tensors
            return sum(stored(getattr(tensor, name)) for name in tensor.__tensor_flatten__()[0])
        storage = tensor.untyped_storage()
        if storage.data_ptr() in seen:
            return 0
        seen.add(storage.data_ptr())
        return storage.nbytes()

    tensors = [*model.parameters(), *model.buffers()]
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    tensors += [t for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t)]
    return sum(stored(t) for t in tensors) / 2**20


def _planned_mb(preset_name: str, processes: int) -> float:
    """The plan of this suite's run: every saving of `SETTINGS`."""
    return planned_mb(
        preset_name,
        batch_size=BATCH,
        seq_len=SEQ,
        processes=processes,
        sharding="fsdp2" if processes > 1 else "ddp",
        checkpointing=True,
        base_quantization="nf4-shardable",
        optimizer_bits=8,
        eight_bit_library="torchao",
        loss_chunk_tokens=LOSS_CHUNK,
    )


def run(quick: bool = False) -> list[dict]:
    """One row per launch (1 process, 2 FSDP2 processes), the worst process of each; ``quick``: llama-60m's shape."""
    preset = "llama-60m" if quick else PRESET
    rows = []
    for processes, sharding in LAUNCHES:
        reports = _torchrun(processes, f"worker({preset!r}, {STEPS}, {sharding!r})", suite="sharded_quantized")
        worst = max(reports, key=lambda report: report["whole_peak_mb"])
        planned = _planned_mb(preset, processes)
        rows.append(
            {
                "preset": preset,
                "processes": processes,
                "sharding": sharding,
                "whole peak MB / process": worst["whole_peak_mb"],
                "imports MB": worst["imports_mb"],
                "steady-state peak MB / process": worst["steady_peak_mb"],
                "planned MB / process": planned,
                "steady / planned": worst["steady_peak_mb"] / planned,
                "beyond tensors MB": worst["beyond_tensors_mb"],
                "steady less beyond tensors / planned": (
                    (worst["steady_peak_mb"] - worst["beyond_tensors_mb"]) / planned
                ),
                "step s": worst["step_s"],
            }
        )
    for row in rows[1:]:
        row["whole peak / 1 process"] = row["whole peak MB / process"] / rows[0]["whole peak MB / process"]
    return rows
