"""PoetTrainer: merges, optimizer reset, resume, DDP, spectrum, and every method."""

import json
import os
import subprocess
import sys
from pathlib import Path

import prewarmed
import pytest
import torch
from script_modules import load_module
from training_utils import TrainingForwards, free_port, tiny_dataset, tiny_poet_model, tiny_trainer
from transformers import TrainerCallback

from poet_hf import MergeReinitCallback
from poet_hf.recipes.pretrain import parse_pretrain_arguments, run_pretraining
from poet_hf.training import clip_threshold, poet_parameters
from poet_hf.tuners.rotation.layer import rotation_layers

ROOT = Path(__file__).resolve().parent.parent

HERE = Path(__file__).resolve().parent


def _fresh(adam_state: dict) -> bool:
    """Adam's state as it starts: step 0 and zero moments."""
    return float(adam_state["step"]) == 0 and all(
        float(adam_state[k].abs().max()) == 0 for k in ("exp_avg", "exp_avg_sq")
    )


class Recorder(TrainerCallback):
    """Runs after MergeReinitCallback: what the optimizer and layers look like at the end of each step."""

    def __init__(self):
        self.rows = []

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        layers = rotation_layers(model)
        poet_ids = {id(p) for p in poet_parameters(model)}
        base = [p for p in model.parameters() if p.requires_grad and id(p) not in poet_ids]
        self.rows.append(
            {
                "step": state.global_step,
                "merges": int(layers[0][1].poet_merge_count["default"]),
                "poet_live": sum(
                    p in optimizer.state and not _fresh(optimizer.state[p]) for p in poet_parameters(model)
                ),
                "base_state": sum(p in optimizer.state for p in base),
                "base_count": len(base),
                "q_zero": all(float(p.abs().max()) == 0 for p in poet_parameters(model)),
            }
        )


@pytest.fixture(scope="module")
def data():
    return tiny_dataset()


def test_merges_every_k_steps_with_gradient_accumulation_and_reset_poet_state_only(tmp_path, data):
    dataset, tokenizer = data
    model = tiny_poet_model(len(tokenizer), merge_every=5)  # the args override it below
    trainer = tiny_trainer(
        tmp_path,
        model,
        dataset,
        max_steps=7,
        merge_every=3,
        gradient_accumulation_steps=2,
        per_device_train_batch_size=2,
    )
    recorder = Recorder()
    trainer.add_callback(recorder)
    trainer.train()
    assert [r["merges"] for r in recorder.rows] == [0, 0, 1, 1, 1, 2, 2]
    for row in recorder.rows:
        merged_now = row["step"] % 3 == 0
        assert row["q_zero"] == merged_now
        assert row["poet_live"] == (0 if merged_now else len(poet_parameters(model)))  # reset to Adam's start
        assert row["base_state"] == row["base_count"] > 0  # embeddings, norms, lm_head keep their moments
    history = next(cb for cb in trainer.callback_handler.callbacks if isinstance(cb, MergeReinitCallback)).history
    assert [h["step"] for h in history] == [3, 6]


def test_two_learning_rates_in_two_param_groups(tmp_path, data):
    dataset, tokenizer = data
    trainer = tiny_trainer(
        tmp_path,
        tiny_poet_model(len(tokenizer)),
        dataset,
        learning_rate=1e-2,
        poet_learning_rate=2e-3,
        weight_decay=0.1,
        max_steps=1,
    )
    optimizer = trainer.create_optimizer()
    poet_group = [g for g in optimizer.param_groups if g.get("poet")]
    assert len(poet_group) == 1 and poet_group[0]["lr"] == 2e-3 and poet_group[0]["weight_decay"] == 0
    others = [g for g in optimizer.param_groups if not g.get("poet")]
    assert {g["lr"] for g in others} == {1e-2} and {g["weight_decay"] for g in others} == {0.1, 0.0}
    assert sum(len(g["params"]) for g in optimizer.param_groups) == sum(
        p.requires_grad for p in trainer.model.parameters()
    )


