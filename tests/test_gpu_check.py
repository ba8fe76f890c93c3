"""scripts/gpu_check.py on this CPU: its plan names tests and suites that exist, it refuses to run without CUDA, and
its steps, budget and summary work (with a stand-in device)."""

from __future__ import annotations

import inspect
import json
import sys
from pathlib import Path

import pytest
from script_modules import load_module

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import gpu_plan as gpu_check  # noqa: E402


def test_the_dry_run_prints_a_plan_of_tests_and_suites_that_exist(capsys):
    script = load_module(ROOT / "scripts" / "gpu_check.py")
    assert script.main(["--dry_run"]) == 0
    printed = capsys.readouterr().out
    for step in gpu_check.plan():
        assert step.name in printed
        if step.command:
            for node in (a for a in step.command if a.startswith("tests/")):
                path, _, test = node.partition("::")
                assert (ROOT / path).exists(), path
                assert not test or f"def {test}(" in (ROOT / path).read_text(), node
        else:
            run = __import__(f"benchmarks.suites.{step.suite}", fromlist=["run"]).run
            inspect.signature(run).bind(**step.options)  # the suite takes these options


def test_without_cuda_it_refuses_and_says_how_to_see_the_plan(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "device_name", lambda: "no CUDA device")
    with pytest.raises(RuntimeError, match="needs a CUDA device; --dry_run"):
        gpu_check.check(tmp_path)


def test_steps_run_in_order_within_the_budget_and_write_json_and_a_summary(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "device_name", lambda: "Stand-in GPU")
    steps = [
        gpu_check.CheckStep("passing command", [sys.executable, "-c", "print('fine')"]),
        gpu_check.CheckStep(
            "failing command", [sys.executable, "-c", "import time; time.sleep(3); raise SystemExit(3)"]
        ),
        gpu_check.CheckStep("late step", [sys.executable, "-c", "print('never')"]),
    ]
    monkeypatch.setattr(gpu_check, "plan", lambda: steps)
    monkeypatch.setattr(gpu_check, "BUDGET_S", 2.5)  # the second step ends past it: the third is skipped
    results = gpu_check.check(tmp_path)
    assert [(r["name"], r["ok"]) for r in results] == [
        ("passing command", True),
        ("failing command", False),
        ("late step", False),
    ]
    assert "fine" in results[0]["output"] and results[2]["output"] == "skipped: over the budget"
    written = json.loads((tmp_path / "gpu_check.json").read_text())
    assert written["device"] == "Stand-in GPU" and len(written["results"]) == 3
    summary = (tmp_path / "gpu_check.md").read_text()
    assert summary.startswith("# GPU check on Stand-in GPU")
    assert "- failing command: FAILED" in summary


def test_the_summary_tabulates_suite_rows():
    rows = [{"method": "poet-bs", "time ratio": 1.234567}]
    text = gpu_check.summary("GPU", [{"name": "pretrain step", "ok": True, "seconds": 12.0, "rows": rows}])
    assert "| method | time ratio |" in text and "| poet-bs | 1.23 |" in text
