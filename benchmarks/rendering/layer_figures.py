"""The measured tables of single layers and folds (docs/benchmarks.md, docs/pretraining-7b.md, docs/quantized.md),
rendered from their results files by `benchmarks.rendering.figures`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from benchmarks.rendering.table_format import markdown_table, mib, provenance, ratio

Load = Callable[[str], dict[str, Any]]


def fold_table(load: Load) -> str:
    """One nf4 layer's merge-then-reinitialize, whole against by rows (docs/pretraining-7b.md)."""
    rows = [
        [
            row["way"],
            f"{mib(row['peak_above_mb'])} ({ratio(row['memory_vs_whole'])})",
            f"{row['peak_above_mb'] / row['float32_copy_mb']:.1f}",
            f"{row['fold_s']:.1f} s ({ratio(row['time_vs_whole'])})",
            f"{row['requantization_error']:.4f}",
        ]
        for row in load("fold")["rows"]
    ]
    header = ["fold", "peak above the layer (vs whole)", "float32 copies of W0", "time (vs whole)", "requant. error"]
    return markdown_table(header, rows)


def three(value: float) -> str:
    """Three significant digits, as the layer tables print times and ratios."""
    return f"{value:.3g}" if value < 100 else f"{value:.0f}"


def span(values: list[float], digits: int = 1) -> str:
    """``"a–b×"`` over ``values``."""
    return f"{min(values):.{digits}f}–{max(values):.{digits}f}×"


def eco_rows(load: Load, layer: str) -> list[dict[str, Any]]:
    return [r for r in load("eco")["rows"] if r["layer"] == layer and r["what"].startswith("eval")]


def eco_table(load: Load) -> str:
    """ECO against SOC and a plain dilated conv at the paper's block-3 shape (docs/benchmarks.md)."""
    rows = [
        [
            baked["what"].removeprefix("eval, block 3 of "),
            three(baked["ms_per_batch"]),
            f"{three(soc['ratio_vs_eco_baked'])}×",
            f"{plain['ratio_vs_eco_baked']:.2f}×",
        ]
        for baked, soc, plain in zip(
            eco_rows(load, "eco_baked"), eco_rows(load, "soc"), eco_rows(load, "plain_dilated"), strict=True
        )
    ]
    return markdown_table(["block 3 of", "baked ECO (ms)", "SOC, 10 terms", "plain dilated conv"], rows)


def eco_train_ratio(load: Load) -> str:
    soc = next(r for r in load("eco")["rows"] if r["layer"] == "soc_train")
    return f"{soc['ratio_vs_eco_baked']:.1f}×"


REFLECTION_COLUMNS = {
    "aux_reflection": "auxiliary reflection",
    "householder_seq": "Householder, d reflections, sequential",
    "householder_wy": "Householder, blocked (WY)",
    "param_matrix_exp": "`orthogonal` (matrix_exp)",
    "param_cayley": "`orthogonal` (cayley)",
}


def reflection_table(load: Load) -> str:
    """Reflections against a plain Linear (docs/benchmarks.md)."""
    rows = [
        [str(r["d"]), *(three(r[f"{name}/linear"]) for name in REFLECTION_COLUMNS)] for r in load("reflection")["rows"]
    ]
    return markdown_table(["d", *REFLECTION_COLUMNS.values()], rows)


def reflection_speedup(load: Load, name: str) -> str:
    values = [r[f"speedup_vs_{name}"] for r in load("reflection")["rows"]]
    return span(values, 0 if min(values) >= 10 else 1)


POET_LAYER_STRATEGIES = ("weight", "activation", "activation-recompute")


