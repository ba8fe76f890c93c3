"""Per-process memory with 1 and 2 processes (DDP and FSDP2) against the memory planner, and what a merge costs on
sharded weights.

A llama-shaped POET-BS model (b = 256, ``base_init="normalized"``) trains a few steps at batch 2 × 256 per process,
started by ``torchrun`` (gloo on CPU, nccl on CUDA); ``fsdp2`` shards it with
``poet_hf.training.distributed.shard_model`` (every decoder layer, the embeddings, the head, then the root), ``ddp``
wraps it in ``DistributedDataParallel``, ``none`` is the plain model in one process. Per process: the *from-start* peak
(peak RSS minus the RSS after imports) and the *steady-state* peak (the highest RSS sampled every millisecond after the
first optimizer step, minus the same baseline). glibc's allocator runs with ``MALLOC_MMAP_THRESHOLD_=131072``, so that a
freed large tensor leaves the process and RSS follows the live tensors (by default glibc raises the threshold as large
blocks are freed and keeps hundreds of MB it no longer uses). Each row carries :func:`poet_hf.plan_memory`'s prediction
for the same run. Then one ``merge_and_reinit``: its time, the RSS it adds over the steady state and the most gathered
bytes alive at once.

The FSDP2 model is built on the ``meta`` device, sharded, then materialized shard by shard (``shard_model``); the
others are built whole. *construction peak* is the peak RSS when the model is ready to train, beside *one full copy*
of its parameters (``W0`` and trainable) and of its training state (``W0``, trainable parameters, their gradients and
two Adam states).

Two more measurements:

- **Loading a checkpoint** (``--suite fsdp`` rows ``load: …``): a pretrained llama checkpoint loaded into a POET
  model by 2 FSDP2 processes: every process reading it whole (``from_pretrained``, then ``shard_model``: what
  happens without meta construction), or built on ``meta`` with rank 0 reading each tensor and *scattering* shards
  or *broadcasting* the whole tensor (Accelerate's ``fsdp_cpu_ram_efficient_loading``). Peak RSS per rank.
- **Under a memory limit** (rows ``limit: …``): each process runs in a cgroup-v1 memory cgroup of its own whose
  limit is 0.8 × one full copy of the training state (charged from after imports); one process with the whole model,
  then 2 FSDP2 processes, try to train 3 steps. Over its limit the kernel kills a process. ``RLIMIT_DATA`` is no
  substitute: it caps reserved address space, which here runs about 1 GB above the memory in use (thread stacks,
  allocator arenas), so it refuses long before the memory is used.
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
from typing import Any

import torch

from benchmarks.common import FIXED_MMAP, status_mb

ROOT = Path(__file__).resolve().parents[2]
SEQ, VOCAB = 256, 32000


class _RssSampler(threading.Thread):
    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak, self.running = status_mb("VmRSS"), True

    def stop(self) -> float:
        self.running = False
        self.join()
        return self.peak

    def run(self) -> None:
        while self.running:
            self.peak = max(self.peak, status_mb("VmRSS"))
            time.sleep(0.001)


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _poet(model, base_init: str | None = "normalized", block_size: int = 256):
    from peft import get_peft_model

    import poet_hf  # noqa: F401
    from poet_hf import PoetConfig

    return get_peft_model(model, PoetConfig(block_size=block_size, base_init=base_init))


def _build(preset, sharding: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The POET model and what trains it: FSDP2 built on ``meta`` and materialized shard by shard, the others whole."""
    from poet_hf.recipes.presets import build_llama
    from poet_hf.training.distributed import shard_model

    if sharding == "fsdp2":
        model = _poet(build_llama(preset, "poet-bs", VOCAB, SEQ, seed=0, device="meta"), block_size=preset.block_size)
        return shard_model(model, seed=0), model
    model = _poet(build_llama(preset, "poet-bs", VOCAB, SEQ, seed=0), block_size=preset.block_size)
    return model, torch.nn.parallel.DistributedDataParallel(model) if sharding == "ddp" else model


