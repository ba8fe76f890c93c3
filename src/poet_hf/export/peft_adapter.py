"""Write an OFT adapter in PEFT's own ``OFTConfig`` format, which stock PEFT loads without ``poet_hf``.

PEFT's OFT holds one input-side rotation per target, block-diagonal with contiguous blocks, as the Cayley–Neumann
series of PEFT's term count or the exact Cayley transform, on the checkpoint's own ``W0``. An `OftConfig` adapter maps
onto it one to one (`poet_hf.tuners.oft.our_oft_state_dict_to_peft`) when its blocks are contiguous
(``spo="contiguous"``), its series is one PEFT computes, and its ``W0`` is the checkpoint's. Where
merge-then-reinitialize folded training into ``W0``, the changed base is written as a plain checkpoint beside the
adapter (``base_output_dir``), and the adapter applies to that base.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
from safetensors.torch import save_file
from torch import nn

from ..orthogonal.cayley_map import CayleyNeumann
from ..tuners.oft import OftConfig, our_oft_state_dict_to_peft
from ..tuners.rotation.layer import rotation_layers
from .card import render_adapter_card
from .folding import max_merge_count
from .source import ExportError
from .writing import check_output_dir, write_atomically

if TYPE_CHECKING:
    from peft import OFTConfig, PeftModel
    from transformers import PreTrainedModel

ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
# OftConfig fields that mean in PEFT's OFTConfig what they mean in ours.
SAME_NAMED_FIELDS = (
    "block_share",
    "coft",
    "eps",
    "module_dropout",
    "target_modules",
    "exclude_modules",
    "bias",
    "layers_to_transform",
    "layers_pattern",
    "modules_to_save",
    "task_type",
    "base_model_name_or_path",
    "revision",
)


def export_peft_adapter(
    model: PeftModel,
    output_dir: str | Path,
    *,
    adapter_name: str | None = None,
    base_output_dir: str | Path | None = None,
    overwrite: bool = False,
) -> Path:
    """Write ``model``'s OFT adapter as a PEFT ``OFTConfig`` adapter folder that stock PEFT loads.

    The folder holds ``adapter_config.json``, ``adapter_model.safetensors`` and a ``README.md`` card that says how
    to load it; ``PeftModel.from_pretrained(base, output_dir)`` then computes what ``model`` computes, with only
    ``transformers`` and ``peft`` installed. Field mapping: ``block_size`` → ``oft_block_size``, ``neumann_terms`` →
    ``num_cayley_neumann_terms`` (0 → ``use_cayley_neumann=False``, whose parameters are negated: PEFT's exact
    transform is the transpose of ours), the other fields by name.

    Args:
        model: a ``PeftModel`` with an [`OftConfig`][poet_hf.OftConfig] adapter.
        output_dir: the adapter folder to write (atomically).
        adapter_name: the adapter to write; default the active one.
        base_output_dir: where to write the base as a plain checkpoint when merge-then-reinitialize changed
            ``W0``; the adapter's ``base_model_name_or_path`` then names it. Not needed (and not written) otherwise.
        overwrite: replace a non-empty ``output_dir`` (and ``base_output_dir``).

    Returns:
        The adapter folder.

    Raises:
        ExportError: PEFT's OFT cannot hold this adapter; the message names the reason and what to do instead.
        FileExistsError: a target folder is not empty and ``overwrite`` is False.
    """
    config, adapter_name = _oft_config_of(model, adapter_name)
    _check_representable(model, config, adapter_name)
    output = Path(output_dir)
    check_output_dir(output, overwrite, None)
    peft_config = to_peft_oft_config(config)
    state = _adapter_state(model, adapter_name)
    # The adapter saves W0 when merges or a repacking changed it (`RotationModel._get_adapter_state_dict`).
    base_changed = bool(max_merge_count(model)) or any(".base_layer." in key for key in state)
    if base_changed:
        if base_output_dir is None:
            raise ExportError(
                "merge-then-reinitialize (or a repacked 4-bit base) changed this adapter's W0, which a PEFT OFT "
                "adapter cannot carry; pass base_output_dir= to write the changed base as a plain checkpoint beside "
                "the adapter, or export the merged model with export_merged"
            )
        peft_config.base_model_name_or_path = str(_write_base(model, Path(base_output_dir), overwrite))
        # The written base holds the merges: relative to it, the adapter is an unmerged one.
        state = {k: v for k, v in state.items() if ".base_layer." not in k and not k.endswith("_merge_count")}
    weights = our_oft_state_dict_to_peft(state, exact_cayley=config.neumann_terms == 0)
    card = render_adapter_card(
        model.get_base_model(), peft_config, model_id=str(output), native_peft=True, base_written=base_changed
    )

    def write(folder: Path) -> None:
        peft_config.save_pretrained(str(folder))
        save_file({k: v.detach().contiguous().cpu() for k, v in weights.items()}, folder / ADAPTER_WEIGHTS_NAME)
        card.save(folder / "README.md")

    write_atomically(output, write)
    return output


def to_peft_oft_config(config: OftConfig) -> OFTConfig:
    """PEFT's ``OFTConfig`` that computes what ``config`` computes (see `export_peft_adapter` for the mapping)."""
    from peft import OFTConfig

    exact = config.neumann_terms == 0
    return OFTConfig(
        r=config.r,
        oft_block_size=0 if config.r else config.side_block_size,
        use_cayley_neumann=not exact,
        num_cayley_neumann_terms=5 if exact else config.neumann_terms,  # PEFT ignores it without the series
        inference_mode=True,
        **{name: getattr(config, name) for name in SAME_NAMED_FIELDS},
    )


