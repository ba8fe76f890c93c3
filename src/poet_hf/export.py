"""Export a POET / OFT / orthogonal model as a plain Hugging Face checkpoint, write its model card, push it.

:func:`export_merged` folds every PEFT tuner layer into plain weights through PEFT's own ``merge_and_unload``
(each layer's ``merge``), in float32, casts to the requested dtype, and writes ``model.safetensors`` (sharded
above ``max_shard_size``), ``config.json``, the tokenizer when there is one, and a ``README.md`` model card, into
a temporary directory beside the target that is renamed into place at the end: an interrupted export leaves
nothing half-written. :func:`push_merged_to_hub` uploads such a folder with ``huggingface_hub``.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

from .distributed import barrier, is_sharded, unsharded_replica
from .tuners.rotation_layer import RotationLayer

ADAPTER_CONFIG_NAME = "adapter_config.json"
RUN_INFO_NAME = "poet_run.json"  # written by PoetTrainer beside each checkpoint
TRAINER_STATE_NAME = "trainer_state.json"
CARD_TEMPLATE = "poet.md"
# PEFT types exported here. poet_hf's own tuners are also found at run time from PEFT's registry (their config
# classes live in poet_hf), so types added later (OFT, orthogonal) need no change here. "OFT" is PEFT's OFT.
KNOWN_PEFT_TYPES = frozenset({"POET", "OFT", "ORTHOGONAL"})
DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "half": torch.float16, "fp32": torch.float32, "float32": torch.float32, "float": torch.float32}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "preprocessor_config.json")
# Config fields that are PEFT bookkeeping, not method hyperparameters (left out of the model card's table).
_BOOKKEEPING_FIELDS = frozenset({
    "peft_type", "task_type", "peft_version", "base_model_name_or_path", "revision", "inference_mode",
    "auto_mapping", "init_weights", "layers_pattern", "layers_to_transform", "modules_to_save", "exclude_modules",
    "bias", "forward", "train_other_params",
})
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")

__all__ = ["export_merged", "push_merged_to_hub", "render_model_card", "ExportError", "HubPushError",
           "supported_peft_types"]


class ExportError(ValueError):
    """The source is not an exportable POET/OFT/orthogonal model, or the output directory is unusable."""


class HubPushError(RuntimeError):
    """Pushing an exported folder to the Hub failed (no token, no network, refused by the Hub)."""


@dataclass
class _Source:
    """A loaded POET/OFT model and what is known about how it was trained."""

    model: nn.Module  # a peft.PeftModel
    tokenizer: Any = None
    directory: Optional[Path] = None
    dtype: torch.dtype = torch.float32  # dtype of the source's base weights (the default export dtype)
    run_info: dict = field(default_factory=dict)
    eval_results: dict = field(default_factory=dict)
    from_scratch: bool = False


# --- public API ---------------------------------------------------------------------------------------------------
def export_merged(
    source: Any,
    output_dir: Union[str, os.PathLike],
    *,
    dtype: Union[str, torch.dtype, None] = None,
    overwrite: bool = False,
    tokenizer: Any = None,
    run_info: Optional[dict] = None,
    repo_id: Optional[str] = None,
    license: str = "other",
    datasets: Union[str, list[str], None] = None,
    max_shard_size: Union[int, str] = "5GB",
    spectrum: bool = True,
    inplace: bool = False,
    progress: Optional[bool] = None,
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

    Returns:
        The path of the written export.
    """
    output = Path(output_dir)
    export_dtype = None if dtype is None else parse_dtype(dtype)
    source_dir = Path(source) if isinstance(source, (str, os.PathLike)) else None
    _check_output_dir(output, overwrite, source_dir)  # before the (possibly long) load
    sharded = _sharded(source)
    loaded = _load_source(source, inplace=inplace)
    if loaded is None:  # a model FSDP2 shards, on a rank other than 0: rank 0 gathered it and writes once
        barrier()
        return output
    tokenizer = tokenizer if tokenizer is not None else loaded.tokenizer
    run = {**loaded.run_info, **(run_info or {})}
    peft_config = _active_config(loaded.model)
    target_names = _tuner_layer_names(loaded.model)
    merge_count = _merge_count(loaded.model)
    plain = _fold(loaded.model, progress)
    spectrum_rows = spectrum_summary(plain, target_names, progress) if spectrum else []
    export_dtype = export_dtype or loaded.dtype
    plain.to(export_dtype)
    card = render_model_card(
        plain, peft_config, export_dtype=export_dtype, run_info=run, eval_results=loaded.eval_results,
        spectrum_rows=spectrum_rows, folded_layers=len(target_names), merge_count=merge_count,
        model_id=repo_id or output.name, license=license, datasets=datasets, from_scratch=loaded.from_scratch,
    )

    def write(folder: Path) -> None:
        plain.save_pretrained(folder, max_shard_size=max_shard_size)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)
        card.save(folder / "README.md")

    _write_atomically(output, write)
    if sharded:
        barrier()
    return output


