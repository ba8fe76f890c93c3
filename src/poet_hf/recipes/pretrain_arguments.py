"""`PretrainArguments`: the options of ``scripts/pretrain.py`` beyond ``TrainingArguments``, and their checks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ..data import EMBEDDED_CORPUS
from ..orthogonal.base_init import BASE_INIT_SCHEMES
from ..tuners.config_utils import check_choice, check_positive_int
from ..tuners.poet import PoetConfig
from ..tuners.rotation.storage_kinds import BASE_QUANTIZATIONS
from .presets import PRESETS
from .script_arguments import ScriptArguments

METHODS = ("poet-bs", "poet-fs", "adamw", "lora", "galore")


# The recipe values that are TrainingArguments flags: the recipe's key -> the flag.
RECIPE_FLAGS = {
    "steps": "max_steps",
    "batch_size": "per_device_train_batch_size",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "learning_rate": "learning_rate",
    "poet_learning_rate": "poet_learning_rate",
    "max_grad_norm": "max_grad_norm",
    "weight_decay": "weight_decay",
    "warmup_steps": "warmup_steps",
}
# Read from the command line into the recipe, which puts them in the adapter config (their home); the training
# argument keeps only what the user set, as an override for the run.
CONFIG_FLAGS = ("merge_every",)
# Training flags the recipe reports as the run uses them (the optimizer and the schedule that actually run).
RUN_FLAGS = ("optim", "lr_scheduler_type", "fused_optimizer_step", "vocab_weights_dtype")


@dataclass
class PretrainArguments(ScriptArguments):
    """The options of ``scripts/pretrain.py`` beside `PoetTrainingArguments`.

    Both are parsed by ``transformers.HfArgumentParser`` (`parse_pretrain_arguments`).

    The preset decides the defaults of the training flags it has a value for (``--max_steps``,
    ``--per_device_train_batch_size``, ``--gradient_accumulation_steps``, ``--learning_rate``,
    ``--poet_learning_rate``, ``--merge_every``, ``--max_grad_norm``, ``--weight_decay``; `pretrain_defaults`): for the
    paper's presets, the paper's run except its length (``--paper_steps`` for that too).
    """

    preset: str = field(
        default="tiny",
        metadata={
            "help": f"model size and recipe: {', '.join(PRESETS)} ('tiny' "
            "trains on 2 CPU cores in minutes; llama-2-7b is Llama-2-7B's shape; the others are the paper's Table 7 "
            "shapes)"
        },
    )
    config_name: str | None = field(
        default=None,
        metadata={
            "help": "train this model's shape instead of the preset's (a config.json, its folder or a Hub id; any "
            "causal LM whose block linears POET knows: LLaMA, Mistral, Qwen2, Gemma, GPT-2, ...); the preset "
            "still gives the recipe"
        },
    )
    config_overrides: str | None = field(
        default=None,
        metadata={"help": "override config settings, as run_clm.py: 'num_hidden_layers=2,hidden_size=256'"},
    )
    model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "continued pretraining: a checkpoint (folder or Hub id) whose weights become POET's W0 (kept: "
            "--base_init defaults to none) and whose other weights train on"
        },
    )
    method: str = field(
        default="poet-bs",
        metadata={
            "help": "poet-bs (POET, block-stochastic: the preset's block, Table 7's 256), poet-fs (POET, fully "
            "stochastic: budget ½ per side), adamw, lora or galore; the names finetune.py takes mean the same"
        },
    )
    block_size_input: int | None = field(default=None, metadata={"help": "POET-BS block size of R only"})
    block_size_output: int | None = field(default=None, metadata={"help": "POET-BS block size of P only"})
    budget: float | None = field(
        default=None,
        metadata={
            "help": "POET-FS index-set size per side: a fraction of "
            f"the dimension (<= 1, default PoetConfig's {PoetConfig.budget}) or an absolute size (> 1)"
        },
    )
    budget_input: float | None = field(default=None, metadata={"help": "POET-FS budget of R only (Fig. 5 splits)"})
    budget_output: float | None = field(default=None, metadata={"help": "POET-FS budget of P only"})
    base_init: str | None = field(
        default=None,
        metadata={
            "help": "W0 initialisation for POET (Table 3): normalized (the default from scratch), xavier, standard, "
            "uniform_spectrum, or none (keep the weights: the default with --model_name_or_path)"
        },
    )
    base_quantization: str | None = field(
        default=None,
        metadata={
            "help": "POET: quantise every W0 with bitsandbytes after base_init (QPOET), as one of "
            f"{', '.join(map(repr, BASE_QUANTIZATIONS))}; needs pip install 'poet_hf[quant]'"
        },
    )
    cache_rotations: Literal["auto", "true", "false"] = field(
        default="auto",
        metadata={
            "help": "POET under gradient accumulation: 'true' builds each rotation once per optimizer step "
            "across the micro-batches (less time; holds the blocks and their pending gradient, 2·rows·b² entries per "
            "side, unsharded, meanwhile), 'false' rebuilds it per micro-batch (less memory), 'auto' decides per layer "
            "by what the cache saves and holds (PoetConfig.cache_rotations) and logs the choice"
        },
    )
    paper_steps: bool = field(
        default=False,
        metadata={"help": "train for Tables 8–9's step count (the paper's presets); --max_steps wins over it"},
    )
    global_batch_size: int | None = field(
        default=None,
        metadata={
            "help": "sequences per optimizer step (the paper's 512), reached by gradient accumulation over processes; "
            "ignored when --gradient_accumulation_steps is given"
        },
    )
    packing: bool = field(
        default=True,
        metadata={
            "help": "pack documents into seq_len-token rows (true) or truncate "
            "/ pad each document to seq_len as GaLore and the paper do (false)"
        },
    )
    min_lr_ratio: float = field(default=0.01, metadata={"help": "cosine schedule floor, as a fraction of the peak"})
    dataset: str = field(
        default=EMBEDDED_CORPUS,
        metadata={"help": "'embedded', a local .txt/.jsonl file or folder, or an HF dataset name"},
    )
    streaming: bool = field(default=False, metadata={"help": "stream the HF dataset"})
    print_recipe: bool = field(default=False, metadata={"help": "print the fully resolved recipe as JSON and exit"})

    def __post_init__(self) -> None:
        self.use_job_defaults("pretraining")
        check_choice("preset", self.preset, tuple(PRESETS))
        if self.base_init in (None, "none"):
            self.base_init = None if self.model_name_or_path or self.base_init == "none" else "normalized"
        check_choice("base_init", self.base_init, (None, *BASE_INIT_SCHEMES))
        if self.config_name and self.model_name_or_path:
            raise ValueError(
                "`config_name` and `model_name_or_path` both name the model; give --model_name_or_path alone "
                "(with --config_overrides to change its config)"
            )
        check_choice("method", self.method, METHODS)
        if self.global_batch_size is not None:
            check_positive_int("global_batch_size", self.global_batch_size)
        if self.base_quantization is not None and not self.method.startswith("poet"):
            raise ValueError(
                f"`base_quantization` quantises POET's frozen W0; --method {self.method} trains every "
                "weight, so it has none (use --method poet-bs or poet-fs)"
            )
        check_choice("base_quantization", self.base_quantization, (None, *BASE_QUANTIZATIONS))
        if self.preset == "tiny" and self.paper_steps:
            raise ValueError("`paper_steps` needs one of the paper's presets; 'tiny' is not in the paper")
