"""The benchmark suites can start: each module of benchmarks/suites/ exposes ``run``, and every suite that measures in
a fresh process (`benchmarks.common.measure_as_a_user`) names a suite that exposes ``measure``.

The suites are benchmarks, not tests (they take minutes to hours), so nothing here runs one; this catches what stops
a suite before its first measurement (a module moved, a function renamed), which the results files cannot show.
"""

from __future__ import annotations

import ast
import importlib
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SUITES = sorted(p for p in (ROOT / "benchmarks" / "suites").glob("*.py") if p.stem != "__init__")


def _measured_suites(path: Path) -> list[str]:
    """The suite names a module passes to ``measure_as_a_user``."""
    calls = [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Call)]
    return [
        call.args[0].value
        for call in calls
        if getattr(call.func, "id", None) == "measure_as_a_user" and isinstance(call.args[0], ast.Constant)
    ]


@pytest.mark.parametrize("path", SUITES, ids=lambda p: p.stem)
def test_a_suite_exposes_run_and_measures_in_suites_that_exist(path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    module = importlib.import_module(f"benchmarks.suites.{path.stem}")
    assert callable(getattr(module, "run", None)), path.stem
    for suite in _measured_suites(path):
        measured = importlib.import_module(f"benchmarks.suites.{suite}")
        assert callable(getattr(measured, "measure", None)), (path.stem, suite)


def test_the_check_sees_the_suites_that_measure_in_a_fresh_process():
    measuring = {p.stem for p in SUITES if _measured_suites(p)}
    assert {"fold", "wide_step", "step_profile", "pretrain_7b", "pretrain_8b"} <= measuring, measuring


def test_the_fresh_process_imports_the_suite_s_measure(monkeypatch):
    """The program `measure_as_a_user` hands the new interpreter, up to its call: run here, it finds ``measure``
    (before the suites moved into benchmarks/suites/ it named ``benchmarks.fold``, and every such suite stopped)."""
    monkeypatch.syspath_prepend(str(ROOT))
    import benchmarks.common as common

    programs = []

    def run(command, **kwargs):
        programs.append(command[-1])
        return subprocess.CompletedProcess(command, 0, stdout='{"measured": 1}\n')

    monkeypatch.setattr(common.subprocess, "run", run)
    assert common.measure_as_a_user("fold", way="whole") == {"measured": 1}
    imports = programs[0].split("print(")[0]
    namespace: dict = {}
    exec(imports, namespace)
    assert namespace["measure"] is importlib.import_module("benchmarks.suites.fold").measure
