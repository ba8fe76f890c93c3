"""The public API of 0.1.0: what CHANGELOG.md lists, with no deprecated name, alias or moved module kept."""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

import pytest
import torch
from models import tiny_llama
from peft import get_peft_model

import poet_hf
from poet_hf import PoetConfig

ROOT = Path(__file__).resolve().parents[1]
CHANGELOG = (ROOT / "CHANGELOG.md").read_text()
PUBLIC_MODULES = ("poet_hf", "poet_hf.training", "poet_hf.export", "poet_hf.vision", "poet_hf.checkpoints")


@pytest.mark.parametrize("module", PUBLIC_MODULES)
def test_the_changelog_names_every_public_name(module: str):
    exported = importlib.import_module(module).__all__
    missing = [name for name in exported if f"`{name}`" not in CHANGELOG]
    assert not missing, f"{module} exports {missing}, which CHANGELOG.md's 0.1.0 API does not list"


@pytest.mark.parametrize("old", ["poet_hf.tuners.orthogonal", "poet_hf.optim", "poet_hf.tuners.bnb", "poet_hf.cli"])
def test_a_former_module_name_does_not_import(old: str):
    sys.modules.pop(old, None)
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(old)
    assert not [f for f in sys.meta_path if type(f).__module__.startswith("poet_hf")], "an import finder of poet_hf"


def _warning_categories(path: Path) -> list[tuple[int, str]]:
    """``(line, category)`` of every ``warnings.warn(…, <category>, …)`` call in a source file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "warnings.warn":
            category = (
                node.args[1]
                if len(node.args) > 1
                else next((k.value for k in node.keywords if k.arg == "category"), None)
            )
            found.append((node.lineno, "" if category is None else ast.unparse(category)))
    return found


def test_no_source_file_warns_of_a_deprecation():
    deprecations = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in sorted((ROOT / "src" / "poet_hf").rglob("*.py"))
        for line, category in _warning_categories(path)
        if category in ("FutureWarning", "DeprecationWarning", "PendingDeprecationWarning")
    ]
    assert not deprecations, f"deprecation warnings in an unpublished package: {deprecations}"


def test_the_merge_callback_takes_the_adapter_name_only():
    from poet_hf.training import MergeReinitCallback

    with pytest.raises(TypeError, match="merge_every"):
        MergeReinitCallback(merge_every=6)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="adapter_name"):
        MergeReinitCallback(6)  # type: ignore[arg-type]


def test_the_merge_interval_comes_from_the_config_unless_the_run_overrides_it():
    from poet_hf.training.callback import merge_interval

    model = get_peft_model(tiny_llama(), PoetConfig(block_size=8, merge_every=30))
    plain = poet_hf.PoetTrainingArguments(output_dir="unused", report_to="none", use_cpu=True)
    override = poet_hf.PoetTrainingArguments(output_dir="unused", report_to="none", use_cpu=True, merge_every=7)
    assert merge_interval(model, plain) == 30 and merge_interval(model, override) == 7
    assert merge_interval(torch.nn.Linear(2, 2), plain) is None  # no rotation layers: no merges
