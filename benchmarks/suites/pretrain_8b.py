"""A POET training step at Llama-3-8B's shape (a 128,256-token vocabulary) on this machine, every saving on.

The run of `benchmarks.suites.pretrain_7b` (meta build, nf4 ``W0`` layer by layer, fused 8-bit steps with the clip,
per-block checkpointing, ``1 × 256``, a merge and a step after it) at ``configs/models/llama-3.1-8b.json``, with the
head and the input embeddings stored in bfloat16 (``vocab_weights_dtype``, `poet_hf.training.bf16_storage`), in its own
process started as a user starts one. Beside it, `poet_hf.plan_memory`'s figure for the same run, and for the same run
with the head and embeddings in float32 (planned only: that run takes as long again).
"""

from __future__ import annotations

from typing import Any

from benchmarks.common import measure_as_a_user
from benchmarks.suites.pretrain_7b import ROOT, planned_mb

CONFIG = str(ROOT / "configs" / "models" / "llama-3.1-8b.json")


def run(quick: bool = False) -> list[dict[str, Any]]:
    """One row (``quick``: two blocks of the shape)."""
    layers = 2 if quick else None
    shape = {"config": CONFIG, "vocab_weights_dtype": "bfloat16"}
    row = measure_as_a_user("pretrain_7b", steps=2, batch=1, seq=256, layers=layers, **shape)
    row["planned_mb"] = planned_mb(1, 256, layers=layers, **shape)
    row["planned_vs_measured"] = row["planned_mb"] / row["steps_peak_mb"]  # both above the imports
    row["planned_float32_vocab_mb"] = planned_mb(1, 256, layers=layers, config=CONFIG)
    return [row]
