"""The measured tables of quantized and 16-bit bases (docs/quantized.md, docs/choosing-a-method.md), rendered from
``benchmarks/results/quantized.json`` by `benchmarks.rendering.figures`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from benchmarks.rendering.table_format import markdown_table, provenance, ratio, scientific

Load = Callable[[str], dict[str, Any]]
MERGES = (1, 5, 10, 20, 50)
QUANTIZED, SIXTEEN_BIT = ("int8", "nf4"), ("bfloat16", "float16")


def quantized_rows(load: Load, table: str) -> list[dict[str, Any]]:
    """The rows of one of the suite's tables (``"drift"``, ``"pretrain step"``, ``"fine-tune step"``, ``"quality"``)."""
    return [row for row in load("quantized")["rows"] if row["table"] == table]


def drift_rows(load: Load, bases: tuple[str, ...]) -> list[dict[str, Any]]:
    return [row for row in quantized_rows(load, "drift") if row["W0"] in bases]


def residual_kept(row: dict[str, Any]) -> str:
    if row["requantize"] != "feedback":
        return "–"
    return "**on disk (`auto`)**" if row["residual_storage"] == "disk" else "on the layer"


def drift_percent(value: float, digits: int = 2) -> str:
    return f"{value * 100:.{digits}f} %"


def quantized_drift_table(load: Load) -> str:
    """The int8 and nf4 ``W0`` after ``K`` folds against the exact float64 weight (docs/quantized.md)."""
    header = ["‖Q‖₂ per side", "W0", "requantize", "residual kept", "W0 bytes / entry held in the steps"]
    header += [f"K = {k}" for k in MERGES] + ["spectrum drift, K = 50"]
    rows = []
    for row in drift_rows(load, QUANTIZED):
        held = f"{row['K=1 held']:.2f}"
        rows.append(
            [
                f"{row['||Q||_2']:.2g}",
                row["W0"],
                row["requantize"],
                residual_kept(row),
                f"**{held}**" if row["residual_storage"] == "disk" else held,
                *(drift_percent(row[f"K={k} weight"]) for k in MERGES),
                drift_percent(row["K=50 spectrum"]),
            ]
        )
    return markdown_table(header, rows)


def sixteen_bit_drift_table(load: Load) -> str:
    """A bfloat16 or float16 ``W0`` after ``K`` folds, also in roundings of the exact weight (docs/quantized.md)."""
    header = ["‖Q‖₂ per side", "W0", "requantize", *(f"K = {k}" for k in MERGES), "roundings, K = 1 / 10 / 50"]
    rows = [
        [
            f"{row['||Q||_2']:.2g}",
            row["W0"],
            row["requantize"],
            *(drift_percent(row[f"K={k} weight"], 3) for k in MERGES),
            " / ".join(f"{row[f'K={k} roundings']:.2f}" for k in (1, 10, 50)),
        ]
        for row in drift_rows(load, SIXTEEN_BIT)
        if row["residual_storage"] == "layer"
    ]
    return markdown_table(header, rows)


def float32_drift(load: Load, merges: int) -> str:
    """The float32 ``W0``'s drift after ``merges`` folds (float32 rounding alone), at the training-size rotations."""
    return scientific(drift_rows(load, ("float32",))[0][f"K={merges} weight"])


def sixteen_bit_disk_roundings(load: Load) -> str:
    """The largest error in roundings after 50 folds of a 16-bit ``W0`` whose residual went to disk."""
    rows = [r for r in drift_rows(load, SIXTEEN_BIT) if r["residual_storage"] == "disk"]
    return f"{max(r['K=50 roundings'] for r in rows):.2f}"


def quantized_pretrain_table(load: Load) -> str:
    """One llama-130m step with a float32, nf4 or int8 ``W0``: memory against AdamW, time against the float32 ``W0``
    (docs/quantized.md; POET's time against AdamW at this configuration is the pretraining step's, one figure)."""
    header = ["W0", "requantize", "W0 bytes / entry", "POET peak (MB)", "memory / AdamW", "at-peak estimate"]
    header += ["saving / at-peak", "analytic estimate", "step (s)", "time / POET float32 W0"]
    rows = [
        [
            row["W0"],
            row["requantize"] or "–",
            f"{row['W0 bytes/entry']:.2f}",
            f"{row['POET peak MB']:.0f}",
            f"**{row['memory ratio']:.3f}**",
            f"{row['at-peak estimate']:.3f}",
            f"{row['saving / at-peak']:.2f}",
            f"{row['analytic estimate']:.3f}",
            f"{row['step s']:.3g}",
            f"**{row['time / POET fp32 W0']:.2f}**",
        ]
        for row in quantized_rows(load, "pretrain step")
    ]
    return markdown_table(header, rows)


