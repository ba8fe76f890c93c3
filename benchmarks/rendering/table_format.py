"""How the rendered tables and figures print numbers (`benchmarks.rendering.figures`)."""

from __future__ import annotations

from typing import Any


def ratio(value: float) -> str:
    return f"{value:.2f}×"


def mib(value: float) -> str:
    return f"{value:,.0f} MiB"


def gib(value_mib: float) -> str:
    return f"{value_mib / 1024:.2f} GiB"


def gib_and_si(value_mib: float) -> str:
    """Binary and decimal units side by side, for a headline that someone will hold against "8 GB"."""
    return f"{value_mib / 1024:.2f} GiB ({value_mib * 2**20 / 1e9:.2f} GB)"


def percent(value: float) -> str:
    return f"{value * 100:+.1f} %".replace("-", "−")


def scientific(value: float) -> str:
    """Two significant digits times a power of ten, as prose writes it: ``1.5·10⁻⁷``."""
    mantissa, exponent = f"{value:.1e}".split("e")
    return f"{mantissa}·10{str(int(exponent)).translate(str.maketrans('-0123456789', '⁻⁰¹²³⁴⁵⁶⁷⁸⁹'))}"


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join([*lines, *("| " + " | ".join(row) + " |" for row in rows)])


def provenance(record: dict[str, Any]) -> str:
    """Where a results file's rows were measured: its command, date, machine and commit."""
    return f"`{record['command']}`, {record['date']}, {record['machine']}, commit `{record['commit']}`"