def push_merged_to_hub(
    output_dir: Union[str, os.PathLike],
    repo_id: str,
    *,
    private: bool = False,
    token: Optional[str] = None,
    commit_message: Optional[str] = None,
    revision: Optional[str] = None,
    endpoint: Optional[str] = None,
) -> str:
    """Upload an export written by :func:`export_merged` to the Hub model repo ``repo_id``; return the commit URL.

    Uses ``huggingface_hub`` (``create_repo(exist_ok=True)`` then ``upload_folder``). The token is ``token``, else
    ``HF_TOKEN``, else the one saved by ``hf auth login``; the endpoint is ``endpoint``, else ``HF_ENDPOINT``.
    The folder on disk is only read. Errors are raised as :class:`HubPushError` with a readable message.
    """
    from huggingface_hub import HfApi, get_token
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

    folder = Path(output_dir)
    _check_export_folder(folder)
    token = token or get_token()
    if not token:
        raise HubPushError(f"no Hugging Face token to push {folder} to '{repo_id}': pass --hub-token / token=..., "
                           "set HF_TOKEN, or run `hf auth login`")
    api = HfApi(endpoint=endpoint, token=token)
    where = f"'{repo_id}' at {api.endpoint}"
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        info = api.upload_folder(folder_path=str(folder), repo_id=repo_id, repo_type="model", revision=revision,
                                 commit_message=commit_message or "Upload POET export (poet_hf)")
    except RepositoryNotFoundError as error:
        raise HubPushError(f"the Hub has no model repo {where} that this token can write to (does the name belong "
                           f"to a dataset or Space, or to another account?): {_first_line(error)}") from error
    except HfHubHTTPError as error:
        raise HubPushError(f"the Hub refused pushing {folder} to {where}: {_first_line(error)}") from error
    except (OSError, ValueError) as error:
        raise HubPushError(f"could not push {folder} to {where}: {type(error).__name__}: {_first_line(error)}") \
            from error
    except Exception as error:  # httpx transport errors (connection refused, DNS, timeouts)
        raise HubPushError(f"could not reach the Hub to push {folder} to {where}: {type(error).__name__}: "
                           f"{_first_line(error)}") from error
    return str(info.commit_url)


def supported_peft_types() -> frozenset[str]:
    """PEFT types :func:`export_merged` accepts: poet_hf's registered tuners, plus POET, OFT and ORTHOGONAL."""
    from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING

    ours = {str(getattr(key, "value", key)) for key, cls in PEFT_TYPE_TO_CONFIG_MAPPING.items()
            if cls.__module__.startswith("poet_hf.")}
    return KNOWN_PEFT_TYPES | ours


def parse_dtype(dtype: Union[str, torch.dtype]) -> torch.dtype:
    """``"bf16"``/``"fp16"``/``"fp32"`` (or the torch names, or a ``torch.dtype``) as a floating ``torch.dtype``."""
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype
    if isinstance(dtype, str) and dtype.lower().removeprefix("torch.") in DTYPES:
        return DTYPES[dtype.lower().removeprefix("torch.")]
    raise ExportError(f"dtype must be one of bf16, fp16, fp32 (or a floating torch.dtype), got {dtype!r}")


