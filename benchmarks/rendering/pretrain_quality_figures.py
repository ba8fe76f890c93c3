"""The pretraining quality table of docs/benchmarks.md and the README's row, and POET-FS's choices on
docs/pretraining.md, rendered from ``benchmarks/results/pretrain_quality.json`` and ``pretrain_choices.json`` by
`benchmarks.rendering.figures`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from benchmarks.rendering.table_format import markdown_table, percent, provenance

Load = Callable[[str], dict[str, Any]]


def _best(load: Load) -> dict[str, dict[str, Any]]:
    return {row["method"]: row for row in load("pretrain_quality")["rows"] if row["best"]}


def quality_table(load: Load) -> str:
    """Every method at every rate: validation perplexity, the last evaluations (flat, or not), the whole process's
    peak, its peak above the imports, and its whole peak against AdamW's at AdamW's best rate."""
    adamw = _best(load)["AdamW"]["peak MB"]
    rows = []
    for row in load("pretrain_quality")["rows"]:
        perplexity = f"{row['val perplexity']:.1f}"
        rows.append(
            [
                row["method"],
                f"{row['rate']:g}" + (" (best)" if row["best"] else ""),
                f"**{perplexity}**" if row["best"] else perplexity,
                ", ".join(f"{loss:.3f}" for _, loss in row["validation losses"][-3:]),
                f"{row['peak MB']:.0f} MB",
                f"{row['above imports MB']:.0f} MB",
                f"{row['peak MB'] / adamw:.2f}",
                f"{row['trainable (M)']:.2f}M",
            ]
        )
    header = ["method", "rate", "validation perplexity", "last three validation losses", "peak, whole process"]
    header += ["peak above the imports", "peak / AdamW's"]
    return markdown_table([*header, "trainable"], rows)


def method_figure(load: Load, method: str) -> str:
    """``method``'s validation perplexity at its best rate and its peak memory against AdamW's."""
    best = _best(load)
    row = best[method]
    return f"{row['val perplexity']:.1f} at {row['peak MB'] / best['AdamW']['peak MB']:.2f}× AdamW's memory"


def perplexity_gap(load: Load, method: str, reference: str) -> str:
    """``method``'s validation perplexity against ``reference``'s, each at its best rate."""
    best = _best(load)
    return f"{best[method]['val perplexity'] / best[reference]['val perplexity'] - 1:+.1%}"


def edge_bests(load: Load) -> str:
    """The methods whose best rate is the smallest or the largest they ran at, with that rate."""
    rows = load("pretrain_quality")["rows"]
    edges = []
    for method, row in _best(load).items():
        rates = sorted(r["rate"] for r in rows if r["method"] == method)
        if row["rate"] in (rates[0], rates[-1]):
            edges.append(f"{method} ({row['rate']:g}, the {'smallest' if row['rate'] == rates[0] else 'largest'})")
    return ", ".join(edges) or "none"


def preset_against_best(load: Load, method: str) -> str:
    """``method``'s validation perplexity at the tiny preset's rate and at its best rate, with both rates."""
    record = load("pretrain_quality")
    rate = record["settings"]["preset rates"]["POET" if method.startswith("POET") else "others"]
    preset = next(row for row in record["rows"] if row["method"] == method and row["rate"] == rate)
    best = _best(load)[method]
    return (
        f"{preset['val perplexity']:.1f} at the preset's {preset['rate']:g}, "
        f"{best['val perplexity']:.1f} at {best['rate']:g}"
    )


def quality_headline(load: Load) -> list[str]:
    """The README's row: POET-BS and every other method at its best rate, validation perplexity and memory / AdamW's."""
    best = _best(load)
    settings = load("pretrain_quality")["settings"]
    adamw = best["AdamW"]["peak MB"]
    others = "; ".join(
        f"{method} {row['val perplexity']:.1f} ({row['peak MB'] / adamw:.2f}×)"
        for method, row in best.items()
        if method != "POET-BS"
    )
    return [
        f"pretraining the {settings['preset']} preset until the validation loss is flat ({settings['steps']} steps), "
        "each method at its best rate: validation perplexity, the whole process's peak memory / AdamW's",
        f"**POET-BS {method_figure(load, 'POET-BS')}**",
        f"{others}; [the picture](docs/benchmarks.md#pretraining-quality-against-memory)",
    ]


def _split(budget: float | dict[str, float]) -> str:
    """A POET-FS budget as R : P (``input`` : ``output``)."""
    sides = budget if isinstance(budget, dict) else {"input": budget, "output": budget}
    return f"{sides['input']:g} : {sides['output']:g}"


def choices_table(load: Load) -> str:
    """POET-FS with one choice changed per run (`benchmarks.suites.pretrain_choices`), the reference first."""
    rows = [
        [
            row["run"],
            f"{row['neumann_terms']} (k = {row['paper k']})",
            str(row["merge_every"]),
            _split(row["budget"]),
            str(row["merges"]),
            f"{row['rotation params']:,}",
            f"{row['val perplexity']:.1f}",
            f"{row['max spectrum drift'] * 100:.1f} %",
        ]
        for row in load("pretrain_choices")["rows"]
    ]
    header = ["run", "`neumann_terms` n (paper k)", "`T_m`", "R : P budget", "merges", "rotation parameters"]
    return markdown_table([*header, "val. perplexity", "largest spectrum drift"], rows)


def _choice(load: Load, run: str = "reference") -> dict[str, Any]:
    """The row of `benchmarks.suites.pretrain_choices` whose name starts with ``run`` (by default the reference)."""
    return next(row for row in load("pretrain_choices")["rows"] if row["run"].startswith(run))


def choice_gap(load: Load, run: str) -> str:
    """The validation perplexity of the choice whose name starts with ``run``, and its gap to the reference's."""
    row, reference = _choice(load, run), _choice(load)
    return f"{row['val perplexity']:.1f} ({percent(row['val perplexity'] / reference['val perplexity'] - 1)})"


