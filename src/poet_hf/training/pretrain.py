"""LLaMA pretraining from scratch with POET or a baseline, as in the POET paper's Table 2.

Every method runs through the same data, model presets and ``PoetTrainer``, so a comparison is one command
per row. ``scripts/pretrain.py`` is the command-line face of :func:`run_pretraining`.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from transformers import LlamaConfig, LlamaForCausalLM, default_data_collator

from ..data import EMBEDDED_CORPUS, load_corpus, load_tokenizer, pack_sequences
from ..diagnostics import plot_spectra, singular_values, spectrum_report
from ..distributed import is_sharded
from ..tuners.constants import DEFAULT_TARGET_MODULES
from ..tuners.poet import PoetConfig, poet_layers
from .arguments import PoetTrainingArguments
from .trainer import PoetTrainer

METHODS = ("poet-bs", "poet-fs", "adamw", "lora", "galore")


@dataclass(frozen=True)
class Preset:
    """A LLaMA shape (Table 7) and the recipe that goes with it (Tables 8–9)."""

    hidden: int
    intermediate_bs: int  # divisible by the block sizes (Table 7's POET-BS column)
    intermediate: int  # GaLore's sizes, used by POET-FS and the baselines
    heads: int
    layers: int
    block_size: int = 256
    learning_rate: float = 1e-2
    poet_learning_rate: float = 1e-3


PRESETS = {
    "tiny": Preset(128, 256, 256, 4, 4, block_size=32, learning_rate=5e-3, poet_learning_rate=4e-3),
    "llama-60m": Preset(512, 1280, 1376, 8, 8, learning_rate=1e-2),
    "llama-130m": Preset(768, 2048, 2048, 12, 12, learning_rate=5e-3),
    "llama-350m": Preset(1024, 2816, 2736, 16, 24, learning_rate=5e-3),
    "llama-1.3b": Preset(2048, 5376, 5461, 32, 24, learning_rate=1e-3),
}


@dataclass
class PretrainArguments:
    """Command-line options of ``scripts/pretrain.py`` (parsed by ``transformers.HfArgumentParser``)."""

    preset: str = field(default="tiny", metadata={"help": f"model size: {', '.join(PRESETS)}"})
    method: str = field(default="poet-bs", metadata={"help": f"one of {', '.join(METHODS)}"})
    block_size: Optional[int] = field(default=None, metadata={"help": "POET-BS block size (default per preset)"})
    budget: float = field(default=0.5, metadata={"help": "POET-FS fraction of each dimension"})
    neumann_terms: int = field(default=5, metadata={"help": "Cayley–Neumann terms (0 = exact Cayley)"})
    merge_every: int = field(default=50, metadata={"help": "optimizer steps between merges (paper: 200-400)"})
    base_init: str = field(default="normalized", metadata={"help": "W0 initialisation for POET (Table 3)"})
    learning_rate: Optional[float] = field(default=None, metadata={"help": "base learning rate (default per preset)"})
    poet_learning_rate: Optional[float] = field(default=None, metadata={"help": "POET learning rate"})
    lora_rank: int = field(default=64, metadata={"help": "LoRA rank for --method lora"})
    max_steps: int = field(default=200, metadata={"help": "optimizer steps"})
    batch_size: int = field(default=8, metadata={"help": "sequences per device per micro-batch"})
    gradient_accumulation_steps: int = field(default=1, metadata={"help": "micro-batches per optimizer step"})
    seq_len: int = field(default=256, metadata={"help": "packed sequence length"})
    max_grad_norm: float = field(default=1.0, metadata={"help": "gradient clipping (paper: 0.1)"})
    weight_decay: float = field(default=0.0, metadata={"help": "weight decay of the non-rotation parameters"})
    min_lr_ratio: float = field(default=0.01, metadata={"help": "cosine schedule floor, as a fraction of the peak"})
    warmup_steps: int = field(default=0, metadata={"help": "linear warm-up steps"})
    dataset: str = field(default=EMBEDDED_CORPUS,
                         metadata={"help": "'embedded', a local .txt/.jsonl file or folder, or an HF dataset name"})
    dataset_config: Optional[str] = field(default=None, metadata={"help": "HF dataset config, e.g. 'en' for C4"})
    streaming: bool = field(default=False, metadata={"help": "stream the HF dataset"})
    text_column: str = field(default="text", metadata={"help": "column holding the text"})
    tokenizer: Optional[str] = field(default=None, metadata={"help": "AutoTokenizer name/path; default embedded"})
    max_eval_sequences: int = field(default=128, metadata={"help": "validation sequences evaluated"})
    output_dir: str = field(default="outputs/pretrain", metadata={"help": "where checkpoints, results.json and "
                            "spectra.png go"})
    logging_steps: int = field(default=10, metadata={"help": "log every this many steps"})
    save_steps: int = field(default=0, metadata={"help": "checkpoint interval (0 = no intermediate checkpoints)"})
    report_to: str = field(default="none", metadata={"help": "Trainer report_to, e.g. 'tensorboard'"})
    resume_from_checkpoint: Optional[str] = field(default=None, metadata={"help": "a checkpoint folder to resume "
                                                  "from"})
    export_dir: Optional[str] = field(default=None, metadata={"help": "export a plain merged model here at the end"})
    seed: int = field(default=0, metadata={"help": "seed of data order, initialisation and permutations"})

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"`preset` must be one of {tuple(PRESETS)}, got {self.preset!r}")
        if self.method not in METHODS:
            raise ValueError(f"`method` must be one of {METHODS}, got {self.method!r}")
        for name in ("max_steps", "batch_size", "seq_len", "merge_every", "gradient_accumulation_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"`{name}` must be >= 1, got {getattr(self, name)!r}")


def build_llama(preset: Preset, method: str, vocab_size: int, seq_len: int, seed: int) -> LlamaForCausalLM:
    """A randomly initialised LLaMA of the preset's shape (POET-BS uses Table 7's divisible FFN size)."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=preset.hidden, num_hidden_layers=preset.layers,
                         intermediate_size=preset.intermediate_bs if method == "poet-bs" else preset.intermediate,
                         num_attention_heads=preset.heads, num_key_value_heads=preset.heads,
                         max_position_embeddings=seq_len, tie_word_embeddings=False)
    return LlamaForCausalLM(config)


