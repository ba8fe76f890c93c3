"""Loading what [`export_merged`][poet_hf.export.export_merged] folds, as a float32 ``PeftModel``.

The source is a ``PeftModel``, a trainer holding one, or a directory (``save_pretrained`` output or a
``PoetTrainer`` checkpoint); its training facts come with it."""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias, TypeGuard, Union

import torch
from torch import nn

from .. import dtypes
from ..sharded import is_sharded, unsharded_replica
from ..tuners.config_utils import holds_full_model

if TYPE_CHECKING:
    from peft import PeftConfig, PeftModel
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase, ProcessorMixin, Trainer

    Processor: TypeAlias = PreTrainedTokenizerBase | ProcessorMixin

ADAPTER_CONFIG_NAME = "adapter_config.json"
RUN_INFO_NAME = "poet_run.json"  # written by PoetTrainer beside each checkpoint
TRAINER_STATE_NAME = "trainer_state.json"
# PEFT types exported here. poet_hf's own tuners are also found at run time from PEFT's registry (their config
# classes live in poet_hf), so types added later (OFT, orthogonal) need no change here. "OFT" is PEFT's OFT.
# What export_merged folds: a model, a trainer holding one, or a directory.
ExportSource = Union[str, "os.PathLike[str]", "Trainer", nn.Module]
KNOWN_PEFT_TYPES = frozenset({"POET", "OFT", "ORTHOGONAL"})
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "preprocessor_config.json",
)


class ExportError(ValueError):
    """The source is not an exportable POET/OFT/orthogonal model, or the output directory is unusable."""


@dataclass
class LoadedSource:
    """A loaded POET/OFT model and what is known about how it was trained."""

    model: PeftModel
    tokenizer: Processor | None = None
    directory: Path | None = None
    dtype: torch.dtype = torch.float32  # dtype of the source's base weights (the default export dtype)
    run_info: dict = field(default_factory=dict)
    eval_results: dict = field(default_factory=dict)
    from_scratch: bool = False


def supported_peft_types() -> frozenset[str]:
    """The PEFT types [`export_merged`][poet_hf.export.export_merged] accepts.

    poet_hf's registered tuners, plus POET, OFT and ORTHOGONAL.

    Returns:
        The PEFT type names.
    """
    from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING

    ours = {
        str(getattr(key, "value", key))
        for key, cls in PEFT_TYPE_TO_CONFIG_MAPPING.items()
        if cls.__module__.startswith("poet_hf.")
    }
    return KNOWN_PEFT_TYPES | ours


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """The export's dtype (`poet_hf.dtypes.parse_dtype`), refused as an `ExportError`."""
    try:
        return dtypes.parse_dtype(dtype)
    except ValueError as error:
        raise ExportError(str(error)) from None


def load_source(source: ExportSource, inplace: bool) -> LoadedSource | None:
    """Turn any accepted source into a float32 PeftModel (a copy unless ``inplace``) and its training facts.

    ``None`` on the ranks other than 0 for a model FSDP2 shards: rank 0 folds an unsharded copy."""
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


def _is_trainer(obj: object) -> TypeGuard[Trainer]:
    try:
        from transformers import Trainer
    except ImportError:  # pragma: no cover - transformers is a dependency
        return False
    return isinstance(obj, Trainer)


def is_sharded_source(source: ExportSource) -> bool:
    """Whether ``source`` (a model or a trainer holding one) is sharded by FSDP2."""
    model = source.model if _is_trainer(source) else source
    return isinstance(model, nn.Module) and is_sharded(model)


def _load_model(model: object, inplace: bool) -> LoadedSource | None:
    from peft import PeftModel

    if isinstance(model, nn.Module) and is_sharded(model):  # FSDP2: fold an unsharded copy gathered on rank 0
        model = unsharded_replica(model)
        if model is None:
            return None
        inplace = True
    if not isinstance(model, PeftModel):
        raise ExportError(
            f"export_merged needs a POET/OFT model (a peft.PeftModel with a POET, OFT or orthogonal "
            f"adapter), a trainer holding one, or a directory; found a {type(model).__name__} "
            f"{_describe_plain_model(model)}"
        )
    _check_peft_type(active_config(model).peft_type, f"the {type(model).__name__}")
    dtype = _base_dtype(model)
    model = model if inplace else copy.deepcopy(model)
    return LoadedSource(model=model.to(torch.float32), dtype=dtype, from_scratch=holds_full_model(active_config(model)))


