"""The documented mapping between PEFT's OFT adapter weights and ours.

PEFT ``OFTConfig`` (0.21) stores, per target module, one parameter ``<module>.oft_R.weight`` of shape
``(r, b(b-1)/2)`` (``(1, …)`` with ``block_share``): row ``i`` is the strict upper triangle of the skew block
``Q_i``, in ``torch.triu_indices(b, b, 1)`` order. We store the same tensor as ``<module>.poet_oft_R``, in the same
order, plus two buffers: ``poet_oft_R_index`` (the block permutation; empty for PEFT's contiguous blocks) and
``poet_oft_merge_count`` (0 until a merge-then-reinitialize).

The values map one to one, except for the exact Cayley transform: PEFT's ``use_cayley_neumann=False`` computes
``(I − Q)(I + Q)^{-1}``, the *transpose* of the rotation its Cayley–Neumann series approximates and of ours
(``(I + Q)(I − Q)^{-1}``), so those parameters are negated (``Q → −Q`` transposes a Cayley rotation).

Keys are checkpoint keys, as written by ``save_pretrained`` / ``get_peft_model_state_dict`` (no adapter name).
Entries that are not adapter parameters (trained biases, ``modules_to_save``) pass through unchanged.
"""

from __future__ import annotations

import torch

PEFT_KEY = ".oft_R.weight"
OUR_KEY = ".poet_oft_R"


def _sign(exact_cayley: bool) -> float:
    return -1.0 if exact_cayley else 1.0


def peft_oft_state_dict_to_ours(state_dict: dict[str, torch.Tensor], exact_cayley: bool) -> dict[str, torch.Tensor]:
    """Convert a PEFT OFT checkpoint state dict into ours (for an ``OftConfig.from_peft_config`` model).

    ``exact_cayley`` is PEFT's ``not use_cayley_neumann``.

    Args:
        state_dict: PEFT's adapter state dict.
        exact_cayley: PEFT's ``not use_cayley_neumann``.

    Returns:
        Our adapter state dict (load it with ``set_peft_model_state_dict``).
    """
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        if key.endswith(PEFT_KEY):
            stem = key[: -len(PEFT_KEY)]
            out[stem + OUR_KEY] = value * _sign(exact_cayley)
            out[stem + OUR_KEY + "_index"] = torch.empty(0, dtype=torch.long)
            out[stem + ".poet_oft_merge_count"] = torch.zeros((), dtype=torch.long)
        else:
            out[key] = value
    return out


def our_oft_state_dict_to_peft(state_dict: dict[str, torch.Tensor], exact_cayley: bool) -> dict[str, torch.Tensor]:
    """Convert our OFT checkpoint state dict into PEFT's; only plain OFT (contiguous blocks, never merged) maps.

    Args:
        state_dict: our adapter state dict.
        exact_cayley: PEFT's ``not use_cayley_neumann``.

    Returns:
        PEFT's adapter state dict.

    Raises:
        ValueError: the adapter uses permuted blocks or changed base weights, which PEFT's OFT cannot hold.
    """
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        if key.endswith(OUR_KEY):
            out[key[: -len(OUR_KEY)] + PEFT_KEY] = value * _sign(exact_cayley)
        elif key.endswith(OUR_KEY + "_index"):
            if value.numel():
                raise ValueError(
                    f"'{key}' holds a block permutation (spo='block'); PEFT's OFT has contiguous "
                    "blocks only, so this adapter has no PEFT equivalent"
                )
        elif key.endswith(".poet_oft_merge_count"):
            if int(value):
                raise ValueError(
                    f"'{key}' = {int(value)}: merge-then-reinitialize changed the base weights, which a "
                    "PEFT OFT adapter cannot carry; export the merged model instead"
                )
        elif ".base_layer.weight" in key:
            raise ValueError(f"'{key}' is a modified base weight, which a PEFT OFT adapter cannot carry")
        else:
            out[key] = value
    return out
