"""Run under ``torchrun --nproc_per_node N`` (gloo, CPU): a POET run sharded with FSDP2 (`shard_model`) that saves
``torch.distributed.checkpoint`` checkpoints through poet_hf's crash-safe publishing and resumes from the newest
complete one, on any process count: the FSDP2 leg of ``scripts/benchmark.py --suite chaos``.

Accelerate enables FSDP only on accelerators, so on a CPU this loop stands in for `PoetTrainer`'s FSDP2 path: the
same schedule as tests/workers/chaos_worker.py (checkpoints every 3 steps into ``OUT/run``, at most 2 kept, merges
every 5, 2 sequences a step on any process count, ``CHAOS_MAX_STEPS`` steps), each checkpoint staged in
``run/.staging``, flushed on every process and published by the main process with one rename
(`poet_hf.checkpoints.publish`, `rotate`). At the end it exports the merged model into ``OUT/export`` and rank 0 writes
``OUT/result.json`` (per-step losses, steps, process count).

Usage: fsdp_chaos_worker.py OUT [KILL_POINT]; KILL_POINT and ``CHAOS_STOP_AT`` as in chaos_worker.py (``staging``:
after every shard is written, before the publish; ``publish``, ``rotate`` and ``merge`` as there).
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "helpers"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

SAVE_STEPS, MERGE_EVERY, KEEP, GLOBAL_BATCH = 3, 5, 2, 2  # as chaos_worker.py's Trainer run
STATE_NAME = "loop_state.json"  # the step and the losses so far, beside the sharded state


def save(run: Path, step: int, model, optimizer, losses: dict, kill_point: str) -> None:
    """Write checkpoint-``step`` crash-safely: every shard into staging, flushed, then published by one rename."""
    import torch.distributed.checkpoint as dcp
    from chaos_worker import die
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from poet_hf.checkpoints import STAGING_DIR, fsync_tree, publish, rotate

    staging_root, name = run / STAGING_DIR, f"checkpoint-{step}"
    if dist.get_rank() == 0:
        import shutil

        shutil.rmtree(staging_root, ignore_errors=True)  # a save or a deletion a kill interrupted
    dist.barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(staging_root / name))
    if dist.get_rank() == 0:
        (staging_root / name / STATE_NAME).write_text(json.dumps({"step": step, "losses": losses}))
    dist.barrier()
    if kill_point == "staging":
        die(run.parent)
    fsync_tree(staging_root / name)
    dist.barrier()
    if dist.get_rank() == 0:
        publish(staging_root / name, run / name)
        rotate(run, KEEP, {str(run / name)})
    dist.barrier()


def resume(run: Path, model, optimizer) -> tuple[int, dict]:
    """Load the newest complete checkpoint of ``run``, resharded onto this process count; its step and losses."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from poet_hf.checkpoints import latest_complete_checkpoint

    checkpoint = latest_complete_checkpoint(run)
    if checkpoint is None:
        return 0, {}
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optim_state}
    dcp.load(state, checkpoint_id=checkpoint)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    saved = json.loads((Path(checkpoint) / STATE_NAME).read_text())
    return saved["step"], {int(step): loss for step, loss in saved["losses"].items()}


def main() -> None:
    out = Path(sys.argv[1])
    kill_point = sys.argv[2] if len(sys.argv) > 2 else ""
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    from chaos_worker import MAX_STEPS, STOP_AT, install_kill_point
    from fsdp_worker import batches, build_optimizer, train_step
    from training_utils import tiny_dataset, tiny_poet_model

    from poet_hf import export_merged, merge_and_reinit
    from poet_hf.training import poet_parameters, reset_optimizer_state
    from poet_hf.training.distributed import shard_model

    install_kill_point("" if kill_point == "staging" else kill_point, out)
    dataset, tokenizer = tiny_dataset()
    model = shard_model(tiny_poet_model(len(tokenizer), merge_every=MERGE_EVERY))
    optimizer = build_optimizer(model, "adamw")
    data = batches(torch.tensor(dataset["input_ids"]), MAX_STEPS, GLOBAL_BATCH)
    start, losses = resume(out / "run", model, optimizer)
    if rank == 0:
        (out / "started").write_text(str(start))
    for step in range(start, STOP_AT or MAX_STEPS):
        losses[step + 1] = train_step(model, optimizer, data[step])
        if (step + 1) % MERGE_EVERY == 0:
            merge_and_reinit(model)
            reset_optimizer_state(optimizer, poet_parameters(model))
        if (step + 1) % SAVE_STEPS == 0:
            save(out / "run", step + 1, model, optimizer, losses, kill_point)
        if rank == 0:
            (out / "progress").write_text(str(step + 1))
    if not STOP_AT:
        export_merged(model, out / "export", overwrite=True, spectrum=False)
    if rank == 0 and not STOP_AT:
        result = {"losses": losses, "global_step": MAX_STEPS, "world": dist.get_world_size()}
        (out / "result.json").write_text(json.dumps(result))
    from poet_hf.training.distributed import end_distributed

    end_distributed(exit_process=True)  # barrier, destroy, then exit before gloo can abort the finalization


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
