"""The per-process memory tables of docs/distributed.md, rendered from ``benchmarks/results/sharding.json`` and
``benchmarks/results/pretrain_step.json`` (measured) and ``benchmarks/results/fsdp_plan.json`` (planned) by
`benchmarks.rendering.figures`, its chaos table (``benchmarks/results/chaos.json``) and its 7B table of a shardable
quantised ``W0`` (``benchmarks/results/sharded_quantized.json``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from benchmarks.rendering.table_format import markdown_table, provenance, ratio, scientific

Load = Callable[[str], dict[str, Any]]
ENGINES = {
    "none": "one process",
    "ddp": "DDP",
    "fsdp2": "FSDP2",
    "zero2": "DeepSpeed ZeRO-2",
    "zero3": "DeepSpeed ZeRO-3",
    "zero3 sized": "DeepSpeed ZeRO-3, deepspeed_zero3.json's settings",
    "zero3 sized, live": "DeepSpeed ZeRO-3, those and the live limits at hidden²",
}
PLANNER_PRESETS = ("llama-60m", "llama-130m")


def engine_rows(load: Load) -> list[dict[str, Any]]:
    """The suite's rows of one step per micro-batch (one process, DDP, FSDP2, ZeRO), without the accumulation rows."""
    return [row for row in load("sharding")["rows"] if row["measurement"] != "accumulate"]


def sharding_table(load: Load) -> str:
    """One process, DDP, FSDP2, ZeRO-2 and ZeRO-3 at the same shape and batch per process."""
    rows = []
    for row in engine_rows(load):
        planned = row.get("planned MB / process")
        rows.append(
            [
                row["preset"],
                row["batch / process"].replace("x", " × "),
                str(row["processes"]),
                ENGINES[row["sharding"]],
                f"{row['steady-state peak MB / process']:.0f}",
                ratio(row["steady / 1-process steady"]),
                f"{planned:.0f} ({row['steady / planned']:.2f})" if planned else "–",
                f"{row['step s']:.2f}",
                f"{row['merge s']:.2f}",
            ]
        )
    header = ["model", "micro-batch / process", "processes", "engine", "steady-state peak MB / process"]
    header += ["vs one process", "planned MB (measured / planned)", "step s", "merge s"]
    return markdown_table(header, rows)


def sharding_detail_table(load: Load) -> str:
    """Every measurement of the suite's rows: construction, full copies, merge costs (docs/benchmarks.md)."""

    def number(row: dict[str, Any], key: str, digits: int = 0) -> str:
        return f"{row[key]:.{digits}f}" if key in row else "–"

    rows = []
    for row in engine_rows(load):
        copies = "–"
        if "one full copy: parameters MB" in row:
            copies = f"{row['one full copy: parameters MB']:.0f} / {row['one full copy: training state MB']:.0f}"
        rows.append(
            [
                row["preset"],
                str(row["processes"]),
                ENGINES[row["sharding"]],
                number(row, "steady-state peak MB / process"),
                number(row, "from-start peak MB / process"),
                number(row, "construction peak MB / process"),
                copies,
                number(row, "planned MB / process"),
                ratio(row["steady / 1-process steady"]),
                number(row, "step s", 1),
                number(row, "merge s", 1),
                number(row, "merge extra RSS MB"),
                number(row, "merge gathered MB (peak alive)", 1),
            ]
        )
    header = ["model", "processes", "engine", "steady-state peak MB / process", "from-start peak MB / process"]
    header += ["construction peak MB / process", "one full copy: parameters / training state MB", "planned MB"]
    header += ["vs 1 process", "step (s)", "one `merge_and_reinit` (s)", "RSS a merge adds (MB)"]
    header += ["most gathered at once (MB)"]
    return markdown_table(header, rows)


def sharding_row(load: Load, preset: str, sharding: str) -> dict[str, Any]:
    return next(r for r in engine_rows(load) if r["preset"] == preset and r["sharding"] == sharding)


def accumulation_row(load: Load, method: str) -> dict[str, Any]:
    """The accumulation row of ``method`` (the suite measures one shape)."""
    return next(r for r in load("sharding")["rows"] if r["measurement"] == "accumulate" and r["method"] == method)


