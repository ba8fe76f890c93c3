"""Planned per-process memory of an 8-GPU FSDP2 run at sizes this machine cannot train: a prediction, not a
measurement.

For each model (`MODELS`: the paper's llama-1.3b preset and three real LLaMA configs from ``configs/models``) and each
method, `poet_hf.recipes.run_plan.plan_pretraining` plans the run ``scripts/pretrain.py`` would make with `RUN_FLAGS`
under a launch of `PROCESSES` processes (``scripts/plan_memory.py --sharding fsdp2 --processes 8 --dtype bfloat16`` with
the same flags): bfloat16 weights and activations, adapter parameters and optimizer states as the planner counts them,
micro-batch 1 × 4096, activation checkpointing, and the accumulation the recipe resolves (the preset's 512-sequence
global batch; a config's run has none). Each part is in MiB per process.
"""

from __future__ import annotations

from typing import Any

from benchmarks.run_cache import ROOT

CONFIGS = ROOT / "configs" / "models"
MODELS = {
    "llama-1.3b (paper preset)": ["--preset", "llama-1.3b"],
    "Llama-3.2-1B": ["--config_name", str(CONFIGS / "llama-3.2-1b.json")],
    "Llama-2-7B": ["--config_name", str(CONFIGS / "llama-2-7b.json")],
    "Llama-3.1-8B": ["--config_name", str(CONFIGS / "llama-3.1-8b.json")],
}
METHODS = ("poet-bs", "poet-fs", "adamw", "galore", "lora")
RUN_FLAGS = ["--per_device_train_batch_size", "1", "--seq_len", "4096", "--activation_checkpointing"]
PROCESSES, SHARDING, DTYPE = 8, "fsdp2", "bfloat16"
SETTINGS = {"processes": PROCESSES, "sharding": SHARDING, "dtype": DTYPE, "flags": RUN_FLAGS, "device GiB": 80}


def run(quick: bool = False) -> list[dict[str, Any]]:
    """One row per model and method: the plan's accumulation, its parts and its total (MiB per process)."""
    from poet_hf.recipes.run_plan import parse_run, plan_pretraining

    models = dict(list(MODELS.items())[:1]) if quick else MODELS
    rows = []
    for model, flags in models.items():
        args, training = parse_run([*flags, *RUN_FLAGS, "--method", METHODS[0]], PROCESSES)
        for plan in plan_pretraining(args, training, METHODS[1:], PROCESSES, SHARDING, DTYPE):
            plan_dict = plan.to_dict()
            rows.append(
                {
                    "model": model,
                    "method": plan_dict["method"],
                    "accumulation": plan_dict["settings"]["accumulation"],
                    **{f"{part} MiB": value for part, value in plan_dict["parts_mb"].items()},
                    "total MiB": plan_dict["total_mb"],
                }
            )
    return rows