def test_a_reference_block_gives_each_side_its_rate_by_block_size():
    from poet_hf.training import poet_param_groups

    model = tiny_poet_model(64, block_size={"input": 8, "output": 16})
    groups = poet_param_groups(model, 1e-2, 2e-3, 0.0, [], reference_block=32)
    poet = {g["block_size"]: g for g in groups if g.get("poet")}
    assert {b: g["lr"] for b, g in poet.items()} == pytest.approx({8: 2e-3 * 4, 16: 2e-3 * 2})
    sides = {b: sum(p.numel() for p in g["params"]) for b, g in poet.items()}
    layers = rotation_layers(model)
    assert sides == {
        8: sum(layer.poet_R["default"].numel() for _, layer in layers),
        16: sum(layer.poet_P["default"].numel() for _, layer in layers),
    }
    assert [g["lr"] for g in poet_param_groups(model, 1e-2, 2e-3, 0.0, []) if g.get("poet")] == [2e-3]


def test_post_merge_clip_ramp():
    got = [clip_threshold(step, 5, 1.0, 4, 0.1) for step in range(1, 13)]
    expected = [1.0] * 5 + [0.1, 0.325, 0.55, 0.775, 1.0, 0.1, 0.325]
    assert got == pytest.approx(expected, abs=1e-12)


def test_resumed_run_matches_uninterrupted_run(tmp_path, data):
    dataset, tokenizer = data

    def run(directory, max_steps, resume=None):
        trainer = tiny_trainer(
            directory,
            tiny_poet_model(len(tokenizer)),
            dataset,
            max_steps=8,
            merge_every=3,
            save_strategy="steps",
            save_steps=4,
        )
        if max_steps < 8:
            trainer.add_callback(StopAt(max_steps))
        trainer.train(resume_from_checkpoint=resume)
        losses = {log["step"]: log["loss"] for log in trainer.state.log_history if "loss" in log}
        return losses, trainer.merge_callback.history

    full, full_history = run(tmp_path / "full", 8)
    run(tmp_path / "part", 4)
    resumed, resumed_history = run(tmp_path / "part", 8, resume=str(tmp_path / "part" / "checkpoint-4"))
    assert sorted(resumed) == list(range(1, 9))  # steps 1-4 come from the checkpoint's log history
    for step in range(5, 9):
        assert abs(resumed[step] - full[step]) <= 1e-6, (step, resumed[step], full[step])
    # The merge at step 3 happened before the checkpoint; the resumed run still knows it (spectrum bound, logs).
    assert [m["step"] for m in resumed_history] == [m["step"] for m in full_history] == [3, 6]
    for before, after in zip(full_history, resumed_history, strict=True):
        assert after["max_neumann_bound"] == pytest.approx(before["max_neumann_bound"], rel=1e-5)


def test_logged_rotation_statistics_at_a_merge_step_are_those_before_the_fold(tmp_path, data):
    dataset, tokenizer = data
    trainer = tiny_trainer(tmp_path, tiny_poet_model(len(tokenizer), merge_every=3), dataset, max_steps=4)
    trainer.train()
    logs = {log["step"]: log for log in trainer.state.log_history if "loss" in log}
    merge = trainer.merge_callback.history[0]
    assert merge["step"] == 3 and merge["max_q_norm"] > 1e-3
    assert logs[3]["poet/q_norm"] == pytest.approx(merge["max_q_norm"], rel=1e-12)  # not the zero after the fold
    assert logs[3]["poet/merge_count"] == 1
    assert logs[4]["poet/q_norm"] < logs[3]["poet/q_norm"]  # one step after the fold: a fresh primitive


class StopAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_save = True
            control.should_training_stop = True


