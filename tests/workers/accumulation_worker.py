"""Run under ``torchrun --nproc_per_node 2`` (gloo, CPU): the gradients of one optimizer step of ``k`` micro-batches
per process, with every micro-batch but the last deferring its rotation gradients, under DDP (``no_sync``) and FSDP2
(``set_requires_gradient_sync``); and a step with a merge-then-reinitialize inside its accumulation window. Each
runs with ``cache_rotations=True`` and with ``"auto"``, which caches under DDP and not under FSDP2 (the cache would
hold more than twice the sharded rotations' state).

Each is compared with the plain-autograd float64 reference computed in one process over every process's
micro-batches (the mean over processes of the sum over micro-batches). Writes OUT/rank<k>.json with the largest
relative error per case, and the rotation-cache bytes held after the first micro-batch and left after the step.

Usage: accumulation_worker.py OUT
"""

import contextlib
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "helpers"))

CASES = [("k1", 1), ("k2", 2), ("k4", 4), ("merge", 2)]  # "merge": k = 2 with merge_and_reinit between the two


def build(cache_rotations: bool | str = True):
    from models import tiny_gpt2
    from peft import get_peft_model

    from poet_hf import PoetConfig

    # float64 GPT-2 in eval mode: no float32 norms, no dropout draws (as in tests/test_rotation_cache.py)
    config = PoetConfig(
        spo="block",
        block_size=16,
        init_weights=False,
        target_modules=["c_attn", "c_proj", "c_fc"],
        cache_rotations=cache_rotations,
    )
    return get_peft_model(tiny_gpt2().double(), config)


def micro_batches(k: int, world: int) -> torch.Tensor:
    """``(world, k, 2, 8)`` token ids: process ``r`` runs ``[r]``."""
    return torch.randint(0, 128, (world, k, 2, 8), generator=torch.Generator().manual_seed(100 + k))


def trainable_grads(model) -> dict[str, torch.Tensor]:
    from poet_hf.sharded import full_tensor

    return {
        name: full_tensor(p.grad).detach().clone()
        for name, p in model.named_parameters()
        if p.requires_grad and p.grad is not None
    }


def reference(k: int, world: int, merge: bool) -> dict[str, torch.Tensor]:
    """One process, plain autograd: every process's micro-batch ``i`` then (for ``merge``) the merge."""
    from poet_hf import merge_and_reinit
    from poet_hf.tuners.rotation.model import plain_autograd

    model, batches = build(), micro_batches(k, world)
    with plain_autograd(model):
        for i in range(k):
            if merge and i == 1:
                merge_and_reinit(model)
            for rank in range(world):
                ids = batches[rank, i]
                (model(input_ids=ids, labels=ids).loss / (k * world)).backward()
    return trainable_grads(model)


def distributed_step(engine: str, k: int, merge: bool, cache_rotations: bool | str) -> tuple:
    from poet_hf import defer_rotation_grads, merge_and_reinit
    from poet_hf.training.distributed import shard_model
    from poet_hf.tuners.rotation.layer import rotation_layers

    rank, world = dist.get_rank(), dist.get_world_size()
    model, batches = build(cache_rotations), micro_batches(k, world)
    wrapped = torch.nn.parallel.DistributedDataParallel(model) if engine == "ddp" else shard_model(model)
    held = 0  # the rotation caches' bytes after the first micro-batch (0 unless it deferred)
    for i in range(k):
        last = i == k - 1
        if merge and i == 1:
            merge_and_reinit(model)
        if engine == "fsdp2":
            model.set_requires_gradient_sync(last)
        sync = wrapped.no_sync() if engine == "ddp" and not last else contextlib.nullcontext()
        with sync, contextlib.nullcontext() if last else defer_rotation_grads():
            ids = batches[rank, i]
            (wrapped(input_ids=ids, labels=ids).loss / k).backward()
        if i == 0:
            held = sum(layer.rotation_cache_bytes() for _, layer in rotation_layers(model))
    left = sum(layer.rotation_cache_bytes() for _, layer in rotation_layers(model))
    state = next(layer.step_state for _, layer in rotation_layers(model))
    chosen = {name: choice.cache for name, choice in state.cache_choices.items()}
    return trainable_grads(model), held, left, chosen


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    import poet_hf  # noqa: F401

    report = {}
    for name, k in CASES:
        expected = reference(k, world, merge=name == "merge")
        for engine in ("ddp", "fsdp2"):
            for cache in (True, "auto"):
                grads, held, left, chosen = distributed_step(engine, k, name == "merge", cache)
                assert grads.keys() == expected.keys(), sorted(set(grads) ^ set(expected))
                error = max(float((grads[n] - expected[n]).abs().max() / expected[n].abs().max()) for n in expected)
                report[f"{engine}-{cache}-{name}"] = {
                    "error": error,
                    "cache_bytes_held": held,
                    "cache_bytes_left": left,
                    "chosen": chosen,
                    "tensors": len(grads),
                }
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    from poet_hf.training.distributed import end_distributed

    end_distributed(exit_process=True)  # barrier, destroy, then exit before gloo can abort the finalization


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
