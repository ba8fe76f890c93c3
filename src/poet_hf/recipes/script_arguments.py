"""`ScriptArguments`: the options every training script has beside its ``TrainingArguments``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..orthogonal.maps import MAPS
from ..tuners.config_utils import check_positive_int
from ..tuners.oft import OftConfig
from ..tuners.poet import PoetConfig

# The options every script shares whose default is its job's recipe (fine-tuning's LoRA rank is LoraConfig's).
JOB_DEFAULTS = {
    "pretraining": {"seq_len": 256, "lora_rank": 64, "max_eval_samples": 128},
    "fine-tuning": {"seq_len": 128, "lora_rank": 8, "max_eval_samples": 256},
}
_JOB_DEFAULT_HELP = {
    name: "default: the job's, " + ", ".join(f"{values[name]} for {job}" for job, values in JOB_DEFAULTS.items())
    for name in JOB_DEFAULTS["pretraining"]
}


# The flags that choose POET's and OFT's orthogonal map and its settings: each is its config field's name, set only
# where given (`map_overrides`), and printed by the recipe.
MAP_FLAGS = ("orthogonal_map", "neumann_terms")


@dataclass(kw_only=True)
class ScriptArguments:
    """The options every training script has beside its ``TrainingArguments``.

    Where the text comes from, the tokenizer, and where to export the merged model; each script's class adds its
    own."""

    dataset_config: str | None = field(default=None, metadata={"help": "HF dataset config name, e.g. 'en' for C4"})
    text_column: str = field(default="text", metadata={"help": "column holding the text"})
    tokenizer_name: str | None = field(
        default=None,
        metadata={
            "help": "AutoTokenizer name or path, as run_clm.py spells it; default: the model's (pretraining: the "
            "--model_name_or_path checkpoint's, else the embedded BPE)",
        },
    )
    export_dir: str | None = field(default=None, metadata={"help": "export a plain merged model here at the end"})
    block_size: int | None = field(
        default=None,
        metadata={
            "help": "POET-BS / OFT block size (a size that does not divide a layer becomes its nearest divisor); "
            f"default: the recipe's (pretraining: the preset's, else PoetConfig's {PoetConfig.block_size}; "
            f"fine-tuning: the POET recipe's, OftConfig's {OftConfig.block_size})"
        },
    )
    orthogonal_map: str | None = field(
        default=None,
        metadata={
            "help": f"POET / OFT: the map from parameters to orthogonal blocks, one of {sorted(MAPS)}; default: "
            f"the config's ({PoetConfig.orthogonal_map!r})"
        },
    )
    neumann_terms: int | None = field(
        default=None,
        metadata={
            "help": "POET / OFT: Cayley–Neumann terms n, PEFT's count (the POET paper's k = n − 2; 0 = the exact "
            f"Cayley transform); default: the config's (POET {PoetConfig.neumann_terms}, the paper's k = "
            f"{PoetConfig.neumann_terms - 2}; OFT {OftConfig.neumann_terms})"
        },
    )
    # None until the script's __post_init__ sets its job's value (`use_job_defaults`): one name, one default.
    seq_len: int = field(
        default=None,
        metadata={"help": "tokens per sequence (classification: the max length); " + _JOB_DEFAULT_HELP["seq_len"]},
    )  # type: ignore[assignment]
    lora_rank: int = field(
        default=None, metadata={"help": "LoRA rank r (--method lora); " + _JOB_DEFAULT_HELP["lora_rank"]}
    )  # type: ignore[assignment]
    max_eval_samples: int = field(
        default=None,
        metadata={
            "help": "evaluate on at most this many sequences / examples; " + _JOB_DEFAULT_HELP["max_eval_samples"]
        },
    )  # type: ignore[assignment]

    def map_overrides(self) -> dict[str, Any]:
        """The orthogonal map's flags that were given (`MAP_FLAGS`), as config fields.

        Returns:
            ``{field: value}`` for each flag set on the command line.
        """
        return {name: getattr(self, name) for name in MAP_FLAGS if getattr(self, name) is not None}

    def use_job_defaults(self, job: str) -> None:
        """Give the shared options left unset the values of ``job`` (a key of `JOB_DEFAULTS`), and check them."""
        for name, value in JOB_DEFAULTS[job].items():
            if getattr(self, name) is None:
                setattr(self, name, value)
            check_positive_int(name, getattr(self, name))