def poet_layer_table(load: Load) -> str:
    """Each strategy's forward+backward time against a plain Linear, and ``auto``'s (docs/benchmarks.md)."""
    rows = [
        [
            f"{r['d_in']} × {r['d_out']}",
            str(r["block"]),
            str(r["tokens"]),
            *(f"{r[f'{s} / plain']:.2f}" for s in POET_LAYER_STRATEGIES),
            r["auto picks"],
            f"**{r['auto / plain']:.2f}** (flop ratio {r['auto flop ratio']:.2f})",
            r["fastest"],
        ]
        for r in load("poet_layer")["rows"]
    ]
    header = ["d_in × d_out", "block", "tokens", "weight", "activation (keeps `h`)", "activation-recompute"]
    return markdown_table([*header, "`auto` picks", "`auto` / plain", "fastest"], rows)


def poet_layer_row(load: Load, d_in: int, d_out: int) -> dict[str, Any]:
    """The `poet_layer` row of one shape at block 256 and 2048 tokens."""
    rows = load("poet_layer")["rows"]
    return next(r for r in rows if (r["d_in"], r["d_out"], r["block"], r["tokens"]) == (d_in, d_out, 256, 2048))


def poet_layer_picks(load: Load, suite: str = "poet_layer") -> str:
    """How many of the rows ``auto`` picked within 10 % of the fastest strategy."""
    rows = load(suite)["rows"]
    good = sum(r["pick within 10% of it"] for r in rows)
    return f"{good} of the {len(rows)}"


def poet_layer_bounded_picks(load: Load, suite: str = "poet_layer") -> str:
    """How many of the rows ``auto`` picked within 10 % of the fastest strategy its memory bound allows."""
    from benchmarks.suites.poet_layer import bounded_pick

    rows = load(suite)["rows"]
    good = sum(bounded_pick(r)["pick within 10% of that"] for r in rows)
    return f"{good} of the {len(rows)}"


LAYER_PROFILE_PARTS = ("base products", "block products", "polynomial", "gathers", "other")


def layer_profile_table(load: Load) -> str:
    """Milliseconds per forward+backward by part (`layer_profile`), beside the plain layer's and at the flop ratio."""
    rows = [
        [
            f"{r['d_in']} × {r['d_out']}",
            str(r["block"]),
            r["strategy"],
            f"{r['plain_ms']:,.0f}",
            f"{r['at flop ratio ms']:,.0f}",
            f"**{r['poet_ms']:,.0f}**",
            *(f"{r[f'{part} ms']:,.0f}" for part in LAYER_PROFILE_PARTS),
        ]
        for r in load("layer_profile")["rows"]
    ]
    header = ["d_in × d_out", "block", "`auto`", "plain", "at its flop ratio", "POET", *LAYER_PROFILE_PARTS]
    return markdown_table(header, rows)


def fold_row(load: Load, way: str) -> dict[str, Any]:
    return next(r for r in load("fold")["rows"] if r["way"] == way)


def oft_layer_table(load: Load) -> str:
    """Our OFT Linear against PEFT's (docs/benchmarks.md)."""
    rows = [
        [
            str(r["in=out"]),
            str(r["block"]),
            three(r["frozen Linear ms"]),
            three(r["PEFT overhead ms"]),
            three(r["ours overhead ms"]),
            f"{r['overhead ours / PEFT']:.2f}",
            f"{r['max |Δy|']:.1e}",
        ]
        for r in load("oft_layer")["rows"]
    ]
    header = ["d", "block", "frozen Linear (ms)", "PEFT overhead (ms)", "our overhead (ms)", "ours / PEFT"]
    return markdown_table([*header, "max \\|Δy\\|"], rows)


def import_time_table(load: Load) -> str:
    """Importing poet_hf, and ``scripts/pretrain.py --help``, against ``import peft`` (docs/benchmarks.md)."""
    rows = [
        [
            f"`{r['command']}`",
            f"{r['seconds']:.2f}",
            ratio(r["/ import peft"]),
            (", ".join(r["backends imported"]) or "none") if "backends imported" in r else "not observed",
        ]
        for r in load("import_time")["rows"]
    ]
    return markdown_table(["command", "seconds", "/ `import peft`", "optional backends imported"], rows)