# --- loading the source -------------------------------------------------------------------------------------------
def _load_source(source: Any, inplace: bool) -> Optional[_Source]:
    """Turn any accepted source into a float32 PeftModel (a copy unless ``inplace``) plus its training facts;
    ``None`` on the ranks other than 0 for a model FSDP2 shards (rank 0 folds an unsharded copy)."""
    if isinstance(source, (str, os.PathLike)):
        return _load_directory(Path(source))
    if _is_trainer(source):
        loaded = _load_model(source.model, inplace)
        if loaded is None:
            return None
        loaded.tokenizer = getattr(source, "processing_class", None)
        loaded.run_info = _trainer_run_info(source)
        loaded.eval_results = _latest_eval(source.state.log_history)
        return loaded
    return _load_model(source, inplace)


def _is_trainer(obj: Any) -> bool:
    try:
        from transformers import Trainer
    except ImportError:  # pragma: no cover - transformers is a dependency
        return False
    return isinstance(obj, Trainer)


def _sharded(source: Any) -> bool:
    model = source.model if _is_trainer(source) else source
    return isinstance(model, nn.Module) and is_sharded(model)


def _load_model(model: Any, inplace: bool) -> Optional[_Source]:
    from peft import PeftModel

    if isinstance(model, nn.Module) and is_sharded(model):  # FSDP2: fold an unsharded copy gathered on rank 0
        model = unsharded_replica(model)
        if model is None:
            return None
        inplace = True
    if not isinstance(model, PeftModel):
        raise ExportError(f"export_merged needs a POET/OFT model (a peft.PeftModel with a POET, OFT or orthogonal "
                          f"adapter), a trainer holding one, or a directory; found a {type(model).__name__} "
                          f"{_describe_plain_model(model)}")
    _check_peft_type(_active_config(model).peft_type, f"the {type(model).__name__}")
    dtype = _base_dtype(model)
    model = model if inplace else copy.deepcopy(model)
    return _Source(model=model.to(torch.float32), dtype=dtype,
                   from_scratch=_holds_full_model(_active_config(model)))


def _describe_plain_model(model: Any) -> str:
    if isinstance(model, nn.Module):
        return "with no PEFT adapter (nothing to fold: save it with save_pretrained instead)"
    return "(not a model)"


def _load_directory(path: Path) -> _Source:
    """Load a ``save_pretrained`` adapter directory or a PoetTrainer checkpoint as a float32 PeftModel."""
    from peft import PeftModel

    if not path.exists():
        raise FileNotFoundError(f"export source {path} does not exist")
    if not path.is_dir():
        raise ExportError(f"export source {path} is a file; pass a directory holding {ADAPTER_CONFIG_NAME}, "
                          "or a PeftModel")
    raw = _read_adapter_config(path)
    _check_peft_type(raw.get("peft_type"), f"{path / ADAPTER_CONFIG_NAME}")
    from peft import PeftConfig

    peft_config = PeftConfig.from_pretrained(str(path))
    base, from_config = _build_base(path, raw, peft_config)
    model = PeftModel.from_pretrained(base, str(path), is_trainable=False).to(torch.float32)
    if from_config:
        _check_full_state(model, path)
    run_info = _read_json(path / RUN_INFO_NAME)
    state = _read_json(path / TRAINER_STATE_NAME)
    for key in ("global_step", "num_input_tokens_seen"):
        if state.get(key) and key not in run_info:
            run_info[key] = state[key]
    return _Source(model=model, tokenizer=_find_tokenizer(path, peft_config.base_model_name_or_path),
                   directory=path, dtype=_config_dtype(base.config), run_info=run_info,
                   eval_results=_latest_eval(state.get("log_history", [])),
                   from_scratch=_holds_full_model(peft_config))


def _read_adapter_config(path: Path) -> dict:
    config_file = path / ADAPTER_CONFIG_NAME
    if config_file.is_file():
        return json.loads(config_file.read_text())
    raise ExportError(f"{path} is not a POET/OFT model or checkpoint: it has no {ADAPTER_CONFIG_NAME}; "
                      f"{_describe_directory(path)}")