def planned_mb(preset: str, method: str = "poet-bs", **settings: Any) -> float:
    """`poet_hf.plan_memory`'s total in MiB for ``method`` on ``preset`` (its block size), `SEQ` tokens a sequence
    unless ``settings`` say otherwise, with ``settings``: what every suite's rows print beside their measurement."""
    from poet_hf import plan_memory
    from poet_hf.recipes.presets import PRESETS

    settings = {"block_size": PRESETS[preset].block_size, "seq_len": SEQ, **settings}
    return plan_memory(preset, method, **settings).total_bytes / 2**20


def _full_copies_mb(model: torch.nn.Module) -> dict[str, float]:
    """One whole copy of the model's parameters, and of its training state (``W0``, trainable parameters, their
    gradients and two Adam states), from the global shapes (whatever the sharding)."""
    frozen = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return {"params_mb": (frozen + trainable) / 2**20, "state_mb": (frozen + 4 * trainable) / 2**20}


def worker(out: str, preset_name: str, batch: int, steps: int, sharding: str = "fsdp2") -> None:
    """Run under torchrun: build, shard (``fsdp2``) or replicate (``ddp``), train, merge once; write the report."""
    import torch.distributed as dist

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    import poet_hf.tuners.rotation.layer as rotation_layer
    from poet_hf import merge_and_reinit
    from poet_hf.recipes.presets import PRESETS

    after_imports = status_mb("VmRSS")
    preset = PRESETS[preset_name]
    model, trained = _build(preset, sharding)
    construction_peak = _peak_rss_mb() - after_imports
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
    train_peak = _peak_rss_mb() - after_imports

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
    steady = status_mb("VmRSS")
    sampler = _RssSampler()
    sampler.start()
    start = time.perf_counter()
    merge_and_reinit(model)
    merge_s = time.perf_counter() - start
    sampler.stop()
    report = {
        "world": world,
        "step_s": statistics.median(times[1:]),
        "train_peak_mb": train_peak,
        "steady_peak_mb": steady_peak,
        "construction_peak_mb": construction_peak,
        **_full_copies_mb(model),
        "merge_s": merge_s,
        "merge_extra_mb": sampler.peak - steady,
        "merge_gathered_mb": gathered["peak"] / 2**20,
        "largest_weight_mb": max(p.numel() * p.element_size() for n, p in model.named_parameters() if "base_layer" in n)
        / 2**20,
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))
    dist.barrier()  # no rank tears gloo down while its peer still talks to it (an abort at exit)
    dist.destroy_process_group()


def load_worker(out: str, preset_name: str, checkpoint: str, loading: str) -> None:
    """Run under torchrun: load ``checkpoint`` into a POET model sharded over the processes, ``loading`` being
    ``whole`` (every process ``from_pretrained``, then ``shard_model``), ``scatter`` or ``broadcast`` (built on
    ``meta``, rank 0 reads); write the peak RSS and the time."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from poet_hf.recipes.presets import PRESETS, build_llama
    from poet_hf.training.distributed import shard_model

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    after_imports = status_mb("VmRSS")
    block_size = PRESETS[preset_name].block_size
    start = time.perf_counter()
    if loading == "whole":
        shard_model(_poet(AutoModelForCausalLM.from_pretrained(checkpoint), base_init=None, block_size=block_size))
    else:
        model = _poet(
            build_llama(PRESETS[preset_name], "poet-bs", VOCAB, SEQ, seed=0, device="meta"),
            base_init=None,
            block_size=block_size,
        )
        shard_model(model, checkpoint=checkpoint, loading=loading)
    dist.barrier()
    report = {"peak_mb": _peak_rss_mb() - after_imports, "load_s": time.perf_counter() - start}
    Path(out, f"rank{dist.get_rank()}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


def memory_cgroup_root() -> Path | None:
    """This process's cgroup-v1 memory controller folder, if a child cgroup can be made there (else ``None``)."""
    try:
        line = next(entry for entry in Path("/proc/self/cgroup").read_text().splitlines() if ":memory:" in entry)
        root = Path("/sys/fs/cgroup/memory") / line.split(":", 2)[2].lstrip("/")
        probe = root / f"poet_probe_{os.getpid()}"
        probe.mkdir()
        probe.rmdir()
        return root
    except (StopIteration, OSError):
        return None


