"""The documentation against the code: every error message the package can raise is explained on the
troubleshooting page, every public object documents its arguments, return value and errors, and the README stays a
landing page whose sections live on the site. (The Python blocks of docs/ and README.md run as tests of their own,
through pytest-markdown-docs; `mkdocs build --strict` runs in CI.)"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "poet_hf"
DOCS = ROOT / "docs"


def _literal_parts(node: ast.expr) -> list[str]:
    """The constant pieces of a message built from literals, f-strings and ``+``."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        return [v.value for v in node.values if isinstance(v, ast.Constant) and isinstance(v.value, str)]
    if isinstance(node, ast.BinOp):
        return _literal_parts(node.left) + _literal_parts(node.right)
    return []


def raised_messages() -> list[tuple[str, str]]:
    """``(where, the longest constant piece of the message)`` for every ``raise X("...")`` in the package."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args:
                pieces = [" ".join(p.split()) for p in _literal_parts(node.exc.args[0])]
                longest = max(pieces, key=len, default="").strip(" .;:,'\"`(")
                if len(longest) >= 12:
                    found.append((f"{path.relative_to(PACKAGE.parent)}:{node.lineno}", longest))
    return found


def test_every_error_message_is_on_the_troubleshooting_page():
    page = " ".join((DOCS / "troubleshooting.md").read_text().split())
    missing = [f"{where}: {text!r}" for where, text in raised_messages() if text not in page]
    assert not missing, "not explained in docs/troubleshooting.md:\n" + "\n".join(missing)


# --- the API reference's docstrings ----------------------------------------------------------------------------------
PUBLIC_MODULES = [
    "poet_hf.training",
    "poet_hf.export",
    "poet_hf.training.distributed",
    "poet_hf.sharded",
    "poet_hf.initialization",
    "poet_hf.orthogonal",
    "poet_hf.orthogonal",
    "poet_hf.diagnostics",
]
PUBLIC_OBJECTS = [
    "poet_hf.tuners.poet.PoetConfig",
    "poet_hf.tuners.oft.OftConfig",
    "poet_hf.tuners.orthogonal_layers.OrthogonalConfig",
    "poet_hf.tuners.poet.merge_and_reinit",
    "poet_hf.tuners.rotation.caches.defer_rotation_grads",
    "poet_hf.tuners.rotation.layer.flush_rotation_caches",
    "poet_hf.tuners.oft.peft_oft_state_dict_to_ours",
    "poet_hf.tuners.oft.our_oft_state_dict_to_peft",
    "poet_hf.tuners.rotation.state_checks.AdapterStateError",
    "poet_hf.recipes.memory_plan.plan_memory",
    "poet_hf.recipes.memory_plan.MemoryPlan",
    "poet_hf.recipes.pretrain.PretrainArguments",
    "poet_hf.recipes.pretrain.run_pretraining",
    "poet_hf.recipes.presets.build_llama",
    "poet_hf.recipes.finetune.FinetuneArguments",
    "poet_hf.recipes.finetune.run_finetuning",
    "poet_hf.vision.lipconvnet.LipConvNetConfig",
    "poet_hf.vision.lipconvnet.LipConvNetForImageClassification",
    "poet_hf.vision.certify.certified_accuracy",
    "poet_hf.vision.flow.ReflectionFlowConfig",
    "poet_hf.vision.flow.ReflectionFlowModel",
]


def _package():
    griffe = pytest.importorskip("griffe")
    return griffe.load("poet_hf", search_paths=[str(ROOT / "src")], docstring_parser="google")


def public_objects() -> list:
    """Every object the API reference documents: each public module's exports (``__all__``, or its public
    functions and classes) and the objects named above, with their public methods defined in the package."""
    package = _package()
    roots = []
    for name in PUBLIC_MODULES:
        module = package[name.removeprefix("poet_hf.")]
        names = list(
            module.exports
            or [
                n
                for n, m in module.members.items()
                if not n.startswith("_") and not m.is_alias and (m.is_function or m.is_class)
            ]
        )
        roots += [module[n] for n in names]
    roots += [package[name.removeprefix("poet_hf.")] for name in PUBLIC_OBJECTS]
    objects = []
    for obj in roots:
        obj = obj.final_target if obj.is_alias else obj
        if obj.is_attribute or obj.is_module:
            continue
        objects.append(obj)
        if obj.is_class:
            objects += [
                m
                for n, m in obj.members.items()
                if m.is_function and not m.is_alias and (not n.startswith("_") or n == "__init__")
            ]
    return list({o.path: o for o in objects}.values())


def _sections(obj) -> dict[str, list]:
    parsed = obj.docstring.parse("google") if obj.docstring else []
    return {s.kind.value: s.value for s in parsed}


def _raises(obj) -> bool:
    """Whether the function's own body raises (``raise X(...)``, not a bare re-raise)."""
    source = "\n".join(obj.lines) if obj.lines else ""
    node = ast.parse(__import__("textwrap").dedent(source)) if source else None
    return node is not None and any(isinstance(n, ast.Raise) and n.exc is not None for n in ast.walk(node))


def _runtime(obj):
    """The live object behind a griffe object (for what only the runtime knows: dataclass fields, base classes)."""
    import importlib

    module = importlib.import_module(obj.module.path)
    value = module
    for part in obj.path.removeprefix(obj.module.path + ".").split("."):
        value = getattr(value, part)
    return value