def _describe_directory(path: Path) -> str:
    """What a directory without ``adapter_config.json`` holds, in words, with a hint."""
    names = sorted(p.name for p in path.iterdir())
    checkpoints = sorted((p.name for p in path.iterdir() if p.is_dir() and p.name.startswith("checkpoint-")),
                         key=lambda n: int(n.rsplit("-", 1)[-1]) if n.rsplit("-", 1)[-1].isdigit() else -1)
    if checkpoints:
        return (f"it holds training checkpoints ({', '.join(checkpoints[-3:])}); pass one of them, e.g. "
                f"{path / checkpoints[-1]}")
    if "config.json" in names and any(n.endswith((".safetensors", ".bin")) for n in names):
        return "it holds a plain transformers model (config.json and weights), which has nothing to fold"
    if not names:
        return "it is empty"
    shown = ", ".join(names[:8]) + (", …" if len(names) > 8 else "")
    return f"found: {shown}"


def _check_peft_type(peft_type: Any, where: str) -> None:
    supported = supported_peft_types()
    if str(getattr(peft_type, "value", peft_type)) not in supported:
        raise ExportError(f"{where} is not a POET/OFT model: its PEFT type is {peft_type!r}; export_merged folds "
                          f"adapters of type {', '.join(sorted(supported))}")


def _holds_full_model(peft_config: Any) -> bool:
    """Whether the adapter file stores every weight of the model (pretraining from scratch)."""
    trains_other = getattr(peft_config, "trains_other_params", None)
    if isinstance(trains_other, bool):
        return trains_other
    return getattr(peft_config, "base_init", None) is not None or bool(getattr(peft_config, "train_other_params",
                                                                               False))


def _build_base(path: Path, raw: dict, peft_config: Any) -> tuple[nn.Module, bool]:
    """The float32 base model: from ``config.json`` beside the adapter, or from ``base_model_name_or_path``.

    Returns ``(model, built_from_config)``; a model built from its config has random weights until the adapter
    file (which must then hold the whole model) is loaded over it.
    """
    from transformers import AutoConfig

    name = peft_config.base_model_name_or_path
    has_config = (path / "config.json").is_file()
    if has_config and (_holds_full_model(peft_config) or not name):
        config = AutoConfig.from_pretrained(str(path))
        return _instantiate(_model_class(config, raw), config), True
    if not name:
        raise ExportError(f"cannot rebuild the base model of {path}: {ADAPTER_CONFIG_NAME} has no "
                          "base_model_name_or_path and there is no config.json beside it")
    config = AutoConfig.from_pretrained(name, revision=peft_config.revision)
    model = _model_class(config, raw).from_pretrained(name, revision=peft_config.revision, dtype=torch.float32)
    return model, False


def _model_class(config: Any, raw: dict) -> Any:
    """The concrete class named by ``config.architectures`` or PEFT's ``auto_mapping``, else an Auto class."""
    import transformers

    names = list(getattr(config, "architectures", None) or [])
    names.append((raw.get("auto_mapping") or {}).get("base_model_class"))
    for name in names:
        if name and hasattr(transformers, name):
            return getattr(transformers, name)
    return transformers.AutoModelForCausalLM


def _instantiate(cls: Any, config: Any) -> nn.Module:
    if hasattr(cls, "_from_config"):
        return cls._from_config(config).to(torch.float32)
    return cls.from_config(config).to(torch.float32)


def _check_full_state(model: nn.Module, path: Path) -> None:
    """Refuse a model rebuilt from its config whose adapter file does not hold every base weight."""
    saved = _saved_adapter_keys(path)
    if saved is None:
        return
    adapter = model.active_adapter if isinstance(model.active_adapter, str) else model.active_adapters[0]
    missing = [key for key in model.state_dict()
               if f".{adapter}." not in key and not key.endswith(f".{adapter}") and "original_module" not in key
               and key not in saved]
    if missing:
        raise ExportError(f"{path} holds only part of the model ({len(missing)} base weights missing, e.g. "
                          f"{missing[0]}) and its {ADAPTER_CONFIG_NAME} names no base_model_name_or_path to load "
                          "them from")


def _saved_adapter_keys(path: Path) -> Optional[set[str]]:
    weights = path / "adapter_model.safetensors"
    if not weights.is_file():
        return None
    from safetensors import safe_open

    with safe_open(str(weights), framework="pt") as handle:
        return set(handle.keys())


def _find_tokenizer(path: Path, base_name: Optional[str]) -> Any:
    """The tokenizer saved beside the adapter, else the base model's local one; ``None`` when there is none."""
    for candidate in (path, Path(base_name) if base_name else None):
        if candidate is not None and candidate.is_dir() and any((candidate / f).is_file() for f in TOKENIZER_FILES):
            return _load_processor(candidate)
    return None


