"""Fine-tuning quality on pretrained weights: LoRA, OFT and POET at their defaults on the testbed.

The defaults are judged on models trained until their validation loss is flat (``TRAINED_TASKS``): two LLaMAs
pretrained here on Shakespeare (``testbed.TRAINED_CAUSAL_LMS``: 4 blocks of width 256, 12 of width 128) and fine-tuned
on Milton, and the real all-MiniLM-L6-v2 encoder fine-tuned to tell four plays apart; ``causal-lm`` is the tests'
short LM, far from trained. Every method runs ``scripts/finetune.py`` with its defaults (only the run length, batch
and sequence length are set here) in a fresh process, which reports:

- the evaluation loss and perplexity (causal LM) or accuracy (classification) before and after, and the evaluation
  loss after the first 5 steps (``loss @5``: fine-tuning must not start by damaging the model);
- time per optimizer step (the median over the steps after the first, evaluations excluded) and peak memory (peak
  RSS minus the RSS after imports), each against OFT's in the same run;
- the trainable parameters.
"""

from __future__ import annotations

import json
import resource
import statistics
import subprocess
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
METHODS = ("lora", "oft", "poet")
LM_SHAPE = {"seq_len": 128, "batch_size": 8, "max_eval_samples": 64, "steps": 60}
ENCODER_SHAPE = {"seq_len": 64, "batch_size": 16, "max_eval_samples": 256, "steps": 100}
TASKS = {
    # the tests' short LM (0.92 epoch of pretraining: far from trained) and the LMs trained until their validation
    # loss is flat (testbed.TRAINED_CAUSAL_LMS), fine-tuned on Milton or (the code LM) on the unit tests
    "causal-lm": {**LM_SHAPE, "model": None},
    "lm-256x4": {**LM_SHAPE, "model": "lm-256x4"},
    "lm-128x12": {**LM_SHAPE, "model": "lm-128x12"},
    "lm-384x3": {**LM_SHAPE, "model": "lm-384x3"},
    "code-192x6": {**LM_SHAPE, "model": "code-192x6"},
    # all-MiniLM-L6-v2, telling four plays apart or (genre) comedy, tragedy and history in unseen plays
    "classification": ENCODER_SHAPE,
    "genre": ENCODER_SHAPE,
}
ENCODER_TASKS = ("classification", "genre")
# What the defaults are judged on: trained models only.
TRAINED_TASKS = ("lm-256x4", "lm-128x12", "classification")


def task_argv(task: str, steps: int | None = None, seed: int = 0) -> list[str]:
    """The model, data, run length and ``seed`` of ``task``, as ``scripts/finetune.py`` arguments (builds the
    testbed if needed)."""
    from benchmarks import testbed

    shape = TASKS[task]
    if task in ENCODER_TASKS:
        files = testbed.classification_files() if task == "classification" else testbed.genre_files()
        data = ["--model_name_or_path", str(testbed.ensure_encoder()), "--task", "sequence-classification"]
        data += ["--dataset", str(files["train"].parent)]
    else:
        model = testbed.ensure_causal_lm(name=shape["model"])
        corpus = testbed.python_code()["finetune"] if task.startswith("code-") else testbed.milton_corpus()
        data = ["--model_name_or_path", str(model), "--dataset", str(corpus)]
    return [
        *data,
        "--max_steps",
        str(steps or shape["steps"]),
        "--seq_len",
        str(shape["seq_len"]),
        "--per_device_train_batch_size",
        str(shape["batch_size"]),
        "--max_eval_samples",
        str(shape["max_eval_samples"]),
        "--eval_steps",
        "5",
        "--logging_steps",
        "1000",
        "--disable_tqdm",
        "true",
        "--seed",
        str(seed),
    ]


def measure(argv: list[str], output_dir: str) -> dict[str, Any]:
    """In the child process: one fine-tuning run of ``scripts/finetune.py`` with ``argv``; its report and costs."""
    from benchmarks.common import status_mb
    from poet_hf.recipes.finetune import parse_finetune_arguments, run_finetuning

    after_imports = status_mb("VmRSS")
    args, training = parse_finetune_arguments([*argv, "--output_dir", output_dir])
    record: dict[str, Any] = {}
    results = run_finetuning(args, training, callbacks=[_Probe(record)])
    trainer = results.pop("trainer")
    evaluations = {log["step"]: log["eval_loss"] for log in trainer.state.log_history if "eval_loss" in log}
    return {
        "before": results["before"],
        "after": results["after"],
        "loss_at_5": evaluations.get(5),
        "evaluations": evaluations,
        "angle_at_5": record.get("angle_at_5"),
        "step_s": statistics.median(record["steps"][1:]),
        "trainable": results["trainable_params"],
        "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - after_imports,
        "learning_rate": trainer.args.learning_rate,
        "poet_learning_rate": getattr(trainer.args, "poet_learning_rate", None),
    }


