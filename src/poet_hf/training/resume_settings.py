"""A resumed run must continue the run it resumes: the settings that shape the adapter or its merge schedule are
compared with those the checkpoint was trained with before anything is loaded.

Another block size, primitive, budget, side or orthogonal map would meet tensors of another shape (the load names the
tensor, not the setting); another ``merge_every`` would load without complaint and merge on another schedule, so the
run would no longer be the one it resumes. `check_resume_settings` names the setting, both values and what to do.
"""

from __future__ import annotations

import json
from pathlib import Path

from peft import PeftConfig

from ..export.source import RUN_INFO_NAME

# The adapter config's fields a resumed run must keep: they shape the adapter's tensors or what a merge folds.
SHAPING_FIELDS = (
    "peft_type",
    "spo",
    "block_size",
    "budget",
    "sides",
    "orthogonal_map",
    "neumann_terms",
    "base_quantization",
)


def _differences(saved: dict[str, object], live: dict[str, object]) -> list[str]:
    def normal(value: object) -> object:
        return getattr(value, "value", value)  # an enum member (peft_type) as its saved string

    return [
        f"{field}={normal(saved[field])!r} (this run: {normal(live.get(field))!r})"
        for field in SHAPING_FIELDS
        if field in saved and normal(saved[field]) != normal(live.get(field))
    ]


def check_resume_settings(checkpoint: str | Path, configs: dict[str, PeftConfig], merge_every: int | None) -> None:
    """Raise ``ValueError`` where the run differs from ``checkpoint`` in a setting of `SHAPING_FIELDS` or in
    ``merge_every``; a checkpoint without an adapter config (no POET model) passes.

    Args:
        checkpoint: the checkpoint folder about to be resumed.
        configs: the live model's adapter configs, by adapter name (``model.peft_config``).
        merge_every: the run's merge interval (`PoetTrainer.merge_every`); ``None``: no merges.
    """
    folder = Path(checkpoint)
    differences = []
    for name, config in configs.items():
        path = folder / ("adapter_config.json" if name == "default" else f"{name}/adapter_config.json")
        if path.is_file():
            differences += _differences(json.loads(path.read_text()), config.to_dict())
    run_info = folder / RUN_INFO_NAME
    if run_info.is_file():
        saved_interval = json.loads(run_info.read_text()).get("merge_every")
        if saved_interval is not None and saved_interval != merge_every:
            differences.append(f"merge_every={saved_interval!r} (this run: {merge_every!r})")
    if differences:
        raise ValueError(
            f"{folder} was trained with {'; '.join(differences)}: a resumed run continues the run it resumes. "
            "Resume with the checkpoint's settings, or start a new run in another output_dir (from the exported "
            "checkpoint, with --model_name_or_path) to change them"
        )