def _load_processor(path: Path) -> Any:
    from transformers import AutoProcessor, AutoTokenizer

    loader = AutoTokenizer if (path / "tokenizer_config.json").is_file() or (path / "tokenizer.json").is_file() \
        else AutoProcessor
    try:
        return loader.from_pretrained(str(path))
    except (OSError, ValueError, KeyError) as error:
        raise ExportError(f"the tokenizer files in {path} could not be loaded: {_first_line(error)}") from error


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _trainer_run_info(trainer: Any) -> dict:
    run = dict(getattr(trainer, "run_info", {}) or {})
    args, state = trainer.args, trainer.state
    run.setdefault("learning_rate", args.learning_rate)
    if getattr(args, "poet_learning_rate", None) is not None:
        run.setdefault("poet_learning_rate", args.poet_learning_rate)
    if getattr(args, "merge_every", None):
        run.setdefault("merge_every", args.merge_every)
    run.setdefault("global_step", state.global_step)
    if state.num_input_tokens_seen:
        run.setdefault("num_input_tokens_seen", state.num_input_tokens_seen)
    return run


def _latest_eval(log_history: list[dict]) -> dict:
    """The most recent evaluation metrics logged by a Trainer (``eval_*`` keys), if any."""
    for entry in reversed(log_history or []):
        metrics = {k: v for k, v in entry.items() if k.startswith("eval_") and isinstance(v, (int, float))}
        if metrics:
            return {**metrics, "step": entry.get("step")}
    return {}


def _active_config(model: Any) -> Any:
    adapter = model.active_adapter if isinstance(model.active_adapter, str) else model.active_adapters[0]
    return model.peft_config[adapter]


def _base_dtype(model: Any) -> torch.dtype:
    dtypes = [p.dtype for n, p in model.get_base_model().named_parameters()
              if p.is_floating_point() and model.base_model.prefix not in n]
    return dtypes[0] if dtypes else torch.float32


def _config_dtype(config: Any) -> torch.dtype:
    value = getattr(config, "dtype", None)
    if isinstance(value, torch.dtype):
        return value
    return DTYPES.get(str(value).removeprefix("torch."), torch.float32) if value else torch.float32


# --- folding --------------------------------------------------------------------------------------------------------
def _tuner_layer_names(model: Any) -> list[str]:
    """Names (relative to the plain model) of every PEFT tuner layer that the fold will replace."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [name for name, module in model.get_base_model().named_modules() if isinstance(module, BaseTunerLayer)]


def _merge_count(model: Any) -> Optional[int]:
    counts = [int(count) for m in model.modules() if isinstance(m, RotationLayer) for count in m.merge_counts.values()]
    return max(counts) if counts else None


def _fold(model: Any, progress: Optional[bool]) -> nn.Module:
    """``merge_and_unload`` in float32: every tuner layer's ``merge`` folds its factors into the base weight."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    with torch.no_grad():
        try:
            plain = model.merge_and_unload(progressbar=_show_progress(progress))
        except ValueError as error:  # e.g. an input-dependent orthogonal layer, which has no single weight
            raise ExportError(f"this model cannot be folded into plain weights: {error}") from error
    left = [name for name, m in plain.named_modules() if isinstance(m, BaseTunerLayer)]
    if left:
        raise ExportError(f"folding left {len(left)} adapter layers in place (e.g. {left[0]}); export_merged cannot "
                          "produce a plain model from this source")
    return plain.eval()


@torch.no_grad()
def spectrum_summary(model: nn.Module, layer_names: list[str], progress: Optional[bool] = None) -> list[dict]:
    """Singular-value summary of the named layers' weight matrices, one row per module-name group."""
    from tqdm.auto import tqdm

    modules = dict(model.named_modules())
    groups: dict[str, list[tuple[float, float]]] = {}
    for name in tqdm(layer_names, desc="spectrum", disable=not _show_progress(progress)):
        weight = getattr(modules.get(name), "weight", None)
        if weight is None:
            continue
        s = torch.linalg.svdvals(weight.detach().float().reshape(weight.shape[0], -1))
        groups.setdefault(name.rsplit(".", 1)[-1], []).append((float(s.max()), float(s.min())))
    return [{"group": group, "count": len(values),
             "sigma_max": _fmt(sum(v[0] for v in values) / len(values)),
             "sigma_min": _fmt(sum(v[1] for v in values) / len(values)),
             "condition": _fmt(max(v[0] / max(v[1], 1e-30) for v in values))}
            for group, values in groups.items()]