def _describe_plain_model(model: object) -> str:
    if isinstance(model, nn.Module):
        return "with no PEFT adapter (nothing to fold: save it with save_pretrained instead)"
    return "(not a model)"


def _load_directory(path: Path) -> LoadedSource:
    """Load a ``save_pretrained`` adapter directory or a PoetTrainer checkpoint as a float32 PeftModel."""
    from peft import PeftModel

    if not path.exists():
        raise FileNotFoundError(f"export source {path} does not exist")
    if not path.is_dir():
        raise ExportError(
            f"export source {path} is a file; pass a directory holding {ADAPTER_CONFIG_NAME}, or a PeftModel"
        )
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
    return LoadedSource(
        model=model,
        tokenizer=_find_tokenizer(path, peft_config.base_model_name_or_path),
        directory=path,
        dtype=_config_dtype(base.config),
        run_info=run_info,
        eval_results=_latest_eval(state.get("log_history", [])),
        from_scratch=holds_full_model(peft_config),
    )


def _read_adapter_config(path: Path) -> dict:
    config_file = path / ADAPTER_CONFIG_NAME
    if config_file.is_file():
        return json.loads(config_file.read_text())
    raise ExportError(
        f"{path} is not a POET/OFT model or checkpoint: it has no {ADAPTER_CONFIG_NAME}; {_describe_directory(path)}"
    )


def _describe_directory(path: Path) -> str:
    """What a directory without ``adapter_config.json`` holds, in words, with a hint."""
    names = sorted(p.name for p in path.iterdir())
    checkpoints = sorted(
        (p.name for p in path.iterdir() if p.is_dir() and p.name.startswith("checkpoint-")),
        key=lambda n: int(n.rsplit("-", 1)[-1]) if n.rsplit("-", 1)[-1].isdigit() else -1,
    )
    if checkpoints:
        return (
            f"it holds training checkpoints ({', '.join(checkpoints[-3:])}); pass one of them, e.g. "
            f"{path / checkpoints[-1]}"
        )
    if "config.json" in names and any(n.endswith((".safetensors", ".bin")) for n in names):
        return "it holds a plain transformers model (config.json and weights), which has nothing to fold"
    if not names:
        return "it is empty"
    shown = ", ".join(names[:8]) + (", …" if len(names) > 8 else "")
    return f"found: {shown}"


def _check_peft_type(peft_type: object, where: str) -> None:
    supported = supported_peft_types()
    if str(getattr(peft_type, "value", peft_type)) not in supported:
        raise ExportError(
            f"{where} is not a POET/OFT model: its PEFT type is {peft_type!r}; export_merged folds "
            f"adapters of type {', '.join(sorted(supported))}"
        )


def _build_base(path: Path, raw: dict, peft_config: PeftConfig) -> tuple[PreTrainedModel, bool]:
    """The float32 base model: from ``config.json`` beside the adapter, or from ``base_model_name_or_path``.

    Returns ``(model, built_from_config)``; a model built from its config has random weights until the adapter
    file (which must then hold the whole model) is loaded over it.
    """
    from transformers import AutoConfig

    name = peft_config.base_model_name_or_path
    has_config = (path / "config.json").is_file()
    if has_config and (holds_full_model(peft_config) or not name):
        config = AutoConfig.from_pretrained(str(path))
        return _instantiate(_model_class(config, raw), config), True
    if not name:
        raise ExportError(
            f"cannot rebuild the base model of {path}: {ADAPTER_CONFIG_NAME} has no "
            "base_model_name_or_path and there is no config.json beside it"
        )
    config = AutoConfig.from_pretrained(name, revision=peft_config.revision)
    model = _model_class(config, raw).from_pretrained(name, revision=peft_config.revision, dtype=torch.float32)
    return model, False