def apply_method(model: LlamaForCausalLM, args: PretrainArguments, preset: Preset) -> torch.nn.Module:
    """Wrap the model for ``args.method``: POET via PoetConfig, LoRA via PEFT, AdamW/GaLore unchanged."""
    from peft import LoraConfig, get_peft_model

    targets = DEFAULT_TARGET_MODULES["llama"]
    if args.method in ("poet-bs", "poet-fs"):
        config = PoetConfig(spo="block" if args.method == "poet-bs" else "full",
                            block_size=args.block_size or preset.block_size, budget=args.budget,
                            neumann_terms=args.neumann_terms, merge_every=args.merge_every,
                            base_init=args.base_init, seed=args.seed)
        return get_peft_model(model, config)
    if args.method == "lora":
        # The paper's LoRA baseline trains embeddings, norms and lm_head fully beside the adapters.
        config = LoraConfig(r=args.lora_rank, lora_alpha=args.lora_rank, target_modules=targets,
                            modules_to_save=["embed_tokens", "input_layernorm", "post_attention_layernorm",
                                             "norm", "lm_head"])
        return get_peft_model(model, config)
    if args.method == "galore":
        try:
            import galore_torch  # noqa: F401
        except ImportError as error:
            raise SystemExit("--method galore needs the `galore-torch` package: pip install galore-torch") from error
    return model


def training_arguments(args: PretrainArguments, preset: Preset) -> PoetTrainingArguments:
    """``PoetTrainingArguments`` of the paper's recipe: cosine to ``min_lr_ratio``, two learning rates."""
    extra: dict[str, Any] = {}
    if args.method == "galore":
        extra = {"optim": "galore_adamw", "optim_target_modules": DEFAULT_TARGET_MODULES["llama"]}
    return PoetTrainingArguments(
        output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size, gradient_accumulation_steps=args.gradient_accumulation_steps,
        learning_rate=args.learning_rate or preset.learning_rate,
        poet_learning_rate=args.poet_learning_rate or preset.poet_learning_rate, merge_every=args.merge_every,
        lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": args.min_lr_ratio},
        warmup_steps=args.warmup_steps, weight_decay=args.weight_decay, max_grad_norm=args.max_grad_norm,
        logging_steps=args.logging_steps, save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500, eval_strategy="no", report_to=args.report_to, seed=args.seed,
        data_seed=args.seed, include_num_input_tokens_seen=True, dataloader_drop_last=True,
        use_cpu=not torch.cuda.is_available(), **extra)