def _show_progress(progress: Optional[bool]) -> bool:
    import sys

    return bool(progress) if progress is not None else sys.stderr.isatty()


# --- model card ---------------------------------------------------------------------------------------------------
_METHODS = {  # peft_type family -> (title, summary, what the export folded)
    "POET": ("POET", "Reparameterized Training via Orthogonal Equivalence Transformation: each weight is trained "
             "as R·W0·P with W0 fixed and R, P learned orthogonal matrices, merged and reinitialized periodically",
             "`W = R·W0·P`"),
    "OFT": ("OFT", "Orthogonal Finetuning: each pretrained weight W0 is trained as R·W0, with R a learned "
            "block-diagonal orthogonal matrix", "`W = R·W0`"),
    "ORTHOGONAL": ("orthogonal layers", "target layers are replaced by orthogonal (Cayley, Householder or ECO) "
                   "parameterizations", "the orthogonal weights"),
}


def card_template_path() -> Path:
    """The packaged model-card template (``poet_hf/model_cards/poet.md``)."""
    return Path(str(resources.files("poet_hf") / "model_cards" / CARD_TEMPLATE))


def render_model_card(
    model: nn.Module,
    peft_config: Any,
    *,
    export_dtype: torch.dtype = torch.float32,
    run_info: Optional[dict] = None,
    eval_results: Optional[dict] = None,
    spectrum_rows: Optional[list[dict]] = None,
    folded_layers: int = 0,
    merge_count: Optional[int] = None,
    model_id: str = "path/to/export",
    license: str = "other",
    datasets: Union[str, list[str], None] = None,
    from_scratch: bool = False,
) -> Any:
    """A ``huggingface_hub.ModelCard`` for an exported model, from the ``model_cards/poet.md`` template."""
    from huggingface_hub import ModelCard, ModelCardData

    run = dict(run_info or {})
    peft_type = str(getattr(peft_config.peft_type, "value", peft_config.peft_type))
    title, summary, formula = _METHODS.get(_method_family(peft_type),
                                           (peft_type, f"the {peft_type} PEFT method", "the adapters"))
    base_model = peft_config.base_model_name_or_path
    dataset_refs = _as_list(datasets) or _as_list(run.pop("datasets", None) or run.pop("dataset", None))
    eval_rows = [(k, _fmt(v)) for k, v in {**(eval_results or {}), **(run.pop("eval", None) or {})}.items()
                 if v is not None]
    data = ModelCardData(
        library_name="transformers", license=license, pipeline_tag=_pipeline_tag(model),
        tags=_tags(peft_type), base_model=base_model if _is_hub_id(base_model) else None,
        datasets=[d for d in dataset_refs if _is_hub_id(d)] or None,
    )
    return ModelCard.from_template(
        data, template_path=str(card_template_path()),
        model_name=model_id.rstrip("/").rsplit("/", 1)[-1], model_id=model_id, architecture=type(model).__name__,
        auto_class=_auto_class_name(model), method_title=title, method_summary=summary, peft_type=peft_type,
        fold_formula=formula,
        base_model_ref=base_model, from_scratch=from_scratch, dataset_refs=dataset_refs,
        export_dtype=str(export_dtype).removeprefix("torch."), folded_layers=folded_layers,
        hyperparameters=_hyperparameter_rows(peft_config, run),
        training_rows=_training_rows(run, merge_count, shown=set(peft_config.to_dict())), eval_rows=eval_rows,
        spectrum_rows=spectrum_rows or [],
    )


def _method_family(peft_type: str) -> str:
    return "OFT" if "OFT" in peft_type else peft_type


def _tags(peft_type: str) -> list[str]:
    tags = ["poet", "orthogonal", "peft", "poet_hf"]
    method = _method_family(peft_type).lower()
    return tags if method in tags else [*tags, method]