def nonfinite_check_table(load: Load) -> str:
    """The non-finite step check against Trainer's clip, as a fraction of a step (docs/benchmarks.md)."""
    rows = [
        [
            r["preset"],
            r["tokens"],
            f"{r['forward+backward s']:.2f}",
            "{:.1f}".format(r["Trainer's clip ms"]),
            f"{r['checked clip ms']:.1f}",
            f"{r['check cost / step'] * 100:.2g} %",
        ]
        for r in load("nonfinite_check")["rows"]
    ]
    header = ["model", "tokens", "forward + backward (s)", "Trainer's clip (ms)", "checked clip (ms)", "cost / step"]
    return markdown_table(header, rows)


PARSER_IMPORTS = "import poet_hf, transformers.training_args"  # the import_time suite's row of that name


def import_row(load: Load, command: str) -> dict[str, Any]:
    return next(r for r in load("import_time")["rows"] if r["command"] == command)


FINETUNE_NAMES = {"oft": "OFT", "poet": "POET (both sides)", "lora": "LoRA (r 16)"}


def finetune_rows(load: Load, accumulation: int) -> list[dict[str, Any]]:
    return [r for r in load("finetune_step")["rows"] if r["accumulation"] == accumulation]


def finetune_step_table(load: Load) -> str:
    """One fine-tuning step against OFT, without accumulation (docs/benchmarks.md)."""
    rows = [
        [
            FINETUNE_NAMES[r["method"]],
            f"{r['trainable (M)']:.2f}",
            three(r["step s"]),
            f"{r['peak MB']:.0f}",
            f"{r['time / OFT']:.2f}",
            f"{r['memory / OFT']:.2f}",
        ]
        for r in finetune_rows(load, 1)
    ]
    header = ["method", "trainable (M)", "step (s)", "peak memory (MB)", "time / OFT", "memory / OFT"]
    return markdown_table(header, rows)


def finetune_accumulation_table(load: Load) -> str:
    """The same step with gradient accumulation (docs/benchmarks.md)."""
    accumulation = max(r["accumulation"] for r in load("finetune_step")["rows"])
    rows = [
        [
            FINETUNE_NAMES[r["method"]],
            three(r["step s"]),
            f"{r['peak MB']:.0f}",
            f"{r['time / OFT']:.2f}",
            f"{r['memory / OFT']:.2f}",
        ]
        for r in finetune_rows(load, accumulation)
    ]
    header = ["method", f"step of {accumulation} micro-batches (s)", "peak memory (MB)", "time / OFT", "memory / OFT"]
    return markdown_table(header, rows)


def finetune_step_row(load: Load, method: str, accumulated: bool = False) -> dict[str, Any]:
    """``method``'s `finetune_step` row, without accumulation or with the suite's."""
    accumulation = max(r["accumulation"] for r in load("finetune_step")["rows"]) if accumulated else 1
    return next(r for r in finetune_rows(load, accumulation) if r["method"] == method)


def finetune_ratio(load: Load, method: str, key: str, accumulated: bool = False) -> str:
    """``method``'s ``key`` ratio to OFT, without accumulation or with the suite's."""
    return ratio(finetune_step_row(load, method, accumulated)[key])


LAYER_TABLES: dict[str, Callable[[Load], str]] = {
    "fold": fold_table,
    "eco": eco_table,
    "reflection": reflection_table,
    "poet_layer": poet_layer_table,
    "layer_profile": layer_profile_table,
    "oft_layer": oft_layer_table,
    "import_time": import_time_table,
    "nonfinite_check": nonfinite_check_table,
    "finetune_step": finetune_step_table,
    "finetune_accumulation": finetune_accumulation_table,
}

