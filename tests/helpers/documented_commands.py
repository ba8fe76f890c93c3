"""The command lines the README and docs/ give in their ``bash`` blocks, and the scripts they call: what
tests/test_documented_commands.py parses and tests/test_documented_runs.py runs."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from script_modules import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BASH_BLOCK = re.compile(r"^```bash\n(.*?)^```", re.S | re.M)
# A script or an example of this repository, or the SLURM file that hands its arguments to scripts/pretrain.py.
SCRIPT = re.compile(r"(?:^|/)((?:scripts|examples)/\w+)\.py$|(?:^|/)examples/cluster/slurm_pretrain\.sh$")
# The installed command's subcommands, and the script each is (`poet_hf.recipes.commands`).
POET_HF_COMMANDS = {
    name: f"scripts/{name.replace('-', '_')}" for name in ("pretrain", "finetune", "plan-memory", "export")
}
SEPARATORS = {"&&", "||", ";", "|"}


def page_lines(page: Path) -> list[str]:
    """Every command line of ``page``'s bash blocks, in page order, a backslash-continued line joined into one."""
    lines = []
    for block in BASH_BLOCK.findall(page.read_text()):
        lines += [line.strip() for line in re.sub(r"\\\n\s*", " ", block).splitlines() if line.strip()]
    return lines


def commands(line: str) -> list[list[str]]:
    """The commands of a shell line, as words: shell comments dropped, split at ``&&``, ``||``, ``;`` and ``|``."""
    found: list[list[str]] = [[]]
    for token in shlex.split(line, comments=True):
        if token in SEPARATORS:
            found.append([])
        else:
            found[-1].append(token)
    return [command for command in found if command]


def script_call(command: list[str]) -> tuple[str, int] | None:
    """The script a command calls (``scripts/pretrain``, ``examples/sft_trl``; the installed ``poet-hf`` command's
    subcommand as the script it is) and the index of the command's first argument to it; None when it calls none."""
    for index, word in enumerate(command):
        if match := SCRIPT.search(word):
            return match.group(1) or "scripts/pretrain", index + 1
        installed = word == "poet-hf" or (word == "poet_hf" and command[index - 1 : index] == ["-m"])
        if installed and command[index + 1 : index + 2] and command[index + 1] in POET_HF_COMMANDS:
            return POET_HF_COMMANDS[command[index + 1]], index + 2
    return None


def script_calls(line: str) -> list[tuple[str, list[str]]]:
    """Each call of a script on ``line``: (the script's name, its arguments)."""
    calls = []
    for command in commands(line):
        if (call := script_call(command)) is not None:
            calls.append((call[0], command[call[1] :]))
    return calls
