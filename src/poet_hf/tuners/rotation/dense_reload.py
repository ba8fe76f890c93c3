"""An adapter trained on a 4-bit or 8-bit base, loaded onto the same checkpoint's full-precision base (the QLoRA habit).

An adapter saves its ``W0`` when ``W0`` is no longer the checkpoint's: merge-then-reinitialize folded rotations into
it, POET re-initialised it (``base_init``), or bitsandbytes repacked a 4-bit base before it was wrapped
(`quantization.QuantizedBaseRepackedWarning`). Such a ``W0`` is stored quantised (codes and statistics), which a
full-precision ``nn.Linear`` cannot take. Loading it there:

- with no merge folded in and no re-initialisation, the saved ``W0`` is only the quantisation of the checkpoint's:
  the adapter is base-agnostic, as a QLoRA adapter is, and the full-precision ``W0`` is kept;
- otherwise the saved ``W0`` carries part of the training: it is dequantised (what the quantised model computed
  with) into the full-precision base, and a `QuantizedAdapterBaseWarning` says so.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from . import quantization


class QuantizedAdapterBaseWarning(UserWarning):
    """An adapter trained on a quantised base was loaded onto a full-precision base; the message says which ``W0``
    the loaded model uses."""


def holds_quantized_weight(state_dict: dict[str, torch.Tensor], base_prefix: str) -> bool:
    """Whether ``state_dict`` holds a bitsandbytes-quantised weight under ``base_prefix`` (codes with a 4-bit quant
    state, or int8 codes with their row scales ``SCB``)."""
    weight_key = f"{base_prefix}weight"
    if weight_key not in state_dict:
        return False
    return f"{base_prefix}SCB" in state_dict or any(key.startswith(f"{weight_key}.") for key in state_dict)


def saved_merge_count(state_dict: dict[str, torch.Tensor], layer_prefix: str) -> int:
    """The most merges any adapter saved under ``layer_prefix`` records (0 when none is saved)."""
    counts = [
        int(value)
        for key, value in state_dict.items()
        if key.startswith(layer_prefix) and "merge_count" in key[len(layer_prefix) :]
    ]
    return max(counts, default=0)


def load_onto_dense_base(
    base: nn.Module, state_dict: dict[str, torch.Tensor], layer_prefix: str, base_prefix: str, base_init: bool = False
) -> None:
    """Replace the quantised ``W0`` saved under ``base_prefix`` by what a full-precision ``base`` can load.

    The saved codes, statistics and error-feedback residual are taken out of ``state_dict``; with merges folded in
    (`saved_merge_count` > 0) or a ``W0`` that POET re-initialised (``base_init``), the dequantised ``W0``, in
    ``base``'s dtype, goes in their place.

    Args:
        base: the full-precision base layer (an ``nn.Linear``).
        state_dict: the state being loaded (changed in place).
        layer_prefix: the rotation layer's key prefix.
        base_prefix: its base layer's key prefix.
        base_init: the adapter re-initialised ``W0`` (``PoetConfig.base_init``), so its ``W0`` is its own.

    Raises:
        ValueError: the base is not an ``nn.Linear``, or the saved ``W0`` has another shape.
    """
    if not isinstance(base, nn.Linear):
        raise ValueError(
            f"'{base_prefix}weight' was saved quantised by bitsandbytes, but this base is a {type(base).__name__}; "
            "load the adapter onto the quantised checkpoint it was trained on"
        )
    saved = _saved_base_keys(state_dict, base_prefix)
    merges = saved_merge_count(state_dict, layer_prefix)
    if not merges and not base_init:
        for key in saved:
            state_dict.pop(key)
        _warn(
            "this adapter was trained on a quantised copy of its base and folded no merge into it, so it is "
            "base-agnostic, as a QLoRA adapter is: it is applied to the full-precision W0 this model holds (its "
            "outputs differ from the quantised model's by the quantisation error of W0)"
        )
        return
    dense = _dequantize_saved(state_dict, base_prefix, base)
    for key in saved:
        state_dict.pop(key)
    state_dict[f"{base_prefix}weight"] = dense.to(base.weight.dtype)
    _warn(
        "this adapter was trained on a quantised base and carries its own W0 (merge-then-reinitialize folded "
        "training into it, or base_init re-initialised it), so the full-precision base's W0 is replaced by the "
        "adapter's, dequantised: the model "
        "computes what the quantised model trained on; for the exact full-precision fold, export the merged model "
        "(poet_hf.export.export_merged) from the quantised model"
    )


def _saved_base_keys(state_dict: dict[str, torch.Tensor], base_prefix: str) -> list[str]:
    weight_key = f"{base_prefix}weight"
    extra = {f"{base_prefix}SCB", *(f"{base_prefix}{name}" for name in quantization.RESIDUAL_NAMES)}
    return [key for key in state_dict if key == weight_key or key.startswith(f"{weight_key}.") or key in extra]


def _dequantize_saved(state_dict: dict[str, torch.Tensor], base_prefix: str, base: nn.Linear) -> torch.Tensor:
    """The out × in matrix the saved quantised ``W0`` stands for, dequantised by bitsandbytes."""
    library = quantization.import_bitsandbytes()
    saved = {key: value for key, value in state_dict.items() if key.startswith(base_prefix)}
    if f"{base_prefix}SCB" in saved:
        layer = library.nn.Linear8bitLt(
            base.in_features, base.out_features, bias=False, has_fp16_weights=False, device="meta"
        )
    else:
        layer = library.nn.Linear4bit(base.in_features, base.out_features, bias=False, device="meta")
    layer.weight = nn.Parameter(torch.empty(0, device=base.weight.device), requires_grad=False)  # where to load
    quantization.load_quantized_state(layer, saved, base_prefix)
    matrix = quantization.dequantize(layer).float()
    if matrix.shape != base.weight.shape:
        raise ValueError(
            f"'{base_prefix}weight' was saved as a {tuple(matrix.shape)} matrix, but this base is "
            f"{tuple(base.weight.shape)}; load the adapter onto the checkpoint it was trained on"
        )
    return matrix


def _warn(message: str) -> None:
    warnings.warn(message, QuantizedAdapterBaseWarning, stacklevel=2)
