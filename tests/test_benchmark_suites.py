"""The benchmark suites can start: each module of benchmarks/suites/ exposes ``run``, and every suite that measures in
a fresh process (`benchmarks.common.measure_as_a_user`) names a suite that exposes ``measure``.

The suites are benchmarks, not tests (they take minutes to hours), so nothing here runs one; this catches what stops
a suite before its first measurement (a module moved, a function renamed), which the results files cannot show.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import subprocess
from pathlib import Path
from typing import cast

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


def _torchrun_calls(path: Path) -> list[tuple[str, str]]:
    """``(suite, function)`` of every ``_torchrun`` launch a suite module makes (its ``suite`` default: fsdp)."""
    tree = ast.parse(path.read_text())
    named = {  # a program built in a variable first: `call = f"worker(...)"`
        target.id: node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    found = []
    for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
        if getattr(call.func, "id", None) != "_torchrun" or len(call.args) < 2:
            continue
        program = call.args[1]
        program = named[program.id] if isinstance(program, ast.Name) else program
        first = program.values[0] if isinstance(program, ast.JoinedStr) else program
        suite = next((k.value for k in call.keywords if k.arg == "suite"), ast.Constant("fsdp"))
        found.append((cast(ast.Constant, suite).value, cast(ast.Constant, first).value.split("(")[0]))
    return found


@pytest.mark.parametrize("path", SUITES, ids=lambda p: p.stem)
def test_a_torchrun_launch_names_a_function_of_a_suite_that_exists(path, monkeypatch):
    """`benchmarks.suites.fsdp._torchrun` starts ``benchmarks.suites.<suite>.<function>`` in fresh processes (it named
    ``benchmarks.fsdp`` after the suites moved, and the fsdp, sharding and sharded_quantized launches all stopped)."""
    monkeypatch.syspath_prepend(str(ROOT))
    for suite, function in _torchrun_calls(path):
        assert callable(getattr(importlib.import_module(f"benchmarks.suites.{suite}"), function, None)), (
            suite,
            function,
        )


def test_the_launch_check_sees_the_suites_that_launch_processes():
    launching = {p.stem for p in SUITES if _torchrun_calls(p)}
    assert {"fsdp", "sharding", "sharded_quantized"} <= launching, launching


def test_the_torchrun_program_imports_the_named_suite_function(monkeypatch):
    """The program `_torchrun` writes for each process imports what it names (it imported ``benchmarks.fsdp``)."""
    monkeypatch.syspath_prepend(str(ROOT))
    import benchmarks.suites.fsdp as fsdp

    programs = []

    def run(command, **kwargs):
        programs.append(Path(command[-1]).read_text())
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(fsdp.subprocess, "run", run)
    fsdp._torchrun(1, "zero_worker('llama-60m', 2, 2, 3)", suite="sharding", check=False)
    imports = programs[0].split("; zero_worker(")[0]
    namespace: dict = {}
    exec(imports, namespace)  # noqa: S102  (the program's own import line)
    assert callable(namespace["zero_worker"])


@pytest.mark.parametrize("path", SUITES, ids=lambda p: p.stem)
def test_every_name_a_suite_imports_from_poet_hf_or_benchmarks_exists(path, monkeypatch):
    """The suites import inside the functions their launches run, where no import at load time sees a name that moved
    (the ZeRO rows imported ``mark_leaf_layers`` long after it became ``prepare_for_zero``)."""
    monkeypatch.syspath_prepend(str(ROOT))
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(("poet_hf", "benchmarks")):
            module = importlib.import_module(node.module)
            missing = [alias.name for alias in node.names if not hasattr(module, alias.name)]
            if missing:  # a submodule is a name too
                missing = [name for name in missing if importlib.util.find_spec(f"{node.module}.{name}") is None]
            assert not missing, (path.stem, node.module, missing)


def _root_paths(path: Path) -> list[str]:
    """Each repository path a suite spells as ``ROOT / "a" / "b.py"`` (a chain of string constants), as text."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        parts: list[str] = []
        while isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and isinstance(node.right, ast.Constant):
            parts.insert(0, str(node.right.value))
            node = node.left
        if parts and getattr(node, "id", None) == "ROOT":
            found.append("/".join(parts))
    return found


@pytest.mark.parametrize("path", SUITES, ids=lambda p: p.stem)
def test_every_file_a_suite_names_under_the_root_exists(path):
    """A file a suite reads by its place in the repository exists there (pretrain_choices hashed
    ``benchmarks/pretrain_quality.py`` long after the suites moved, and died before its first run); what a suite
    writes (``.cache/...``) is not checked."""
    named = [p for p in _root_paths(path) if not p.startswith(".cache")]
    missing = [p for p in named if not (ROOT / p).exists()]
    assert not missing, (path.stem, missing)


def test_the_path_check_sees_what_the_suites_name():
    """The check reads the chains it is meant to: the 7B suite's config and the quality suite's script."""
    assert "configs/models/llama-2-7b.json" in _root_paths(ROOT / "benchmarks" / "suites" / "pretrain_7b.py")
    assert "scripts/pretrain.py" in _root_paths(ROOT / "benchmarks" / "suites" / "pretrain_quality.py")


def test_the_layer_profile_puts_each_product_in_its_part_by_its_operands():
    """`layer_profile.part_of`: a product of the layer's own size, a block product (a ``b``-wide face beside a token
    or width dimension), the map's polynomial (``b × b`` faces only), a gather, and the rest."""
    from benchmarks.suites.layer_profile import part_of

    tokens, d_in, d_out, b = 2048, 1024, 4096, 64
    assert part_of("aten::mm", [[tokens, d_in], [d_in, d_out]], b) == "base products"
    assert part_of("aten::linear", [[tokens, d_in], [d_out, d_in], []], b) == "base products"
    assert part_of("aten::bmm", [[d_in // b, b, b], [d_in // b, b, tokens]], b) == "block products"
    assert part_of("aten::mm", [[tokens, b], [b, b]], b) == "block products"
    assert part_of("aten::baddbmm", [[16, b, b], [16, b, b], [16, b, b]], b) == "polynomial"
    assert part_of("aten::gather", [[tokens, d_in], [tokens, d_in]], b) == "gathers"
    assert part_of("aten::add_", [[tokens, d_in], [tokens, d_in]], b) == "other"
