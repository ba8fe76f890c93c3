"""The fine-tuning quality tables of docs/finetuning.md, docs/choosing-a-method.md and the README, rendered from
``benchmarks/results/finetune_choice.json`` (the choosing sweep) and ``finetune_report.json`` (the reporting set) by
`benchmarks.rendering.figures`."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from typing import Any

from benchmarks.rendering.table_format import markdown_table, provenance

Load = Callable[[str], dict[str, Any]]
TASK_NAMES = {
    "lm-256x4": "LM 256×4, Milton",
    "lm-128x12": "LM 128×12, Milton",
    "classification": "MiniLM, four plays",
    "lm-384x3": "LM 384×3, Milton",
    "code-192x6": "code LM 192×6, unit tests",
    "genre": "MiniLM, genre",
}
GAIN = "loss gain / OFT's"
METHOD_NAMES = {"lora": "LoRA (r 8)", "oft": "OFT (block 32)", "poet": "POET (`--recipe default`)"}


def _rate_label(row: dict[str, Any]) -> str:
    marks = [name for name, flag in (("default", row["default"]), ("best", row["best"])) if flag]
    return f"{row['rate']:g}" + (f" ({', '.join(marks)})" if marks else "")


def _gain_and_angle(row: dict[str, Any]) -> str:
    angle = f" ({row['angle @5']:.1f}°)" if row["method"] != "lora" else ""
    return f"{row[GAIN]:.2f}{angle}"


def _rows_by_task(rows: list[dict[str, Any]], key: Callable[[dict[str, Any]], Any]) -> dict[Any, dict[str, Any]]:
    """``rows`` grouped by ``key`` (a row → its table row), each group keyed by task."""
    groups: dict[Any, dict[str, Any]] = {}
    for row in rows:
        groups.setdefault(key(row), {})[row["task"]] = row
    return groups


def choice_table(load: Load) -> str:
    """Every method at every rate of the sweep: its loss gain over OFT's default on each choosing task (the largest
    angle a layer turned by at step 5), and the mean over the tasks."""
    record = load("finetune_choice")
    tasks = list(record["settings"]["tasks"])
    cells = _rows_by_task(record["rows"], lambda row: (row["method"], row["rate"]))
    rows = []
    for (method, _), by_task in sorted(
        cells.items(), key=lambda item: (list(METHOD_NAMES).index(item[0][0]), item[0][1])
    ):
        gains = [by_task[t][GAIN] for t in tasks]
        first = by_task[tasks[0]]
        text = [_gain_and_angle(by_task[t]) for t in tasks]
        mean = f"{sum(gains) / len(gains):.2f}"
        rows.append([METHOD_NAMES[method], _rate_label(first), *text, f"**{mean}**" if first["best"] else mean])
    return markdown_table(["method", "rate", *(TASK_NAMES[t] for t in tasks), "mean"], rows)


def sweep_table(load: Load) -> str:
    """POET with one choice of its default recipe changed: its loss gain over OFT's default on each choosing task
    (the largest angle a layer turned by at step 5), and the mean over the tasks."""
    record = load("finetune_sweep")
    tasks = list(record["settings"]["tasks"])
    rows = []
    for variant, by_task in _rows_by_task(record["rows"], lambda row: row["variant"]).items():
        mean = sum(by_task[t][GAIN] for t in tasks) / len(tasks)
        rows.append([variant, *(_gain_and_angle(by_task[t]) for t in tasks), f"{mean:.2f}"])
    return markdown_table(["variant", *(TASK_NAMES[t] for t in tasks), "mean"], rows)


def report_table(load: Load) -> str:
    """Each method at its default and at its best rate of the choosing sweep on the reporting set, over the seeds."""
    rows = []
    for row in load("finetune_report")["rows"]:
        metric = row["metric"]
        digits = ".3f" if metric == "accuracy" else ".1f"
        rows.append(
            [
                TASK_NAMES[row["task"]],
                METHOD_NAMES[row["method"]],
                f"{row['rate']:g} ({row['setting']})",
                f"{metric} {row[f'{metric} before']:{digits}}",
                f"{row[f'{metric} after']:{digits}}",
                f"{row['loss before']:.3f} → {row['loss @5']:.3f} → {row['loss after']:.3f}",
                f"{row[GAIN]:.2f} ({row[GAIN + ' min']:.2f}–{row[GAIN + ' max']:.2f})",
                f"{row['memory / OFT']:.2f}",
                f"{row['trainable (M)']:.2f}M",
            ]
        )
    header = ["task", "method", "rate", "before", "after (mean)", "loss before → @5 → after (mean)"]
    header += ["loss gain / OFT's default: mean (range)", "memory / OFT", "trainable"]
    return markdown_table(header, rows)


def testbed_table(load: Load) -> str:
    """How each trained LM of the two sets was pretrained: its shape, corpus, steps and last validation losses."""
    choosing = load("finetune_choice")["settings"]["tasks"]
    rows = []
    for name, record in load("finetune_report")["settings"]["testbed"].items():
        recipe, losses = record["recipe"], record["validation_losses"]
        best = min(losses)
        rows.append(
            [
                name,
                "choosing" if name in choosing else "reporting",
                f"{recipe['hidden']} × {recipe['layers']} blocks, {record['parameters'] / 1e6:.1f}M",
                "standard library modules (own BPE)" if "corpus" in recipe else "the bundled plays",
                "its unit tests" if "corpus" in recipe else "Milton",
                str(record["steps"]),
                ", ".join(f"{loss:.3f}" for loss in losses[-3:]),
                f"{best:.3f} ({math.exp(best):.0f})",
            ]
        )
    header = ["model", "set", "shape", "pretrained on", "fine-tuned on", "steps", "last validation losses"]
    return markdown_table([*header, "kept: validation loss (perplexity)"], rows)


def _report_rows(load: Load, method: str, setting: str) -> list[dict[str, Any]]:
    """``method``'s reporting rows at its ``"default"`` or ``"best"`` rate, in the suite's task order."""
    rows = load("finetune_report")["rows"]
    return [r for r in rows if r["method"] == method and setting in r["setting"].split(" = ")]


def report_gains(load: Load, method: str, setting: str) -> str:
    """``method``'s mean loss gain over OFT's default on each reporting task, at its ``"default"`` or ``"best"``
    rate."""
    return ", ".join(f"{r[GAIN]:.2f}" for r in _report_rows(load, method, setting))


def report_mean(load: Load, method: str, setting: str) -> float:
    """``method``'s loss gain over OFT's default at its ``"default"`` or ``"best"`` rate, the mean over the
    reporting tasks and seeds."""
    return statistics.mean(r[GAIN] for r in _report_rows(load, method, setting))


def report_min(load: Load, method: str, setting: str) -> float:
    """``method``'s smallest loss gain over OFT's default at its ``"default"`` or ``"best"`` rate, over the reporting
    tasks and seeds."""
    return min(r[GAIN + " min"] for r in _report_rows(load, method, setting))


def report_memory(load: Load, method: str) -> str:
    """``method``'s peak memory over OFT's on each reporting task, at its default rate."""
    return ", ".join(f"{r['memory / OFT']:.2f}" for r in _report_rows(load, method, "default"))


def choice_mean(load: Load, method: str, setting: str) -> float:
    """``method``'s loss gain over OFT's default at its ``"default"`` or ``"best"`` rate, the mean over the
    choosing tasks."""
    return statistics.mean(r[GAIN] for r in load("finetune_choice")["rows"] if r["method"] == method and r[setting])


def usual_lora_mean(load: Load) -> str:
    """LoRA's mean loss gain over OFT's default on the choosing tasks at the usual LoRA rate, 2e-4."""
    rows = [r for r in load("finetune_choice")["rows"] if r["method"] == "lora" and math.isclose(r["rate"], 2e-4)]
    return f"{statistics.mean(r[GAIN] for r in rows):.2f}"


def default_angles(load: Load, method: str) -> str:
    """The largest angle a layer turned by at step 5 at ``method``'s default rate, per choosing task."""
    record = load("finetune_choice")
    by_task = {r["task"]: r for r in record["rows"] if r["method"] == method and r["default"]}
    angles = [f"{by_task[task]['angle @5']:.1f}°" for task in record["settings"]["tasks"]]
    return ", ".join(angles[:-1]) + " and " + angles[-1]


