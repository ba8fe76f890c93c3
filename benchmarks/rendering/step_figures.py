"""The measured tables of one pretraining step against AdamW (README.md, docs/benchmarks.md,
docs/choosing-a-method.md), of one step at 7B-class widths, and of the training modes (docs/training-modes.md),
rendered from ``benchmarks/results/pretrain_step.json``, ``wide_step.json`` and ``training_modes.json`` by
`benchmarks.rendering.figures`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from benchmarks.rendering.table_format import markdown_table, provenance, ratio

Load = Callable[[str], dict[str, Any]]
METHOD_NAMES = {"poet-bs": "POET-BS 256", "poet-fs": "POET-FS ½", "poet-bs, cache off": "POET-BS 256, cache off"}
WIDE_NAMES = {"adamw": "AdamW", "poet-bs": "POET-BS 256", "lora": "LoRA (r 16)"}
ACCUMULATED = ("llama-130m", "4x256")  # the shape the accumulation rows run at


def pretrain_step_rows(load: Load, accumulation: int | None = 1) -> list[dict[str, Any]]:
    """The `pretrain_step` rows of one number of micro-batches per step (``None``: every row)."""
    rows = load("pretrain_step")["rows"]
    return [r for r in rows if accumulation is None or r.get("accumulation", 1) == accumulation]


def pretrain_step_row(load: Load, preset: str, batch: str, method: str = "poet-bs", accumulation: int = 1):
    """The one `pretrain_step` row of a shape, a method and a number of micro-batches per step."""
    rows = pretrain_step_rows(load, accumulation)
    return next(r for r in rows if (r["preset"], r["batch"], r["method"]) == (preset, batch, method))


def shape(row: dict[str, Any]) -> str:
    return f"{row['preset'].removeprefix('llama-')}, {row['batch'].replace('x', ' × ')}"


def pretrain_step_table(load: Load) -> str:
    """Every row without accumulation: memory and time against AdamW, each beside its floor (docs/benchmarks.md)."""
    header = ["model, batch", "method", "AdamW peak (MB)", "POET peak (MB)", "memory ratio", "analytic estimate"]
    header += ["saving / analytic", "saving / at-peak", "AdamW step (s)", "POET step (s)", "time ratio", "flop ratio"]
    rows = [
        [
            shape(r),
            METHOD_NAMES[r["method"]],
            f"{r['AdamW peak MB']:.0f}",
            f"{r['POET peak MB']:.0f}",
            f"{r['memory ratio']:.2f}",
            f"{r['analytic estimate ratio']:.2f}",
            f"{r['saving / analytic']:.2f}",
            f"{r['saving / at-peak']:.2f}",
            f"{r['AdamW step s']:.3g}",
            f"{r['POET step s']:.3g}",
            f"{r['time ratio']:.2f}",
            f"{r['flop ratio']:.2f}",
        ]
        for r in pretrain_step_rows(load)
    ]
    return markdown_table(header, rows)


def pretrain_step_planned_table(load: Load) -> str:
    """Every row's measured peaks, whole and above the imports, beside `plan_memory`'s (docs/benchmarks.md)."""
    header = ["model, batch", "micro-batches", "method", "AdamW whole process (MB)", "POET whole process (MB)"]
    header += ["AdamW above imports / planned (MB)", "POET above imports / planned (MB)", "measured / planned"]
    rows = [
        [
            shape(r),
            str(r["accumulation"]),
            METHOD_NAMES[r["method"]],
            f"{r['AdamW whole peak MB']:.0f}",
            f"{r['POET whole peak MB']:.0f}",
            f"{r['AdamW peak MB']:.0f} / {r['AdamW planned MB']:.0f}",
            f"{r['POET peak MB']:.0f} / {r['POET planned MB']:.0f}",
            f"{r['AdamW measured / planned']:.2f} / {r['POET measured / planned']:.2f}",
        ]
        for r in pretrain_step_rows(load, None)
    ]
    return markdown_table(header, rows)


def accumulation_rows(load: Load) -> list[dict[str, Any]]:
    """The rows of the accumulation shape, by micro-batches per step (1 first)."""
    rows = [r for r in pretrain_step_rows(load, None) if (r["preset"], r["batch"]) == ACCUMULATED]
    return sorted(rows, key=lambda r: r["accumulation"])


def pretrain_step_accumulation_table(load: Load) -> str:
    """llama-130m at 4 × 256 with 1, 2 and 8 micro-batches per optimizer step (docs/benchmarks.md)."""
    header = ["micro-batches per step", "method", "AdamW peak (MB)", "POET peak (MB)", "memory ratio"]
    header += ["analytic estimate", "cache (MB), measured / analytic", "AdamW step (s)", "POET step (s)", "time ratio"]
    header += ["flop ratio"]
    rows = [
        [
            str(r["accumulation"]),
            METHOD_NAMES[r["method"]],
            f"{r['AdamW peak MB']:.0f}",
            f"{r['POET peak MB']:.0f}",
            f"{r['memory ratio']:.2f}",
            f"{r['analytic estimate ratio']:.2f}",
            f"{r['POET cache MB']:.0f} / {r['cache floor MB']:.0f}",
            f"{r['AdamW step s']:.3g}",
            f"{r['POET step s']:.3g}",
            f"{r['time ratio']:.2f}",
            f"{r['flop ratio']:.2f}",
        ]
        for r in accumulation_rows(load)
    ]
    return markdown_table(header, rows)


def accumulated(load: Load, method: str, key: str, micro_batches: int = 8) -> float:
    """One figure of the accumulation shape's row of ``method`` at ``micro_batches`` per step."""
    return pretrain_step_row(load, *ACCUMULATED, method, micro_batches)[key]