@pytest.mark.slow
# int8: W0 requantised at every merge, on every rank; nf4-shardable: the codes as plain parameters, DDP-replicated,
# with the other savings DDP takes (bitsandbytes' 8-bit states, activation checkpointing, the chunked loss)
@pytest.mark.parametrize("quantization", [None, "int8", "nf4-shardable+savings"])
def test_two_process_ddp_ranks_identical_and_match_single_process(tmp_path, quantization):
    env = {"OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "1"}
    worker = str(HERE / "workers" / "ddp_worker.py")
    extra = [quantization] if quantization else []
    if quantization is None:
        # As users launch: on a CPU-only machine `--multi_gpu` is what makes accelerate start several (gloo) processes.
        launch = [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--multi_gpu",
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            "--main_process_port",
            str(free_port()),
        ]
        subprocess.run(
            [*launch, "--num_processes", "2", worker, str(tmp_path / "ddp"), "2"],
            check=True,
            env={**os.environ, **env},
            capture_output=True,
            timeout=600,
        )
    else:  # the same ranks, forked with torchrun's variables from the imports-only server (tests/helpers/prewarmed.py)
        prewarmed.run(worker, [tmp_path / "ddp", "2", *extra], tmp_path / "ddp.log", env=env, ranks=2)
    prewarmed.run(worker, [tmp_path / "single", "4", *extra], tmp_path / "single.log", env=env)
    ranks = [json.loads((tmp_path / "ddp" / f"rank{r}.json").read_text()) for r in (0, 1)]
    single = json.loads((tmp_path / "single" / "rank0.json").read_text())
    assert ranks[0]["world"] == 2 and ranks[0]["merges"] == 3
    assert ranks[0]["hash"] == ranks[1]["hash"]
    assert ranks[0]["losses"] == pytest.approx(single["losses"], rel=1e-4, abs=1e-4)
    if quantization and "+savings" in quantization:  # 8-bit states, checkpointing and the chunked loss were on
        assert ranks[0]["savings"] == single["savings"] == [True, True, 16]


@pytest.mark.slow
def test_fused_steps_under_ddp_step_every_rank_alike_and_match_one_process(tmp_path):
    """Every DDP bucket steps after its all-reduce, in the backward of the last of two micro-batches a step (DDP's
    communication hook fires only there); the head and embeddings, stored in bfloat16, train as row chunks DDP does not
    hold, all-reduced by their own hooks. The reference: one process with the same 4 sequences a step."""
    env = {"OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "1"}
    worker = str(HERE / "workers" / "ddp_worker.py")
    ddp = [tmp_path / "ddp", "1", "fused:bfloat16", "2"]  # 2 processes × 1 sequence × 2 micro-batches
    prewarmed.run(worker, ddp, tmp_path / "ddp.log", env=env, ranks=2)
    prewarmed.run(worker, [tmp_path / "single", "4", "fused:bfloat16"], tmp_path / "single.log", env=env)
    ranks = [json.loads((tmp_path / "ddp" / f"rank{r}.json").read_text()) for r in (0, 1)]
    single = json.loads((tmp_path / "single" / "rank0.json").read_text())
    assert ranks[0]["world"] == 2 and ranks[0]["merges"] == 3
    assert ranks[0]["hash"] == ranks[1]["hash"]  # every process stepped the same reduced gradients
    assert ranks[0]["losses"] == pytest.approx(single["losses"], rel=1e-4, abs=1e-4)


# --- the pretraining entry point -----------------------------------------------------------------------------------
def small_args(tmp_path, method, corpus, **overrides):
    fields = {
        "method": method,
        "max_steps": 4,
        "per_device_train_batch_size": 2,
        "global_batch_size": 2,
        "seq_len": 64,
        "merge_every": 2,
        "max_eval_samples": 8,
        "logging_steps": 1,
        "output_dir": str(tmp_path / method),
        "block_size": 32,
        "dataset": corpus,
    }
    fields.update(overrides)
    return parse_pretrain_arguments(**fields)


@pytest.mark.parametrize("method", ["poet-bs", "poet-fs", "adamw", "lora"])
def test_each_method_runs_and_reports(tmp_path, method, local_corpus):
    export = {"export_dir": str(tmp_path / "export")} if method == "poet-bs" else {}
    results = run_pretraining(*small_args(tmp_path, method, local_corpus, **export))
    saved = json.loads((tmp_path / method / "results.json").read_text())
    assert saved["val_perplexity"] == pytest.approx(results["val_perplexity"])
    assert saved["tokens_seen"] == 4 * 2 * 64
    assert (tmp_path / method / "spectra.png").stat().st_size > 1000
    assert saved["merges"] == (2 if method.startswith("poet") else 0)
    assert saved["trainable_params"] > 0 and saved["wall_time_s"] > 0
    assert all(torch.isfinite(torch.tensor(saved["train_losses"])))
    # the validation curve runs from the evaluation before training to the one after it
    (first_step, first_loss), (last_step, last_loss) = saved["validation_losses"][0], saved["validation_losses"][-1]
    assert (first_step, last_step) == (0, saved["steps"])
    assert (first_loss, last_loss) == (saved["initial_val_loss"], saved["val_loss"])
    if export:  # --export-dir leaves a plain model that stock transformers loads, with a model card
        from transformers import AutoModelForCausalLM

        plain = AutoModelForCausalLM.from_pretrained(export["export_dir"])
        assert not any("poet" in n for n, _ in plain.named_parameters())
        assert "POET" in (Path(export["export_dir"]) / "README.md").read_text()


def test_galore_without_package_says_how_to_install(tmp_path, local_corpus):
    try:
        import galore_torch  # noqa: F401

        pytest.skip("galore-torch is installed here")
    except ImportError:
        pass
    with pytest.raises(SystemExit, match="pip install galore-torch"):
        run_pretraining(*small_args(tmp_path, "galore", local_corpus))


def test_spectrum_stays_within_neumann_error_and_adamw_drifts(tmp_path, local_corpus):
    poet = run_pretraining(*small_args(tmp_path, "poet-bs", local_corpus, max_steps=8, neumann_terms=3))
    adamw = run_pretraining(*small_args(tmp_path, "adamw", local_corpus, max_steps=8))
    bound = poet["spectrum_bound"]
    assert poet["merges"] == 4 and 1e-8 < bound < 0.05  # CNP with 3 terms is inexact, so the check is not vacuous
    assert poet["spectrum_drift"]["max_drift"] <= bound + 1e-5  # + float32 rounding of the folds
    assert adamw["spectrum_drift"]["max_drift"] > 10 * poet["spectrum_drift"]["max_drift"]


def test_spectrum_callback_in_a_stock_trainer_reads_the_weights_when_built_and_when_trained(tmp_path):
    """`SpectrumCallback` in a plain `transformers.Trainer` (AdamW on a tiny LLaMA): its snapshots are the singular
    values of the modules' dense weights when the Trainer is built and when training ends (float64 SVD of the float32
    weights, read here from the modules), its drift is ``max |σ_after − σ_before| / σ_max(before)`` over them, the
    plot is written, and a model without POET layers has no bound."""
    from models import tiny_llama
    from tolerances import gamma
    from transformers import Trainer, TrainingArguments

    from poet_hf.training import SpectrumCallback

    dataset, tokenizer = tiny_dataset()
    model = tiny_llama(0, hidden=32, intermediate=64, vocab=len(tokenizer), heads=2, max_position_embeddings=64)
    names = ["q_proj", "down_proj"]

    def dense_spectra():
        return {
            name: torch.linalg.svdvals(module.weight.detach().double())
            for name, module in model.named_modules()
            if name.endswith(tuple(names))
        }

    initial = dense_spectra()
    callback = SpectrumCallback(names, title="adamw")
    fields = {"max_steps": 3, "per_device_train_batch_size": 4, "learning_rate": 1e-2, "save_strategy": "no"}
    args = TrainingArguments(str(tmp_path), report_to="none", use_cpu=True, seed=0, **fields)
    trainer = Trainer(model=model.train(), args=args, train_dataset=dataset, callbacks=[callback])
    assert callback.before is not None and callback.report is None  # taken when the Trainer was built
    trainer.train()
    final = dense_spectra()
    assert set(callback.before) == set(callback.after) == set(initial) and len(initial) == 4  # 2 layers × 2 names
    for name, s0 in initial.items():
        bound = gamma(64, torch.float64) * float(s0.max())  # a backward-stable SVD of the same matrix
        torch.testing.assert_close(callback.before[name], s0, rtol=0, atol=bound)
        torch.testing.assert_close(callback.after[name], final[name], rtol=0, atol=bound)
    drifts = [float((final[n] - initial[n]).abs().max() / initial[n].max()) for n in initial]
    assert callback.report["spectrum_drift"]["max_drift"] == pytest.approx(max(drifts), rel=1e-12)
    assert max(drifts) > 1e-3  # AdamW moved them, so the comparison above is not of two equal snapshots
    assert callback.report["spectrum_bound"] is None
    assert (tmp_path / "spectra.png").stat().st_size > 1000


@pytest.mark.slow
@pytest.mark.xdist_group("tiny_pretraining")
def test_pretraining_lowers_validation_perplexity_fivefold(tiny_pretraining):
    # The README's main job, shortened: the embedded corpus, POET-BS, the tiny preset, 4 merges.
    results = tiny_pretraining()
    assert results["merges"] == 4
    assert results["val_perplexity"] * 5 <= results["initial_val_perplexity"]
    losses = results["train_losses"]
    assert losses[-1] < losses[0] - 0.5  # the logged training loss falls by more than half a nat


def test_tensorboard_logs_both_learning_rates_and_poet_statistics(tmp_path, data):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    dataset, tokenizer = data
    trainer = tiny_trainer(
        tmp_path,
        tiny_poet_model(len(tokenizer)),
        dataset,
        max_steps=3,
        report_to="tensorboard",
        learning_rate=1e-2,
        poet_learning_rate=2e-3,
    )
    trainer.train()
    events = EventAccumulator(str(next(tmp_path.rglob("events.out.tfevents.*")).parent)).Reload()
    tags = set(events.Tags()["scalars"])
    for tag in (
        "train/loss",
        "train/learning_rate",
        "train/poet_learning_rate",
        "train/poet/merge_count",
        "train/poet/q_norm",
        "train/poet/block_orth_error",
        "train/poet/e_orth_R",
        "train/poet/e_orth_P",
        "train/poet/trace_R",
        "train/poet/trace_P",
        "train/poet/e_orth_R/q_proj",
        "train/poet/trace_P/down_proj",
        "train/poet/probe_cos_R",
        "train/poet/probe_cos_P",
    ):
        assert tag in tags, tags
    assert [e.value for e in events.Scalars("train/poet/merge_count")] == [0, 1, 1]
    assert events.Scalars("train/poet_learning_rate")[0].value == pytest.approx(2e-3)
    assert events.Scalars("train/learning_rate")[0].value == pytest.approx(1e-2)


def pretrain_script():
    return load_module(ROOT / "scripts" / "pretrain.py")


@pytest.mark.parametrize("flags", [["--activation_checkpointing"], ["--bf16"]])
def test_the_pretraining_script_takes_trainer_flags(tmp_path, local_corpus, flags):
    """--activation_checkpointing recomputes the blocks in the backward; --bf16 on a CPU trains under bf16 autocast
    (the non-POET Linear layers, e.g. lm_head, return bf16), never silently in float32, or, on a CPU without AVX-512
    (whose torch kernels cannot run it), is refused with a clear message before the run."""
    small = ["--per_device_train_batch_size", "2", "--global_batch_size", "2", "--seq_len", "64"]
    argv = [*small, "--max_steps", "2", "--max_eval_samples", "4", "--dataset", local_corpus, "--block_size", "32"]
    argv += ["--output_dir", str(tmp_path), "--logging_steps", "1", *flags]
    if flags == ["--bf16"] and not torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        with pytest.raises(ValueError, match="bfloat16 attention kernels for CPUs need AVX-512"):
            pretrain_script().main(argv)
        return
    with TrainingForwards() as seen:
        results = pretrain_script().main(argv)
    assert results["steps"] == 2 and all(torch.isfinite(torch.tensor(results["train_losses"])))
    if flags == ["--activation_checkpointing"]:
        assert seen.recomputed > 0 and seen.linear_dtypes == {torch.float32}
    else:
        assert torch.bfloat16 in seen.linear_dtypes and seen.recomputed == 0


def test_fp16_and_bf16_without_avx512_are_refused_on_a_cpu_with_a_clear_message(monkeypatch, tmp_path):
    from poet_hf import PoetTrainingArguments
    from poet_hf.recipes.cli import check_cpu_mixed_precision

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    training = PoetTrainingArguments(output_dir=str(tmp_path), bf16=True, use_cpu=True, report_to="none")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    with pytest.raises(ValueError, match=r"`bf16` on this CPU \(torch capability AVX2\)"):
        check_cpu_mixed_precision(training)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    check_cpu_mixed_precision(training)  # trains: the bf16 tests above
    training.bf16 = False
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    check_cpu_mixed_precision(training)  # float32 runs anywhere
    # Accelerate ignores fp16 on a CPU (a run with it gives float32's losses bit for bit): refused, on any CPU.
    fp16 = PoetTrainingArguments(output_dir=str(tmp_path), fp16=True, use_cpu=True, report_to="none")
    with pytest.raises(ValueError, match="`fp16` on a CPU: Accelerate does not autocast to float16"):
        check_cpu_mixed_precision(fp16)
