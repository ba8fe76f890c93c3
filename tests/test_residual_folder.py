"""The residual files' folder (poet_hf.tuners.rotation.residual_folder): its free-space check, its tmpfs warning, the
folders of killed processes removed at the next start, and each model's folder its own.

References: the files the merges actually write (their sizes on disk), ``stat -f`` for a file system's type, and
processes killed with SIGKILL.
"""

from __future__ import annotations

import gc
import math
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import bitsandbytes  # noqa: F401  (the `quant` extra, part of `dev`)
import prewarmed
import pytest
import torch
from peft import get_peft_model
from torch import nn

import poet_hf  # noqa: F401
from poet_hf import PoetConfig, merge_and_reinit, plan_memory
from poet_hf.tuners.rotation import residual_folder
from poet_hf.tuners.rotation.layer import rotation_layers
from poet_hf.tuners.rotation.model import set_residual_folder
from poet_hf.tuners.rotation.residual_folder import PREFIX, ResidualSpaceError

ROOT = Path(__file__).resolve().parent.parent
PRETRAIN = ROOT / "scripts" / "pretrain.py"
RUN_ENV = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}  # of every scripts/pretrain.py run here
SHAPES = {"up": (128, 256), "down": (256, 128)}  # (in, out) of each target


class TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(*SHAPES["up"]), nn.Linear(*SHAPES["down"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x)))


@pytest.fixture
def parent(tmp_path):
    """A parent folder of this test's own."""
    return tmp_path / "residuals"


def nf4_model(parent: Path | None = None) -> nn.Module:
    """A two-layer POET model with an nf4 ``W0`` whose residual files go under ``parent`` (default: the temp folder)."""
    torch.manual_seed(0)
    config = PoetConfig(target_modules=list(SHAPES), block_size=32, base_quantization="nf4", residual_storage="disk")
    model = get_peft_model(TwoLayers(), config)
    set_residual_folder(model, parent)
    return model


def folder_of(model: nn.Module) -> residual_folder.ResidualFolder:
    return rotation_layers(model)[0][1].step_state.residual_folder


def residual_files(parent: Path) -> list[Path]:
    return [f for folder in parent.glob(f"{PREFIX}*") for f in folder.glob("residual-*.safetensors")]


def test_the_free_space_check_refuses_before_any_file_and_names_the_folder_and_bytes(parent, monkeypatch):
    """A disk with one byte less than the residual files need refuses the first merge before anything is folded or
    written; the message names the folder and the bytes, which are the int8 codes and float32 scale per 64 entries of
    every W0. With exactly enough the merge runs."""
    model = nf4_model(parent)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    needed = sum(i * o + 4 * math.ceil(i * o / 64) for i, o in SHAPES.values())
    usage = shutil.disk_usage(parent.parent)
    monkeypatch.setattr(
        residual_folder.shutil, "disk_usage", lambda path: usage._replace(free=needed - 1)
    )  # a size-limited disk
    with pytest.raises(ResidualSpaceError) as refused:
        merge_and_reinit(model)
    assert str(parent) in str(refused.value)
    assert f"{needed / 2**20:,.0f} MiB" in str(refused.value)
    assert residual_files(parent) == []
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())  # nothing folded
    monkeypatch.setattr(residual_folder.shutil, "disk_usage", lambda path: usage._replace(free=needed))
    merge_and_reinit(model)  # exactly enough: it runs
    assert len(residual_files(parent)) == len(SHAPES)