def training_modes_table(load: Load) -> str:
    """Compile, checkpointing, 8-bit states and fused steps against the eager step and AdamW (training-modes.md)."""
    header = ["model", "method", "mode", "step s", "peak MB", "states MB", "compile s", "time vs eager"]
    header += ["memory vs eager", "time vs AdamW", "memory vs AdamW"]
    rows = [
        [
            r["preset"],
            {"adamw": "AdamW", "poet-bs": "POET-BS"}[r["method"]],
            r["mode"],
            f"{r['step s']:.3g}",
            f"{r['peak MB']:.0f}",
            f"{r['states MB']:.1f}",
            f"{r['compile s']:.1f}" if r["compile s"] else "–",
            f"{r['time vs eager']:.2f}",
            f"{r['memory vs eager']:.2f}",
            f"{r['time vs AdamW']:.2f}",
            f"{r['memory vs AdamW']:.2f}",
        ]
        for r in load("training_modes")["rows"]
        if r["table"] == "step"
    ]
    return markdown_table(header, rows)


def eight_bit_quality(load: Load) -> str:
    """The main job's perplexity with 8-bit states against 32-bit ones (``--suite training_modes``)."""
    rows = {r["optim"]: r for r in load("training_modes")["rows"] if r["table"] == "quality"}
    eight, full = rows["adamw_bnb_8bit"], rows["adamw_torch"]
    gap = f"{eight['vs adamw_torch'] * 100:+.1f} %".replace("-", "−")
    return f"{eight['val perplexity']:.1f} against {full['val perplexity']:.1f} ({gap})"


def fused_against_eager(load: Load, preset: str = "llama-60m") -> str:
    """The fused step's peak and time against the eager step's, per method, at ``preset`` (docs/training-modes.md)."""
    rows = {(r["method"], r["mode"]): r for r in load("training_modes")["rows"] if r.get("preset") == preset}
    peaks = " and ".join(
        f"{rows[(m, 'eager')]['peak MB']:.0f} → {rows[(m, 'fused step')]['peak MB']:.0f} MB ({name})"
        for m, name in (("adamw", "AdamW"), ("poet-bs", "POET-BS"))
    )
    times = " and ".join(ratio(rows[(m, "fused step")]["time vs eager"]) for m in ("adamw", "poet-bs"))
    return f"peak {peaks}, time {times}"


