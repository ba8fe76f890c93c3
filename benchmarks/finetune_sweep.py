"""The sweep POET's fine-tuning defaults were chosen from (``scripts/finetune.py --recipe default``).

On both testbed tasks (``benchmarks/finetune_quality.py``), one run each: OFT and LoRA at their defaults, then POET
over its block layout (contiguous or permuted), learning rate, block size (each side at ``lr·32/b``), the paper's fully
stochastic recipe, merge interval and Cayley–Neumann terms. Rows carry the evaluation loss after 5 steps (``loss @5``:
no damage if below ``loss before``) and the largest angle a layer's rotations turn it by at step 5 (``angle @5``,
degrees).
"""

from __future__ import annotations

from typing import Any

from .finetune_quality import run as run_variants

BS = ["--method", "poet", "--spo", "block"]  # the rate, size, merge and Neumann rows vary permuted 32-blocks
VARIANTS = {
    "oft": ["--method", "oft"],
    "lora": ["--method", "lora"],
    "poet (default: contiguous 32, lr 1e-3)": ["--method", "poet"],
    "poet BS 32 (permuted blocks)": BS,
    "poet BS 32, lr 3e-4": [*BS, "--poet_learning_rate", "3e-4"],
    "poet BS 32, lr 2e-3": [*BS, "--poet_learning_rate", "2e-3"],
    "poet BS 16": [*BS, "--block_size", "16"],
    "poet BS 64": [*BS, "--block_size", "64"],
    "poet BS 32, merge every 20": [*BS, "--merge_every", "20"],
    "poet BS 32, 5 Neumann terms": [*BS, "--neumann_terms", "5"],
    "poet --recipe paper (FS 1/2)": ["--method", "poet", "--recipe", "paper"],
    "poet --recipe paper, lr 3e-3": ["--method", "poet", "--recipe", "paper", "--poet_learning_rate", "3e-3"],
    "poet FS 1/2, one rate 2e-4 (before)": [
        "--method",
        "poet",
        "--recipe",
        "paper",
        "--poet_learning_rate",
        "2e-4",
        "--poet_reference_block",
        "0",
    ],
}


def run(quick: bool = False) -> list[dict[str, Any]]:
    return run_variants(quick=quick, repeats=1, tasks=("causal-lm", "classification"), variants=VARIANTS)
