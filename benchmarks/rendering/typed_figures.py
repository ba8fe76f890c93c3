"""Measured-looking numbers typed into the prose of the README and docs/, which no results file backs.

A number with a unit of measurement (×, %, MB, MiB, GB, GiB, ms, s, tokens/s, GFLOP/s, or after the word
perplexity) counts when it stands outside a rendered figure or table (`benchmarks.rendering.figures`), outside code, and
outside a marker that says what it is instead:

- ``<!-- analytic -->…<!-- /analytic -->``: counted from the shapes (bytes that must exist, flops that must run);
- ``<!-- paper -->…<!-- /paper -->``: a paper's figure, or another project's;
- ``<!-- input -->…<!-- /input -->``: a setting, an example's input, or a machine's description;
- ``<!-- outside -->…<!-- /outside -->``: a measurement made outside this repository's suites, which no results file
  can hold (a checkpoint kept aside for evaluation); the marked text says who measured it, when, and how.

`LEFT` is, per page, how many such numbers the page may still carry, and why. ``--check_figures`` fails
on a page with more (a figure typed by hand), naming each number, and on a page with fewer until its count here is
lowered too: the counts only fall.
"""

from __future__ import annotations

import re
from pathlib import Path

UNIT = re.compile(
    r"(?<![\w.])\d[\d,]*(?:\.\d+)?\s?(?:×(?!\s?\d)|%|(?:MiB|GiB|MB|GB|ms|s)\b|tokens/s|GFLOP/s)"
    r"|\bperplexity\b[^.\d\n]{0,20}\d[\d,]*(?:\.\d+)?"
)
HIDDEN = (
    re.compile(r"```.*?```", re.S),  # code blocks
    re.compile(r"<!-- (?P<kind>figure|table): [\w.-]+ -->.*?<!-- /(?P=kind) -->", re.S),  # rendered
    re.compile(r"<!-- (?P<kind>analytic|paper|input|outside) -->.*?<!-- /(?P=kind) -->", re.S),  # said what they are
    re.compile(r"`[^`\n]*`"),  # inline code
)
# Typed measured numbers a page may still carry, each with why it cannot be rendered; a page's count only falls.
LEFT: dict[str, int] = {}


def prose(text: str) -> str:
    """``text`` with its code, rendered figures and marked numbers blanked, its lines kept where they were."""
    for pattern in HIDDEN:
        text = pattern.sub(lambda match: "\n" * match.group(0).count("\n"), text)
    return text


def typed_figures(text: str) -> list[tuple[int, str]]:
    """``(line, number with its unit)`` of every typed measured-looking number in a page's ``text``."""
    return [
        (line_number, match.group(0))
        for line_number, line in enumerate(prose(text).splitlines(), start=1)
        for match in UNIT.finditer(line)
    ]


def typed_figure_problems(root: Path, pages: list[Path]) -> list[str]:
    """One line per page whose typed numbers differ in count from `LEFT`, naming them."""
    problems = []
    for page in pages:
        relative = page.relative_to(root).as_posix()
        found, allowed = typed_figures(page.read_text()), LEFT.get(relative, 0)
        if len(found) > allowed:
            listed = "; ".join(f"line {line}: {number!r}" for line, number in found)
            problems.append(
                f"{relative}: {len(found)} typed figures, {allowed} allowed: render each from a results file or mark "
                f"it <!-- analytic -->, <!-- paper --> or <!-- input --> ({listed})"
            )
        elif len(found) < allowed:
            problems.append(f"{relative}: {len(found)} typed figures left: lower LEFT[{relative!r}] from {allowed}")
    return problems