def wide_row(load: Load, shape: str = "llama-2-7b", method: str = "poet-bs", precision: str = "float32"):
    """The one `wide_step` row of a shape, a method and a precision."""
    rows = load("wide_step")["rows"]
    return next(r for r in rows if (r["shape"], r["method"], r["precision"]) == (shape, method, precision))


def wide_step_table(load: Load) -> str:
    """One step of two 7B-class blocks at 1 × 2048 tokens, per method (docs/benchmarks.md)."""
    rows = [
        [
            r["shape"],
            r["precision"],
            WIDE_NAMES[r["method"]],
            f"{r['trainable_m']:.1f}",
            f"{r['step_s']:.1f}",
            f"{r['peak_mb']:.0f}",
            f"{r['time / AdamW']:.2f}",
            f"{r['memory / AdamW']:.2f}",
            f"{r['linear flop ratio']:.2f}" if "linear flop ratio" in r else "–",
        ]
        for r in load("wide_step")["rows"]
    ]
    header = ["shape", "precision", "method", "trainable (M)", "step (s)", "peak above imports (MB)"]
    return markdown_table([*header, "time / AdamW", "memory / AdamW", "flop ratio of the Linear layers"], rows)


def wide_headline(load: Load) -> list[str]:
    """The README's headline row of the step at 7B-class widths."""
    seven, eight = wide_row(load, "llama-2-7b"), wide_row(load, "llama-3-8b")
    return [
        "POET-BS 256 step at Llama-2-7B's widths (two blocks, 1 × 2048, float32): time / AdamW",
        f"**{ratio(seven['time / AdamW'])}**",
        f"flop ratio of the Linear layers {ratio(seven['linear flop ratio'])}; "
        f"memory {ratio(seven['memory / AdamW'])}; at Llama-3-8B's widths {ratio(eight['time / AdamW'])} the time, "
        f"{ratio(eight['memory / AdamW'])} the memory; [the table](docs/benchmarks.md#one-step-at-7b-class-widths)",
    ]


def losing_headlines(load: Load) -> list[list[str]]:
    """The README's headline rows where POET loses, at the scales of the rows where it wins: gradient accumulation with
    the default rotation cache at llama-130m, bfloat16 autocast at 7B-class widths, and LoRA at those widths."""
    bs, fs = (accumulated(load, method, "memory ratio") for method in ("poet-bs", "poet-fs"))
    off = accumulated(load, "poet-bs, cache off", "memory ratio")
    seven, eight = (wide_row(load, shape, precision="bfloat16 autocast") for shape in ("llama-2-7b", "llama-3-8b"))
    lora = wide_row(load, "llama-2-7b", "lora")
    return [
        [
            f"the llama-130m step with gradient accumulation ({ACCUMULATED[1].replace('x', ' × ')}, 8 micro-batches, "
            "the default rotation cache): memory / AdamW",
            f"**POET-BS {ratio(bs)}, POET-FS ½ {ratio(fs)}**",
            f"time {ratio(accumulated(load, 'poet-bs', 'time ratio'))} (POET-BS); with the cache off POET-BS needs "
            f"{ratio(off)} the memory at {ratio(accumulated(load, 'poet-bs, cache off', 'time ratio'))} the time",
        ],
        [
            "the step at Llama-2-7B's widths under bfloat16 autocast: time / AdamW",
            f"**{ratio(seven['time / AdamW'])}**",
            f"{ratio(eight['time / AdamW'])} at Llama-3-8B's widths; memory {ratio(seven['memory / AdamW'])}",
        ],
        [
            "LoRA (r 16) at Llama-2-7B's widths, float32: time and memory / AdamW, beside POET-BS's",
            f"**{ratio(lora['time / AdamW'])} the time, {ratio(lora['memory / AdamW'])} the memory**",
            f"POET-BS {ratio(wide_row(load)['time / AdamW'])} and {ratio(wide_row(load)['memory / AdamW'])}; LoRA "
            "fine-tunes a low-rank update, POET trains the full-rank weight",
        ],
    ]