def limit_worker(out: str, preset_name: str, batch: int, seq: int, cgroups: str) -> None:
    """Run under torchrun: move into the memory cgroup ``cgroups/rank<k>`` (its limit set by the caller; charges
    start here, after imports), then build (on ``meta`` and shard when there are several processes, else whole) and
    train 3 steps; write the loss. Over the limit the kernel kills the process, and no report is written."""
    import torch.distributed as dist

    from poet_hf.recipes.presets import PRESETS

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    Path(cgroups, f"rank{rank}", "cgroup.procs").write_text(str(os.getpid()))
    model, trained = _build(PRESETS[preset_name], "fsdp2" if world > 1 else "none")
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(rank))
    for _ in range(3):
        loss = trained(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    Path(out, f"rank{rank}.json").write_text(json.dumps({"loss": float(loss)}))
    dist.barrier()
    dist.destroy_process_group()


def _torchrun(processes: int, call: str, timeout: int = 3600, check: bool = True, suite: str = "fsdp") -> list[dict]:
    """Run ``benchmarks.suites.<suite>.<call>`` (its first argument, OUT, added) in ``processes`` processes; their
    reports (``{}`` for a process that wrote none, when ``check`` is off)."""
    with tempfile.TemporaryDirectory() as out:
        name, arguments = call.split("(", 1)
        code = (
            f"import sys; sys.path.insert(0, {str(ROOT)!r}); from benchmarks.suites.{suite} import {name}; "
            f"{name}({out!r}, {arguments}"
        )
        script = Path(out, "run.py")
        script.write_text(code)
        env = {
            **os.environ,
            "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // processes)),
            **FIXED_MMAP,
        }
        subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc_per_node",
                str(processes),
                "--master_port",
                str(29600 + processes),
                str(script),
            ],
            env=env,
            check=check,
            capture_output=True,
            timeout=timeout,
        )
        reports = [Path(out, f"rank{r}.json") for r in range(processes)]
        return [json.loads(r.read_text()) if r.exists() else {} for r in reports]


RUNS = [(1, "none"), (2, "ddp"), (2, "fsdp2")]


def training_rows(preset: str, batch: int, steps: int) -> list[dict]:
    """1 process, 2 under DDP, 2 under FSDP2: memory (steady state, from start, at construction) against the plan
    and against one full copy of the model, step and merge costs."""
    rows = []
    for processes, sharding in RUNS:
        reports = _torchrun(processes, f"worker({preset!r}, {batch}, {steps}, {sharding!r})")
        worst = max(reports, key=lambda r: r["steady_peak_mb"])
        planned = planned_mb(
            preset, batch_size=batch, processes=processes, sharding="fsdp2" if sharding == "fsdp2" else "ddp"
        )
        rows.append(
            {
                "measurement": "train",
                "preset": preset,
                "batch / process": f"{batch}x{SEQ}",
                "processes": processes,
                "sharding": sharding,
                "steady-state peak MB / process": worst["steady_peak_mb"],
                "from-start peak MB / process": max(r["train_peak_mb"] for r in reports),
                "construction peak MB / process": max(r["construction_peak_mb"] for r in reports),
                "one full copy: parameters MB": worst["params_mb"],
                "one full copy: training state MB": worst["state_mb"],
                "planned MB / process": planned,
                "steady / planned": worst["steady_peak_mb"] / planned,
                "step s": worst["step_s"],
                "merge s": max(r["merge_s"] for r in reports),
                "merge extra RSS MB": max(r["merge_extra_mb"] for r in reports),
                "merge gathered MB (peak alive)": max(r["merge_gathered_mb"] for r in reports),
                "largest W0 MB": worst["largest_weight_mb"],
            }
        )
    for row in rows[1:]:
        row["steady / 1-process steady"] = (
            row["steady-state peak MB / process"] / rows[0]["steady-state peak MB / process"]
        )
    return rows