def drift_against_reference(load: Load, run: str) -> str:
    """How many times the reference's largest spectrum drift the choice ``run`` drifts."""
    reference = _choice(load)["max spectrum drift"]
    return f"{_choice(load, run)['max spectrum drift'] / reference:.1f}×"


def choices_initial(load: Load) -> str:
    """The validation perplexity the choices' runs start from."""
    return f"{_choice(load)['initial val perplexity']:.0f}"


PRETRAIN_QUALITY_TABLES: dict[str, Callable[[Load], str]] = {
    "pretrain_quality": quality_table,
    "pretrain_choices": choices_table,
}
PRETRAIN_QUALITY_FIGURES: dict[str, Callable[[Load], str]] = {
    "pretrain_quality.source": lambda load: provenance(load("pretrain_quality")),
    "pretrain_choices.source": lambda load: provenance(load("pretrain_choices")),
    "pretrain_choices.initial": choices_initial,
    "pretrain_choices.reference": lambda load: f"{_choice(load)['val perplexity']:.1f}",
    "pretrain_choices.n5_drift": lambda load: drift_against_reference(load, "n = 5"),
    **{
        f"pretrain_choices.{key}": (lambda load, run=run: choice_gap(load, run))
        for key, run in (("n5", "n = 5"), ("tm50", "T_m = 50"), ("tm400", "T_m = 400"))
        + (("r_heavy", "R-heavy"), ("p_heavy", "P-heavy"))
    },
    "pretrain_quality.savings_gap": lambda load: perplexity_gap(load, "POET-BS, every saving on", "POET-BS"),
    "pretrain_quality.edge_bests": edge_bests,
    "pretrain_quality.adamw_rates": lambda load: preset_against_best(load, "AdamW"),
    "pretrain_quality.poet_bs_rates": lambda load: preset_against_best(load, "POET-BS"),
    "pretrain_quality.lead_over_adamw": lambda load: perplexity_gap(load, "POET-BS", "AdamW"),
    "pretrain_quality.lead_over_adamw_8bit": lambda load: perplexity_gap(load, "POET-BS", "AdamW 8-bit"),
    **{
        f"pretrain_quality.{key}": (lambda load, m=method: method_figure(load, m))
        for key, method in (
            ("poet_bs", "POET-BS"),
            ("poet_fs", "POET-FS"),
            ("adamw", "AdamW"),
            ("adamw_8bit", "AdamW 8-bit"),
            ("galore", "GaLore 8-bit, layer-wise"),
            ("apollo", "APOLLO-Mini, layer-wise"),
            ("savings", "POET-BS, every saving on"),
        )
    },
}