def wide_figures() -> dict[str, Callable[[Load], str]]:
    """POET-BS's time and memory against AdamW's at each 7B-class shape, in float32."""
    figures: dict[str, Callable[[Load], str]] = {"wide_step.source": lambda load: provenance(load("wide_step"))}
    for shape in ("llama-2-7b", "llama-3-8b"):
        for key, column in (("time", "time / AdamW"), ("memory", "memory / AdamW"), ("flops", "linear flop ratio")):
            figures[f"wide_step.{shape}.{key}"] = lambda load, s=shape, c=column: ratio(wide_row(load, s)[c])
        figures[f"wide_step.{shape}.bf16_time"] = lambda load, s=shape: ratio(
            wide_row(load, s, precision="bfloat16 autocast")["time / AdamW"]
        )
    return figures


def step_profile_table(load: Load) -> str:
    """The everything-on step's time by part, beside AdamW's with checkpointing (docs/benchmarks.md)."""
    rows = [
        [r["variant"], r["part"], f"{r['seconds']:.2f}", f"{100 * r['share']:.0f} %"]
        for r in load("step_profile")["rows"]
    ]
    return markdown_table(["step", "part", "seconds", "share of the step"], rows)


def profile_part(load: Load, variant: str, part: str) -> dict[str, Any]:
    return next(r for r in load("step_profile")["rows"] if (r["variant"], r["part"]) == (variant, part))


STEP_TABLES: dict[str, Callable[[Load], str]] = {
    "step_profile": step_profile_table,
    "wide_step": wide_step_table,
    "pretrain_step": pretrain_step_table,
    "pretrain_step_planned": pretrain_step_planned_table,
    "pretrain_step_accumulation": pretrain_step_accumulation_table,
    "training_modes": training_modes_table,
}

PROFILED = {  # figure key -> (variant, part) of `step_profile`
    "adamw.products": ("AdamW, checkpointing", "matrix products"),
    "poet.products": ("POET-BS, everything on", "matrix products"),
    "poet.gathers": ("POET-BS, everything on", "gathers and copies"),
    "poet.dequantize": ("POET-BS, everything on", "dequantizing W0"),
    "poet.elementwise": ("POET-BS, everything on", "element-wise and the rest"),
    "poet.optimizer": ("POET-BS, everything on", "optimizer steps"),
    "recompute": ("POET-BS, plain", "forward recomputed (checkpointing on minus off)"),
}


def profile_figures() -> dict[str, Callable[[Load], str]]:
    """Each profiled part's seconds and share of its step (docs/benchmarks.md)."""
    figures: dict[str, Callable[[Load], str]] = {
        "step_profile.source": lambda load: provenance(load("step_profile")),
        "step_profile.time_ratio": lambda load: ratio(
            profile_part(load, *PROFILED["poet.products"])["step_s"]
            / profile_part(load, *PROFILED["adamw.products"])["step_s"]
        ),
    }
    for key, (variant, part) in PROFILED.items():
        figures[f"step_profile.{key}.seconds"] = lambda load, v=variant, p=part: (
            f"{profile_part(load, v, p)['seconds']:.1f} s"
        )
        figures[f"step_profile.{key}.share"] = lambda load, v=variant, p=part: (
            f"{100 * profile_part(load, v, p)['share']:.0f} %"
        )
    return figures


STEP_FIGURES: dict[str, Callable[[Load], str]] = {
    **wide_figures(),
    **profile_figures(),
    "pretrain_step.source": lambda load: provenance(load("pretrain_step")),
    "pretrain_step.accumulation_bs_time": lambda load: ratio(accumulated(load, "poet-bs", "time ratio")),
    "pretrain_step.accumulation_bs_cache_off_time": lambda load: ratio(
        accumulated(load, "poet-bs, cache off", "time ratio")
    ),
    "pretrain_step.accumulation_fs_time": lambda load: ratio(accumulated(load, "poet-fs", "time ratio")),
    "pretrain_step.accumulation_fs_memory": lambda load: ratio(accumulated(load, "poet-fs", "memory ratio")),
    "pretrain_step.accumulation_fs_single_time": lambda load: ratio(
        accumulated(load, "poet-fs", "time ratio", micro_batches=1)
    ),
    "pretrain_step.accumulation_bs_flop_ratio": lambda load: f"{accumulated(load, 'poet-bs', 'flop ratio'):.2f}",
    "pretrain_step.planner_gap": lambda load: planner_gap(load),
    "training_modes.source": lambda load: provenance(load("training_modes")),
    "training_modes.eight_bit_quality": eight_bit_quality,
    "training_modes.fused_60m": fused_against_eager,
}