def _overrides_foreign_method(obj) -> bool:
    """A method that overrides one of a base class outside the package (``forward``, ``Trainer.log``…): its
    contract is documented there."""
    if not (obj.parent and obj.parent.is_class):
        return False
    cls = _runtime(obj.parent)
    return any(obj.name in vars(base) for base in cls.__mro__[1:] if not base.__module__.startswith("poet_hf"))


def _implements_protocol_method(obj) -> bool:
    """A method of a class that subclasses one of the package's protocols (`OrthogonalMap`): its contract is
    documented on the protocol, which this test checks as a public object of its own."""
    if not (obj.parent and obj.parent.is_class):
        return False
    cls = _runtime(obj.parent)
    return any(
        getattr(base, "_is_protocol", False) and obj.name in vars(base)
        for base in cls.__mro__[1:]
        if base.__module__.startswith("poet_hf")
    )


def _help_fields(obj) -> set[str]:
    """The dataclass fields of a class that document themselves (``metadata={"help": ...}``, PEFT's convention)."""
    import dataclasses

    cls = _runtime(obj)
    if not dataclasses.is_dataclass(cls):
        return set()
    return {f.name for f in dataclasses.fields(cls) if f.metadata.get("help")}


def docstring_problems(obj) -> list[str]:
    if obj.is_class:
        return [] if obj.docstring else ["no docstring"]
    if obj.name != "__init__" and (_overrides_foreign_method(obj) or _implements_protocol_method(obj)):
        return []
    owner = obj.parent if obj.name == "__init__" else obj
    if not owner.docstring and not obj.docstring:
        return ["no docstring"]
    sections = _sections(obj)
    if obj.name == "__init__":  # the class docstring documents the constructor (Google style), __init__'s may add
        for kind, value in _sections(owner).items():
            sections[kind] = value + sections.get(kind, []) if isinstance(value, list) else value
    documented = {p.name for p in sections.get("parameters", []) + sections.get("other parameters", [])}
    if obj.name == "__init__":
        documented |= _help_fields(obj.parent)
    params = [
        p.name
        for p in obj.parameters
        if p.name not in ("self", "cls") and p.kind.value not in ("variadic positional", "variadic keyword")
    ]
    problems = []
    missing = [p for p in params if p not in documented]
    if missing:
        problems.append(f"arguments not under Args: {missing}")
    returns = obj.returns
    if (
        obj.name != "__init__"
        and returns is not None
        and str(returns) not in ("None", "NoReturn")
        and "returns" not in sections
        and "yields" not in sections
        and not obj.name.startswith("__")
    ):
        problems.append("no Returns section")
    if _raises(obj) and "raises" not in sections:
        problems.append("raises but has no Raises section")
    return problems


def test_every_public_object_documents_its_arguments_return_value_and_errors():
    problems = [f"{obj.path}: {p}" for obj in public_objects() for p in docstring_problems(obj)]
    assert not problems, f"{len(problems)} docstring gaps:\n" + "\n".join(problems)


# --- the README is a landing page -------------------------------------------------------------------------------------
def test_readme_is_a_landing_page_that_starts_with_the_two_commands_and_links_into_the_site():
    readme = (ROOT / "README.md").read_text()
    lines = readme.splitlines()
    assert len(lines) <= 200
    assert lines[:4] == [
        "```bash",
        "pip install -q torch==2.13.0 && pip install -q -e . && python scripts/pretrain.py",
        'pip install -q torch==2.13.0 && pip install -q -e ".[dev]" && python -m pytest',
        "```",
    ]
    linked = set(re.findall(r"\]\((docs/[^)#]+)", readme))
    assert {
        f"docs/{page}"
        for page in (
            "index.md",
            "concepts.md",
            "pretraining.md",
            "finetuning.md",
            "distributed.md",
            "export.md",
            "troubleshooting.md",
            "benchmarks.md",
        )
    } <= linked
    assert all((ROOT / path).exists() for path in linked)


def test_every_page_of_the_site_is_in_its_navigation():
    import yaml

    def pages(node):
        if isinstance(node, str):
            yield node
        elif isinstance(node, dict):
            for value in node.values():
                yield from pages(value)
        elif isinstance(node, list):
            for value in node:
                yield from pages(value)

    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text().replace("!!python", "#"))
    listed = set(pages(config["nav"]))
    on_disk = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert on_disk == listed


def test_every_test_the_engine_table_names_exists_and_no_cell_is_untested():
    """docs/distributed.md's table of savings against engines: each cell tested by a test that exists (its file, its
    function and the parameter id it names) or refused; none left "untested"."""
    page = (DOCS / "distributed.md").read_text()
    section = page.split("## Which saving runs on which engine", 1)[1]
    table = next(block for block in section.split("\n\n") if block.startswith("| "))
    rows = [line for line in table.splitlines() if not line.startswith("| ---")][1:]
    cells = [cell.strip() for row in rows for cell in row.strip("|").split(" | ")[1:]]
    assert len(rows) >= 8 and len(cells) == 4 * len(rows)
    assert all(re.match(r"(\S+ )?(tested|refused)", cell) for cell in cells), cells
    named = re.findall(r"`(test_\w+\.py)::(test_\w+)(?:\[([^\]]+)\])?`", table)
    assert len(named) >= 10
    for module, function, parameters in named:
        source = (ROOT / "tests" / module).read_text()
        assert f"def {function}(" in source, (module, function)
        for part in filter(None, re.split(r"[-+]", parameters or "")):
            assert part in source, (module, function, part)
