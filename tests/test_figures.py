"""The README's and the docs' measured figures against the committed results files (`benchmarks.rendering.figures`):
a clean checkout passes ``--check_figures``; a figure changed by hand fails it, naming the page and the figure."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from script_modules import load_module  # noqa: E402

from benchmarks.rendering.figures import FIGURE, TABLE, check_figures, render_figures  # noqa: E402


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """The pages and the results files, copied."""
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    shutil.copytree(ROOT / "docs", tmp_path / "docs", ignore=shutil.ignore_patterns("figures", "*.py"))
    shutil.copytree(ROOT / "benchmarks" / "results", tmp_path / "benchmarks" / "results")
    return tmp_path


def test_every_rendered_figure_of_this_checkout_is_its_results_files():
    assert check_figures(ROOT) == []
    assert load_module(ROOT / "scripts" / "benchmark.py").main(["--check_figures"]) == 0


def test_the_readme_headline_table_is_rendered_and_carries_the_7b_figure():
    readme = (ROOT / "README.md").read_text()
    tables = {m["name"]: m["body"] for m in TABLE.finditer(readme)}
    assert "headline" in tables and tables["headline"].count("\n") >= 3
    assert "GiB" in tables["headline"]


def test_a_headline_figure_changed_by_hand_fails_naming_the_readme(checkout: Path):
    readme = checkout / "README.md"
    text = readme.read_text()
    table = next(m for m in TABLE.finditer(text) if m["name"] == "headline")
    body = table["body"]
    start = body.index("**") + 2
    end = body.index("**", start)
    edited = body[:start] + "0.01×" + body[end:]  # the first bold figure, typed over
    readme.write_text(text.replace(body, edited))
    problems = check_figures(checkout)
    assert len(problems) == 1
    assert problems[0].startswith("README.md: table 'headline' differs") and "0.01×" in problems[0]
    assert render_figures(checkout) == [readme] and check_figures(checkout) == []  # rendering puts it back


def test_a_figure_in_prose_changed_by_hand_fails_and_an_unknown_name_is_reported(checkout: Path):
    page = next(p for p in sorted((checkout / "docs").glob("*.md")) if FIGURE.search(p.read_text()))
    text = page.read_text()
    figure = FIGURE.search(text)
    page.write_text(text.replace(figure[0], figure["open"] + "42" + figure["close"], 1))
    problems = check_figures(checkout)
    assert len(problems) == 1 and problems[0].startswith(f"docs/{page.name}: figure {figure['name']!r} differs")
    page.write_text(text + "\n<!-- figure: no.such.figure -->1<!-- /figure -->\n")
    assert any("no figure named 'no.such.figure'" in p for p in check_figures(checkout))


# Every floor a results file records, with the measurement it bounds from below: a floor counts only what the run
# must hold or do, so no measurement of that run falls below it. Where a bound is not that (the pretraining step's
# analytic memory and flop ratios leave out AdamW's own update costs), it is called an estimate and is not here.
FLOORS = {
    ("fold", "floor_mb"): "peak_above_mb",  # the fold's memory above the layer's codes
    ("pretrain_step", "cache floor MB"): "POET cache MB",  # the rotation caches' blocks and pending gradients
}


def _rows_with(name: str, key: str) -> list[dict]:
    import json

    rows = json.loads((ROOT / "benchmarks" / "results" / f"{name}.json").read_text())["rows"]
    return [row for row in rows if key in row]


def test_every_recorded_floor_is_registered_and_at_or_below_its_measurement():
    import json

    recorded = {
        (path.stem, key)
        for path in (ROOT / "benchmarks" / "results").glob("*.json")
        for row in json.loads(path.read_text()).get("rows", [])
        for key in row
        if "floor" in key.lower()
    }
    assert recorded == set(FLOORS), "a results file records a floor this test does not check (or no longer does)"
    for (name, floor), measured in FLOORS.items():
        for row in _rows_with(name, floor):
            assert row[measured] >= row[floor], (name, row)


def test_eco_layers_are_above_their_floor():
    """The plain dilated convolution is the floor of any convolution of its shape (benchmarks/suites/eco.py)."""
    groups: dict[tuple[str, str], dict[str, float]] = {}
    for row in _rows_with("eco", "ms_per_batch"):
        groups.setdefault((row["what"], row["shape"]), {})[row["layer"]] = row["ms_per_batch"]
    assert any("plain_dilated" in layers for layers in groups.values())
    for group, layers in groups.items():
        if "plain_dilated" in layers:
            assert min(layers.values()) == layers["plain_dilated"], group


def test_a_number_typed_into_the_prose_fails_the_check_naming_page_and_line(checkout):
    """A measured-looking number outside the markers and code fails ``--check_figures``; the same number inside an
    analytic, paper or input marker, inside code, or rendered, does not."""
    page = checkout / "docs" / "concepts.md"
    original = page.read_text()
    page.write_text(original + "\nPOET-BS trains at 1.23× AdamW's speed here.\n")
    problems = check_figures(checkout)
    assert len(problems) == 1 and problems[0].startswith("docs/concepts.md: ") and "'1.23×'" in problems[0]
    line = len(original.splitlines()) + 2
    assert f"line {line}" in problems[0]
    marked = ("analytic", "paper", "input", "outside")
    for allowed in [f"<!-- {kind} -->1.23×<!-- /{kind} -->" for kind in marked] + ["`1.23×`"]:
        page.write_text(original + f"\nPOET-BS trains at {allowed} AdamW's speed here.\n")
        assert check_figures(checkout) == [], allowed
    page.write_text(original + "\n```text\nstep 1.23× of AdamW\n```\nA perplexity of 41.5 was seen.\n")
    assert "'perplexity of 41.5'" in " ".join(check_figures(checkout))


def test_a_page_that_drops_an_allowed_typed_number_asks_for_the_count_to_fall(checkout, monkeypatch):
    """A page allowed two typed numbers (``LEFT``) that now carries one asks for its count to be lowered."""
    from benchmarks.rendering import typed_figures

    page = checkout / "docs" / "concepts.md"
    page.write_text(page.read_text() + "\nPOET-BS trains at 1.23× AdamW's speed here.\n")
    monkeypatch.setitem(typed_figures.LEFT, "docs/concepts.md", 2)
    assert check_figures(checkout) == ["docs/concepts.md: 1 typed figures left: lower LEFT['docs/concepts.md'] from 2"]


def test_a_results_file_measured_on_uncommitted_changes_fails_unless_still_listed(checkout, monkeypatch):
    """A results file whose commit carries ``+changes`` fails ``--check_figures``, naming it, unless
    ``STILL_ON_CHANGES`` lists it; a listed file that was re-measured on a committed tree asks to come off the list."""
    import json

    from benchmarks.rendering import committed_sources

    path = checkout / "benchmarks" / "results" / "fold.json"
    record = json.loads(path.read_text())
    assert not record["commit"].endswith("+changes")
    path.write_text(json.dumps({**record, "commit": record["commit"] + "+changes"}))
    render_figures(checkout)  # the pages name the commit: only the source's provenance is left to fail
    assert check_figures(checkout) == [
        "benchmarks/results/fold.json: measured on uncommitted changes: commit, then measure it again"
    ]
    monkeypatch.setitem(committed_sources.STILL_ON_CHANGES, "fold", "a reason")
    assert check_figures(checkout) == []
    path.write_text(json.dumps(record))
    render_figures(checkout)
    assert check_figures(checkout) == [
        "benchmarks/results/fold.json: measured on a committed tree: take 'fold' off STILL_ON_CHANGES"
    ]