# Each ratio of each row without accumulation, as ``pretrain_step.<size>_<batch>.<method>.<figure>`` (for example
# ``pretrain_step.130m_4x256.poet-bs.time``): memory / AdamW, its analytic estimate, the share of the at-peak saving,
# and time / AdamW with its flop ratio.
ROW_FIGURES = {
    "memory": ("memory ratio", ratio),
    "estimate": ("analytic estimate ratio", ratio),
    "at_peak": ("saving / at-peak", lambda value: f"{value * 100:.0f} %"),
    "time": ("time ratio", ratio),
    "flop_ratio": ("flop ratio", ratio),
}
SHAPES = (("llama-60m", "4x256"), ("llama-130m", "4x256"), ("llama-130m", "16x256"), ("llama-350m", "2x256"))


def _row_figure(preset: str, batch: str, method: str, key: str, show: Callable[[float], str]):
    return lambda load: show(pretrain_step_row(load, preset, batch, method)[key])


STEP_FIGURES.update(
    {
        f"pretrain_step.{preset.removeprefix('llama-')}_{batch}.{method}.{name}": _row_figure(
            preset, batch, method, key, show
        )
        for preset, batch in SHAPES
        for method in ("poet-bs", "poet-fs")
        for name, (key, show) in ROW_FIGURES.items()
    }
)


def planner_gap(load: Load) -> str:
    """The largest relative gap between `plan_memory` and a measured peak above the imports, either method."""
    gaps = [
        abs(r[f"{who} measured / planned"] - 1) for r in pretrain_step_rows(load, None) for who in ("AdamW", "POET")
    ]
    return f"{max(gaps) * 100:.0f} %"


# Each figure of each step row of ``--suite training_modes``, as ``training_modes.<preset>.<method>.<mode>.<figure>``
# with the mode's spaces and `` + `` as ``_`` (for example ``training_modes.60m.poet-bs.fused_step.memory``).
MODE_FIGURES = {
    "time": ("time vs eager", ratio),
    "memory": ("memory vs eager", ratio),
    "time_adamw": ("time vs AdamW", ratio),
    "memory_adamw": ("memory vs AdamW", ratio),
    "states": ("states MB", lambda value: f"{value:.1f} MB"),
    "compile": ("compile s", lambda value: f"{value:.0f} s"),
}
MODES = ("eager", "compiled", "checkpointing", "8-bit states", "fused step", "checkpointing + fused step")


def _mode_figure(preset: str, method: str, mode: str, key: str, show: Callable[[float], str]):
    def figure(load: Load) -> str:
        rows = load("training_modes")["rows"]
        return show(
            next(r for r in rows if (r.get("preset"), r.get("method"), r.get("mode")) == (preset, method, mode))[key]
        )

    return figure


def _mode_key(preset: str, method: str, mode: str, name: str) -> str:
    return (
        f"training_modes.{preset.removeprefix('llama-')}.{method}.{mode.replace(' + ', '_').replace(' ', '_')}.{name}"
    )


STEP_FIGURES.update(
    {
        _mode_key(preset, method, mode, name): _mode_figure(preset, method, mode, key, show)
        for preset, modes in (("tiny", MODES), ("llama-60m", ("eager", "checkpointing", "fused step", MODES[-1])))
        for method in ("adamw", "poet-bs")
        for mode in modes
        for name, (key, show) in MODE_FIGURES.items()
    }
)
