"""Crash-safe checkpoints (poet_hf.checkpoints) and checked loads (poet_hf.tuners.rotation.state_checks).

- A fresh process draws the same SPO permutations from the same seed, which is what lets a restarted run redraw them.
- A run SIGKILLed at random moments and at named points (inside a checkpoint write, just before its publication,
  inside a rotation, inside a merge), each time restarted with ``resume_from_checkpoint="auto"``, ends bit for bit
  where an uninterrupted run ends; the same under 2-process DDP.
- Resuming a finished run takes no step and says the run is complete.
- An adapter damaged in each way the math cares about fails at load time, naming the file, the tensor and the fault.
"""

from __future__ import annotations

import json
import logging
import random
import re
import signal
import subprocess
import time
from pathlib import Path

import prewarmed
import pytest
import torch
from models import tiny_llama
from safetensors.torch import load_file, save_file

from poet_hf.checkpoints import (
    MANIFEST_NAME,
    STAGING_DIR,
    checkpoint_problem,
    latest_complete_checkpoint,
    resolve_resume_checkpoint,
)
from poet_hf.orthogonal import sample_permutation, spo_generator
from poet_hf.tuners.rotation.state_checks import AdapterStateError

HERE = Path(__file__).resolve().parent
WORKER = HERE / "workers" / "chaos_worker.py"
ENV = {"OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "1", "PYTHONWARNINGS": "ignore"}


# --- determinism across processes ------------------------------------------------------------------------------------
def test_same_seed_gives_same_permutation_in_a_fresh_process(tmp_path):
    """A new process that has drawn nothing (forked from the imports-only server of tests/helpers/prewarmed.py) draws
    the permutations this one draws: what a restarted run needs to redraw the killed run's (SPO is keyed, not
    stateful)."""
    (tmp_path / "draw.py").write_text(
        "import json, sys\n"
        "from poet_hf.orthogonal import sample_permutation, spo_generator\n"
        "draw = sample_permutation(32, spo_generator(7, 2, 'layers.3.mlp.up_proj', 'output'))\n"
        "open(sys.argv[1], 'w').write(json.dumps(draw.tolist()))\n"
    )
    prewarmed.run(tmp_path / "draw.py", [tmp_path / "draw.json"], tmp_path / "draw.log")
    here = sample_permutation(32, spo_generator(7, 2, "layers.3.mlp.up_proj", "output")).tolist()
    assert json.loads((tmp_path / "draw.json").read_text()) == here


# --- chaos -----------------------------------------------------------------------------------------------------------
def _start(out: Path, point: str = "", ddp: bool = False, ranks: int | None = None, steps: int = 60) -> prewarmed.Ranks:
    """One run of the worker: a process, or 2 DDP ranks (gloo) set up as torchrun sets them up (``ranks``: that many),
    of ``steps`` steps, forked from a server that has done the imports (tests/helpers/prewarmed.py: 18 launches would
    otherwise spend minutes importing)."""
    (out / "started").unlink(missing_ok=True)
    env = {**ENV, "CHAOS_MAX_STEPS": str(steps)}
    return prewarmed.start(WORKER, [out, point], out / "stderr.log", env=env, ranks=ranks or (2 if ddp else 1))


def _finish(process: prewarmed.Ranks, out: Path, timeout: float = 300) -> int:
    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        pytest.fail(f"the worker hung; its log:\n{(out / 'stderr.log').read_text()[-3000:]}")


def _wait_started(process: prewarmed.Ranks, out: Path) -> None:
    deadline = time.monotonic() + 120
    while not (out / "started").exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)


def _kill_at_random(process: prewarmed.Ranks, out: Path, rng: random.Random, window: float) -> bool:
    """SIGKILL the worker's processes at a random moment of its training; whether the kill landed (it had not
    finished)."""
    _wait_started(process, out)
    time.sleep(rng.uniform(0.0, window))
    if process.poll() is not None:
        return False
    process.kill()
    return True


def _result(out: Path) -> dict:
    return json.loads((out / "result.json").read_text())


def _checkpoint_names(run: Path) -> list[str]:
    return sorted(p.name for p in run.iterdir() if p.name.startswith("checkpoint-"))