def sharding_accumulation_table(load: Load) -> str:
    """POET-BS and AdamW under FSDP2 with gradient accumulation: per-process peak against the plan and each other."""
    rows = [row for row in load("sharding")["rows"] if row["measurement"] == "accumulate"]
    adamw = {row["preset"]: row["steady-state peak MB / process"] for row in rows if row["method"] == "adamw"}
    body = [
        [
            row["preset"],
            row["batch / process"].replace("x", " × "),
            str(row["accumulation"]),
            {"poet-bs": "POET-BS 256", "adamw": "AdamW"}[row["method"]],
            f"{row['steady-state peak MB / process']:.0f}",
            f"{row['planned MB / process']:.0f} ({row['steady / planned']:.2f})",
            ratio(row["steady-state peak MB / process"] / adamw[row["preset"]]),
            f"{row['step s']:.1f}",
        ]
        for row in rows
    ]
    header = ["model", "micro-batch / process", "micro-batches per step", "method", "steady-state peak MB / process"]
    header += ["planned MB (measured / planned)", "vs AdamW", "step s"]
    return markdown_table(header, body)


def planner_rows(load: Load) -> list[dict[str, Any]]:
    """`pretrain_step`'s one-process rows at 4 × 256 without accumulation, at the planner's validation shapes."""
    return [
        row
        for row in load("pretrain_step")["rows"]
        if row["preset"] in PLANNER_PRESETS and row["batch"] == "4x256" and row["accumulation"] == 1
    ]


def planner_table(load: Load) -> str:
    """Measured peak against `plan_memory` for AdamW, POET-BS and POET-FS in one process, glibc's own allocator."""
    rows, seen = [], set()
    for row in planner_rows(load):
        if row["preset"] not in seen:  # AdamW once per shape
            seen.add(row["preset"])
            rows.append(_planner_row(row, "AdamW", "AdamW"))
        rows.append(_planner_row(row, "POET", {"poet-bs": "POET-BS", "poet-fs": "POET-FS ½"}[row["method"]]))
    header = ["model", "micro-batch", "method", "measured peak MB", "planned MB", "measured / planned"]
    return markdown_table(header, rows)


def _planner_row(row: dict[str, Any], side: str, name: str) -> list[str]:
    measured, planned = row[f"{side} peak MB"], row[f"{side} planned MB"]
    return [row["preset"], "4 × 256", name, f"{measured:.0f}", f"{planned:.0f}", f"{measured / planned:.2f}"]


def sharding_planner_gap(load: Load) -> str:
    """The largest gap between a measured steady state and its plan, over the rows with a plan."""
    gaps = [abs(row["steady / planned"] - 1) for row in load("sharding")["rows"] if row.get("planned MB / process")]
    return f"{max(gaps) * 100:.0f} %"


def default_allocator_excess(load: Load) -> str:
    """How far above its plan a one-process run peaks under glibc's own allocator: the range over the rows."""
    sides = ("AdamW", "POET")
    excess = [row[f"{side} peak MB"] / row[f"{side} planned MB"] - 1 for row in planner_rows(load) for side in sides]
    return f"{min(excess) * 100:.0f} to {max(excess) * 100:.0f} %"


def zero_against_fsdp2(load: Load, engine: str = "zero3") -> str:
    """ZeRO-3's steady-state peak per process (its ``engine`` row, an `ENGINES` key) against FSDP2's, per shape."""
    rows = engine_rows(load)
    by_engine = {(row["preset"], row["sharding"]): row["steady-state peak MB / process"] for row in rows}
    presets = list(dict.fromkeys(preset for preset, _ in by_engine))  # in the suite's order
    return " and ".join(f"{ratio(by_engine[(p, engine)] / by_engine[(p, 'fsdp2')])} at {p}" for p in presets)


