"""The README's and the docs' measured figures, rendered from the committed results files.

A page marks each rendered piece:

- a table: ``<!-- table: NAME -->``, the table's lines, ``<!-- /table -->``;
- a figure in prose: ``<!-- figure: NAME -->7.7 GiB<!-- /figure -->``.

``NAME`` is a key of `TABLES` or `FIGURES`, whose function builds the text from ``benchmarks/results/<suite>.json``
(`benchmarks.results`). `render_figures` rewrites every marked piece; `check_figures` lists every piece whose text
differs from what its results file gives, naming the page, the piece and the first differing line, so a figure
typed by hand fails ``python scripts/benchmark.py --check_figures`` (CI runs it).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.rendering.committed_sources import uncommitted_source_problems
from benchmarks.rendering.finetune_figures import FINETUNE_FIGURES, FINETUNE_TABLES, finetune_headline
from benchmarks.rendering.layer_figures import LAYER_FIGURES, LAYER_TABLES
from benchmarks.rendering.pretrain_quality_figures import (
    PRETRAIN_QUALITY_FIGURES,
    PRETRAIN_QUALITY_TABLES,
    quality_headline,
)
from benchmarks.rendering.quantized_figures import QUANTIZED_FIGURES, QUANTIZED_TABLES
from benchmarks.rendering.sharding_figures import SHARDING_FIGURES, SHARDING_TABLES
from benchmarks.rendering.step_figures import (
    STEP_FIGURES,
    STEP_TABLES,
    losing_headlines,
    pretrain_step_row,
    wide_headline,
)
from benchmarks.rendering.table_format import gib, gib_and_si, markdown_table, mib, percent, provenance, ratio
from benchmarks.rendering.typed_figures import typed_figure_problems
from benchmarks.rendering.vision_figures import VISION_FIGURES, VISION_TABLES
from benchmarks.results import load_results

TABLE = re.compile(r"(?P<open><!-- table: (?P<name>[\w.-]+) -->\n)(?P<body>.*?)(?P<close>\n?<!-- /table -->)", re.S)
FIGURE = re.compile(r"(?P<open><!-- figure: (?P<name>[\w.-]+) -->)(?P<body>.*?)(?P<close><!-- /figure -->)", re.S)
PAGES = ("README.md", "docs/*.md")

Load = Callable[[str], dict[str, Any]]


# --- the suites' rows ---------------------------------------------------------------------------------------------
def seven_b(load: Load) -> dict[str, Any]:
    return load("pretrain_7b")["rows"][0]


def eight_b(load: Load) -> dict[str, Any]:
    return load("pretrain_8b")["rows"][0]


def quality(load: Load) -> list[dict[str, Any]]:
    return load("savings_quality")["rows"]


def mean_gap(load: Load, run: str = "everything on") -> str:
    """The ``run`` rows' mean gap to the plain job over the seeds, and how many."""
    gaps = [row["vs plain"] for row in quality(load) if row["run"] == run]
    return f"{percent(sum(gaps) / len(gaps))} over {len(gaps)} seeds"


def gap_range(load: Load, run: str = "everything on") -> str:
    """The smallest and the largest of the ``run`` rows' gaps to the plain job, as ``"a to b"``."""
    gaps = [row["vs plain"] for row in quality(load) if row["run"] == run]
    return f"{percent(min(gaps))} to {percent(max(gaps))}"


def main_job(load: Load) -> dict[str, Any]:
    """The README's main job as typed: the plain run at the scripts' default seed 0."""
    return next(r for r in quality(load) if r["run"] == "plain" and r["seed"] == 0)


def quality_gaps(load: Load, run: str = "everything on") -> str:
    """The ``run`` rows' perplexity against the plain ones', per seed."""
    gaps = [row for row in quality(load) if row["run"] == run]
    return " / ".join(f"{percent(row['vs plain'])} (seed {row['seed']})" for row in gaps)


BFLOAT16_RUN = "everything on, bfloat16 head and embeddings"


def bfloat16_vocab_gaps(load: Load) -> str:
    """Per seed: the bfloat16 head and embeddings against the same savings in float32."""
    rows = {(row["run"], row["seed"]): row["val perplexity"] for row in quality(load)}
    seeds = sorted({seed for run, seed in rows if run == BFLOAT16_RUN})
    gaps = (rows[(BFLOAT16_RUN, seed)] / rows[("everything on", seed)] - 1 for seed in seeds)
    return " / ".join(f"{percent(gap)} (seed {seed})" for gap, seed in zip(gaps, seeds, strict=True))