def _chaos(tmp_path: Path, plan: list[str], ddp: bool, seed: int) -> None:
    reference, chaos = tmp_path / "reference", tmp_path / "chaos"
    reference.mkdir()
    chaos.mkdir()
    process = _start(reference, ddp=ddp)
    _wait_started(process, reference)
    started = time.monotonic()
    assert _finish(process, reference) == 0, (reference / "stderr.log").read_text()[-3000:]
    # Random kills fall within the first 1/(2(k+1)) of a whole run's training time, so that k of them cannot finish it
    # even on a machine that got twice as fast meanwhile.
    window = (time.monotonic() - started) / (2 * (plan.count("random") + 1))
    rng = random.Random(seed)
    kills = 0
    for point in plan:
        process = _start(chaos, "" if point == "random" else point, ddp=ddp)
        if point == "random":
            assert _kill_at_random(process, chaos, rng, window), (chaos / "stderr.log").read_text()[-3000:]
            kills += 1
            continue
        code = _finish(process, chaos)
        # The named point was reached and killed its process (a run that got past it would have exited 0).
        log = (chaos / "stderr.log").read_text()[-3000:]
        assert code == -signal.SIGKILL, (point, code, log)
        assert not (chaos / "result.json").exists(), point
        kills += 1
        names = _checkpoint_names(chaos / "run")
        assert all(checkpoint_problem(chaos / "run" / name) is None for name in names), (point, names)
    assert kills >= (3 if ddp else 8)
    assert _finish(_start(chaos, ddp=ddp), chaos) == 0, (chaos / "stderr.log").read_text()[-3000:]
    expected, got = _result(reference), _result(chaos)
    assert got["global_step"] == expected["global_step"] == 60
    assert got["losses"] == expected["losses"]  # every step's loss, across merges, resets and restarts
    assert got["hash"] == expected["hash"]  # and the final weights, bit for bit


@pytest.mark.slow
def test_a_run_killed_nine_times_resumes_with_auto_and_ends_bit_for_bit_as_an_uninterrupted_one(tmp_path):
    plan = ["staging", "random", "merge", "random", "publish", "random", "rotate", "random", "random", "random"]
    _chaos(tmp_path, plan, ddp=False, seed=0)


@pytest.mark.slow
def test_two_process_ddp_killed_four_times_resumes_bit_for_bit(tmp_path):
    _chaos(tmp_path, ["random", "staging", "random", "random"], ddp=True, seed=1)


@pytest.mark.slow
def test_a_disk_that_fills_during_a_save_names_the_checkpoint_and_the_previous_one_resumes(tmp_path):
    reference, full = tmp_path / "reference", tmp_path / "full"
    reference.mkdir()
    full.mkdir()
    assert _finish(_start(reference, steps=12), reference) == 0, (reference / "stderr.log").read_text()[-3000:]
    assert _finish(_start(full, "disk_full", steps=12), full) == 1
    log = (full / "stderr.log").read_text()
    assert "CheckpointWriteError: could not write checkpoint-6 into" in log and "File too large" in log
    assert f"the newest complete checkpoint, {full / 'run' / 'checkpoint-3'}, is untouched" in log
    assert _checkpoint_names(full / "run") == ["checkpoint-3"]
    assert checkpoint_problem(full / "run" / "checkpoint-3") is None
    assert _finish(_start(full, steps=12), full) == 0, (full / "stderr.log").read_text()[-3000:]  # room: auto resumes
    expected, got = _result(reference), _result(full)
    assert got["losses"] == expected["losses"] and got["hash"] == expected["hash"]


@pytest.mark.slow
@pytest.mark.parametrize("before, after", [(2, 1), (1, 2)])
def test_a_ddp_run_resumed_on_another_process_count_continues_its_losses_through_merges(tmp_path, before, after):
    """The same 2 sequences a step on 1 or 2 processes: a run stopped after checkpoint-6 (a merge after step 5) and
    resumed on the other process count logs the losses of an uninterrupted run, the merge after step 10 included, to
    the reduction order's rounding."""
    reference, elastic = tmp_path / "reference", tmp_path / "elastic"
    reference.mkdir()
    elastic.mkdir()
    run = _start(reference, ranks=before, steps=12)
    assert _finish(run, reference) == 0, (reference / "stderr.log").read_text()[-3000:]
    process = _start(elastic, ranks=before, steps=12)
    deadline = time.monotonic() + 300
    while not (elastic / "run" / "checkpoint-6").is_dir() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    process.kill()
    assert (elastic / "run" / "checkpoint-6").is_dir() and not (elastic / "result.json").exists()
    logged = len((elastic / "stderr.log").read_text())
    assert _finish(_start(elastic, ranks=after, steps=12), elastic) == 0, (elastic / "stderr.log").read_text()[-3000:]
    assert f"resuming from {elastic / 'run' / 'checkpoint-6'}," in (elastic / "stderr.log").read_text()[logged:]
    expected, got = _result(reference), _result(elastic)
    assert (expected["world"], got["world"]) == (before, after) and got["global_step"] == 12
    assert got["losses"].keys() == expected["losses"].keys()
    assert all(abs(got["losses"][k] - v) <= 1e-4 * abs(v) for k, v in expected["losses"].items()), got["losses"]


