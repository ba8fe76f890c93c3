"""Every command line that the README, the docs and the scripts' and examples' own docstrings give for a script or an
example of this repository names only flags it takes, with values it accepts: each is parsed by its own parser.

The README's main job runs in tests/test_scripts.py and its tests in CI; most other commands need a GPU, a cluster,
the Hub or hours, so here each is parsed, which is where a renamed or misspelt flag shows. A command with a
placeholder (``…``, ``$VAR``, ``<...>``, a usage line's ``[--flag]``) cannot be parsed as written; it is listed with
that reason in the test's output (``-rA``) rather than dropped silently.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest
from documented_commands import PAGES, page_lines, script_calls
from script_modules import ROOT, load_module

PLACEHOLDER = re.compile(r"…|\$|<[^>]*>|\[--")


def _docstring_commands(path: Path) -> list[str]:
    """The indented command lines of a module docstring (``python scripts/...``, ``accelerate launch ...``)."""
    import ast

    text = ast.get_docstring(ast.parse(path.read_text())) or ""
    text = re.sub(r"\\\n\s*", " ", text)
    return [
        line.strip()
        for line in text.splitlines()
        if line.startswith("    ") and re.search(r"scripts/|examples/|poet-hf |-m poet_hf ", line)
    ]


def documented_commands() -> list[tuple[str, str]]:
    """(where, command line) for every line of a bash block of the pages, and of the scripts' and examples'
    docstrings."""
    found = [
        (str(page.relative_to(ROOT)), line)
        for page in PAGES
        for line in page_lines(page)
        if re.search(r"(scripts|examples)/[\w/]+\.(py|sh)|poet-hf |-m poet_hf ", line)
    ]
    programs = [*(ROOT / "scripts").glob("*.py"), *(ROOT / "examples").glob("*.py")]
    for script in sorted([*programs, ROOT / "src" / "poet_hf" / "recipes" / "commands.py"]):
        found += [(str(script.relative_to(ROOT)), line) for line in _docstring_commands(script)]
    return found


@cache
def parse_of(script: str):
    """The function that parses ``script``'s command line: a script's ``build_parser().parse_args``, an example's
    ``parse_args``."""
    module = load_module(ROOT / f"{script}.py")
    return module.build_parser().parse_args if hasattr(module, "build_parser") else module.parse_args


COMMANDS = documented_commands()


def test_the_pages_give_commands_for_the_scripts():
    """The extraction finds what it is meant to: the README's main job and export line, and the cluster commands."""
    lines = [line for _, line in COMMANDS]
    assert "python scripts/pretrain.py" in " ".join(lines) and len(COMMANDS) >= 40
    assert any(call[0] == "scripts/export" for line in lines for call in script_calls(line))
    assert any(call[0].startswith("examples/") for line in lines for call in script_calls(line))
    assert any(line.startswith("sbatch ") for line in lines)
    assert any(call[0] == "scripts/plan_memory" and "poet-hf" in line for line in lines for call in script_calls(line))


@pytest.mark.parametrize("where, line", COMMANDS, ids=[f"{where}:{line[:60]}" for where, line in COMMANDS])
def test_a_documented_command_parses_with_its_script_s_own_parser(where, line):
    if PLACEHOLDER.search(line):
        pytest.skip(f"{where}: a placeholder stands for a value: {line}")
    calls = script_calls(line)
    assert calls, f"{where}: no script call found in {line!r}"
    for script, arguments in calls:
        try:
            parse_of(script)(arguments)
        except SystemExit as error:
            pytest.fail(f"{where}: {script}.py refuses {' '.join(arguments)!r} (exit {error.code}): {line}")