def _oft_config_of(model: nn.Module, adapter_name: str | None) -> tuple[OftConfig, str]:
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, dict) or not configs:
        raise ExportError(
            f"export_peft_adapter needs a PeftModel with an OftConfig adapter, got a {type(model).__name__}"
        )
    name = adapter_name or getattr(model, "active_adapter", None) or next(iter(configs))
    if name not in configs:
        raise ExportError(f"adapter {name!r} not found; this model has {sorted(configs)}")
    config = configs[name]
    if not isinstance(config, OftConfig):
        peft_type = str(getattr(config.peft_type, "value", config.peft_type))
        raise ExportError(
            f"adapter {name!r} is {peft_type}, and PEFT's OFTConfig holds OFT adapters only (one input-side "
            "rotation); a POET adapter (R·W0·P) has no PEFT format: export the merged model with export_merged, or "
            "share the adapter itself, which loads where poet_hf is imported"
        )
    return config, name


def _check_representable(model: PeftModel, config: OftConfig, adapter_name: str) -> None:
    """Raise an `ExportError` naming the first thing about the adapter that PEFT's OFT cannot hold."""
    if config.spo != "contiguous":
        raise ExportError(
            f"`spo`={config.spo!r}: the blocks act on a permutation of the input, and PEFT's OFT has contiguous "
            "blocks only; export the merged model with export_merged instead"
        )
    if config.orthogonal_map != CayleyNeumann.name:
        raise ExportError(
            f"`orthogonal_map`={config.orthogonal_map!r}: PEFT's OFT builds its blocks by the Cayley–Neumann map "
            f"only (orthogonal_map={CayleyNeumann.name!r}); export the merged model with export_merged instead"
        )
    if config.neumann_terms in (2, 3):
        raise ExportError(
            f"`neumann_terms`={config.neumann_terms}: PEFT's Cayley–Neumann series computes this polynomial for no "
            "term count (its 3 terms are our 4); PEFT holds neumann_terms=0 (exact Cayley) or 4 and more"
        )
    if config.block_size_pattern:
        raise ExportError(
            f"`block_size_pattern`={config.block_size_pattern}: block sizes that differ per layer have no field in "
            "PEFT's OFTConfig; choose a block size (or `r`) that divides every target, or export the merged model"
        )
    for name, layer in rotation_layers(model, adapter_name):
        base = layer.get_base_layer()
        if not isinstance(base, nn.Linear) and getattr(layer, "base_quantization", None) is None:
            raise ExportError(
                f"target '{name}' is a {type(base).__name__}; the PEFT OFT format is written for Linear targets "
                "(and their bitsandbytes forms) only; export the merged model with export_merged instead"
            )


def _adapter_state(model: PeftModel, adapter_name: str) -> dict[str, torch.Tensor]:
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(model, adapter_name=adapter_name)


def _write_base(model: PeftModel, folder: Path, overwrite: bool) -> Path:
    """Write the model's current base (``W0`` with the merges folded in, no adapter) as a plain checkpoint."""
    if any(getattr(layer, "base_quantization", None) for _, layer in rotation_layers(model)):
        raise ExportError(
            "the base is quantised, and writing a changed quantised W0 as a plain checkpoint is not supported; "
            "export the merged model with export_merged instead"
        )
    check_output_dir(folder, overwrite, None)
    base = cast("PreTrainedModel", model.get_base_model())
    state = {}
    for key, value in base.state_dict().items():
        parts = key.split(".")
        if any(part.startswith("poet_") for part in parts) or "modules_to_save" in parts:
            continue  # the adapter's parameters and buffers, a 16-bit base's rounding residual, trained copies
        state[key.replace(".base_layer.", ".").replace(".original_module.", ".")] = value

    def write(staging: Path) -> None:
        base.save_pretrained(staging, state_dict=state)

    write_atomically(folder, write)
    return folder