# --- the pieces -------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A 6-step run with checkpoints every 3 steps and at most 2 kept."""
    from training_utils import tiny_dataset, tiny_poet_model, tiny_trainer

    out = tmp_path_factory.mktemp("finished")
    dataset, tokenizer = tiny_dataset()
    trainer = tiny_trainer(
        out, tiny_poet_model(len(tokenizer)), dataset, save_strategy="steps", save_steps=2, save_total_limit=2
    )
    trainer.train(resume_from_checkpoint="auto")  # nothing there yet: a fresh start
    return out, dataset, tokenizer


def test_checkpoints_are_published_whole_and_rotation_keeps_the_newest(finished_run):
    out, _, _ = finished_run
    assert _checkpoint_names(out) == ["checkpoint-4", "checkpoint-6"]
    assert not (out / STAGING_DIR).exists()
    manifest = json.loads((out / "checkpoint-6" / MANIFEST_NAME).read_text())["files"]
    assert {"trainer_state.json", "adapter_model.safetensors", "optimizer.pt", "scheduler.pt"} <= set(manifest)
    assert all((out / "checkpoint-6" / name).stat().st_size == size for name, size in manifest.items())


def test_resuming_a_finished_run_takes_no_step_and_says_so(finished_run, caplog, tmp_path):
    from training_utils import tiny_poet_model, tiny_trainer

    out, dataset, tokenizer = finished_run
    model = tiny_poet_model(len(tokenizer), seed=1)  # different weights: the checkpoint's must be loaded
    trainer = tiny_trainer(out, model, dataset, save_strategy="steps", save_steps=2, save_total_limit=2)
    with caplog.at_level(logging.WARNING, logger="poet_hf.checkpoints"):
        output = trainer.train(resume_from_checkpoint="auto")
    assert "the run is complete" in caplog.text and "step 6 of 6" in caplog.text
    assert output.global_step == 6 and output.metrics["run_complete"]
    assert _checkpoint_names(out) == ["checkpoint-4", "checkpoint-6"]  # no checkpoint-7
    saved = load_file(out / "checkpoint-6" / "adapter_model.safetensors")
    state = model.state_dict()
    for key, tensor in saved.items():
        live = next(v for k, v in state.items() if k.replace(".default", "") == key)
        assert torch.equal(live, tensor), key


def test_auto_skips_a_partial_folder_with_a_warning_and_starts_fresh_without_any(tmp_path, caplog):
    assert resolve_resume_checkpoint("auto", tmp_path) is None
    good, partial = tmp_path / "checkpoint-3", tmp_path / "checkpoint-9"
    good.mkdir()
    (good / "trainer_state.json").write_text(json.dumps({"global_step": 3}))
    partial.mkdir()
    (partial / "adapter_model.safetensors").write_bytes(b"")  # a plain Trainer killed mid-write
    with caplog.at_level(logging.WARNING, logger="poet_hf.checkpoints"):
        assert latest_complete_checkpoint(tmp_path) == str(good)
    assert "skipping" in caplog.text and "checkpoint-9" in caplog.text
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        resolve_resume_checkpoint(str(partial), tmp_path)
    # A manifest's sizes are checked: a file cut short makes the folder partial.
    (good / MANIFEST_NAME).write_text(json.dumps({"files": {"trainer_state.json": 999}}))
    assert "wrong size" in checkpoint_problem(good)


# --- checked loads ----------------------------------------------------------------------------------------------------
@pytest.fixture
def saved_adapter(tmp_path):
    """A tiny POET model (block side on q_proj etc.) saved with save_pretrained, and a loader."""
    from peft import PeftModel

    from poet_hf import PoetConfig

    def base():
        return tiny_llama(hidden=32, intermediate=64, vocab=64, heads=2).train()

    from peft import get_peft_model

    model = get_peft_model(base(), PoetConfig(block_size=8, init_weights=False))
    model.save_pretrained(tmp_path)
    path = tmp_path / "adapter_model.safetensors"

    def load():
        return PeftModel.from_pretrained(base(), tmp_path)

    return path, load, model


