"""Writing an export: fold, cast, and save weights, config, tokenizer and card, atomically.

Everything goes into a staging directory that is renamed into place only when complete."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..orthogonal.spectra import module_singular_values, spectrum_summary
from ..sharded import barrier
from .card import render_model_card
from .folding import fold, max_merge_count, show_progress, tuner_layer_names
from .source import ExportError, ExportSource, LoadedSource, active_config, is_sharded_source, load_source, parse_dtype

if TYPE_CHECKING:
    from huggingface_hub import ModelCard
    from transformers import PreTrainedModel

    from .source import Processor


def _fold_with_card(
    loaded: LoadedSource,
    export_dtype: torch.dtype | None,
    spectrum: bool,
    progress: bool | None,
    record_quantization: bool,
    run: dict,
    card_fields: dict,
) -> tuple[PreTrainedModel, ModelCard]:
    """The plain model, folded and cast, and its model card (see `export_merged` for the arguments)."""
    peft_config = active_config(loaded.model)
    target_names = tuner_layer_names(loaded.model)
    merge_count = max_merge_count(loaded.model)
    plain, quantization_config = fold(loaded.model, progress)
    spectrum_rows = (
        spectrum_summary(module_singular_values(plain, target_names, show_progress(progress))) if spectrum else []
    )
    export_dtype = export_dtype or loaded.dtype
    plain.to(export_dtype)  # type: ignore[arg-type]  # transformers' decorated .to drops torch's dtype overload
    if record_quantization and quantization_config is not None:
        plain.config.source_quantization_config = quantization_config
    card = render_model_card(
        plain,
        peft_config,
        export_dtype=export_dtype,
        run_info=run,
        eval_results=loaded.eval_results,
        spectrum_rows=spectrum_rows,
        folded_layers=len(target_names),
        merge_count=merge_count,
        from_scratch=loaded.from_scratch,
        **card_fields,
    )
    return plain, card


def export_merged(
    source: ExportSource,
    output_dir: str | os.PathLike,
    *,
    dtype: str | torch.dtype | None = None,
    overwrite: bool = False,
    tokenizer: Processor | None = None,
    run_info: dict | None = None,
    repo_id: str | None = None,
    license: str = "other",
    datasets: str | list[str] | None = None,
    max_shard_size: int | str = "5GB",
    spectrum: bool = True,
    inplace: bool = False,
    progress: bool | None = None,
    record_quantization: bool = False,
) -> Path:
    """Fold a POET / OFT / orthogonal model into plain weights and write a stock Hugging Face checkpoint.

    Args:
        source: a ``peft.PeftModel`` with a POET/OFT/orthogonal adapter; a ``transformers.Trainer`` holding one
            (e.g. ``PoetTrainer``); or a directory with ``adapter_config.json``: one written by ``save_pretrained``
            or a ``PoetTrainer`` checkpoint. A directory's base model is rebuilt from the ``config.json`` beside
            it when the adapter file holds the whole model (pretraining from scratch), else loaded from the
            adapter config's ``base_model_name_or_path``.
        output_dir: the folder to create. It must not exist or be empty, unless ``overwrite``.
        dtype: ``"bf16"``, ``"fp16"``, ``"fp32"`` or a ``torch.dtype``; default: the source's dtype. Folding is
            always done in float32, then the weights are cast.
        overwrite: replace an existing non-empty ``output_dir`` (only once the new export is complete).
        tokenizer: a tokenizer / processor to save beside the weights; default: the source's, when it has one.
        run_info: training facts for the model card (``learning_rate``, ``poet_learning_rate``,
            ``num_input_tokens_seen``, ``datasets``, ``eval`` …); merged over the checkpoint's ``poet_run.json``.
        repo_id: the Hub repo the export is meant for (used in the card's loading snippet).
        license: the card's license identifier (``"other"`` unless given).
        datasets: dataset ids for the card's metadata.
        max_shard_size: shard ``model.safetensors`` above this size, as ``save_pretrained`` does.
        spectrum: compute the singular values of every folded matrix for the card (an SVD per layer).
        inplace: fold an in-memory model in place instead of a copy (saves memory; the model is then plain).
        progress: show progress bars (``None``: only on a terminal).
        record_quantization: for a source on a quantised (bitsandbytes) base, record its quantisation config in
            ``config.json`` as ``source_quantization_config``; the checkpoint stays full precision (a
            ``quantization_config`` key would tell ``transformers`` the weights are already quantised). Load it
            quantised again with ``from_pretrained(path, quantization_config=BitsAndBytesConfig.from_dict(
            config.source_quantization_config))``.

    Returns:
        The path of the written export.
    """
    output = Path(output_dir)
    export_dtype = None if dtype is None else parse_dtype(dtype)
    source_dir = Path(source) if isinstance(source, (str, os.PathLike)) else None
    check_output_dir(output, overwrite, source_dir)  # before the (possibly long) load
    sharded = is_sharded_source(source)
    loaded = load_source(source, inplace=inplace)
    if loaded is None:  # a model FSDP2 shards, on a rank other than 0: rank 0 gathered it and writes once
        barrier()
        return output
    tokenizer = tokenizer if tokenizer is not None else loaded.tokenizer
    card_fields = {"model_id": repo_id or output.name, "license": license, "datasets": datasets}
    run = {**loaded.run_info, **(run_info or {})}
    plain, card = _fold_with_card(loaded, export_dtype, spectrum, progress, record_quantization, run, card_fields)

    def write(folder: Path) -> None:
        plain.save_pretrained(folder, max_shard_size=max_shard_size)
        if tokenizer is not None:
            save_processor(tokenizer, folder)
        card.save(folder / "README.md")

    write_atomically(output, write)
    if sharded:
        barrier()
    return output


# How a tokenizer was loaded, which transformers records with its settings: an export would otherwise carry the
# exporting machine's offline mode (HF_HUB_OFFLINE sets local_files_only) into every recipient's load.
LOADING_OPTIONS = ("local_files_only",)


def save_processor(processor: Processor, folder: Path) -> None:
    """``processor.save_pretrained(folder)``, without the options it was loaded with (`LOADING_OPTIONS`); the
    processor itself is left as it was."""
    init_kwargs = getattr(processor, "init_kwargs", None)
    if not isinstance(init_kwargs, dict) or not set(LOADING_OPTIONS) & set(init_kwargs):
        processor.save_pretrained(folder)
        return
    kept = {key: init_kwargs.pop(key) for key in LOADING_OPTIONS if key in init_kwargs}
    try:
        processor.save_pretrained(folder)
    finally:
        init_kwargs.update(kept)


def check_output_dir(output: Path, overwrite: bool, source_dir: Path | None) -> None:
    """Refuse a file, a non-empty directory (unless ``overwrite``), or a target that contains the source."""
    if source_dir is not None:
        src, out = source_dir.resolve(), output.resolve()
        if out == src or out in src.parents:
            raise ExportError(
                f"output directory {output} is (or contains) the source {source_dir}; export somewhere else"
            )
    if output.exists() and not output.is_dir():
        raise ExportError(f"output path {output} exists and is a file, not a directory")
    if output.is_dir() and any(output.iterdir()) and not overwrite:
        entries = sorted(p.name for p in output.iterdir())
        raise FileExistsError(
            f"output directory {output} exists and is not empty ({len(entries)} entries: "
            f"{', '.join(entries[:5])}{', …' if len(entries) > 5 else ''}); pass overwrite=True "
            "(--overwrite) to replace it"
        )


def write_atomically(output: Path, write: Callable[[Path], None]) -> None:
    """Run ``write`` into a temporary directory beside ``output``, then rename it into place.

    On any error, including KeyboardInterrupt, the temporary directory is removed and ``output`` is left as it
    was. An existing ``output`` is moved aside only once the new export is complete, and deleted after the swap.
    """
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.partial-", dir=output.parent))
    try:
        write(staging)
        os.chmod(staging, 0o777 & ~_umask())  # mkdtemp creates 0700
        _swap_into_place(staging, output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _swap_into_place(staging: Path, output: Path) -> None:
    if not output.exists():
        os.replace(staging, output)
        return
    retired = Path(tempfile.mkdtemp(prefix=f".{output.name}.old-", dir=output.parent))
    os.replace(output, retired / "previous")
    try:
        os.replace(staging, output)
    except BaseException:
        os.replace(retired / "previous", output)  # put the old export back
        shutil.rmtree(retired, ignore_errors=True)
        raise
    shutil.rmtree(retired, ignore_errors=True)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
