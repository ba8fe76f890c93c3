"""Per-process memory with 1 and 2 processes (DDP and FSDP2) against the memory planner, and what a merge costs on
sharded weights.

A llama-shaped POET-BS model (b = 256, ``base_init="normalized"``) trains a few steps at batch 2 × 256 per process,
started by ``torchrun`` (gloo on CPU, nccl on CUDA); ``fsdp2`` shards it with ``poet_hf.distributed.shard_model``
(every decoder layer, the embeddings, the head, then the root), ``ddp`` wraps it in ``DistributedDataParallel``,
``none`` is the plain model in one process. Per process: the *from-start* peak (peak RSS minus the RSS after
imports) and the *steady-state* peak (the highest RSS sampled every millisecond after the first optimizer step,
minus the same baseline). glibc's allocator runs with ``MALLOC_MMAP_THRESHOLD_=131072``, so that
a freed large tensor leaves the process and RSS follows the live tensors (by default glibc raises the threshold as
large blocks are freed and keeps hundreds of MB it no longer uses). Each row carries
:func:`poet_hf.plan_memory`'s prediction for the same run. Then one ``merge_and_reinit``: its time, the RSS it adds
over the steady state and the most gathered bytes alive at once.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
SEQ, VOCAB = 256, 32000


def _rss_mb() -> float:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * 4096 / 2**20


class _RssSampler(threading.Thread):
    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak, self.running = _rss_mb(), True

    def stop(self) -> float:
        self.running = False
        self.join()
        return self.peak

    def run(self) -> None:
        while self.running:
            self.peak = max(self.peak, _rss_mb())
            time.sleep(0.001)


def worker(out: str, preset_name: str, batch: int, steps: int, sharding: str = "fsdp2") -> None:
    """Run under torchrun: build, shard (``fsdp2``) or replicate (``ddp``), train, merge once; write the report."""
    import torch.distributed as dist

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    from peft import get_peft_model

    import poet_hf  # noqa: F401
    import poet_hf.tuners.rotation_layer as rotation_layer
    from poet_hf import PoetConfig, merge_and_reinit
    from poet_hf.distributed import shard_model
    from poet_hf.training.pretrain import PRESETS, build_llama

    after_imports = _rss_mb()
    preset = PRESETS[preset_name]
    model = get_peft_model(build_llama(preset, "poet-bs", VOCAB, SEQ, seed=0),
                           PoetConfig(block_size=preset.block_size, base_init="normalized"))
    trained = model
    if sharding == "fsdp2":
        shard_model(model)
    elif sharding == "ddp":
        trained = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    ids = torch.randint(0, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(rank))
    times, steady_sampler = [], None
    for step in range(steps + 1):
        start = time.perf_counter()
        trained(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        if step == 0:  # the steady state: everything after the first optimizer step
            steady_sampler = _RssSampler()
            steady_sampler.start()
    steady_peak = steady_sampler.stop() - after_imports
    train_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - after_imports

    gathered = {"alive": 0, "peak": 0}
    original = rotation_layer.full_tensor

    def tracked(tensor):
        result = original(tensor)
        if result is not tensor:
            size = result.numel() * result.element_size()
            gathered["alive"] += size
            gathered["peak"] = max(gathered["peak"], gathered["alive"])
            weakref.finalize(result, lambda n=size: gathered.__setitem__("alive", gathered["alive"] - n))
        return result

    rotation_layer.full_tensor = tracked
    steady = _rss_mb()
    sampler = _RssSampler()
    sampler.start()
    start = time.perf_counter()
    merge_and_reinit(model)
    merge_s = time.perf_counter() - start
    sampler.stop()
    report = {"world": world, "step_s": statistics.median(times[1:]), "train_peak_mb": train_peak,
              "steady_peak_mb": steady_peak,
              "merge_s": merge_s, "merge_extra_mb": sampler.peak - steady,
              "merge_gathered_mb": gathered["peak"] / 2**20,
              "largest_weight_mb": max(p.numel() * p.element_size() for n, p in model.named_parameters()
                                       if "base_layer" in n) / 2**20}
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))
    dist.barrier()  # no rank tears gloo down while its peer still talks to it (an abort at exit)
    dist.destroy_process_group()


def _torchrun(processes: int, preset: str, batch: int, steps: int, sharding: str) -> list[dict]:
    with tempfile.TemporaryDirectory() as out:
        code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); from benchmarks.fsdp import worker; "
                f"worker({out!r}, {preset!r}, {batch}, {steps}, {sharding!r})")
        script = Path(out, "run.py")
        script.write_text(code)
        env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // processes)),
               "MALLOC_MMAP_THRESHOLD_": "131072"}
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes),
                        "--master_port", str(29600 + processes), str(script)], env=env, check=True,
                       capture_output=True, timeout=3600)
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(processes)]


RUNS = [(1, "none"), (2, "ddp"), (2, "fsdp2")]


def run(quick: bool = False, presets: tuple[str, ...] = ("llama-60m", "llama-130m")) -> list[dict]:
    from poet_hf import plan_memory
    from poet_hf.training.pretrain import PRESETS

    batch, steps = (2, 2) if quick else (2, 3)
    rows = []
    for preset in ("tiny",) if quick else presets:
        for processes, sharding in RUNS:
            reports = _torchrun(processes, preset, batch, steps, sharding)
            worst = max(reports, key=lambda r: r["steady_peak_mb"])
            planned = plan_memory(preset, "poet-bs", block_size=PRESETS[preset].block_size, batch_size=batch,
                                  seq_len=SEQ, processes=processes, sharding="fsdp2" if sharding == "fsdp2" else "ddp")
            rows.append({"preset": preset, "batch / process": f"{batch}x{SEQ}", "processes": processes,
                         "sharding": sharding,
                         "steady-state peak MB / process": worst["steady_peak_mb"],
                         "from-start peak MB / process": max(r["train_peak_mb"] for r in reports),
                         "planned MB / process": planned.total_bytes / 2**20,
                         "steady / planned": worst["steady_peak_mb"] / (planned.total_bytes / 2**20),
                         "step s": worst["step_s"], "merge s": max(r["merge_s"] for r in reports),
                         "merge extra RSS MB": max(r["merge_extra_mb"] for r in reports),
                         "merge gathered MB (peak alive)": max(r["merge_gathered_mb"] for r in reports),
                         "largest W0 MB": worst["largest_weight_mb"]})
        single = rows[-len(RUNS)]["steady-state peak MB / process"]
        for row in rows[-len(RUNS) + 1:]:
            row["steady / 1-process steady"] = row["steady-state peak MB / process"] / single
    return rows