def _damage(path: Path, key_part: str, change) -> str:
    tensors = load_file(path)
    key = next(k for k in sorted(tensors) if k.endswith(key_part))
    tensors[key] = change(tensors[key].clone()).contiguous()
    save_file(tensors, path)
    return key


def test_an_undamaged_adapter_loads_and_computes_the_saved_function(saved_adapter):
    path, load, model = saved_adapter
    ids = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        assert torch.equal(load()(ids).logits, model(ids).logits)


def _duplicate(index):
    index[1] = index[0]
    return index


def _out_of_range(index):
    index[0] = index.numel()
    return index


@pytest.mark.parametrize(
    "key_part, change, message",
    [
        ("q_proj.poet_R_index", _duplicate, "is not a permutation"),
        ("q_proj.poet_P_index", _out_of_range, "out of range"),
        ("v_proj.poet_R_index", lambda index: index[:-1], r"has shape \(31,\)"),
        ("up_proj.poet_R", lambda skew: skew[:, :-1], "implies"),
        ("down_proj.poet_merge_count", lambda count: count + 1, "merge counts disagree"),
    ],
)
def test_a_damaged_tensor_fails_at_load_naming_file_tensor_and_fault(saved_adapter, key_part, change, message):
    path, load, _ = saved_adapter
    key = _damage(path, key_part, change)
    with pytest.raises(AdapterStateError, match=message) as error:
        load()
    assert str(path) in str(error.value)
    if "merge" not in key_part:
        assert f"'{key}.default'" in str(error.value)  # the tensor, as loaded (PEFT adds the adapter name)


def test_a_truncated_adapter_file_fails_at_load_naming_the_file(saved_adapter):
    path, load, _ = saved_adapter
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    with pytest.raises(AdapterStateError, match="truncated") as error:
        load()
    assert str(path) in str(error.value)


def test_a_damaged_checkpoint_fails_at_resume_naming_the_checkpoint(finished_run, tmp_path):
    import shutil

    from training_utils import tiny_poet_model, tiny_trainer

    out, dataset, tokenizer = finished_run
    copy = tmp_path / "checkpoint-4"
    shutil.copytree(out / "checkpoint-4", copy)
    weights = copy / "adapter_model.safetensors"
    _damage(weights, "poet_R_index", _duplicate)
    (copy / MANIFEST_NAME).unlink()  # else the changed size alone marks it partial
    trainer = tiny_trainer(tmp_path / "resumed", tiny_poet_model(len(tokenizer)), dataset)
    with pytest.raises(AdapterStateError, match="is not a permutation") as error:
        trainer.train(resume_from_checkpoint=str(copy))
    assert str(copy) in str(error.value)


# --- a pretraining run rerun at its end -------------------------------------------------------------------------------
PRETRAIN_WORKER = HERE / "workers" / "pretrain_worker.py"
# Eight steps, a checkpoint at 4 and 8, merges at 3 and 6: the rerun must rebuild the merges' history too.
PRETRAIN_ARGS = ["--max_steps", "8", "--save_steps", "4", "--merge_every", "3", "--max_eval_samples", "8"]
PRETRAIN_ARGS += ["--seq_len", "64", "--global_batch_size", "4", "--per_device_train_batch_size", "4"]
PRETRAIN_ARGS += ["--logging_steps", "2", "--resume_from_checkpoint", "auto"]
# What a rerun cannot reproduce: the time it took, and what cache_rotations="auto" chose at the first step it ran.
NOT_REPRODUCED = {"wall_time_s", "rotation_caches"}