def test_the_counted_bytes_are_what_the_files_take_and_what_plan_memory_reports(parent):
    """After a merge, the residual files hold the counted bytes (plus one safetensors header each, under 1 KiB);
    `plan_memory` reports the same count beside the memory for the tiny preset's nf4 run."""
    model = nf4_model(parent)
    merge_and_reinit(model)
    files = residual_files(parent)
    counted, written = folder_of(model).disk_bytes()
    on_disk = sum(f.stat().st_size for f in files)
    assert written == on_disk
    assert 0 <= on_disk - counted < 1024 * len(files)
    assert counted == sum(i * o + 4 * math.ceil(i * o / 64) for i, o in SHAPES.values())
    # The tiny preset: 4 blocks, each q, k, v, o of 128 × 128 and gate, up, down of 128 × 256.
    tiny = [128 * 128] * 16 + [128 * 256] * 12
    plan = plan_memory("tiny", "poet-bs", block_size=32, base_quantization="nf4")
    assert plan.residual_bytes == sum(n + 4 * math.ceil(n / 64) for n in tiny)
    assert plan_memory("tiny", "poet-bs", block_size=32).residual_bytes == 0  # a float32 W0 keeps none
    on_layer = plan_memory("tiny", "poet-bs", block_size=32, base_quantization="nf4", residual_storage="layer")
    assert on_layer.residual_bytes == 0  # counted in W0 instead


def test_each_model_counts_and_keeps_its_own_files_and_takes_them_when_freed(tmp_path):
    """Two models with residual files under two parents: each counts its own two files (not the other's), a copy
    writes under its original's parent, and a freed model's folder goes with it."""
    needed = sum(i * o + 4 * math.ceil(i * o / 64) for i, o in SHAPES.values())
    first, second = nf4_model(tmp_path / "first"), nf4_model(tmp_path / "second")
    merge_and_reinit(first)
    merge_and_reinit(second)
    assert len(residual_files(tmp_path / "first")) == len(residual_files(tmp_path / "second")) == len(SHAPES)
    assert folder_of(first).disk_bytes()[0] == folder_of(second).disk_bytes()[0] == needed
    copy = pickle.loads(pickle.dumps(first))
    assert folder_of(copy).parent == tmp_path / "first" and folder_of(copy) is not folder_of(first)
    assert folder_of(copy).disk_bytes()[0] == needed  # the copy's stores count in the copy's folder
    folder = folder_of(first).current()
    assert folder is not None and folder.is_dir()
    del first
    gc.collect()
    assert not folder.exists()
    assert len(residual_files(tmp_path / "second")) == len(SHAPES)