COLLAPSED = 0.2  # a loss gain below a fifth of OFT's default: the run lost what the model had


def collapse_angles(load: Load) -> str:
    """The smallest step-5 angle of a rotation run that collapsed, and the largest of one that still gained more than
    OFT's default, over the choosing sweep."""
    rows = [r for r in load("finetune_choice")["rows"] if r["method"] != "lora"]
    collapsed = min(r["angle @5"] for r in rows if r[GAIN] < COLLAPSED)
    gained = max(r["angle @5"] for r in rows if r[GAIN] > 1)
    return f"one run collapsed at {collapsed:.0f}° while another still gained at {gained:.0f}°"


def best_rate(load: Load, method: str) -> str:
    return next(f"{r['rate']:g}" for r in load("finetune_choice")["rows"] if r["method"] == method and r["best"])


def finetune_headline(load: Load) -> list[str]:
    """The README's row: each method's mean gain on the reporting set, at its best rate and at its default."""
    names = {"lora": "LoRA", "oft": "OFT", "poet": "POET"}

    def gains(setting: str) -> str:
        return " / ".join(f"{names[m]} {report_mean(load, m, setting):.2f}" for m in names)

    settings = load("finetune_report")["settings"]
    tasks = "; ".join(TASK_NAMES[t] for t in settings["tasks"])
    return [
        f"fine-tuning three models no rate was chosen on ({tasks}), {len(settings['seeds'])} seeds: loss gain / "
        "OFT's at its default rate, each method at its best rate of the choosing sweep",
        f"**{gains('best')}**",
        f"at each one's default rate: {gains('default')}; per task, with the seeds' range: "
        "[Fine-tuning](docs/finetuning.md#the-reporting-set); which to pick: "
        "[Choosing a method](docs/choosing-a-method.md)",
    ]