def _hyperparameter_rows(peft_config: Any, run: dict) -> list[tuple[str, str]]:
    """The method's config fields (block size or budget, whichever the SPO kind uses), run overrides applied."""
    fields = {k: v for k, v in peft_config.to_dict().items() if k not in _BOOKKEEPING_FIELDS}
    spo = fields.get("spo")
    if spo == "full":
        fields.pop("block_size", None)
    elif spo is not None:
        fields.pop("budget", None)
    if "merge_every" in run:  # PoetTrainingArguments.merge_every overrides the config's
        fields["merge_every"] = run.pop("merge_every")
    if fields.get("neumann_terms") == 0:
        fields["neumann_terms"] = "0 (exact Cayley transform)"
    if isinstance(fields.get("target_modules"), (list, set, tuple)):
        fields["target_modules"] = ", ".join(sorted(fields["target_modules"]))
    return [(name, _fmt(value)) for name, value in fields.items()]


def _training_rows(run: dict, merge_count: Optional[int], shown: set[str]) -> list[tuple[str, str]]:
    """Learning rates, tokens seen, steps and merges first, then the run's other scalars not already ``shown``."""
    labels = {"learning_rate": "learning rate", "poet_learning_rate": "POET learning rate",
              "num_input_tokens_seen": "tokens seen", "tokens_seen": "tokens seen", "global_step": "optimizer steps",
              "steps": "optimizer steps"}
    rows: dict[str, str] = {}
    for key, label in labels.items():
        if run.get(key) and label not in rows:  # 0 tokens seen means "not tracked"
            rows[label] = _fmt(run[key])
    if merge_count is not None:
        rows["merges (merge-then-reinitialize)"] = str(merge_count)
    rows.update({k: _fmt(v) for k, v in run.items()
                 if k not in labels and k not in shown and isinstance(v, (str, int, float, bool))})
    return list(rows.items())


def _pipeline_tag(model: nn.Module) -> Optional[str]:
    name = type(model).__name__
    for suffix, tag in (("ForCausalLM", "text-generation"), ("ForImageClassification", "image-classification"),
                        ("ForSequenceClassification", "text-classification"), ("ForMaskedLM", "fill-mask")):
        if name.endswith(suffix):
            return tag
    return None


def _auto_class_name(model: nn.Module) -> str:
    name = type(model).__name__
    for suffix in ("ForCausalLM", "ForImageClassification", "ForSequenceClassification", "ForMaskedLM"):
        if name.endswith(suffix):
            return f"AutoModel{suffix}"
    return "AutoModel"


def _is_hub_id(value: Any) -> bool:
    return isinstance(value, str) and bool(_HUB_ID.match(value)) and not Path(value).exists()


def _as_list(value: Any) -> list[str]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else [str(v) for v in value]


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10_000:
        return f"{value:,}"
    return str(value).replace("|", "\\|")


# --- writing --------------------------------------------------------------------------------------------------------
def _check_output_dir(output: Path, overwrite: bool, source_dir: Optional[Path]) -> None:
    """Refuse a file, a non-empty directory (unless ``overwrite``), or a target that contains the source."""
    if source_dir is not None:
        src, out = source_dir.resolve(), output.resolve()
        if out == src or out in src.parents:
            raise ExportError(f"output directory {output} is (or contains) the source {source_dir}; export "
                              "somewhere else")
    if output.exists() and not output.is_dir():
        raise ExportError(f"output path {output} exists and is a file, not a directory")
    if output.is_dir() and any(output.iterdir()) and not overwrite:
        entries = sorted(p.name for p in output.iterdir())
        raise FileExistsError(f"output directory {output} exists and is not empty ({len(entries)} entries: "
                              f"{', '.join(entries[:5])}{', …' if len(entries) > 5 else ''}); pass overwrite=True "
                              "(--overwrite) to replace it")


def _write_atomically(output: Path, write: Callable[[Path], None]) -> None:
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


def _check_export_folder(folder: Path) -> None:
    if not folder.is_dir():
        raise HubPushError(f"{folder} is not a directory; export a model with export_merged first")
    names = {p.name for p in folder.iterdir()}
    if "config.json" not in names or not any(n.endswith(".safetensors") for n in names):
        raise HubPushError(f"{folder} does not look like an export (needs config.json and *.safetensors, found "
                           f"{', '.join(sorted(names)) or 'nothing'})")


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