# --- the tables ---------------------------------------------------------------------------------------------------
def eight_b_headline(load: Load) -> list[str]:
    """The README's row for Llama-3-8B's shape."""
    big = eight_b(load)
    return [
        "Llama-3-8B's shape (128k vocabulary), the same savings (the head and embeddings stored in bfloat16: "
        f"`--vocab_weights_dtype bfloat16`), {big['batch']} × {big['seq']}: the whole process's peak RSS",
        f"**{gib_and_si(big['steps_whole_peak_mb'])}** in the steps; "
        f"{gib_and_si(big['merge_whole_peak_mb'])} in a merge",
        f"`plan_memory` {ratio(big['planned_vs_measured'])} above the imports; with the head and embeddings in "
        f"float32 it plans {gib_and_si(big['planned_float32_vocab_mb'] + big['imports_rss_mb'])}; "
        "[the 8B section](docs/pretraining-7b.md#llama-3-8bs-shape-a-128k-vocabulary)",
    ]


def headline_table(load: Load) -> str:
    """The README's headline table."""
    step130, step350 = pretrain_step_row(load, "llama-130m", "4x256"), pretrain_step_row(load, "llama-350m", "2x256")
    step130_16 = pretrain_step_row(load, "llama-130m", "16x256")
    big = seven_b(load)
    plain = main_job(load)
    rows = [
        [
            "POET-BS 256 pretraining step, llama-130m, 4 × 256: memory / AdamW",
            f"**{ratio(step130['memory ratio'])}**",
            f"analytic estimate {ratio(step130['analytic estimate ratio'])}; peak RSS above the imports, each in "
            f"its own process started as a user starts it; whole process {mib(step130['POET whole peak MB'])} against "
            f"{mib(step130['AdamW whole peak MB'])} ({load('pretrain_step')['date']})",
        ],
        [
            "the same run: time / AdamW",
            f"**{ratio(step130['time ratio'])}**",
            f"flop ratio {ratio(step130['flop ratio'])} (an estimate: multiply-adds only); "
            f"{ratio(step130_16['time ratio'])} at 16 × 256 (flop ratio {ratio(step130_16['flop ratio'])})",
        ],
        wide_headline(load),
        *losing_headlines(load),
        [
            "POET-BS 256, llama-350m, 2 × 256: memory / AdamW",
            f"**{ratio(step350['memory ratio'])}**",
            f"analytic estimate {ratio(step350['analytic estimate ratio'])}",
        ],
        [
            "Llama-2-7B's shape, POET training steps (nf4 `W0`, 8-bit states with 32-bit ones for the embeddings, "
            "fused steps with the clip, checkpointing, the head and embeddings stored in bfloat16), "
            f"{big['batch']} × {big['seq']}: the whole process's peak RSS",
            f"**{gib_and_si(big['steps_whole_peak_mb'])}** in the steps; "
            f"{gib_and_si(big['merge_whole_peak_mb'])} in a merge",
            f"imports ({mib(big['imports_rss_mb'])}) included, started as a user starts it (no allocator variable); "
            f"above the imports {mib(big['steps_peak_mb'])}, `plan_memory` {mib(big['planned_mb'])} "
            f"({ratio(big['planned_vs_measured'])}); [the recipe](docs/pretraining-7b.md)",
        ],
        eight_b_headline(load),
        [
            "the README's main job with every saving on (nf4 `W0`, 8-bit states, fused steps, checkpointing), "
            "validation perplexity against the plain job",
            f"**{quality_gaps(load)}**",
            f"plain job {plain['val perplexity']:.2f} (seed 0), the clip at the recipe's {plain['max_grad_norm']}; "
            f"the plain job with another AdamW kernel (the same update, other last bits): "
            f"{quality_gaps(load, 'plain, other rounding')}",
        ],
        quality_headline(load),
        finetune_headline(load),
    ]
    return markdown_table(["what", "figure", "note"], rows)


def pretrain_7b_table(load: Load) -> str:
    """The phases of the 7B step (docs/pretraining-7b.md)."""
    big = seven_b(load)
    phases = [
        ("build: `meta`, then each layer initialized and quantized to nf4", "build", big["build_s"]),
        ("training steps (two)", "steps", big["step_s"]),
        (f"merge of all {7 * big['layers']} layers (each `W0` by groups of rows)", "merge", None),
        ("the step after the merge", "after_merge", big["after_merge_s"]),
    ]
    rows = []
    for label, key, seconds in phases:
        seconds = big[f"{key}_s"] if seconds is None else seconds
        planned = f"{mib(big['planned_mb'])} ({ratio(big['planned_vs_measured'])})" if key == "steps" else "–"
        rows.append([label, f"{seconds:.0f} s", mib(big[f"{key}_whole_peak_mb"]), mib(big[f"{key}_peak_mb"]), planned])
    header = ["phase", "time", "peak RSS, whole process", "peak RSS above the imports", "`plan_memory`"]
    return markdown_table(header, rows)