FINETUNE_TABLES: dict[str, Callable[[Load], str]] = {
    "finetune_choice": choice_table,
    "finetune_report": report_table,
    "finetune_sweep": sweep_table,
    "finetune_testbed": testbed_table,
}
FINETUNE_FIGURES: dict[str, Callable[[Load], str]] = {
    "finetune_choice.source": lambda load: provenance(load("finetune_choice")),
    "finetune_report.source": lambda load: provenance(load("finetune_report")),
    "finetune_sweep.source": lambda load: provenance(load("finetune_sweep")),
    **{
        f"finetune_report.{method}_{setting}": (lambda load, m=method, s=setting: report_gains(load, m, s))
        for method in METHOD_NAMES
        for setting in ("default", "best")
    },
    **{
        f"finetune_report.{method}_{setting}_min": (lambda load, m=method, s=setting: f"{report_min(load, m, s):.2f}")
        for method in METHOD_NAMES
        for setting in ("default", "best")
    },
    **{f"finetune_report.{method}_memory": (lambda load, m=method: report_memory(load, m)) for method in METHOD_NAMES},
    "finetune_choice.lora_usual_mean": usual_lora_mean,
    "finetune_choice.poet_default_angles": lambda load: default_angles(load, "poet"),
    "finetune_choice.oft_default_angles": lambda load: default_angles(load, "oft"),
    "finetune_choice.collapse_angles": collapse_angles,
    **{f"finetune_choice.{method}_best": (lambda load, m=method: best_rate(load, m)) for method in METHOD_NAMES},
    **{
        f"finetune_{suite}.{method}_{setting}_mean": (
            lambda load, mean=mean, m=method, s=setting: f"{mean(load, m, s):.2f}"
        )
        for suite, mean in (("choice", choice_mean), ("report", report_mean))
        for method in METHOD_NAMES
        for setting in ("default", "best")
    },
}