def quantized_quality_table(load: Load) -> str:
    """The README's main job with a float32, int8 and nf4 ``W0`` (docs/quantized.md)."""
    rows = [
        [row["W0"], str(row["steps"]), str(row["merges"]), f"{row['val perplexity']:.2f}", percent_gap(row)]
        for row in quantized_rows(load, "quality")
    ]
    return markdown_table(["W0", "steps", "merges", "validation perplexity", "vs float32"], rows)


def percent_gap(row: dict[str, Any]) -> str:
    return f"{row['vs float32'] * 100:+.2f} %".replace("-", "−")


def finetune_rows(load: Load) -> list[dict[str, Any]]:
    return quantized_rows(load, "fine-tune step")


def quantized_finetune_table(load: Load) -> str:
    """One fine-tuning step on a 4-bit or 8-bit base: QOFT and QPOET against QLoRA (docs/quantized.md)."""
    header = ["base", "method", "trainable (M)", "step (s)", "peak memory (MB)", "time / QLoRA", "memory / QLoRA"]
    rows = [
        [
            row["base"],
            row["method"],
            f"{row['trainable (M)']:.2f}",
            f"{row['step s']:.3g}",
            f"{row['peak MB']:.0f}",
            f"**{row['time / QLoRA']:.2f}**",
            f"**{row['memory / QLoRA']:.3f}**",
        ]
        for row in finetune_rows(load)
    ]
    return markdown_table(header, rows)


def choosing_quantized_table(load: Load) -> str:
    """QOFT and QPOET against QLoRA, the short form (docs/choosing-a-method.md)."""
    names = {"QOFT": "QOFT (block 32)", "QPOET": "QPOET (contiguous 32)"}
    rows = [
        [row["base"], names[row["method"]], f"{row['time / QLoRA']:.2f}", f"{row['memory / QLoRA']:.2f}"]
        for row in finetune_rows(load)
        if row["method"] != "LoRA r 8"
    ]
    return markdown_table(["base", "method", "time / QLoRA", "memory / QLoRA"], rows)


def finetune_figure(load: Load, method: str, base: str, key: str) -> float:
    return next(r for r in finetune_rows(load) if (r["method"], r["base"]) == (method, base))[key]


QUANTIZED_TABLES: dict[str, Callable[[Load], str]] = {
    "quantized_drift": quantized_drift_table,
    "sixteen_bit_drift": sixteen_bit_drift_table,
    "quantized_pretrain": quantized_pretrain_table,
    "quantized_quality": quantized_quality_table,
    "quantized_finetune": quantized_finetune_table,
    "choosing_quantized": choosing_quantized_table,
}

QUANTIZED_FIGURES: dict[str, Callable[[Load], str]] = {
    "quantized.source": lambda load: provenance(load("quantized")),
    "quantized.float32_drift_1": lambda load: float32_drift(load, 1),
    "quantized.float32_drift_50": lambda load: float32_drift(load, 50),
    "quantized.sixteen_bit_disk_roundings": sixteen_bit_disk_roundings,
    "quantized.qoft_nf4_time": lambda load: ratio(finetune_figure(load, "QOFT", "nf4", "time / QLoRA")),
    "quantized.qoft_int8_time": lambda load: ratio(finetune_figure(load, "QOFT", "int8", "time / QLoRA")),
    "quantized.qpoet_time": lambda load: ratio(finetune_figure(load, "QPOET", "nf4", "time / QLoRA")),
    "quantized.qpoet_memory": lambda load: ratio(finetune_figure(load, "QPOET", "nf4", "memory / QLoRA")),
}


def _drift_figure(base: str, requantize: str, merges: int, key: str):
    """The ``base`` ``W0``'s error after ``merges`` folds at the training-size rotations, the residual on the layer."""

    def figure(load: Load) -> str:
        row = next(
            r for r in drift_rows(load, (base,)) if r["requantize"] == requantize and r["residual_storage"] == "layer"
        )
        value = row[f"K={merges} {key}"]
        return f"{value:.2f}" if key == "roundings" else drift_percent(value, 2 if value >= 0.01 else 3)

    return figure


QUANTIZED_FIGURES.update(
    {
        f"quantized.drift.{base}.{requantize}.{merges}": _drift_figure(base, requantize, merges, "weight")
        for base in (*QUANTIZED, *SIXTEEN_BIT)
        for requantize in ("feedback", "nearest", "stochastic")
        for merges in (1, 50)
    }
    | {
        f"quantized.roundings.{base}.{requantize}.50": _drift_figure(base, requantize, 50, "roundings")
        for base in SIXTEEN_BIT
        for requantize in ("feedback", "nearest", "stochastic")
    }
)
