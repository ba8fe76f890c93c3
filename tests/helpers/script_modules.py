"""Scripts and examples loaded as modules, so that a test calls their ``main`` in its own process (a new interpreter
would spend most of its time importing)."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load_module(path: Path) -> ModuleType:
    """The Python file at ``path`` (e.g. ``ROOT / "scripts" / "pretrain.py"``), executed as a fresh module."""
    spec = importlib.util.spec_from_file_location(f"loaded_{path.parent.name}_{path.stem}", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def command_line_error(capsys, parse: Callable[[], object]) -> str:
    """The one line a command line's argument error prints, checked as argparse's own: exit status 2, nothing else on
    standard error, and the line names the script (``prog: error: ...``)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        parse()
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and ": error: " in err, (exit_info.value.code, err)
    return err