def test_a_folder_its_owner_removes_during_the_scan_is_left_alone(tmp_path, monkeypatch):
    """Folders now go with their model, so another process may remove one between the scan seeing its lock file and
    opening it (seen as a FileNotFoundError in a 2-process test run); the scan leaves it to its owner."""
    folder = tmp_path / f"{PREFIX}{os.getpid()}-x"
    folder.mkdir()
    (folder / residual_folder.LOCK_FILE).write_bytes(b"")
    real_open = os.open

    def vanished(path, *args, **kwargs):
        if str(path).endswith(residual_folder.LOCK_FILE):
            raise FileNotFoundError(path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(residual_folder.os, "open", vanished)
    assert residual_folder.remove_stale_folders(tmp_path) == []


def filesystem_of(path: Path) -> str:
    """The file system type of ``path`` as coreutils' ``stat -f`` names it."""
    return subprocess.run(["stat", "-f", "-c", "%T", str(path)], capture_output=True, text=True).stdout.strip()


def test_a_parent_on_tmpfs_warns_that_the_files_are_ram(tmp_path):
    shm = Path("/dev/shm")
    if not shm.is_dir() or filesystem_of(shm) != "tmpfs" or filesystem_of(tmp_path) == "tmpfs":
        pytest.skip("needs /dev/shm on a tmpfs and a temp folder on a disk")
    try:
        with pytest.warns(UserWarning, match="tmpfs"):
            merge_and_reinit(nf4_model(shm / f"poet-test-{os.getpid()}"))
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("error")
            merge_and_reinit(nf4_model(tmp_path))  # on a disk: no warning
    finally:
        shutil.rmtree(shm / f"poet-test-{os.getpid()}", ignore_errors=True)


HOLDER = """
import sys, time
import torch
from poet_hf.tuners.rotation.residual_folder import ResidualFolder
owner = ResidualFolder(sys.argv[1])
folder = owner.path()
(folder / "residual-x.safetensors").write_bytes(b"0" * 1000)
print(folder, flush=True)
time.sleep(600)
"""


def test_only_the_folders_of_dead_processes_are_removed(parent):
    """Of two processes that opened residual folders, the one killed with SIGKILL leaves its folder, which the next
    start removes; the live one's folder stays, and so does a folder that is not one of ours."""
    holders = [
        subprocess.Popen([sys.executable, "-c", HOLDER, str(parent)], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    try:
        dead, alive = (Path(h.stdout.readline().strip()) for h in holders)
        holders[0].send_signal(signal.SIGKILL)
        holders[0].wait()
        foreign = parent / f"{PREFIX}not-ours"
        foreign.mkdir()
        assert dead.exists() and alive.exists()
        model = nf4_model(parent)  # a run whose residuals go to disk starts: its stores count the files it will write
        for _, layer in rotation_layers(model):
            layer.attach_residual_store("default")
        assert folder_of(model).disk_bytes()[0] > 0
        folder_of(model).check_disk_space()  # what a start runs
        del model
        assert not dead.exists()
        assert alive.exists() and foreign.exists()
    finally:
        for holder in holders:
            holder.kill()
            holder.wait()


def _pretrain_args(out: Path, parent: Path, resume: bool) -> list[str]:
    args = ["--base_quantization", "nf4", "--max_steps", "16", "--merge_every", "2", "--save_steps", "2"]
    args += ["--output_dir", str(out), "--residual_folder", str(parent), "--max_eval_samples", "8"]
    return [*args, "--logging_steps", "1000", *(["--resume_from_checkpoint", "auto"] if resume else [])]


def _run_to_be_killed(out: Path, parent: Path, resume: bool) -> prewarmed.Ranks:
    """``scripts/pretrain.py`` with an nf4 ``W0``, forked from the imports-only server (tests/helpers/prewarmed.py): a
    process of its own, whose pid names its residual folder, that a SIGKILL ends as it ends any process."""
    return prewarmed.start(PRETRAIN, _pretrain_args(out, parent, resume), out.parent / "killed.log", env=RUN_ENV)


@pytest.mark.slow
def test_a_run_killed_three_times_and_resumed_leaves_no_residual_folder_behind(tmp_path):
    """``scripts/pretrain.py`` with an nf4 ``W0`` (residual files on disk) is SIGKILLed three times once it has written
    residual files and a checkpoint, and restarted with ``--resume_from_checkpoint auto`` each time: each killed run
    leaves its folder, the next start removes it, and once the last run ends no folder is left."""
    parent, out = tmp_path / "residuals", tmp_path / "run"
    for life in range(3):
        run = _run_to_be_killed(out, parent, resume=life > 0)
        pid = run.processes[0].pid
        deadline = time.monotonic() + 300
        mine = None
        while time.monotonic() < deadline and run.poll() is None:
            mine = next(iter(parent.glob(f"{PREFIX}{pid}-*")), None)
            checkpoints = list(out.glob("checkpoint-*"))
            if mine is not None and any(mine.glob("residual-*")) and checkpoints:
                break
            time.sleep(0.2)
        assert run.poll() is None, "the run ended before it could be killed"
        run.kill()
        assert mine is not None and mine.exists()  # a killed process leaves its folder
        assert len(list(parent.glob(f"{PREFIX}*"))) == 1  # the previous killed run's is gone
    # The last run ends as an interpreter ends (its exit handlers run): a fresh one, started as a user starts it.
    last = [sys.executable, str(PRETRAIN), *_pretrain_args(out, parent, resume=True)]
    assert subprocess.run(last, env={**os.environ, **RUN_ENV}, capture_output=True, timeout=600).returncode == 0
    assert list(parent.glob(f"{PREFIX}*")) == []