def load_data(args: PretrainArguments, tokenizer) -> tuple[Any, Any]:
    """Packed train and (capped) validation sets."""
    corpus = load_corpus(args.dataset, args.dataset_config, streaming=args.streaming, seed=args.seed)
    train = pack_sequences(corpus["train"], tokenizer, args.seq_len, args.text_column)
    validation = pack_sequences(corpus["validation"], tokenizer, args.seq_len, args.text_column)
    if args.streaming:
        return train, validation.take(args.max_eval_sequences)
    return train, validation.select(range(min(args.max_eval_sequences, len(validation))))


def count_trainable(model: torch.nn.Module) -> dict[str, int]:
    """Trainable parameters in total and inside the transformer blocks (the paper's Table 2 convention)."""
    trainable = [(n, p.numel()) for n, p in model.named_parameters() if p.requires_grad]
    return {"trainable_params": sum(n for _, n in trainable),
            "trainable_block_params": sum(n for name, n in trainable if ".layers." in name and "norm" not in name)}


def neumann_drift_bound(trainer: PoetTrainer, model: torch.nn.Module) -> Optional[float]:
    """Bound on any singular value's relative drift over the run: each merge and the live primitive scale it
    by at most ``1 + ε`` (``ε`` from the Cayley–Neumann truncation); ``None`` without POET layers."""
    layers = poet_layers(model)
    if not layers:
        return None
    callback = trainer.merge_callback
    live = max(layer.rotation_stats("default")["neumann_bound"] for _, layer in layers)
    return math.prod(1 + m["max_neumann_bound"] for m in callback.history) * (1 + live) - 1


def _perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))


def run_pretraining(args: PretrainArguments) -> dict[str, Any]:
    """Train, evaluate and report; writes ``results.json`` and ``spectra.png`` in ``args.output_dir``."""
    started = time.time()
    preset = PRESETS[args.preset]
    tokenizer = load_tokenizer(args.tokenizer)
    train, validation = load_data(args, tokenizer)
    model = apply_method(build_llama(preset, args.method, len(tokenizer), args.seq_len, args.seed), args, preset)
    targets = DEFAULT_TARGET_MODULES["llama"]
    spectra_before = singular_values(model, targets)
    run_info = {"method": args.method, "preset": args.preset, **{k: v for k, v in asdict(args).items()
                                                                   if k in ("block_size", "budget", "neumann_terms",
                                                                            "merge_every", "dataset", "seq_len")}}
    trainer = PoetTrainer(model=model, args=training_arguments(args, preset), train_dataset=train,
                          eval_dataset=validation, data_collator=default_data_collator, processing_class=tokenizer,
                          run_info=run_info)
    initial_loss = trainer.evaluate()["eval_loss"]
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    final_loss = trainer.evaluate()["eval_loss"]
    spectra_after = singular_values(model, targets)
    results = {
        **run_info,
        "val_loss": final_loss, "val_perplexity": _perplexity(final_loss),
        "initial_val_loss": initial_loss, "initial_val_perplexity": _perplexity(initial_loss),
        "tokens_seen": int(trainer.state.num_input_tokens_seen), "steps": trainer.state.global_step,
        **count_trainable(model), "wall_time_s": time.time() - started,
        "merges": max((int(layer.merge_counts["default"]) for _, layer in poet_layers(model)), default=0),
        "spectrum_drift": spectrum_report(spectra_before, spectra_after),
        "spectrum_bound": neumann_drift_bound(trainer, model),
        "train_losses": [log["loss"] for log in trainer.state.log_history if "loss" in log],
    }
    output = Path(args.output_dir)
    trainer.save_model(str(output))  # every rank: under FSDP2 the state is gathered collectively
    if args.export_dir and (is_sharded(model) or trainer.is_world_process_zero()):  # a sharded fold gathers on all
        from ..export import export_merged

        evaluation = {"eval_loss": final_loss, "eval_perplexity": results["val_perplexity"]}
        results["export_dir"] = str(export_merged(trainer, args.export_dir, overwrite=True,
                                                  run_info={"eval": evaluation}))
    if trainer.is_world_process_zero():
        output.mkdir(parents=True, exist_ok=True)
        plot_spectra(spectra_before, spectra_after, output / "spectra.png", f"{args.method} on {args.preset}")
        (output / "results.json").write_text(json.dumps(results, indent=2))
    return results