LAYER_FIGURES: dict[str, Callable[[Load], str]] = {
    "fold.source": lambda load: provenance(load("fold")),
    "eco.source": lambda load: provenance(load("eco")),
    "eco.soc_span": lambda load: span([r["ratio_vs_eco_baked"] for r in eco_rows(load, "soc")], 0),
    "eco.plain_span": lambda load: span([1 / r["ratio_vs_eco_baked"] for r in eco_rows(load, "plain_dilated")], 2),
    "eco.train": eco_train_ratio,
    "reflection.source": lambda load: provenance(load("reflection")),
    "reflection.vs_cayley": lambda load: reflection_speedup(load, "param_cayley"),
    "reflection.vs_wy": lambda load: reflection_speedup(load, "householder_wy"),
    "reflection.vs_matrix_exp": lambda load: reflection_speedup(load, "param_matrix_exp"),
    "reflection.vs_linear": lambda load: span([r["aux_reflection/linear"] for r in load("reflection")["rows"]], 2),
    "poet_layer.source": lambda load: provenance(load("poet_layer")),
    "layer_profile.source": lambda load: provenance(load("layer_profile")),
    "poet_layer.picks": poet_layer_picks,
    "poet_layer.bounded_picks": poet_layer_bounded_picks,
    "poet_layer_bf16.source": lambda load: provenance(load("poet_layer_bf16")),
    "poet_layer_bf16.picks": lambda load: poet_layer_picks(load, "poet_layer_bf16"),
    "poet_layer_bf16.bounded_picks": lambda load: poet_layer_bounded_picks(load, "poet_layer_bf16"),
    **{
        f"poet_layer.{d_in}x{d_out}.{key}": lambda load, i=d_in, o=d_out, c=column: ratio(poet_layer_row(load, i, o)[c])
        for d_in, d_out in ((4096, 4096), (4096, 14336))
        for key, column in (("auto", "auto / plain"), ("flops", "auto flop ratio"))
    },
    "oft_layer.source": lambda load: provenance(load("oft_layer")),
    "oft_layer.ratios": lambda load: span([r["overhead ours / PEFT"] for r in load("oft_layer")["rows"]], 2),
    "finetune_step.source": lambda load: provenance(load("finetune_step")),
    "finetune_step.poet_time": lambda load: finetune_ratio(load, "poet", "time / OFT"),
    "finetune_step.poet_memory": lambda load: finetune_ratio(load, "poet", "memory / OFT"),
    "finetune_step.lora_memory": lambda load: finetune_ratio(load, "lora", "memory / OFT"),
    "finetune_step.lora_time": lambda load: finetune_ratio(load, "lora", "time / OFT"),
    "finetune_step.oft_vs_lora_time": lambda load: ratio(1 / finetune_step_row(load, "lora")["time / OFT"]),
    **{
        f"finetune_step.{method}_trainable": (
            lambda load, m=method: f"{finetune_step_row(load, m)['trainable (M)']:.2f}M"
        )
        for method in ("lora", "oft", "poet")
    },
    "finetune_step.accumulated_poet_time": lambda load: finetune_ratio(load, "poet", "time / OFT", accumulated=True),
    "import_time.source": lambda load: provenance(load("import_time")),
    "import_time.stack": lambda load: f"{import_row(load, 'import poet_hf, peft')['seconds']:.1f} s",
    "import_time.bare": lambda load: f"{import_row(load, 'import poet_hf')['seconds']:.1f} s",
    "import_time.peft": lambda load: f"{import_row(load, 'import peft')['seconds']:.1f} s",
    "import_time.stack_vs_peft": lambda load: ratio(import_row(load, "import poet_hf, peft")["/ import peft"]),
    "import_time.help": lambda load: f"{import_row(load, 'scripts/pretrain.py --help')['seconds']:.1f} s",
    "import_time.help_parser": lambda load: f"{import_row(load, PARSER_IMPORTS)['seconds']:.1f} s",
    "nonfinite_check.source": lambda load: provenance(load("nonfinite_check")),
    "nonfinite_check.cost": lambda load: f"{load('nonfinite_check')['rows'][0]['check cost / step'] * 100:.2g} %",
    "fold.floor": lambda load: mib(fold_row(load, "by rows")["floor_mb"]),
    "fold.memory_ratio": lambda load: ratio(fold_row(load, "by rows")["memory_vs_whole"]),
    "fold.time_ratio": lambda load: ratio(fold_row(load, "by rows")["time_vs_whole"]),
}
