"""Every command-line script prints its help, and every flag it takes has a help text."""

import contextlib
import io
from pathlib import Path

import pytest
from script_modules import load_module

SCRIPTS = sorted((Path(__file__).resolve().parent.parent / "scripts").glob("*.py"))


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_help_runs_and_every_flag_is_explained(path):
    parser = load_module(path).build_parser()
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["--help"])
    assert exit_info.value.code == 0 and out.getvalue().startswith("usage:")
    bare = [
        action.option_strings[0] if action.option_strings else action.dest
        for action in parser._actions
        if not action.help and action.dest != "help"
    ]
    assert not bare, f"{path.name}: flags without a help text: {bare}"
