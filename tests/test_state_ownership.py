"""State lives in objects a model or a run owns: no module-level container that the package writes at run time, no
``global`` rebinding, no ``_poet_*`` attribute stashed on another object (a tensor's, a module's).

The references are the source files themselves, read as syntax trees: a finding names the file and line."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "poet_hf"
CONTAINERS = {"dict", "list", "set", "defaultdict", "OrderedDict", "Counter", "deque"}
CONTAINERS |= {"WeakSet", "WeakKeyDictionary", "WeakValueDictionary", "WeakIdKeyDictionary"}
MUTATORS = {"append", "add", "update", "pop", "popitem", "clear", "setdefault", "extend", "insert", "remove"}
MUTATORS |= {"discard", "appendleft", "__setitem__", "__delitem__"}


def _is_container(value: ast.expr | None) -> bool:
    if isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)):
        return True
    if isinstance(value, ast.Call):
        name = value.func.attr if isinstance(value.func, ast.Attribute) else getattr(value.func, "id", "")
        return name in CONTAINERS
    return False


def _module_containers(tree: ast.Module) -> set[str]:
    """Names that the module binds, at its top level, to a mutable container."""
    names = set()
    for node in tree.body:
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        if _is_container(value):
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def _writes_in_functions(tree: ast.Module, names: set[str]) -> list[int]:
    """Lines, inside a function, that write into one of ``names`` (item assignment or deletion, a mutating call)."""
    lines = []
    for function in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
        for node in ast.walk(function):
            if isinstance(node, ast.Subscript) and isinstance(node.ctx, (ast.Store, ast.Del)):
                if isinstance(node.value, ast.Name) and node.value.id in names:
                    lines.append(node.lineno)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
                if isinstance(node.func.value, ast.Name) and node.func.value.id in names:
                    lines.append(node.lineno)
    return lines


def _stashed_attributes(tree: ast.Module) -> list[int]:
    """Lines that set or read a ``_poet_*`` attribute by assignment or by name (``setattr``/``getattr``/``hasattr``)."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_poet_") and isinstance(node.ctx, ast.Store):
            lines.append(node.lineno)
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") in ("setattr", "getattr", "hasattr", "delattr"):
            if (
                len(node.args) > 1
                and isinstance(node.args[1], ast.Constant)
                and str(node.args[1].value).startswith("_poet_")
            ):
                lines.append(node.lineno)
    return lines


def _findings(check) -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        found += [f"{path.relative_to(PACKAGE.parent)}:{line}" for line in check(tree)]
    return found


def test_no_module_level_container_is_written_at_run_time():
    found = _findings(lambda tree: _writes_in_functions(tree, _module_containers(tree)))
    assert not found, f"module-level containers written at run time (give the state to its owner): {found}"


def test_no_function_rebinds_a_module_global():
    found = _findings(lambda tree: [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Global)])
    assert not found, f"`global` statements: {found}"


def test_no_attribute_is_stashed_on_another_object():
    found = _findings(_stashed_attributes)
    assert not found, f"_poet_* attributes set on tensors or modules: {found}"


def test_the_scans_find_what_they_look_for():
    """Each scan flags a planted instance of what it forbids (and leaves a read-only constant table alone)."""
    planted = ast.parse(
        "CACHE: dict = {}\nTABLE = {'a': 1}\nFLAG = False\n"
        "def f(t):\n    CACHE[id(t)] = t\n    global FLAG\n    FLAG = True\n"
        "    t._poet_anchor = 1\n    return TABLE['a']\n"
    )
    assert _writes_in_functions(planted, _module_containers(planted)) == [5]
    assert [n.lineno for n in ast.walk(planted) if isinstance(n, ast.Global)] == [6]
    assert _stashed_attributes(planted) == [8]
