"""Crash-safe checkpoints: a ``checkpoint-N`` folder exists only once all of it is on disk.

Resuming picks the newest complete one.

`CrashSafeTrainer` is a ``transformers.Trainer`` whose checkpoints are written atomically:

1. every file (weights or adapter with the POET state, optimizer, scheduler, RNG, ``trainer_state.json``) is written
   into ``<output_dir>/.staging/checkpoint-N`` by the Trainer's own code;
2. after a barrier (all of it written), each process ``fsync``s the folder, then all wait at a second barrier;
3. the main process writes `MANIFEST_NAME` (every file and its size), ``fsync``s it, and publishes the folder
   with one ``os.replace`` onto ``checkpoint-N``, then ``fsync``s the output folder;
4. only then are old checkpoints rotated out (``save_total_limit``), each first moved out of sight, so a kill during
   a deletion never leaves a damaged folder under a checkpoint name, and the newest complete one is never deleted.

A kill at any moment leaves either a complete checkpoint or none under that name; leftovers in ``.staging`` are
cleared at the next save. ``train(resume_from_checkpoint="auto")`` (also ``"latest"`` or ``True``) resumes from the
newest complete checkpoint of ``output_dir``, warns about and skips partial folders (from a plain ``Trainer`` or a
damaged disk), starts fresh with a message when there is none, and does nothing, saying so, when that checkpoint
ended the run.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any, cast

from transformers import Trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, TrainOutput

from ._quiet_imports import quiet_deepspeed_probe
from .tuners.rotation.state_checks import AdapterStateError, check_safetensors_file

__all__ = [
    "CrashSafeTrainer",
    "MANIFEST_NAME",
    "STAGING_DIR",
    "checkpoint_problem",
    "latest_complete_checkpoint",
    "resolve_resume_checkpoint",
    "RESUME_LATEST",
]

logger = logging.getLogger(__name__)

MANIFEST_NAME = "checkpoint_manifest.json"
STAGING_DIR = ".staging"
TRAINER_STATE_NAME = "trainer_state.json"
RESUME_LATEST = ("auto", "latest")  # what --resume_from_checkpoint accepts besides a folder
_CHECKPOINT_NAME = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")


# --- what is complete -------------------------------------------------------------------------------------------------
def checkpoint_problem(folder: str | Path) -> str | None:
    """Why ``folder`` is not a complete checkpoint (``None`` if it is).

    With a manifest (every checkpoint this package writes), each listed file must exist with its size; without one
    (a plain ``Trainer``'s), ``trainer_state.json`` must parse. Every safetensors file must be whole.
    """
    folder = Path(folder)
    manifest = folder / MANIFEST_NAME
    if manifest.is_file():
        try:
            sizes = json.loads(manifest.read_text())["files"]
        except (ValueError, KeyError) as error:
            return f"unreadable {MANIFEST_NAME} ({error})"
        for name, size in sizes.items():
            path = folder / name
            if not path.is_file() or path.stat().st_size != size:
                return f"{name} is missing or has the wrong size"
    else:
        try:
            json.loads((folder / TRAINER_STATE_NAME).read_text())
        except (OSError, ValueError):
            return f"no readable {TRAINER_STATE_NAME} (a write that did not finish)"
    for weights in folder.rglob("*.safetensors"):
        try:
            check_safetensors_file(weights)
        except AdapterStateError as error:
            return str(error)
    return None


def _checkpoints_by_step(output_dir: str | Path) -> list[tuple[int, Path]]:
    folder = Path(output_dir)
    if not folder.is_dir():
        return []
    found = [
        (int(match.group(1)), path)
        for path in folder.iterdir()
        if path.is_dir() and (match := _CHECKPOINT_NAME.match(path.name))
    ]
    return sorted(found)


def latest_complete_checkpoint(output_dir: str | Path) -> str | None:
    """The newest complete ``checkpoint-N`` in ``output_dir``, or ``None``.

    Every newer partial folder is named in a warning and skipped."""
    for _, path in reversed(_checkpoints_by_step(output_dir)):
        problem = checkpoint_problem(path)
        if problem is None:
            return str(path)
        logger.warning("skipping %s: not a complete checkpoint (%s)", path, problem)
    return None


def resolve_resume_checkpoint(value: str | bool | None, output_dir: str | Path) -> str | None:
    """The checkpoint folder a ``resume_from_checkpoint`` value means.

    ``"auto"``, ``"latest"`` or ``True``: the newest complete checkpoint of ``output_dir``, or ``None`` (a fresh
    start, logged) when there is none. A folder: itself, if complete. ``None``/``False``/``""``: ``None``.
    """
    if value is None or value is False or value == "":
        return None
    if value is True or (isinstance(value, str) and value.lower() in RESUME_LATEST):
        checkpoint = latest_complete_checkpoint(output_dir)
        if checkpoint is None:
            logger.warning(
                "resume_from_checkpoint=%r: no complete checkpoint in %s, starting from scratch", value, output_dir
            )
        else:
            logger.warning("resuming from %s, the newest complete checkpoint in %s", checkpoint, output_dir)
        return checkpoint
    if not Path(value).is_dir():
        raise ValueError(
            f"`resume_from_checkpoint`={value!r} is neither a checkpoint folder nor one of "
            f"{RESUME_LATEST + (True,)} (the newest complete checkpoint of the output folder)"
        )
    problem = checkpoint_problem(value)
    if problem is not None:
        raise ValueError(
            f"`resume_from_checkpoint`={value!r} is not a complete checkpoint: {problem}; pass 'auto' to "
            "resume from the newest complete one"
        )
    return str(value)


# --- writing ----------------------------------------------------------------------------------------------------------
def _fsync(path: str | Path, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(folder: str | Path) -> None:
    """Flush every file under ``folder`` and the folders themselves to disk."""
    for root, _, files in os.walk(folder):
        for name in files:
            _fsync(os.path.join(root, name))
        _fsync(root, directory=True)


def publish(staged: str | Path, final: str | Path) -> None:
    """Write the manifest of ``staged`` and move it onto ``final`` in one rename.

    An older folder of that name is first moved out of sight."""
    staged, final = Path(staged), Path(final)
    files = {str(p.relative_to(staged)): p.stat().st_size for p in sorted(staged.rglob("*")) if p.is_file()}
    manifest = staged / MANIFEST_NAME
    manifest.write_text(json.dumps({"files": files}, indent=1))
    _fsync(manifest)
    _fsync(staged, directory=True)
    if final.exists():
        discard(final, staged.parent)
    os.replace(staged, final)
    _fsync(final.parent, directory=True)


def discard(folder: str | Path, staging_root: str | Path) -> None:
    """Delete ``folder`` after moving it into ``staging_root``.

    A kill midway then leaves nothing half-deleted under a checkpoint name."""
    trash = Path(staging_root) / f"deleting-{Path(folder).name}"
    trash.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(trash, ignore_errors=True)
    os.replace(folder, trash)
    shutil.rmtree(trash, ignore_errors=True)


def rotate(output_dir: str | Path, save_total_limit: int | None, keep: set[str]) -> None:
    """``save_total_limit`` rotation: delete the oldest checkpoints beyond the limit.

    Never a folder in ``keep``: the checkpoint just published, which is the newest complete one, and the best model."""
    if not save_total_limit or save_total_limit <= 0:
        return
    checkpoints = [path for _, path in _checkpoints_by_step(output_dir)]
    protected = {str(Path(p)) for p in keep}
    excess = len(checkpoints) - max(save_total_limit, len(protected))
    for path in checkpoints:
        if excess <= 0:
            break
        if str(path) not in protected:
            discard(path, Path(output_dir) / STAGING_DIR)
            excess -= 1


UNIVERSAL_SUFFIX = "_universal"  # DeepSpeed's universal checkpoint beside global_stepN (training/zero_universal.py)


def zero_states_folder(checkpoint: str | Path) -> Path | None:
    """The DeepSpeed states of ``checkpoint`` as it was written (``global_stepN``), if it holds any."""
    steps = sorted(p for p in Path(checkpoint).glob("global_step*") if not p.name.endswith(UNIVERSAL_SUFFIX))
    return steps[-1] if steps else None


def zero_states_processes(checkpoint: str | Path) -> int:
    """How many processes wrote the DeepSpeed ZeRO optimizer states of ``checkpoint`` (0: it holds none).

    DeepSpeed partitions them by process: ``global_stepN/*zero_pp_rank_<r>_*_optim_states.pt``."""
    folder = zero_states_folder(checkpoint)
    return len(list(folder.glob("*zero_pp_rank_*_optim_states.pt"))) if folder else 0


def check_zero_states_resumable(checkpoint: str | Path, world_size: int, deepspeed: bool, reshards: bool) -> None:
    """Refuse, before any work, a checkpoint whose DeepSpeed ZeRO optimizer states this run cannot load.

    DeepSpeed loads ZeRO states only under DeepSpeed, and on as many processes as wrote them unless it reshards them
    (ZeRO-3, through its universal checkpoint: `poet_hf.training.zero_universal`). A DDP checkpoint (``optimizer.pt``)
    resumes on any process count.

    Args:
        checkpoint: the checkpoint folder to resume.
        world_size: the run's process count.
        deepspeed: whether the run uses DeepSpeed.
        reshards: whether the run can load ZeRO states written by another process count.

    Raises:
        ValueError: the checkpoint's ZeRO states were written by another process count, or the run has no DeepSpeed.
    """
    ranks = zero_states_processes(checkpoint)
    if ranks and (not deepspeed or (ranks != world_size and not reshards)):
        this_run = f"{world_size} process(es) {'under DeepSpeed' if deepspeed else 'without DeepSpeed'}"
        raise ValueError(
            f"{checkpoint} holds DeepSpeed ZeRO optimizer states of {ranks} processes, which DeepSpeed loads only "
            f"under DeepSpeed, on {ranks} processes or, with ZeRO-3, on any count; this run has {this_run}. Resume it "
            f"with the launch that wrote it (--num_processes {ranks} and its DeepSpeed config), under ZeRO-3, or "
            "start a new run from its weights (--model_name_or_path on the exported checkpoint)"
        )


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (a full disk, a quota); the checkpoints already published are untouched.

    Args:
        name: the checkpoint's folder name (``checkpoint-N``).
        staging_root: the staging folder it was being written into.
        run_dir: the run's output folder.
        error: what the write raised.
    """

    def __init__(self, name: str, staging_root: str, run_dir: str, error: BaseException) -> None:
        latest = latest_complete_checkpoint(run_dir)
        free = shutil.disk_usage(run_dir).free / 2**20 if os.path.isdir(run_dir) else float("nan")
        kept = f"the newest complete checkpoint, {latest}, is untouched" if latest else "no checkpoint was published"
        super().__init__(
            f"could not write {name} into {staging_root} ({type(error).__name__}: {error}); {kept}: make room on "
            f"that disk ({free:,.0f} MiB free) and resume with resume_from_checkpoint='auto'"
        )


class CrashSafeTrainer(Trainer):
    """``transformers.Trainer`` with atomic checkpoints and ``resume_from_checkpoint="auto"`` (module docstring).

    Under DDP and FSDP2 every process writes its part into the staging folder as the Trainer does; the main process
    publishes after a barrier. Loading a checkpoint checks its adapter state (index tensors, skew shapes, merge counts,
    whole files) and names the file in any error.
    """

    _staging_root: str | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        with quiet_deepspeed_probe():  # Accelerate imports DeepSpeed here, which warns on a machine without CUDA
            super().__init__(*args, **kwargs)

    def _get_output_dir(self, trial: Any) -> str:
        return self._staging_root or super()._get_output_dir(trial)

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        run_dir = super()._get_output_dir(trial)
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        staging_root = os.path.join(run_dir, STAGING_DIR)
        if self.args.should_save:
            shutil.rmtree(staging_root, ignore_errors=True)  # a save or a deletion a kill interrupted
        self.accelerator.wait_for_everyone()
        self._staging_root = staging_root
        try:
            super()._save_checkpoint(model, trial)  # every file, into staging_root/name
        except Exception as error:  # a full disk is an OSError, a RuntimeError (torch.save) or a SafetensorError
            raise CheckpointWriteError(name, staging_root, run_dir, error) from error
        finally:
            self._staging_root = None
        staged = os.path.join(staging_root, name)
        best = self.state.best_model_checkpoint
        if best and os.path.dirname(best) == staging_root:
            self.state.best_model_checkpoint = os.path.join(run_dir, os.path.basename(best))
            if self.args.should_save:
                self.state.save_to_json(os.path.join(staged, TRAINER_STATE_NAME))
        self.accelerator.wait_for_everyone()  # every file is written: nothing changes in `staged` from here on
        if os.path.isdir(staged):
            fsync_tree(staged)  # on every process, so that a multi-node run's shards are flushed by their writers
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            final = os.path.join(run_dir, name)
            publish(staged, final)
            best = self.state.best_model_checkpoint
            rotate(run_dir, self.args.save_total_limit, {final, best} if best else {final})
            shutil.rmtree(staging_root, ignore_errors=True)  # empty by now: leave the output folder clean
        self.accelerator.wait_for_everyone()

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        try:
            super()._load_from_checkpoint(resume_from_checkpoint, model)
        except AdapterStateError as error:
            raise error.in_file(resume_from_checkpoint) from None

    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
        **kwargs: Any,
    ) -> TrainOutput:
        """``Trainer.train``; ``resume_from_checkpoint`` may also be ``"auto"``/``"latest"`` (module docstring)."""
        checkpoint = resolve_resume_checkpoint(resume_from_checkpoint, cast(str, self.args.output_dir))
        if checkpoint is not None:
            self._prepare_resume(checkpoint)
        if checkpoint is not None and self._finished_at(checkpoint):
            return self._load_finished_run(checkpoint)
        return super().train(
            resume_from_checkpoint=checkpoint, trial=trial, ignore_keys_for_eval=ignore_keys_for_eval, **kwargs
        )

    def _prepare_resume(self, checkpoint: str) -> None:
        """Refuse ``checkpoint`` before any work if this run cannot load its optimizer states
        (`check_zero_states_resumable`)."""
        check_zero_states_resumable(checkpoint, self.args.world_size, self.is_deepspeed_enabled, reshards=False)

    def _finished_at(self, checkpoint: str) -> bool:
        """Whether ``checkpoint`` ended its run and the arguments ask for no more steps."""
        state = json.loads(Path(checkpoint, TRAINER_STATE_NAME).read_text())
        step, last = state.get("global_step", 0), state.get("max_steps", 0)
        return bool(last) and step >= last and (self.args.max_steps <= 0 or self.args.max_steps <= step)

    def _load_finished_run(self, checkpoint: str) -> TrainOutput:
        from transformers.trainer_callback import TrainerState

        self._load_from_checkpoint(checkpoint)
        self.state = TrainerState.load_from_json(os.path.join(checkpoint, TRAINER_STATE_NAME))
        logger.warning(
            "the run is complete: %s is step %d of %d; nothing to train (raise max_steps to train on)",
            checkpoint,
            self.state.global_step,
            self.state.max_steps,
        )
        # The callbacks see a run of no steps, begun and ended on the checkpoint: what they report at the end (the
        # spectrum's drift from the initial weights, the merges' history restored from the checkpoint) is the finished
        # run's, as an uninterrupted run would have reported it.
        self.control = self.callback_handler.on_train_begin(self.args, self.state, self.control)
        self.control = self.callback_handler.on_train_end(self.args, self.state, self.control)
        losses = [log["loss"] for log in self.state.log_history if "loss" in log]
        return TrainOutput(
            self.state.global_step,
            sum(losses) / len(losses) if losses else float("nan"),
            {"train_runtime": 0.0, "run_complete": True},
        )