def fsdp_plan_table(load: Load) -> str:
    """`benchmarks.suites.fsdp_plan`'s rows: each part the plan holds in any row and the total, GiB per process."""
    record = load("fsdp_plan")
    rows = record["rows"]
    parts = [key for key in rows[0] if key.endswith(" MiB") and key != "total MiB" and any(r[key] for r in rows)]
    device = record["settings"]["device GiB"]
    body = [
        [
            row["model"],
            row["method"],
            str(row["accumulation"]),
            *(f"{row[part] / 1024:.2f}" for part in parts),
            f"**{row['total MiB'] / 1024:.2f}**",
            "yes" if row["total MiB"] / 1024 <= device else "no",
        ]
        for row in rows
    ]
    header = ["model", "method", "accumulation", *(part.removesuffix(" MiB") for part in parts), "total"]
    return markdown_table([*header, f"fits {device} GiB"], body)


def _gap(value: float) -> str:
    return "0" if value == 0 else scientific(value)


def chaos_table(load: Load) -> str:
    """The chaos run: kills and restarts per engine, and each final state against its kill-free replay and against
    an uninterrupted 2-process run, beside the 1-process run's own distance from it (docs/distributed.md)."""
    rows = [
        [
            ENGINES[r["engine"]],
            str(r["kills"]),
            str(r["restarts"]),
            str(r["failed restarts"]),
            r["process counts"],
            "yes" if r.get("same as its replay") else "**no**",
            f"{_gap(r['max |Δ loss| to 2-process'])} ({_gap(r['1-process run |Δ loss|'])})",
            f"{_gap(r['max |Δ weight| to 2-process'])} ({_gap(r['1-process run |Δ weight|'])})",
        ]
        for r in load("chaos")["rows"]
    ]
    header = ["engine", "kills", "launches", "failed", "processes per launch", "bit for bit as its replay"]
    gaps = ["max \\|Δ loss\\| to 2 processes (1-process run's)", "max \\|Δ weight\\| to 2 processes (1-process run's)"]
    return markdown_table([*header, *gaps], rows)


def sharded_quantized_table(load: Load) -> str:
    """Llama-2-7B's shape with every saving that composes with FSDP2, on 1 process and on 2 (docs/distributed.md)."""
    rows = [
        [
            ENGINES[r["sharding"]],
            str(r["processes"]),
            f"{r['whole peak MB / process']:,.0f}",
            ratio(r.get("whole peak / 1 process", 1.0)),
            f"{r['steady-state peak MB / process']:,.0f}",
            f"{r['planned MB / process']:,.0f}",
            ratio(r["steady / planned"]),
            f"{r['beyond tensors MB']:,.0f}",
            ratio(r["steady less beyond tensors / planned"]),
            f"{r['step s']:.0f}",
        ]
        for r in load("sharded_quantized")["rows"]
    ]
    header = ["engine", "processes", "whole peak MB / process", "against 1 process", "steady peak above imports MB"]
    header += ["planned MB", "steady / planned", "beyond tensors MB", "steady less beyond tensors / planned"]
    return markdown_table([*header, "step s"], rows)


def ddp_fused_table(load: Load) -> str:
    """Fused optimizer steps under DDP against one process and unfused DDP, beside the planner (docs/distributed.md)."""
    rows = [
        [
            r["preset"],
            ENGINES[r["sharding"]],
            str(r["processes"]),
            "fused" if r["fused steps"] else "unfused",
            r["head and embeddings"],
            f"{r['steady-state peak MB / process']:,.0f}",
            ratio(r["steady / unfused DDP steady"]),
            f"{r['planned MB / process']:,.0f}",
            ratio(r["steady / planned"]),
        ]
        for r in load("ddp_fused")["rows"]
    ]
    header = ["model", "engine", "processes", "steps", "head and embeddings", "steady peak above imports MB"]
    return markdown_table([*header, "against unfused DDP", "planned MB", "steady / planned"], rows)