class _Probe:
    """Times every optimizer step (evaluations between steps excluded) and records, at step 5, the largest angle any
    layer's rotations turn it by (``poet_hf.diagnostics.rotation_angle``)."""

    def __new__(cls, record: dict[str, Any]):
        import time

        from transformers import TrainerCallback

        from poet_hf.diagnostics import rotation_angle
        from poet_hf.tuners.rotation.layer import rotation_layers

        class Probe(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                record["started"] = time.perf_counter()

            def on_step_end(self, args, state, control, model=None, **kwargs):
                record.setdefault("steps", []).append(time.perf_counter() - record["started"])
                if state.global_step == 5:
                    record["angle_at_5"] = max(
                        (rotation_angle(layer) for _, layer in rotation_layers(model)), default=0.0
                    )

        return Probe()


def run_child(argv: list[str], output_dir: Path, threads: int | None = None) -> dict[str, Any]:
    """One fine-tuning run in a fresh process (with ``threads`` torch threads if given); its `measure` record."""
    import os

    code = (
        f"import json, sys; sys.path.insert(0, {str(ROOT)!r}); from benchmarks.suites.finetune_quality import measure; "
        f"print('RESULT ' + json.dumps(measure({argv!r}, {str(output_dir)!r})))"
    )
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)} if threads else None
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    if out.returncode:
        raise RuntimeError(f"fine-tuning {argv} failed:\n{out.stderr[-3000:]}")
    return json.loads(next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))[7:])


def metric_row(task: str, label: str, result: dict[str, Any], oft: dict[str, Any]) -> dict[str, Any]:
    metric = "accuracy" if task in ENCODER_TASKS else "perplexity"
    gain = {m: result["after"][m] - result["before"][m] for m in ("loss", metric)}
    oft_gain = oft["after"]["loss"] - oft["before"]["loss"]
    return {
        "task": task,
        "method": label,
        "metric": metric,
        f"{metric} before": result["before"][metric],
        f"{metric} after": result["after"][metric],
        "loss before": result["before"]["loss"],
        "loss @5": result["loss_at_5"],
        "loss after": result["after"]["loss"],
        "angle @5": result["angle_at_5"],
        "loss gain / OFT's": gain["loss"] / oft_gain if oft_gain else float("nan"),
        "step s": result["step_s"],
        "time / OFT": result["step_s"] / oft["step_s"],
        "peak MB": result["peak_mb"],
        "memory / OFT": result["peak_mb"] / oft["peak_mb"],
        "trainable (M)": result["trainable"] / 1e6,
    }


def run(quick: bool = False, repeats: int = 3, tasks: tuple[str, ...] = TRAINED_TASKS) -> list[dict[str, Any]]:
    """Every method at its defaults, each in its own process, repeats interleaved; time and memory are medians."""
    import tempfile

    rows = []
    for task in tasks:
        argv = task_argv(task, 6 if quick else None)
        runs: dict[str, list[dict]] = {method: [] for method in METHODS}
        with tempfile.TemporaryDirectory() as scratch:
            for _ in range(1 if quick else repeats):  # interleaved: noise hits every method alike
                for method in METHODS:
                    runs[method].append(run_child([*argv, "--method", method], Path(scratch) / method))
        result = {method: _median(rs) for method, rs in runs.items()}
        rows += [metric_row(task, method, r, result["oft"]) for method, r in result.items()]
    return rows


def _median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    first = runs[0]
    merged = dict(first)
    for key in ("step_s", "peak_mb"):
        merged[key] = statistics.median(r[key] for r in runs)
    return merged


RUN_CACHE = ROOT / ".cache" / "finetune_runs"


def run_parallel(jobs: dict[Any, Callable[[], list[str]]], workers: int = 2) -> dict[Any, dict[str, Any]]:
    """Each job (a key → a function giving its ``scripts/finetune.py`` arguments) in its own process, ``workers`` at a
    time with one torch thread each, every finished run kept in `RUN_CACHE` (`benchmarks.run_cache.run_parallel`):
    for quality and memory; time per step is not read from these runs (`benchmarks.suites.finetune_step` times it
    alone)."""
    from benchmarks.run_cache import code_version
    from benchmarks.run_cache import run_parallel as run_kept

    version = code_version([ROOT / "scripts" / "finetune.py", Path(__file__), ROOT / "benchmarks" / "testbed.py"])
    return run_kept(jobs, partial(run_child, threads=1), RUN_CACHE, version, workers)


def quality_row(task: str, method: str, result: dict[str, Any], oft: dict[str, Any]) -> dict[str, Any]:
    """`metric_row` without the time columns: quality runs share the machine (`run_parallel`)."""
    row = metric_row(task, method, result, oft)
    for timed in ("step s", "time / OFT"):
        row.pop(timed)
    return row