def held_7b(load: Load) -> float:
    """MiB the 7B steps hold before any activation or gradient, by `plan_memory`: ``W0``, the trainable parameters
    and their optimizer states (above the imports)."""
    from benchmarks.suites.pretrain_7b import plan

    big = seven_b(load)
    parts = plan(big["batch"], big["seq"], vocab_weights_dtype=big["vocab_weights_dtype"]).parts
    return (
        sum(parts[name] for name in ("W0", "other frozen weights", "trainable parameters", "optimizer states")) / 2**20
    )


def memory_peers_table(load: Load) -> str:
    """POET with every saving on against the low-memory optimizers (docs/benchmarks.md)."""
    rows = []
    for r in load("memory_peers")["rows"]:
        if r.get("table"):
            continue
        poet = r["method"].startswith("POET")
        bold = (lambda text: f"**{text}**") if poet else (lambda text: text)
        planned = f"{r['planned MB']:.0f} MB ({r['planned MB'] / r['peak MB']:.2f}×)" if r["planned MB"] else ""
        rows.append(
            [
                r["preset"],
                bold(r["method"]),
                bold(f"{r['peak MB']:.0f}"),
                bold(f"{r['peak / AdamW']:.3g}"),
                f"{r['step s']:.3g}",
                planned,
            ]
        )
    return markdown_table(["shape", "method", "peak MB", "peak / AdamW", "step s", "`plan_memory`"], rows)


def peer_rows(load: Load, preset: str) -> dict[str, dict[str, Any]]:
    """The `memory_peers` rows of one shape, by method."""
    return {r["method"]: r for r in load("memory_peers")["rows"] if r.get("preset") == preset}


def poet_time_ratio(load: Load, preset: str) -> str:
    """POET's step time (every saving on) over AdamW's, in the `memory_peers` run."""
    rows = peer_rows(load, preset)
    return ratio(rows["POET-BS, everything on"]["step s"] / rows["AdamW"]["step s"])


def planner_gap(load: Load) -> str:
    """The largest relative gap between `plan_memory` and a measured POET peak of `memory_peers`."""
    rows = [r for r in load("memory_peers")["rows"] if r.get("planned MB")]
    return f"{max(abs(r['planned MB'] / r['peak MB'] - 1) for r in rows) * 100:.0f} %"


def state_step_table(load: Load) -> str:
    """One 8-bit AdamW step of a 32000 × 4096 tensor, per implementation (docs/training-modes.md)."""
    names = {
        "bitsandbytes, whole tensor": "bitsandbytes `AdamW8bit`, whole tensor",
        "bitsandbytes, chunked": "bitsandbytes `AdamW8bit`, chunked (what the fused steps run)",
        "torchao": "torchao `AdamW8bit` (compiled update)",
    }
    rows = [
        [names[r["implementation"]], f"{r['step_s']:.2f}", f"{r['transient_mb']:.0f} MB"]
        for r in load("memory_peers")["rows"]
        if r.get("table") == "8-bit state step"
    ]
    return markdown_table(["implementation", "step s", "memory above the states"], rows)


def plan_7b_table(load: Load) -> str:
    """`plan_memory`'s parts for the 7B run, POET against AdamW with the same savings (docs/pretraining-7b.md).

    The planner's output for the run's shape and settings (``--seq_len`` and batch from the results file), not a
    measurement: it changes with the planner's code."""
    from benchmarks.suites.pretrain_7b import plan

    big = seven_b(load)
    plans = [
        plan(big["batch"], big["seq"], method=method, vocab_weights_dtype=big["vocab_weights_dtype"])
        for method in ("poet-bs", "adamw")
    ]
    rows = [
        [part, *(f"{p.parts[part] / 2**20:.0f}" for p in plans)]
        for part in plans[0].parts
        if any(p.parts[part] for p in plans)
    ]
    rows.append(["**total**", *(f"**{p.total_bytes / 2**20:.0f}**" for p in plans)])
    return markdown_table(["MiB per process", "POET-BS, everything on", "AdamW, 8-bit states, fused"], rows)