SHARDING_TABLES: dict[str, Callable[[Load], str]] = {
    "chaos": chaos_table,
    "ddp_fused": ddp_fused_table,
    "sharded_quantized": sharded_quantized_table,
    "sharding": sharding_table,
    "sharding_detail": sharding_detail_table,
    "sharding_accumulation": sharding_accumulation_table,
    "planner_one_process": planner_table,
    "fsdp_plan": fsdp_plan_table,
}
SHARDING_FIGURES: dict[str, Callable[[Load], str]] = {
    "chaos.source": lambda load: provenance(load("chaos")),
    "ddp_fused.source": lambda load: provenance(load("ddp_fused")),
    "ddp_fused.planner_gap": lambda load: "{:.0f} %".format(
        100 * max(abs(r["steady / planned"] - 1) for r in load("ddp_fused")["rows"])
    ),
    "sharded_quantized.source": lambda load: provenance(load("sharded_quantized")),
    "sharded_quantized.ratio": lambda load: ratio(load("sharded_quantized")["rows"][1]["whole peak / 1 process"]),
    "sharded_quantized.planner_gap_one": lambda load: (
        f"{abs(load('sharded_quantized')['rows'][0]['steady / planned'] - 1) * 100:.0f} %"
    ),
    "sharded_quantized.planner_gap_fsdp2": lambda load: (
        f"{abs(load('sharded_quantized')['rows'][1]['steady / planned'] - 1) * 100:.1f} %"
    ),
    "sharded_quantized.beyond_tensors": lambda load: " and ".join(
        f"{r['beyond tensors MB']:.0f}" for r in load("sharded_quantized")["rows"]
    ),
    "sharded_quantized.tensor_gap": lambda load: "{:.1f} %".format(
        100 * max(abs(r["steady less beyond tensors / planned"] - 1) for r in load("sharded_quantized")["rows"])
    ),
    "chaos.kills": lambda load: str(sum(r["kills"] for r in load("chaos")["rows"])),
    "chaos.failed": lambda load: str(sum(r["failed restarts"] for r in load("chaos")["rows"])),
    "chaos.steps": lambda load: str(load("chaos")["settings"]["steps"]),
    "chaos.random": lambda load: str(load("chaos")["settings"]["random kills per engine"]),
    "chaos.named": lambda load: str(len(load("chaos")["settings"]["named points"])),
    "chaos.per_engine": lambda load: str(
        load("chaos")["settings"]["random kills per engine"] + len(load("chaos")["settings"]["named points"])
    ),
    "sharding.source": lambda load: provenance(load("sharding")),
    "fsdp_plan.source": lambda load: provenance(load("fsdp_plan")),
    "sharding.planner_gap": sharding_planner_gap,
    "sharding.zero3_vs_fsdp2": zero_against_fsdp2,
    "sharding.zero3_sized_vs_fsdp2": lambda load: zero_against_fsdp2(load, "zero3 sized"),
    "sharding.zero3_live_vs_fsdp2": lambda load: zero_against_fsdp2(load, "zero3 sized, live"),
    "sharding.accumulation_poet_vs_adamw": lambda load: ratio(accumulation_row(load, "poet-bs")["POET / AdamW"]),
    "sharding.accumulation_poet_time": lambda load: ratio(
        accumulation_row(load, "poet-bs")["step s"] / accumulation_row(load, "adamw")["step s"]
    ),
    "pretrain_step.default_allocator_excess": default_allocator_excess,
    "sharding.fsdp2_construction_130m": lambda load: (
        f"{sharding_row(load, 'llama-130m', 'fsdp2')['construction peak MB / process']:.0f} MB"
    ),
    "sharding.parameters_130m": lambda load: (
        f"{sharding_row(load, 'llama-130m', 'fsdp2')['one full copy: parameters MB']:.0f} MB"
    ),
    "sharding.whole_construction_130m": lambda load: (
        f"{sharding_row(load, 'llama-130m', 'none')['construction peak MB / process']:.0f} MB"
    ),
    "sharding.ddp_construction_130m": lambda load: (
        f"{sharding_row(load, 'llama-130m', 'ddp')['construction peak MB / process']:.0f} MB"
    ),
    "sharding.fsdp2_steady_vs_state_130m": lambda load: (
        f"{sharding_row(load, 'llama-130m', 'fsdp2')['from-start peak MB / process']:.0f} against "
        f"{sharding_row(load, 'llama-130m', 'fsdp2')['one full copy: training state MB']:.0f} MB"
    ),
}
