"""A tiny POET run that resumes with ``resume_from_checkpoint="auto"``, for the chaos tests of test_checkpoints.py.

Usage: chaos_worker.py OUT_DIR [KILL_POINT]. Runs (or, started as DDP ranks, every rank runs) a POET training
into OUT_DIR with checkpoints every 3 steps, merges every 5, at most 2 checkpoints kept and 2 sequences a step on any
process count, for CHAOS_MAX_STEPS steps (default 60); at the end rank 0 writes OUT_DIR/result.json (per-step losses
and a hash of every parameter and buffer).

KILL_POINT names a moment at which the process SIGKILLs itself (test-only, patched in here):

- ``staging``: inside a checkpoint write, after the weights and optimizer are written, before the trainer state;
- ``publish``: after the manifest is written, just before the staged folder is renamed onto its checkpoint name;
- ``rotate``: in the middle of deleting an old checkpoint (one file gone);
- ``merge``: inside merge-then-reinitialize, after half of the layers are folded;
- ``disk_full``: not a kill: while the second checkpoint is written, no file may grow past 4 KiB (``RLIMIT_FSIZE``,
  with ``SIGXFSZ`` ignored, so a write fails as on a full disk).

With ``CHAOS_STOP_AT=S`` (a checkpoint's step) it stops cleanly after step S and writes no result.

``OUT_DIR/started`` appears when training starts (a parent kills at random moments after it), holding the step it
starts from; ``OUT_DIR/progress`` holds the last step done, and ``OUT_DIR/killed`` appears when a kill point fires.
Under ``accelerate launch`` with a DeepSpeed config it is the ZeRO leg of ``scripts/benchmark.py --suite chaos``.
"""

import json
import os
import signal
import sys
from pathlib import Path

from transformers import TrainerCallback

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "helpers"))
from training_utils import state_hash, tiny_dataset, tiny_poet_model, tiny_trainer  # noqa: E402

MAX_STEPS = int(os.environ.get("CHAOS_MAX_STEPS", "60"))  # the tests that kill at one moment need fewer
STOP_AT = int(os.environ.get("CHAOS_STOP_AT", "0"))  # stop cleanly after this step's checkpoint (a replay's segment)
SAVE_STEPS, MERGE_EVERY = 3, 5
GLOBAL_BATCH = 2  # sequences per step, whatever the process count: 2 on one process, 1 on each of two


def die(out: Path) -> None:
    """SIGKILL this process, leaving ``OUT/killed`` (a launch that died without it crashed); under DDP the launcher
    (torchrun's agent, or tests/helpers/prewarmed.py) then stops the other ranks and the launch fails."""
    (out / "killed").touch()
    os.kill(os.getpid(), signal.SIGKILL)


def install_kill_point(point: str, out: Path) -> None:
    import shutil

    from transformers import Trainer

    import poet_hf.checkpoints as checkpoints
    from poet_hf.tuners.rotation.layer import RotationLayer

    if point == "staging":
        save_rng = Trainer._save_rng_state

        def killed_after_rng(self, output_dir):
            save_rng(self, output_dir)
            die(out)

        Trainer._save_rng_state = killed_after_rng
    elif point == "publish":
        replace = os.replace

        def killed_replace(src, dst):
            if Path(src).parent.name == checkpoints.STAGING_DIR:
                die(out)
            replace(src, dst)

        checkpoints.os.replace = killed_replace
    elif point == "rotate":
        rmtree = shutil.rmtree

        def killed_rmtree(path, *args, **kwargs):
            if Path(path).name.startswith("deleting-") and Path(path).exists():
                next(p for p in Path(path).rglob("*") if p.is_file()).unlink()
                die(out)
            rmtree(path, *args, **kwargs)

        checkpoints.shutil.rmtree = killed_rmtree
    elif point == "merge":
        merge, calls = RotationLayer.merge_and_reinit, []

        def killed_merge(self, *args, **kwargs):
            calls.append(1)
            if len(calls) == 3:  # of the tiny model's 14 layers
                die(out)
            return merge(self, *args, **kwargs)

        RotationLayer.merge_and_reinit = killed_merge
    elif point == "disk_full":
        import resource

        save, saves = Trainer._save_checkpoint, []

        def save_on_a_full_disk(self, *args, **kwargs):
            saves.append(1)
            if len(saves) < 2:
                return save(self, *args, **kwargs)
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
            resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
            try:
                return save(self, *args, **kwargs)
            finally:  # the log may grow again: only the checkpoint's files met the full disk
                resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))

        Trainer._save_checkpoint = save_on_a_full_disk
    elif point:
        raise ValueError(f"unknown kill point {point!r}")


class MarkProgress(TrainerCallback):
    """``OUT/started`` holds the step training starts from, ``OUT/progress`` the last step done (rank 0 writes)."""

    def __init__(self, out: Path):
        self.out = out

    def on_train_begin(self, args, state, control, **kwargs):
        if args.process_index == 0:
            (self.out / "started").write_text(str(state.global_step))

    def on_step_end(self, args, state, control, **kwargs):
        if args.process_index == 0:
            (self.out / "progress").write_text(str(state.global_step))
        if state.global_step == STOP_AT:
            control.should_training_stop = True  # after this step's checkpoint, which the schedule puts here


def main() -> None:
    out = Path(sys.argv[1])
    install_kill_point(sys.argv[2] if len(sys.argv) > 2 else "", out)
    dataset, tokenizer = tiny_dataset()
    model = tiny_poet_model(len(tokenizer), merge_every=MERGE_EVERY)
    trainer = tiny_trainer(
        out / "run",
        model,
        dataset,
        max_steps=MAX_STEPS,
        save_strategy="steps",
        save_steps=SAVE_STEPS,
        save_total_limit=2,
        per_device_train_batch_size=GLOBAL_BATCH // int(os.environ.get("WORLD_SIZE", "1")),
    )
    trainer.add_callback(MarkProgress(out))
    output = trainer.train(resume_from_checkpoint="auto")
    if trainer.args.process_index == 0 and not STOP_AT:
        losses = {log["step"]: log["loss"] for log in trainer.state.log_history if "loss" in log}
        (out / "result.json").write_text(
            json.dumps(
                {
                    "losses": losses,
                    "hash": state_hash(model),
                    "global_step": trainer.state.global_step,
                    "complete": bool(output.metrics.get("run_complete")),
                    "world": trainer.args.world_size,
                }
            )
        )


if __name__ == "__main__":
    main()
    from poet_hf.training.distributed import end_distributed

    end_distributed(exit_process=True)  # accelerate's gloo group: exit before it can abort the finalization
