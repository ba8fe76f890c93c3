"""The model card of an export, rendered from the packaged ``model_cards/poet.md`` template."""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..model_cards import render_card
from ..orthogonal.maps import map_from_config

if TYPE_CHECKING:
    from huggingface_hub import ModelCard
    from peft import PeftConfig

CARD_TEMPLATE = "poet.md"
ADAPTER_CARD_TEMPLATE = "adapter.md"
# Config fields that are PEFT bookkeeping, not method hyperparameters (left out of the model card's table).
_BOOKKEEPING_FIELDS = frozenset(
    {
        "peft_type",
        "task_type",
        "peft_version",
        "base_model_name_or_path",
        "revision",
        "inference_mode",
        "auto_mapping",
        "init_weights",
        "layers_pattern",
        "layers_to_transform",
        "modules_to_save",
        "exclude_modules",
        "bias",
        "forward",
        "train_other_params",
    }
)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_METHODS = {  # peft_type family -> (title, summary, what the export folded)
    "POET": (
        "POET",
        "Reparameterized Training via Orthogonal Equivalence Transformation: each weight is trained "
        "as R·W0·P with W0 fixed and R, P learned orthogonal matrices, merged and reinitialized periodically",
        "`W = R·W0·P`",
    ),
    "OFT": (
        "OFT",
        "Orthogonal Finetuning: each pretrained weight W0 is trained as R·W0, with R a learned "
        "block-diagonal orthogonal matrix",
        "`W = R·W0`",
    ),
    "ORTHOGONAL": (
        "orthogonal layers",
        "target layers are replaced by orthogonal (Cayley, Householder or ECO) parameterizations",
        "the orthogonal weights",
    ),
}


def render_model_card(
    model: nn.Module,
    peft_config: PeftConfig,
    *,
    export_dtype: torch.dtype = torch.float32,
    run_info: dict | None = None,
    eval_results: dict | None = None,
    spectrum_rows: list[dict] | None = None,
    folded_layers: int = 0,
    merge_count: int | None = None,
    model_id: str = "path/to/export",
    license: str = "other",
    datasets: str | list[str] | None = None,
    from_scratch: bool = False,
) -> ModelCard:
    """A ``huggingface_hub.ModelCard`` for an exported model, from the ``model_cards/poet.md`` template.

    ``spectrum_rows`` are [`spectrum_summary`][poet_hf.orthogonal.spectra.spectrum_summary] rows.

    Args:
        model: the exported (plain) model.
        peft_config: the adapter config it was folded from.
        export_dtype: the dtype the weights were written in.
        run_info: training facts (learning rates, steps, merges, tokens…).
        eval_results: the last evaluation.
        spectrum_rows: the singular-value summary of the folded weights.
        folded_layers: how many layers were folded.
        datasets: the datasets' Hub ids.
        license: the license tag.
        merge_count: merges folded into ``W0`` during training.
        model_id: the name the card's loading snippet uses.
        from_scratch: the model was pretrained from scratch (no base model to cite).

    Returns:
        The rendered ``huggingface_hub.ModelCard``.
    """
    run = dict(run_info or {})
    peft_type = str(getattr(peft_config.peft_type, "value", peft_config.peft_type))
    title, summary, formula = _METHODS.get(
        _method_family(peft_type), (peft_type, f"the {peft_type} PEFT method", "the adapters")
    )
    base_model = peft_config.base_model_name_or_path
    dataset_refs = _as_list(datasets) or _as_list(run.pop("datasets", None) or run.pop("dataset", None))
    eval_rows = [
        (k, _fmt(v)) for k, v in {**(eval_results or {}), **(run.pop("eval", None) or {})}.items() if v is not None
    ]
    data = {
        "license": license,
        "pipeline_tag": _pipeline_tag(model),
        "tags": _tags(peft_type),
        "base_model": base_model if _is_hub_id(base_model) else None,
        "datasets": [d for d in dataset_refs if _is_hub_id(d)] or None,
    }
    return render_card(
        CARD_TEMPLATE,
        data,
        model_name=model_id.rstrip("/").rsplit("/", 1)[-1],
        model_id=model_id,
        architecture=type(model).__name__,
        auto_class=_auto_class_name(model),
        method_title=title,
        method_summary=summary,
        peft_type=peft_type,
        fold_formula=formula,
        base_model_ref=base_model,
        from_scratch=from_scratch,
        dataset_refs=dataset_refs,
        export_dtype=str(export_dtype).removeprefix("torch."),
        folded_layers=folded_layers,
        hyperparameters=_hyperparameter_rows(peft_config, run),
        training_rows=_training_rows(run, merge_count, shown=set(peft_config.to_dict())),
        eval_rows=eval_rows,
        spectrum_rows=[
            {**row, **{key: _fmt(row[key]) for key in ("sigma_max", "sigma_min", "condition")}}
            for row in spectrum_rows or []
        ],
    )


def _method_family(peft_type: str) -> str:
    return "OFT" if "OFT" in peft_type else peft_type


