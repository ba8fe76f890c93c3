"""Merge-then-reinitialize into one nf4 ``W0`` of Llama-2-7B's MLP shape (11008 × 4096): whole against by rows.

``by rows`` is the library's path (`poet_hf.tuners.rotation.row_fold`: groups of whole output blocks, about
``ROW_BLOCK_ENTRIES`` entries each, rotated twice); ``whole`` is the fold the library did before it (dequantise,
rotate and requantise the whole matrix, `RotationLayer.rotate_weight` and
`poet_hf.tuners.rotation.quantization.requantize`), reached by
turning the row path off. POET-BS 256 on both sides, error feedback with the residual in a file (the default on a
CPU), rotations of the size seen in training. Each way runs in its own process started as a user starts one; the
third of three folds is measured (the residual then exists and is read back): its peak RSS above the RSS before it
(Linux's ``clear_refs``) and its time. Median of ``repeats`` processes per way, interleaved.

The floor of this two-pass fold is what it must hold beyond the layer's codes: the old residual read back from its
file, the new codes and scales (0.52 B per entry) and the new residual (1.06 B per entry), all at once in the second
pass, plus one group's float32 rows.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from benchmarks.common import measure_as_a_user

SHAPE = (11008, 4096)


def measure(way: str, shape: tuple[int, int] = SHAPE) -> dict[str, Any]:
    """In the child process: three folds of one nf4 layer ``way`` (``"whole"`` or ``"by rows"``); the third's peak
    above the RSS before it, and its time."""
    import torch
    from peft import get_peft_model
    from torch import nn

    import poet_hf  # noqa: F401
    from benchmarks.common import reset_peak_rss, status_mb
    from poet_hf import PoetConfig
    from poet_hf.initialization import materialize_model
    from poet_hf.tuners.rotation import layer as rotation_layer
    from poet_hf.tuners.rotation.layer import rotation_layers

    if way == "whole":
        rotation_layer.foldable_by_rows = lambda layer, adapter: False  # the fold before the row path
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(shape[1], shape[0], bias=False))
    config = PoetConfig(target_modules=["0"], block_size=256, base_init="normalized", base_quantization="nf4")
    model = get_peft_model(model, config)
    materialize_model(model, seed=0, device="cpu")
    layer = rotation_layers(model)[0][1]
    generator = torch.Generator().manual_seed(3)
    for _ in range(3):
        with torch.no_grad():
            for side, spec in layer.sides("default").items():
                param = layer.rotation_parameter("default", side)
                param.copy_(torch.randn(param.shape, generator=generator) * 0.17 / (2 * spec.block**0.5))
        before = status_mb("VmRSS")
        reset_peak_rss()
        start = time.perf_counter()
        layer.merge_and_reinit("default")
        seconds = time.perf_counter() - start
    entries = shape[0] * shape[1]
    return {
        "way": way,
        "shape": f"{shape[0]} × {shape[1]}",
        "fold_s": seconds,
        "peak_above_mb": status_mb("VmHWM") - before,
        "float32_copy_mb": entries * 4 / 2**20,
        "floor_mb": ((1.06 + 0.52 + 1.06) * entries + 4 * layer_group_entries(layer)) / 2**20,
        "requantization_error": layer.requantization_error,
    }


def layer_group_entries(layer: Any) -> int:
    """Entries of one group of rows of the library's row path."""
    from poet_hf.tuners.rotation.quantized_rows import rows_per_block

    base = layer.get_base_layer()
    block = layer.sides("default")["output"].block
    rows = max(block, (rows_per_block(base) or 0) // block * block)
    return rows * base.in_features


def run(quick: bool = False, repeats: int = 3) -> list[dict]:
    """One row per way: the medians of ``repeats`` processes, and the ratios against the whole fold."""
    runs: dict[str, list[dict]] = {"whole": [], "by rows": []}
    for _ in range(1 if quick else repeats):
        for way in runs:
            runs[way].append(measure_as_a_user("fold", way=way))
    rows = []
    for measured in runs.values():
        row = dict(measured[0])
        for key in ("fold_s", "peak_above_mb", "requantization_error"):
            row[key] = statistics.median(m[key] for m in measured)
        rows.append(row)
    whole = rows[0]
    for row in rows:
        row["memory_vs_whole"] = row["peak_above_mb"] / whole["peak_above_mb"]
        row["time_vs_whole"] = row["fold_s"] / whole["fold_s"]
    return rows