def savings_quality_table(load: Load) -> str:
    """The main job with every saving on against the plain job, per seed (docs/pretraining-7b.md)."""
    rows = [
        [
            row["run"],
            str(row["seed"]),
            f"`{row['optimizer']}`" + (", fused" if row["fused steps"] else ""),
            str(row["max_grad_norm"]),
            f"{row['val perplexity']:.2f}",
            "–" if row["run"] == "plain" else percent(row["vs plain"]),
        ]
        for row in quality(load)
    ]
    return markdown_table(["run", "seed", "optimizer", "clip", "validation perplexity", "vs plain"], rows)


def choosing_pretrain_table(load: Load) -> str:
    """POET-BS and POET-FS against AdamW at llama-130m, 4 × 256 (docs/choosing-a-method.md)."""
    rows = []
    for method, name in (("poet-bs", "POET-BS 256"), ("poet-fs", "POET-FS ½")):
        step = pretrain_step_row(load, "llama-130m", "4x256", method)
        big_batch = pretrain_step_row(load, "llama-130m", "16x256", method)
        rows.append(
            [
                name,
                f"{step['memory ratio']:.2f} (analytic estimate {step['analytic estimate ratio']:.2f})",
                f"{step['time ratio']:.2f} (flop ratio {step['flop ratio']:.2f}); "
                f"{big_batch['time ratio']:.2f} at 16 × 256 (flop ratio {big_batch['flop ratio']:.2f})",
            ]
        )
    return markdown_table(["method", "memory / AdamW", "time / AdamW"], rows)


TABLES: dict[str, Callable[[Load], str]] = {
    "choosing_pretrain": choosing_pretrain_table,
    "headline": headline_table,
    "pretrain_7b": pretrain_7b_table,
    "plan_7b": plan_7b_table,
    "memory_peers": memory_peers_table,
    "state_step": state_step_table,
    "savings_quality": savings_quality_table,
    **LAYER_TABLES,
    **FINETUNE_TABLES,
    **PRETRAIN_QUALITY_TABLES,
    **SHARDING_TABLES,
    **STEP_TABLES,
    **QUANTIZED_TABLES,
    **VISION_TABLES,
}


# --- the figures in prose -----------------------------------------------------------------------------------------
def shape_figures(suite: str, row_of: Callable[[Load], dict[str, Any]]) -> dict[str, Callable[[Load], str]]:
    """The figures every large-shape suite (`pretrain_7b`, `pretrain_8b`) gives of its row ``row_of(load)``."""
    return {
        f"{suite}.whole_peak": lambda load: gib_and_si(row_of(load)["whole_peak_mb"]),
        f"{suite}.steps_whole_peak": lambda load: gib_and_si(row_of(load)["steps_whole_peak_mb"]),
        f"{suite}.merge_whole_peak": lambda load: gib_and_si(row_of(load)["merge_whole_peak_mb"]),
        f"{suite}.steps_peak": lambda load: mib(row_of(load)["steps_peak_mb"]),
        f"{suite}.planned": lambda load: mib(row_of(load)["planned_mb"]),
        f"{suite}.planned_ratio": lambda load: ratio(row_of(load)["planned_vs_measured"]),
        f"{suite}.planned_float32_whole": lambda load: gib_and_si(
            row_of(load)["planned_float32_vocab_mb"] + row_of(load)["imports_rss_mb"]
        ),
        f"{suite}.source": lambda load: provenance(load(suite)),
    }


FIGURES: dict[str, Callable[[Load], str]] = {
    **shape_figures("pretrain_7b", seven_b),
    "pretrain_7b.whole_peak_mib": lambda load: mib(seven_b(load)["whole_peak_mb"]),
    "pretrain_7b.imports": lambda load: mib(seven_b(load)["imports_rss_mb"]),
    "pretrain_7b.planned_adamw": lambda load: gib(seven_b(load)["planned_adamw_same_savings_mb"]),
    "pretrain_7b.planned_gpu": lambda load: gib(seven_b(load)["planned_gpu_bf16_1x2048_mb"]),
    "pretrain_7b.states": lambda load: gib(seven_b(load)["states_mb"]),
    "pretrain_7b.residual_files": lambda load: gib(seven_b(load)["residual_file_mb"]),
    "pretrain_7b.merge_working": lambda load: mib(seven_b(load)["merge_peak_mb"] - held_7b(load)),
    "pretrain_7b.merge_time": lambda load: f"{seven_b(load)['merge_s']:.0f} s",
    "pretrain_7b.held": lambda load: mib(held_7b(load)),
    "pretrain_7b.held_whole": lambda load: gib_and_si(held_7b(load) + seven_b(load)["imports_rss_mb"]),
    "pretrain_7b.working": lambda load: mib(seven_b(load)["steps_peak_mb"] - held_7b(load)),
    "savings_quality.gaps": quality_gaps,
    "savings_quality.noise": lambda load: quality_gaps(load, "plain, other rounding"),
    "savings_quality.mean_gap": lambda load: mean_gap(load),
    "savings_quality.range": lambda load: gap_range(load),
    "savings_quality.source": lambda load: provenance(load("savings_quality")),
    "savings_quality.bfloat16_gaps": lambda load: quality_gaps(load, BFLOAT16_RUN),
    "savings_quality.bfloat16_vs_float32": bfloat16_vocab_gaps,
    **shape_figures("pretrain_8b", eight_b),
    "pretrain_8b.step_time": lambda load: f"{eight_b(load)['after_merge_s']:.0f} s",
    "main_job.perplexity": lambda load: (
        f"{next(r for r in quality(load) if r['run'] == 'plain')['val perplexity']:.2f}"
    ),
    "memory_peers.source": lambda load: provenance(load("memory_peers")),
    "memory_peers.time_130m": lambda load: poet_time_ratio(load, "llama-130m"),
    "memory_peers.time_350m": lambda load: poet_time_ratio(load, "llama-350m"),
    "memory_peers.planner_gap": planner_gap,
    **LAYER_FIGURES,
    **FINETUNE_FIGURES,
    **PRETRAIN_QUALITY_FIGURES,
    **SHARDING_FIGURES,
    **STEP_FIGURES,
    **QUANTIZED_FIGURES,
    **VISION_FIGURES,
}