def _model_class(config: PretrainedConfig, raw: dict) -> Any:
    """The concrete class named by ``config.architectures`` or PEFT's ``auto_mapping``, else an Auto class."""
    import transformers

    names = list(getattr(config, "architectures", None) or [])
    names.append((raw.get("auto_mapping") or {}).get("base_model_class"))
    for name in names:
        if name and hasattr(transformers, name):
            return getattr(transformers, name)
    return transformers.AutoModelForCausalLM


def _instantiate(cls: Any, config: PretrainedConfig) -> PreTrainedModel:
    if hasattr(cls, "_from_config"):
        return cls._from_config(config).to(torch.float32)
    return cls.from_config(config).to(torch.float32)


def _check_full_state(model: PeftModel, path: Path) -> None:
    """Refuse a model rebuilt from its config whose adapter file does not hold every base weight."""
    saved = _saved_adapter_keys(path)
    if saved is None:
        return
    adapter = model.active_adapter if isinstance(model.active_adapter, str) else model.active_adapters[0]
    missing = [
        key
        for key in model.state_dict()
        if f".{adapter}." not in key
        and not key.endswith(f".{adapter}")
        and "original_module" not in key
        and key not in saved
    ]
    if missing:
        raise ExportError(
            f"{path} holds only part of the model ({len(missing)} base weights missing, e.g. "
            f"{missing[0]}) and its {ADAPTER_CONFIG_NAME} names no base_model_name_or_path to load "
            "them from"
        )


def _saved_adapter_keys(path: Path) -> set[str] | None:
    weights = path / "adapter_model.safetensors"
    if not weights.is_file():
        return None
    from safetensors import safe_open

    with safe_open(str(weights), framework="pt") as handle:
        return set(handle.keys())


def _find_tokenizer(path: Path, base_name: str | None) -> Processor | None:
    """The tokenizer saved beside the adapter, else the base model's local one; ``None`` when there is none."""
    for candidate in (path, Path(base_name) if base_name else None):
        if candidate is not None and candidate.is_dir() and any((candidate / f).is_file() for f in TOKENIZER_FILES):
            return _load_processor(candidate)
    return None


def _load_processor(path: Path) -> Processor:
    from transformers import AutoProcessor, AutoTokenizer

    loader = (
        AutoTokenizer
        if (path / "tokenizer_config.json").is_file() or (path / "tokenizer.json").is_file()
        else AutoProcessor
    )
    try:
        return loader.from_pretrained(str(path))
    except (OSError, ValueError, KeyError) as error:
        raise ExportError(f"the tokenizer files in {path} could not be loaded: {first_line(error)}") from error


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _trainer_run_info(trainer: Trainer) -> dict:
    run = dict(getattr(trainer, "run_info", {}) or {})
    args, state = trainer.args, trainer.state
    run.setdefault("learning_rate", args.learning_rate)
    poet_learning_rate = getattr(args, "poet_learning_rate", None)  # PoetTrainingArguments
    if poet_learning_rate is not None:
        run.setdefault("poet_learning_rate", poet_learning_rate)
    merge_every = getattr(trainer, "merge_every", None)  # PoetTrainer: the interval the run merged at
    if merge_every:
        run.setdefault("merge_every", merge_every)
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


def active_config(model: PeftModel) -> PeftConfig:
    """The ``PeftConfig`` of ``model``'s active adapter."""
    adapter = model.active_adapter if isinstance(model.active_adapter, str) else model.active_adapters[0]
    return model.peft_config[adapter]


def _base_dtype(model: PeftModel) -> torch.dtype:
    dtypes = [
        p.dtype
        for n, p in model.get_base_model().named_parameters()
        if p.is_floating_point() and str(model.base_model.prefix) not in n
    ]
    return dtypes[0] if dtypes else torch.float32


def _config_dtype(config: PretrainedConfig) -> torch.dtype:
    value = getattr(config, "dtype", None)
    if isinstance(value, torch.dtype):
        return value
    return dtypes.DTYPES.get(str(value).removeprefix("torch."), torch.float32) if value else torch.float32


def first_line(error: BaseException) -> str:
    """The first line of an error's message (its type name when empty), for one-line error reports."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
