"""The package's layering, read from the source (AST, nothing executed): no module imports a layer above its own,
the pure-math layer needs no Hugging Face library, and the scripts stay thin command lines over the library."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "poet_hf"

# Which parts of poet_hf each part may import (itself always). A part is the first name below `poet_hf.`.
ALLOWED = {
    "_version": set(),
    "_quiet_imports": set(),  # imports no feature asked for kept out: PEFT's hook, lazy names, optional packages' logs
    "allocator": set(),  # the C allocator's setting: ctypes only
    "dtypes": set(),  # one reading of a dtype's name (bf16 and bfloat16 alike)
    "orthogonal": set(),  # the mathematics, FeedbackGD and weight spectra included
    "sharded": set(),  # whole views of FSDP2-sharded tensors and models: torch and PEFT only
    "tuners": {"orthogonal", "sharded"},
    "data": set(),
    "initialization": {"allocator", "orthogonal", "tuners", "sharded"},  # materializes meta models, sharded or not
    "checkpoints": {"tuners", "_quiet_imports"},
    "model_cards": set(),
    "diagnostics": {"orthogonal", "tuners", "sharded"},
    "export": {"orthogonal", "tuners", "sharded", "model_cards", "_version", "dtypes"},
    "vision": {"orthogonal", "model_cards"},  # the models; their training run is a recipe
    "training": {  # the Trainer, its callback and arguments, the optimizers, sharding
        "allocator",
        "dtypes",
        "orthogonal",
        "tuners",
        "data",
        "initialization",
        "sharded",
        "diagnostics",
        "export",
        "checkpoints",
        "_quiet_imports",
    },
}
# Runs: pretraining, fine-tuning, presets, the vision run, the scripts' options, the planner; above all the library.
ALLOWED["recipes"] = ALLOWED["training"] | {"training", "vision", "model_cards"}
ALLOWED["__main__"] = {"recipes"}  # python -m poet_hf COMMAND: the poet-hf command, above everything
HUGGING_FACE = {"transformers", "peft", "accelerate", "datasets", "huggingface_hub", "safetensors"}
PURE_MATH = {"orthogonal"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, module: str, is_package: bool) -> list[str]:
    """The absolute module name of every import statement in ``source``, function-level imports included.

    ``from . import x`` counts as importing ``<package>.x``, which may be a module.
    """
    package = module if is_package else module.rpartition(".")[0]
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if not node.level:
                names.append(node.module)
                continue
            base = package.split(".")[: len(package.split(".")) - node.level + 1]
            target = ".".join(base + ([node.module] if node.module else []))
            names.append(target if node.module else f"{target}.{node.names[0].name}")
    return names


def part_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "poet_hf" and len(parts) > 1 else None


def layering_violations(source: str, module: str, is_package: bool = False) -> list[str]:
    """Every import in ``source`` (the module ``module``) that reaches a part its layer may not use."""
    own = part_of(module)
    if own is None:  # the top-level __init__ re-exports from every layer
        return []
    allowed = ALLOWED[own] | {own}
    problems = []
    for name in imported_modules(source, module, is_package):
        part = part_of(name)
        if part is not None and part in ALLOWED and part not in allowed:
            problems.append(f"{module} imports {name} ({own}/ may use only {sorted(allowed)})")
        if own in PURE_MATH and name.split(".")[0] in HUGGING_FACE:
            problems.append(f"{module} imports {name} ({own}/ is pure PyTorch)")
    return problems


def package_modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_every_part_of_the_package_has_a_layer():
    parts = {part_of(module_name(path)) for path in package_modules()} - {None}
    assert parts <= set(ALLOWED), f"parts without a layer in ALLOWED: {sorted(parts - set(ALLOWED))}"


@pytest.mark.parametrize("path", package_modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_imports_a_layer_above_its_own(path):
    assert layering_violations(path.read_text(), module_name(path), path.name == "__init__.py") == []


@pytest.mark.parametrize(
    "source, module, expected",
    [
        ("from ...training import PoetTrainer", "poet_hf.tuners.poet.layer", "imports poet_hf.training"),
        (
            "def f():\n    from ...export import export_merged",
            "poet_hf.tuners.rotation.layer",
            "imports poet_hf.export",
        ),
        ("import poet_hf.vision.lipconvnet", "poet_hf.export", "imports poet_hf.vision"),
        ("from transformers import PreTrainedModel", "poet_hf.orthogonal.eco", "is pure PyTorch"),
        ("from ..tuners import poet", "poet_hf.orthogonal.cayley", "imports poet_hf.tuners"),
    ],
)
def test_the_layering_check_catches_upward_imports(source, module, expected):
    problems = layering_violations(source, module)
    assert len(problems) == 1 and expected in problems[0], problems


def test_the_layering_check_accepts_downward_and_relative_sibling_imports():
    assert (
        layering_violations("from ..orthogonal import cayley\nfrom .layer import Linear", "poet_hf.tuners.poet.model")
        == []
    )
    assert layering_violations("from .cayley import cayley", "poet_hf.orthogonal", is_package=True) == []


MAX_SCRIPT_FUNCTION_LINES = 30


@pytest.mark.parametrize("path", sorted((ROOT / "scripts").glob("*.py")), ids=lambda p: p.name)
def test_scripts_are_thin_command_lines(path):
    """A script parses arguments and calls the library: no classes, short functions, nothing that needs reuse."""
    tree = ast.parse(path.read_text())
    classes = [node.name for node in tree.body if isinstance(node, ast.ClassDef)]
    long_functions = [
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and node.end_lineno - node.lineno + 1 > MAX_SCRIPT_FUNCTION_LINES
    ]
    assert classes == [] and long_functions == [], (classes, long_functions)


PROGRAMS = sorted(
    [*(ROOT / "scripts").glob("*.py"), *(ROOT / "tests" / "workers").glob("*.py"), *(ROOT / "examples").rglob("*.py")]
)


def work_at_import(source: str) -> list[str]:
    """The top-level statements of ``source`` that do work when it is imported: anything but imports, definitions,
    assignments, docstrings, ``sys.path`` set-up and the ``__main__`` / ``TYPE_CHECKING`` guards."""
    found = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.Expr):
            text = ast.unparse(node.value)
            harmless = isinstance(node.value, ast.Constant) or text.startswith("sys.path.insert(")
        elif isinstance(node, ast.If):
            harmless = ast.unparse(node.test) in ("__name__ == '__main__'", "TYPE_CHECKING")
        else:
            harmless = isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef, ast.Assign))
        found += [] if harmless else [f"line {node.lineno}: {ast.unparse(node).splitlines()[0]}"]
    return found


@pytest.mark.parametrize("path", PROGRAMS, ids=lambda p: str(p.relative_to(ROOT)))
def test_a_program_does_its_work_under_its_main_guard(path):
    """pytest-markdown-docs imports every Python file under the test paths to read its docstrings, in each xdist
    worker: a worker script that ran at import pretrained the README's model twice per test run."""
    assert work_at_import(path.read_text()) == []