def _tags(peft_type: str) -> list[str]:
    tags = ["poet", "orthogonal", "peft", "poet_hf"]
    method = _method_family(peft_type).lower()
    return tags if method in tags else [*tags, method]


def _hyperparameter_rows(peft_config: PeftConfig, run: dict) -> list[tuple[str, str]]:
    """The method's config fields (block size or budget, whichever the SPO kind uses), run overrides applied."""
    fields = {k: v for k, v in peft_config.to_dict().items() if k not in _BOOKKEEPING_FIELDS}
    spo = fields.get("spo")
    if spo == "full":
        fields.pop("block_size", None)
    elif spo is not None:
        fields.pop("budget", None)
    if "merge_every" in run:  # PoetTrainingArguments.merge_every overrides the config's
        fields["merge_every"] = run.pop("merge_every")
    if "orthogonal_map" in fields:
        fields["orthogonal_map"] = map_from_config(peft_config).describe()
    if isinstance(fields.get("target_modules"), (list, set, tuple)):
        fields["target_modules"] = ", ".join(sorted(fields["target_modules"]))
    return [(name, _fmt(value)) for name, value in fields.items()]


def _training_rows(run: dict, merge_count: int | None, shown: set[str]) -> list[tuple[str, str]]:
    """Learning rates, tokens seen, steps and merges first, then the run's other scalars not already ``shown``."""
    labels = {
        "learning_rate": "learning rate",
        "poet_learning_rate": "POET learning rate",
        "num_input_tokens_seen": "tokens seen",
        "tokens_seen": "tokens seen",
        "global_step": "optimizer steps",
        "steps": "optimizer steps",
    }
    rows: dict[str, str] = {}
    for key, label in labels.items():
        if run.get(key) and label not in rows:  # 0 tokens seen means "not tracked"
            rows[label] = _fmt(run[key])
    if merge_count is not None:
        rows["merges (merge-then-reinitialize)"] = str(merge_count)
    rows.update(
        {
            k: _fmt(v)
            for k, v in run.items()
            if k not in labels and k not in shown and isinstance(v, (str, int, float, bool))
        }
    )
    return list(rows.items())


def _pipeline_tag(model: nn.Module) -> str | None:
    name = type(model).__name__
    for suffix, tag in (
        ("ForCausalLM", "text-generation"),
        ("ForImageClassification", "image-classification"),
        ("ForSequenceClassification", "text-classification"),
        ("ForMaskedLM", "fill-mask"),
    ):
        if name.endswith(suffix):
            return tag
    return None


def _auto_class_name(model: nn.Module) -> str:
    name = type(model).__name__
    for suffix in ("ForCausalLM", "ForImageClassification", "ForSequenceClassification", "ForMaskedLM"):
        if name.endswith(suffix):
            return f"AutoModel{suffix}"
    return "AutoModel"


def _is_hub_id(value: object) -> bool:
    return isinstance(value, str) and bool(_HUB_ID.match(value)) and not Path(value).exists()


def _as_list(value: str | list[str] | None) -> list[str]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else [str(v) for v in value]


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10_000:
        return f"{value:,}"
    return str(value).replace("|", "\\|")


def render_adapter_card(
    model: nn.Module, peft_config: PeftConfig, *, model_id: str, native_peft: bool = False, base_written: bool = False
) -> ModelCard:
    """A ``huggingface_hub.ModelCard`` for an adapter folder, from the ``model_cards/adapter.md`` template.

    It says how to load the adapter: with ``pip install poet_hf`` and ``import poet_hf`` before PEFT for this
    package's adapter types, with stock PEFT for one written in PEFT's own format (`export_peft_adapter`).

    Args:
        model: the base model the adapter applies to.
        peft_config: the adapter's config (this package's, or PEFT's ``OFTConfig`` when ``native_peft``).
        model_id: the name the card's loading snippet uses.
        native_peft: the folder is in PEFT's own format.
        base_written: the base the adapter applies to was written beside it (merges folded into ``W0``).

    Returns:
        The rendered ``huggingface_hub.ModelCard``.
    """
    import peft

    from .._version import __version__

    peft_type = str(getattr(peft_config.peft_type, "value", peft_config.peft_type))
    title = _METHODS.get(_method_family(peft_type), (peft_type,))[0]
    base_model = peft_config.base_model_name_or_path
    data = {
        "library_name": "peft",
        "pipeline_tag": _pipeline_tag(model),
        "tags": sorted(set(_tags(peft_type))),
        "base_model": base_model if _is_hub_id(base_model) else None,
    }
    return render_card(
        ADAPTER_CARD_TEMPLATE,
        data,
        model_name=model_id.rstrip("/").rsplit("/", 1)[-1],
        model_id=model_id,
        needs_poet_hf=not native_peft,
        method_title=title,
        peft_type=peft_type,
        base_model_ref=base_model,
        base_written=base_written,
        auto_class=_auto_class_name(model),
        peft_version=peft.__version__,
        poet_hf_version=__version__,
    )
