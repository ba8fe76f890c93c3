"""Fine-tune a pretrained model with POET, OFT or LoRA (the POET paper's Table 6 setting, any HF model).

``scripts/finetune.py`` is the command-line face of [`run_finetuning`][poet_hf.recipes.finetune.run_finetuning]. The
steps, top to bottom:

1. load the model (``AutoModelForCausalLM`` or ``AutoModelForSequenceClassification``) and its tokenizer;
2. load the data: a text corpus packed into sequences (causal LM) or a labelled text dataset (classification),
   from an HF dataset name or local ``.txt`` / ``.jsonl`` / ``.json`` / ``.csv`` files;
3. wrap it: ``PoetConfig`` (``W0`` is the pretrained weight, kept), ``OftConfig`` or PEFT's ``LoraConfig``;
4. evaluate, train with ``PoetTrainer``, evaluate again; 5. save the adapter and optionally export the merged model.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, cast

import numpy as np
import torch
from peft import LoraConfig
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    TrainerCallback,
    default_data_collator,
)

from ..data import EMBEDDED_CORPUS, load_corpus, pack_sequences
from ..initialization import has_meta_tensors
from ..training.arguments import PoetTrainingArguments
from ..training.distributed import fsdp_requested
from ..training.trainer import PoetTrainer
from ..tuners.config_utils import DEFAULT_TARGET_MODULES, check_choice
from ..tuners.oft import OftConfig
from ..tuners.poet import POET_FINETUNE_RECIPES, PoetConfig
from ..tuners.rotation import quantization, storage_kinds
from .cli import TrainingFlags, check_cpu_mixed_precision, parse_arguments, run_defaults, training_arguments
from .script_arguments import ScriptArguments

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from .pretrain import TextDataset

METHODS = ("poet", "oft", "lora")
# The pretraining script's names for POET's two layouts, accepted here too: the same method names in every script.
METHOD_ALIASES = {"poet-bs": {"spo": "block"}, "poet-fs": {"recipe": "paper"}}
TASKS = ("causal-lm", "sequence-classification")
# OFT and LoRA train at their configs' defaults at this rate (PEFT's convention: one rate for every adapter
# parameter); POET at its recipe's (POET_FINETUNE_RECIPES).
ADAPTER_LEARNING_RATE = 1e-3


@dataclass
class FinetuneArguments(ScriptArguments):
    """The options of ``scripts/finetune.py`` beside `PoetTrainingArguments`.

    Both are parsed by ``transformers.HfArgumentParser`` (`parse_finetune_arguments`).

    The training flags (``--learning_rate``, ``--max_steps``, ``--per_device_train_batch_size``, ``--seed``,
    ``--merge_every``, ``--poet_reference_block``, …) are ``TrainingArguments``'; `finetune_defaults` gives the ones the
    method's recipe decides.
    """

    model_name_or_path: str = field(metadata={"help": "pretrained model: a hub name or a local directory"})
    method: str = field(
        default="oft",
        metadata={
            "help": "oft, lora, poet (POET with --recipe's settings; the default recipe is contiguous 32-blocks), "
            "poet-bs (POET, block-stochastic: --recipe's with spo='block') or poet-fs (POET, fully stochastic: "
            "the paper's recipe); poet-bs and poet-fs are the SPO kinds pretrain.py's names mean"
        },
    )
    task: str = field(default="causal-lm", metadata={"help": f"one of {', '.join(TASKS)}"})
    dataset: str = field(
        default=EMBEDDED_CORPUS,
        metadata={
            "help": "'embedded' (causal LM only), an HF dataset name, or local files / a "
            "folder of .txt/.jsonl/.json/.csv"
        },
    )
    label_column: str = field(default="label", metadata={"help": "integer label column (classification)"})
    eval_split: str = field(
        default="validation",
        metadata={"help": "split to evaluate on if the dataset has it; otherwise a twentieth of train is held out"},
    )
    base_quantization: str | None = field(
        default=None,
        metadata={
            "help": "load the model's Linear layers quantised by bitsandbytes (QOFT, QPOET, QLoRA), as one of "
            f"{', '.join(map(repr, storage_kinds.BASE_QUANTIZATIONS))} (4-bit kinds double-quantised); needs pip "
            "install 'poet_hf[quant]'"
        },
    )
    recipe: str = field(
        default="default",
        metadata={
            "help": f"POET only: one of {', '.join(POET_FINETUNE_RECIPES)} (PoetConfig.for_finetuning). 'default' "
            "is 32-blocks on both sides in OFT's contiguous layout; 'paper' is the POET paper's Table 6 setting "
            "(fully stochastic, budget 1/2): far more trainable parameters and time per step than OFT's "
            "(docs/finetuning.md has the measured figures)"
        },
    )
    spo: str | None = field(
        default=None,
        metadata={
            "help": "POET: 'contiguous', 'block' (permuted) or 'full' "
            "(default: the recipe's); OFT: 'contiguous' (default, PEFT's blocks) or 'block'"
        },
    )
    budget: float | None = field(
        default=None,
        metadata={
            "help": "POET spo='full': index-set size per side as a "
            f"fraction of the dimension (default: the recipe's, else PoetConfig's {PoetConfig.budget})"
        },
    )
    lora_alpha: float | None = field(default=None, metadata={"help": "LoRA alpha; default: 2 × lora_rank"})
    target_modules: str | None = field(
        default=None,
        metadata={"help": "comma-separated module names; default per model type (every Linear in the blocks)"},
    )
    max_train_samples: int | None = field(
        default=None, metadata={"help": "use at most this many training sequences / examples"}
    )

    def __post_init__(self) -> None:
        if self.method in METHOD_ALIASES:
            for name, value in METHOD_ALIASES[self.method].items():
                if name == "recipe" or getattr(self, name) is None:
                    setattr(self, name, value)
            self.method = "poet"
        check_choice("method", self.method, METHODS + tuple(METHOD_ALIASES))
        check_choice("task", self.task, TASKS)
        check_choice("base_quantization", self.base_quantization, (None, *storage_kinds.BASE_QUANTIZATIONS))
        check_choice("recipe", self.recipe, tuple(POET_FINETUNE_RECIPES))
        if self.method != "poet" and self.recipe != "default":
            raise ValueError(
                f"`recipe` applies to --method poet only; --method {self.method} takes its config's defaults"
            )
        if self.method == "poet":  # the recipe fills what the command line left unset
            for name, value in POET_FINETUNE_RECIPES[self.recipe].config.items():
                if getattr(self, name) is None:
                    setattr(self, name, value)
        allowed_spo = ("contiguous", "block", "full") if self.method == "poet" else ("contiguous", "block")
        if self.method in ("poet", "oft") and self.spo is not None and self.spo not in allowed_spo:
            raise ValueError(f"`spo` for --method {self.method} must be one of {allowed_spo}, got {self.spo!r}")
        if self.task == "sequence-classification" and self.dataset == EMBEDDED_CORPUS:
            raise ValueError(
                "`dataset`='embedded' is an unlabelled corpus; sequence classification needs a "
                "labelled dataset (an HF name or local files with text and label columns)"
            )
        self.use_job_defaults("fine-tuning")


def finetune_defaults(args: FinetuneArguments, given: TrainingFlags) -> dict[str, object]:
    """The training flags the method's recipe decides, for those the user did not give.

    POET's rotation rate (``poet_learning_rate``, unless ``--learning_rate`` alone was given, which then sets every
    rate) and its per-block-size scaling (`POET_FINETUNE_RECIPES`); 1e-3 for OFT, LoRA and any new head; a short run;
    evaluation batches as large as the training ones.

    Args:
        args: the script's options.
        given: the training flags the user set.

    Returns:
        ``PoetTrainingArguments`` field values.
    """
    batch = given.get("per_device_train_batch_size", 8)
    values: dict[str, object] = {
        "output_dir": "outputs/finetune",
        "max_steps": 200,
        "learning_rate": ADAPTER_LEARNING_RATE,
        "per_device_train_batch_size": batch,
        "per_device_eval_batch_size": batch,
        "logging_steps": 10,
        "eval_strategy": "steps" if "eval_steps" in given else "no",
    }
    if args.method == "poet":
        recipe = POET_FINETUNE_RECIPES[args.recipe]
        values["poet_reference_block"] = recipe.reference_block
        values["poet_learning_rate"] = given.get("learning_rate", recipe.learning_rate)
    return run_defaults(given, **values)


def parse_finetune_arguments(
    argv: list[str] | None = None, **fields: object
) -> tuple[FinetuneArguments, PoetTrainingArguments]:
    """``scripts/finetune.py``'s options from a command line or from keyword ``fields``.

    ``argv`` ``None`` reads ``sys.argv``; ``fields`` may belong to either dataclass (`cli.parse_arguments`).

    Args:
        argv: the command line.
        **fields: field values instead of a command line.

    Returns:
        ``(FinetuneArguments, PoetTrainingArguments)``.
    """
    return parse_arguments(FinetuneArguments, finetune_defaults, argv, fields or None, PoetTrainingArguments)


def load_model(args: FinetuneArguments, num_labels: int | None = None) -> tuple[PreTrainedModel, list[str]]:
    """The pretrained model for ``args.task``, and the modules the checkpoint did not provide.

    The model is a hub name or a local path. A new classification head, or the pooler a sentence-embedding checkpoint
    lacks, starts random, so it trains fully and is saved beside the adapter."""
    quantized = (
        {}
        if args.base_quantization is None
        else {"quantization_config": quantization.bits_and_bytes_config(args.base_quantization), "dtype": torch.float32}
    )
    sharded = fsdp_requested() and torch.cuda.is_available()  # Accelerate shards on accelerators only
    if args.task == "causal-lm" and args.method != "lora" and not quantized and sharded:
        # Built on meta: PoetTrainer shards it and fills each process's shards from the checkpoint (pretrained_weights).
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.model_name_or_path)), []
    if args.task == "causal-lm":
        model, info = cast(  # output_loading_info: the model and what loading found
            "tuple[PreTrainedModel, dict[str, list[str]]]",
            AutoModelForCausalLM.from_pretrained(args.model_name_or_path, output_loading_info=True, **quantized),
        )
    else:
        model, info = AutoModelForSequenceClassification.from_pretrained(
            args.model_name_or_path, num_labels=num_labels, output_loading_info=True, **quantized
        )
    return model, sorted({key.rsplit(".", 1)[0] for key in info["missing_keys"]})


def local_weights(model: str) -> str:
    """A local folder holding the safetensors weights of ``model`` (a path, or a hub id fetched into the cache)."""
    if Path(model).exists():
        return model
    from huggingface_hub import snapshot_download

    return snapshot_download(model, allow_patterns=["*.safetensors", "*.json"])


def load_model_tokenizer(args: FinetuneArguments):
    """``AutoTokenizer`` for ``args.tokenizer_name`` or the model; a pad token is set (EOS) where missing."""
    from transformers import AutoTokenizer

    name = args.tokenizer_name or args.model_name_or_path
    tokenizer = AutoTokenizer.from_pretrained(name)
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"tokenizer of {name!r} has neither a pad nor an EOS token")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_finetune_data(
    args: FinetuneArguments, tokenizer: PreTrainedTokenizerBase, seed: int = 0
) -> tuple[TextDataset, TextDataset, int | None]:
    """Tokenized train and evaluation sets, and the number of labels (classification).

    ``seed`` draws the held-out twentieth of a dataset without an evaluation split."""
    raw = load_corpus(args.dataset, args.dataset_config, seed=seed, validation_split=args.eval_split)
    if args.task == "causal-lm":
        train = pack_sequences(raw["train"], tokenizer, args.seq_len, args.text_column)
        evaluation = pack_sequences(raw["validation"], tokenizer, args.seq_len, args.text_column)
        num_labels = None
    else:
        for column in (args.text_column, args.label_column):
            if column not in raw["train"].column_names:
                raise ValueError(f"column {column!r} not in the dataset columns {raw['train'].column_names}")
        labels = sorted(set(raw["train"][args.label_column]))
        if labels != list(range(len(labels))):
            raise ValueError(f"`{args.label_column}` must hold the integers 0..n-1, got {labels[:10]}")
        num_labels = len(labels)

        def tokenize(batch: dict) -> dict:
            encoded = tokenizer(batch[args.text_column], truncation=True, max_length=args.seq_len, padding="max_length")
            encoded["labels"] = batch[args.label_column]
            return encoded

        columns = raw["train"].column_names
        train = raw["train"].map(tokenize, batched=True, remove_columns=columns)
        evaluation = raw["validation"].map(tokenize, batched=True, remove_columns=columns)
    if len(train) == 0 or len(evaluation) == 0:
        raise ValueError(
            f"dataset {args.dataset!r} gives {len(train)} training and {len(evaluation)} evaluation "
            f"examples at seq_len={args.seq_len}; use more data or a shorter --seq_len"
        )
    if args.max_train_samples is not None:
        train = train.select(range(min(args.max_train_samples, len(train))))
    evaluation = evaluation.select(range(min(args.max_eval_samples, len(evaluation))))
    return train, evaluation, num_labels


def target_modules(args: FinetuneArguments, model: torch.nn.Module):
    """``--target_modules`` or the default per model type (every Linear in the blocks, as POET)."""
    if args.target_modules:
        return [name.strip() for name in args.target_modules.split(",") if name.strip()]
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in DEFAULT_TARGET_MODULES:
        raise ValueError(f"no default target modules for model_type {model_type!r}; pass --target_modules")
    return DEFAULT_TARGET_MODULES[model_type]


def method_config(
    args: FinetuneArguments,
    model: torch.nn.Module,
    new_modules: list[str] | None = None,
    training: PoetTrainingArguments | None = None,
):
    """The PEFT config of ``args.method``.

    ``new_modules`` (and, through the task type, classification heads) are trained fully and saved beside the adapter.
    From ``training`` (the command line's) come ``seed``, the rotations' permutations, and ``merge_every``, the
    interval the adapter records (unset: the config's)."""
    from peft import TaskType

    common = {
        "target_modules": target_modules(args, model),
        "task_type": TaskType.CAUSAL_LM if args.task == "causal-lm" else TaskType.SEQ_CLS,
        "modules_to_save": list(new_modules or []) or None,
    }
    # Only what the command line (or the POET recipe) set; everything else is the config class's default.
    chosen = {name: getattr(args, name) for name in ("spo", "block_size", "budget") if getattr(args, name) is not None}
    chosen.update(args.map_overrides())
    seed = 0 if training is None else training.seed
    if training is not None and training.merge_every is not None:
        chosen["merge_every"] = training.merge_every
    if args.method == "poet":
        recipe = POET_FINETUNE_RECIPES[args.recipe]
        return PoetConfig(
            seed=seed,
            rotation_learning_rate=recipe.learning_rate,
            rotation_reference_block=recipe.reference_block,
            **chosen,
            **common,
        )
    if args.method == "oft":
        chosen.pop("budget", None)
        return OftConfig(seed=seed, **chosen, **common)
    lora_alpha = args.lora_alpha or 2 * args.lora_rank
    return LoraConfig(r=args.lora_rank, lora_alpha=lora_alpha, **common)  # type: ignore[arg-type]  # a float works


def apply_method(
    args: FinetuneArguments,
    model: torch.nn.Module,
    new_modules: list[str] | None = None,
    training: PoetTrainingArguments | None = None,
) -> torch.nn.Module:
    from ..tuners.tuner_base import get_peft_model_quietly

    return get_peft_model_quietly(model, method_config(args, model, new_modules, training))


def accuracy(eval_prediction) -> dict[str, float]:
    """Classification accuracy, for ``Trainer(compute_metrics=...)``."""
    logits, labels = eval_prediction
    logits = logits[0] if isinstance(logits, tuple) else logits
    return {"accuracy": float((np.argmax(logits, axis=-1) == labels).mean())}


def _metrics(result: dict[str, float], task: str) -> dict[str, float]:
    metrics = {"loss": result["eval_loss"]}
    if task == "causal-lm":
        metrics["perplexity"] = math.exp(min(result["eval_loss"], 50.0))
    else:
        metrics["accuracy"] = result["eval_accuracy"]
    return metrics


class _LastEvaluation(TrainerCallback):
    """The metrics of the trainer's latest evaluation and the step it ran at."""

    def __init__(self) -> None:
        self.step: int | None = None
        self.metrics: dict[str, float] | None = None

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.step, self.metrics = state.global_step, metrics


def _evaluate_after_training(trainer: PoetTrainer, last: _LastEvaluation) -> dict[str, float]:
    """The final model's metrics.

    Those of the evaluation the trainer ran at the last step (with ``eval_steps``, ``transformers`` evaluates the last
    step too) when nothing has changed the model since, else a new evaluation."""
    if last.metrics is not None and last.step == trainer.state.global_step and not trainer.args.load_best_model_at_end:
        return last.metrics
    return trainer.evaluate()


def run_finetuning(
    args: FinetuneArguments, training: PoetTrainingArguments | None = None, callbacks: list | None = None
) -> dict[str, object]:
    """Evaluate, fine-tune, evaluate again; save the adapter (and the merged export).

    Returns the report, also written to ``output_dir/results.json``: ``{"before": {...}, "after": {...}, ...}``.

    Args:
        args: the run's options (``scripts/finetune.py``'s own flags).
        training: the training arguments (its ``TrainingArguments`` flags); ``None``: the method's defaults
            (`finetune_defaults`).
        callbacks: extra ``TrainerCallback`` objects.

    Returns:
        The report (also written to ``results.json``), with the trainer under ``"trainer"``.
    """
    started = time.time()
    if training is None:
        training = training_arguments(PoetTrainingArguments, finetune_defaults(args, {}))
    check_cpu_mixed_precision(training)
    torch.manual_seed(training.seed)
    tokenizer = load_model_tokenizer(args)
    train, evaluation, num_labels = load_finetune_data(args, tokenizer, training.seed)
    base, new_modules = load_model(args, num_labels)
    if args.task == "sequence-classification" and getattr(base.config, "pad_token_id", None) is None:
        base.config.pad_token_id = tokenizer.pad_token_id  # decoder-only classifiers find the last token by it
    model = apply_method(args, base, new_modules, training)
    trainer = PoetTrainer(
        model=model,
        args=training,
        train_dataset=train,
        eval_dataset=evaluation,
        pretrained_weights=local_weights(args.model_name_or_path) if has_meta_tensors(model) else None,
        data_collator=default_data_collator,
        processing_class=tokenizer,
        compute_metrics=accuracy if args.task == "sequence-classification" else None,
        callbacks=callbacks,
        run_info={
            "method": args.method,
            "base_model": args.model_name_or_path,
            "dataset": args.dataset,
            "task": args.task,
        },
    )
    before = _metrics(trainer.evaluate(), args.task)
    last_evaluation = _LastEvaluation()  # added after the evaluation before training, which it must not see
    trainer.add_callback(last_evaluation)
    trainer.train(resume_from_checkpoint=training.resume_from_checkpoint)
    after = _metrics(_evaluate_after_training(trainer, last_evaluation), args.task)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    results: dict[str, object] = {
        "method": args.method,
        "model": args.model_name_or_path,
        "task": args.task,
        "dataset": args.dataset,
        "before": before,
        "after": after,
        "steps": trainer.state.global_step,
        "trainable_params": trainable,
        "train_examples": len(train),
        "eval_examples": len(evaluation),
        "wall_time_s": time.time() - started,
        "arguments": asdict(args),
        "training_arguments": training.to_sanitized_dict(),
    }
    if trainer.is_world_process_zero():
        output = Path(cast(str, training.output_dir))
        output.mkdir(parents=True, exist_ok=True)
        trainer.save_model(str(output))
        if args.export_dir:
            results["export_dir"] = str(export_model(trainer, args.export_dir, tokenizer))
        (output / "results.json").write_text(json.dumps(results, indent=2, default=str))
    results["trainer"] = trainer  # for callers in Python (not written to results.json)
    return results


def export_model(trainer: PoetTrainer, export_dir: str, tokenizer) -> Path:
    """The merged plain model, loadable by stock ``transformers``.

    POET / OFT go through ``poet_hf.export.export_merged`` (model card, dtype handling); LoRA, which it does not
    handle, through PEFT's ``merge_and_unload`` on a copy, so the trained adapter model stays usable.
    """
    import copy

    from ..export import export_merged

    model = trainer.model  # a PeftModel
    if getattr(model, "peft_type", None) == "LORA":
        merged = cast("PeftModel", copy.deepcopy(model)).merge_and_unload()
        merged.save_pretrained(export_dir)
        tokenizer.save_pretrained(export_dir)
        return Path(export_dir)
    return export_merged(trainer, export_dir, overwrite=True, tokenizer=tokenizer, inplace=False)