def test_the_import_check_sees_work_outside_the_guard():
    source = 'import sys\nsys.path.insert(0, "x")\nX = 1\nrun(X)\nif __name__ == "__main__":\n    run(X)\n'
    assert work_at_import(source) == ["line 4: run(X)"]


MAX_LINES = {"file": 500, "class": 300, "function": 80}


def oversized(source: str, where: str) -> list[str]:
    """Every file, class or function of ``source`` longer than `MAX_LINES` allows."""
    found = [f"{where}: {source.count(chr(10))} lines"] if source.count("\n") > MAX_LINES["file"] else []
    for node in ast.walk(ast.parse(source)):
        kind = "class" if isinstance(node, ast.ClassDef) else "function"
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_LINES[kind]:
                found.append(f"{where}: {kind} {node.name} {length} lines")
    return found


def test_files_classes_and_functions_of_the_package_stay_small():
    assert [problem for path in package_modules() for problem in oversized(path.read_text(), str(path))] == []


def test_the_size_check_sees_a_long_function():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES["function"]))
    assert oversized(f"def f():\n{body}\n", "example") == ["example: function f 81 lines"]


# Lines of src/ that spell `Any` (imports aside): half the 278 of 2026-12-01 (issue 71). What is left is forced by
# generic signatures (PEFT's and Trainer's overrides, `**kwargs` forwarded to a dataclass) or untyped libraries
# (bitsandbytes' quantisation state, DeepSpeed's engine).
ANY_LINE_BUDGET = 139


def lines_using_any(source: str) -> int:
    """Lines of ``source`` where the name ``Any`` appears, import lines aside."""
    return sum(1 for line in source.splitlines() if re.search(r"\bAny\b", line) and "import" not in line)


def test_the_package_spells_any_on_at_most_its_budget_of_lines():
    assert sum(lines_using_any(path.read_text()) for path in package_modules()) <= ANY_LINE_BUDGET


def test_the_any_count_sees_annotations_and_skips_imports():
    source = "from typing import Any\n\ndef f(x: Any) -> dict[str, Any]:\n    return cast('Any', x)\n"
    assert lines_using_any(source) == 2


def classes_declaring(source: str, field_name: str) -> list[str]:
    """The classes of ``source`` that declare the annotated field ``field_name`` in their own body."""
    return [
        node.name
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.ClassDef)
        for statement in node.body
        if isinstance(statement, ast.AnnAssign)
        and isinstance(statement.target, ast.Name)
        and statement.target.id == field_name
    ]


@pytest.mark.parametrize("field_name", ["block_size", "merge_every"])
def test_a_setting_is_a_field_of_at_most_three_classes(field_name):
    """Issue 71: a setting has one home; the two a user sets most are declared by at most three classes (the
    script's options or the training arguments, the rotation config, and POET's config with its own default)."""
    owners = [name for path in package_modules() for name in classes_declaring(path.read_text(), field_name)]
    assert len(owners) <= 3, owners


def test_the_field_count_sees_a_declaration_and_not_a_use():
    source = "class A:\n    block_size: int = 2\n\nclass B:\n    def f(self):\n        block_size: int = 3\n"
    assert classes_declaring(source, "block_size") == ["A"]