# --- rendering and checking ---------------------------------------------------------------------------------------
def _loader(root: Path) -> Load:
    cache: dict[str, dict[str, Any]] = {}

    def load(suite: str) -> dict[str, Any]:
        if suite not in cache:
            cache[suite] = load_results(suite, root)
        return cache[suite]

    return load


def pages(root: Path) -> list[Path]:
    return sorted(path for pattern in PAGES for path in root.glob(pattern))


def _expected(kind: str, name: str, load: Load) -> str:
    registry = TABLES if kind == "table" else FIGURES
    if name not in registry:
        raise KeyError(f"no {kind} named {name!r} (known: {', '.join(registry)})")
    return registry[name](load)


def render_page(text: str, load: Load) -> str:
    """``text`` with every marked table and figure rewritten from the results files."""
    text = TABLE.sub(lambda m: m["open"] + _expected("table", m["name"], load) + "\n<!-- /table -->", text)
    return FIGURE.sub(lambda m: m["open"] + _expected("figure", m["name"], load) + m["close"], text)


def render_figures(root: Path) -> list[Path]:
    """Rewrite the marked figures of every page under ``root``; returns the pages that changed."""
    load, changed = _loader(root), []
    for page in pages(root):
        text = page.read_text()
        rendered = render_page(text, load)
        if rendered != text:
            page.write_text(rendered)
            changed.append(page)
    return changed


def check_figures(root: Path) -> list[str]:
    """Every marked piece under ``root`` whose text differs from its results file, every page with more (or fewer)
    typed measured numbers in its prose than `benchmarks.rendering.typed_figures.LEFT` allows, and every results file
    measured on uncommitted changes (`benchmarks.rendering.committed_sources`); one line each."""
    load, problems = _loader(root), []
    for page in pages(root):
        relative = page.relative_to(root)
        text = page.read_text()
        for kind, pattern in (("table", TABLE), ("figure", FIGURE)):
            for match in pattern.finditer(text):
                try:
                    expected = _expected(kind, match["name"], load)
                except (KeyError, FileNotFoundError) as error:
                    problems.append(f"{relative}: {kind} {match['name']!r}: {error}")
                    continue
                written = match["body"]
                if written.strip() != expected.strip():
                    problems.append(
                        f"{relative}: {kind} {match['name']!r} differs from its results file: "
                        f"{_first_difference(written.strip(), expected.strip())}"
                    )
    return problems + typed_figure_problems(root, pages(root)) + uncommitted_source_problems(root)


def _first_difference(written: str, expected: str) -> str:
    for number, (a, b) in enumerate(zip(written.splitlines(), expected.splitlines(), strict=False), start=1):
        if a != b:
            return f"line {number} reads {a!r}, the results give {b!r}"
    return f"{len(written.splitlines())} lines written, {len(expected.splitlines())} rendered"


def figures_command(root: Path, render: bool) -> int:
    """``--render_figures`` (``render``) or ``--check_figures``: print what it did; the exit status."""
    if render:
        for page in render_figures(root):
            print(f"rendered {page}")
        return 0
    problems = check_figures(root)
    for problem in problems:
        print(problem)
    print(f"figures: {len(problems)} differ from their results files" if problems else "figures: all rendered")
    return 1 if problems else 0
