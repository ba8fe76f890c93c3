"""Export a POET / OFT model as a plain Hugging Face checkpoint, and optionally push it to the Hub.

    poet-hf export SOURCE OUTPUT_DIR [--push_to_hub --hub_model_id REPO_ID] [--hub_private_repo]
                       [--hub_token TOKEN] [--dtype bf16|fp16|fp32] [--overwrite]

(``python scripts/export.py`` in a checkout is the same command.)

SOURCE is a directory written by ``save_pretrained`` or a ``PoetTrainer`` checkpoint (``checkpoint-N/``).
The Hub token may also come from ``HF_TOKEN`` (or ``hf auth login``); the endpoint from ``HF_ENDPOINT``.
Flags are spelled and mean what they do in ``transformers.TrainingArguments`` (``--push_to_hub`` with
``--hub_model_id``, ``--hub_private_repo``), as in the training scripts; the hyphenated forms work too, as there.
``--dtype`` takes either name of a dtype (``bf16`` or ``bfloat16``, ``fp16`` or ``float16``, ``fp32`` or ``float32``).
Exit codes: 0 success; 1 export refused; 2 usage error or no Hub token (checked before exporting);
3 export written, but the push failed (the export stays complete on disk).
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
from pathlib import Path

from ..dtypes import NAMES, dtype_name
from .argument_errors import OneLineErrorParser, command_name, option_type


def build_parser() -> argparse.ArgumentParser:
    """The export command's parser."""
    parser = OneLineErrorParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help="save_pretrained adapter directory or PoetTrainer checkpoint directory")
    parser.add_argument("output_dir", help="folder to write the plain model into (must not exist or be empty)")
    parser.add_argument(
        "--dtype",
        type=option_type(dtype_name),
        choices=NAMES,
        default=None,
        help="dtype of the exported weights, bf16/bfloat16, fp16/float16 or fp32/float32 (folded in float32 first); "
        "default: the source's",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty OUTPUT_DIR")
    add_hub_arguments(parser)
    from ..export import export_merged

    license_default = inspect.signature(export_merged).parameters["license"].default
    parser.add_argument(
        "--license", default=license_default, help=f"license id for the model card (default: {license_default})"
    )
    parser.add_argument("--dataset", action="append", default=None, help="dataset id for the card (repeatable)")
    parser.add_argument(
        "--no_spectrum", "--no-spectrum", action="store_true", help="skip the per-layer SVDs of the card's spectrum"
    )
    return parser


def add_hub_arguments(parser: argparse.ArgumentParser) -> None:
    """The Hub flags, spelled as ``TrainingArguments`` spells them."""
    parser.add_argument(
        "--push_to_hub",
        "--push-to-hub",
        action="store_true",
        help="push the export to the model repo --hub_model_id names",
    )
    parser.add_argument("--hub_model_id", "--hub-model-id", default=None, help="the model repo to push to")
    parser.add_argument(
        "--hub_private_repo",
        "--hub-private-repo",
        action="store_true",
        help="create the Hub repo as private",
    )
    parser.add_argument(
        "--hub_token", "--hub-token", default=None, help="Hub token (default: HF_TOKEN or the saved login)"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The arguments; ``--push_to_hub`` needs ``--hub_model_id``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    check_hub_arguments(parser, args)
    return args


def check_hub_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """`add_hub_arguments`' one rule: ``--push_to_hub`` needs ``--hub_model_id`` (else the parser's error)."""
    if args.push_to_hub and not args.hub_model_id:
        parser.error("--push_to_hub needs --hub_model_id REPO_ID, the model repo to push to")


def hub_token(args: argparse.Namespace) -> str | None:
    """--hub_token, else HF_TOKEN, else the token saved by `hf auth login`."""
    from huggingface_hub import get_token

    return args.hub_token or os.environ.get("HF_TOKEN") or get_token()


def main(argv: list[str] | None = None) -> int:
    """Export (and push) as the command line asks; the exit status."""
    args = parse_args(argv)
    token = hub_token(args) if args.push_to_hub else None
    if args.push_to_hub and not token:  # fail before the (possibly long) export, touching nothing on disk
        print(
            f"{command_name()}: error: no Hugging Face token to push to '{args.hub_model_id}': pass --hub_token, set "
            "HF_TOKEN, or run `hf auth login`. Nothing was exported or changed.",
            file=sys.stderr,
        )
        return 2
    from ..export import ExportError, export_merged

    try:
        path = export_merged(
            args.source,
            args.output_dir,
            dtype=args.dtype,
            overwrite=args.overwrite,
            repo_id=args.hub_model_id,
            license=args.license,
            datasets=args.dataset,
            spectrum=not args.no_spectrum,
        )
    except (ExportError, FileExistsError, FileNotFoundError) as error:
        print(f"{command_name()}: error: {error}", file=sys.stderr)
        return 1
    print(f"exported {args.source} -> {path}")
    return push(args, path, token) if args.push_to_hub else 0


def push(args: argparse.Namespace, path: Path, token: str | None) -> int:
    """Upload the finished export; on failure say that the export itself is complete."""
    from ..export import HubPushError, push_merged_to_hub

    try:
        url = push_merged_to_hub(path, args.hub_model_id, private=args.hub_private_repo, token=token)
    except HubPushError as error:
        print(
            f"{command_name()}: error: push to the Hub failed: {error}\n"
            f"The export in {path} is complete and untouched; retry the upload with "
            f"`hf upload {args.hub_model_id} {path} .` or rerun this command with --overwrite.",
            file=sys.stderr,
        )
        return 3
    print(f"pushed {path} -> {url}")
    return 0