@pytest.mark.slow
def test_a_pretraining_run_killed_before_its_results_reruns_to_the_same_results(tmp_path):
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    prewarmed.run(PRETRAIN_WORKER, [*PRETRAIN_ARGS, "--output_dir", reference], tmp_path / "reference.log", env=ENV)
    launch = prewarmed.start(
        PRETRAIN_WORKER, ["--die_before_results", *PRETRAIN_ARGS, "--output_dir", killed], tmp_path / "kill.log", ENV
    )
    assert launch.wait(600) == -signal.SIGKILL, (tmp_path / "kill.log").read_text()[-3000:]
    assert _checkpoint_names(killed) == ["checkpoint-4", "checkpoint-8"] and not (killed / "results.json").exists()
    for attempt in ("rerun", "rerun of the finished run"):  # the job requeued, then the same command once more
        prewarmed.run(PRETRAIN_WORKER, [*PRETRAIN_ARGS, "--output_dir", killed], tmp_path / f"{attempt}.log", env=ENV)
        assert "the run is complete" in (tmp_path / f"{attempt}.log").read_text(), attempt
        assert _checkpoint_names(killed) == ["checkpoint-4", "checkpoint-8"]  # no step taken
        expected, got = (json.loads((folder / "results.json").read_text()) for folder in (reference, killed))
        assert got["spectrum_drift"]["max_drift"] > 0 and got["merges"] == 2
        differing = {key for key in expected.keys() | got.keys() if expected.get(key) != got.get(key)}
        assert differing <= NOT_REPRODUCED, {key: (expected.get(key), got.get(key)) for key in differing}


# --- a resume that would not continue its run -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def stopped_and_reference_runs(tmp_path_factory):
    """A run stopped after 4 of 6 steps (checkpoints at 2 and 4, merges every 2) and the same run uninterrupted."""
    from training_utils import state_hash, tiny_dataset, tiny_poet_model, tiny_trainer

    dataset, tokenizer = tiny_dataset()
    stopped, reference = tmp_path_factory.mktemp("stopped"), tmp_path_factory.mktemp("reference")
    saves = {"save_strategy": "steps", "save_steps": 2}
    tiny_trainer(stopped, tiny_poet_model(len(tokenizer)), dataset, max_steps=4, **saves).train()
    uninterrupted = tiny_trainer(reference, tiny_poet_model(len(tokenizer)), dataset, **saves)
    uninterrupted.train()
    return stopped, state_hash(uninterrupted.model), dataset, tokenizer


@pytest.mark.parametrize(
    "change, named",
    [
        ({"block_size": 16}, "block_size=8 (this run: 16)"),
        ({"spo": "full"}, "spo='block' (this run: 'full')"),
        ({"merge_every": 3}, "merge_every=2 (this run: 3)"),
    ],
)
def test_a_resume_with_other_adapter_or_merge_settings_names_them_and_the_checkpoint_still_resumes(
    stopped_and_reference_runs, tmp_path, change, named
):
    import shutil

    from training_utils import state_hash, tiny_poet_model, tiny_trainer

    stopped, reference_hash, dataset, tokenizer = stopped_and_reference_runs
    run = tmp_path / "run"
    shutil.copytree(stopped, run)
    changed = tiny_trainer(run, tiny_poet_model(len(tokenizer), **change), dataset, save_strategy="steps", save_steps=2)
    with pytest.raises(ValueError, match=re.escape(f"checkpoint-4 was trained with {named}")):
        changed.train(resume_from_checkpoint="auto")
    assert _checkpoint_names(run) == ["checkpoint-2", "checkpoint-4"]  # nothing written
    resumed = tiny_trainer(run, tiny_poet_model(len(tokenizer), seed=1), dataset, save_strategy="steps", save_steps=2)
    resumed.train(resume_from_checkpoint="auto")
    assert state_hash(resumed.model) == reference_hash


@pytest.mark.parametrize("shard", ["adapter_model.safetensors", "optimizer.pt"])
def test_a_truncated_file_of_the_newest_checkpoint_is_named_and_the_previous_one_resumes(
    stopped_and_reference_runs, tmp_path, caplog, shard
):
    import shutil

    from training_utils import state_hash, tiny_poet_model, tiny_trainer

    stopped, reference_hash, dataset, tokenizer = stopped_and_reference_runs
    run = tmp_path / "run"
    shutil.copytree(stopped, run)
    damaged = run / "checkpoint-4" / shard
    damaged.write_bytes(damaged.read_bytes()[: damaged.stat().st_size // 2])  # a copy cut short
    resumed = tiny_trainer(run, tiny_poet_model(len(tokenizer), seed=1), dataset, save_strategy="steps", save_steps=2)
    with caplog.at_level(logging.WARNING, logger="poet_hf.checkpoints"):
        resumed.train(resume_from_checkpoint="auto")
    assert f"skipping {run / 'checkpoint-4'}: not a complete checkpoint ({shard} is missing or has the wrong size)" in (
        caplog.text
    )
    assert state_hash(resumed.model) == reference_hash  # from checkpoint-2, as the uninterrupted run