def loading_rows(preset: str) -> list[dict]:
    """A pretrained checkpoint of ``preset`` (written here once) loaded by 2 FSDP2 processes, three ways."""
    from poet_hf.recipes.presets import PRESETS, build_llama

    rows = []
    with tempfile.TemporaryDirectory() as checkpoint:
        build_llama(PRESETS[preset], "poet-bs", VOCAB, SEQ, seed=0).save_pretrained(checkpoint)
        for loading in ("whole", "broadcast", "scatter"):
            reports = _torchrun(2, f"load_worker({preset!r}, {checkpoint!r}, {loading!r})")
            rows.append(
                {
                    "measurement": f"load: {loading}",
                    "preset": preset,
                    "processes": 2,
                    "sharding": "fsdp2",
                    "rank 0 peak MB": reports[0]["peak_mb"],
                    "rank 1 peak MB": reports[1]["peak_mb"],
                    "load s": max(r["load_s"] for r in reports),
                }
            )
    return rows


def limit_rows(preset: str, batch: int, seq: int, budget_fraction: float = 0.8) -> list[dict]:
    """Each process in a memory cgroup limited to ``budget_fraction`` of one full copy of the training state (charged
    from after its imports): 1 process with the whole model, then 2 FSDP2 processes, train 3 steps."""
    from poet_hf.recipes.presets import PRESETS, build_llama

    meta = build_llama(PRESETS[preset], "poet-bs", VOCAB, SEQ, seed=0, device="meta")
    state_mb = _full_copies_mb(_poet(meta, block_size=PRESETS[preset].block_size))["state_mb"]
    budget = int(budget_fraction * state_mb)
    root = memory_cgroup_root()
    if root is None:
        return [
            {
                "measurement": "limit: memory cgroup",
                "preset": preset,
                "error": "no cgroup-v1 memory controller this process can write to; nothing measured",
            }
        ]
    rows = []
    for processes in (1, 2):
        cgroups = root / f"poet_limit_{os.getpid()}"
        for rank in range(processes):
            (cgroups / f"rank{rank}").mkdir(parents=True)
            (cgroups / f"rank{rank}" / "memory.limit_in_bytes").write_text(str(budget * 2**20))
        try:
            reports = _torchrun(processes, f"limit_worker({preset!r}, {batch}, {seq}, {str(cgroups)!r})", check=False)
            peaks = [
                int((cgroups / f"rank{r}" / "memory.max_usage_in_bytes").read_text()) / 2**20 for r in range(processes)
            ]
        finally:
            for rank in range(processes):
                (cgroups / f"rank{rank}").rmdir()
            cgroups.rmdir()
        rows.append(
            {
                "measurement": "limit: memory cgroup",
                "preset": preset,
                "batch / process": f"{batch}x{seq}",
                "processes": processes,
                "sharding": "fsdp2" if processes > 1 else "none",
                "one full copy: training state MB": state_mb,
                "limit MB / process": budget,
                "peak charged MB / process": max(peaks),
                "trained 3 steps": all("loss" in r for r in reports),
            }
        )
    return rows


def run(quick: bool = False, presets: tuple[str, ...] = ("llama-60m", "llama-130m")) -> list[dict]:
    if quick:
        return training_rows("tiny", 2, 2) + loading_rows("tiny")
    rows = [row for preset in presets for row in training_rows(preset, 2, 3)]
    return rows + loading_rows("llama-130m") + limit_rows("llama-130m", 1, 128)
