"""What the load-time adapter checks cost (``poet_hf.tuners.rotation.state_checks``), on llama-130m POET adapters.

A llama-130m (the paper's Table 7 shape, random weights) gets a POET-BS 256 and a POET-FS ½ adapter, saved with
``save_pretrained``; ``PeftModel.from_pretrained`` reloads each onto a fresh base model, alternately with the checks
(the safetensors header check, every layer's ``load_state_dict`` pre-hook on index, skew and merge-count tensors, the
merge-count agreement post-hook) and with them switched off; medians over 5 pairs. ``checks alone`` runs every check
on the loaded model's own (in-memory) state dict: their pure cost, without the first read of the file's pages, which
the load pays either way. Its floor is one pass over the index and skew tensors (the adapter's bytes).
"""

from __future__ import annotations

import contextlib
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

ADAPTERS = {"POET-BS 256": {"spo": "block", "block_size": 256}, "POET-FS ½": {"spo": "full", "budget": 0.5}}


@contextmanager
def _checks_off() -> Iterator[None]:
    import poet_hf.tuners.config_utils as config_utils
    import poet_hf.tuners.rotation.layer as rotation_layer
    import poet_hf.tuners.rotation.model as rotation_model

    saved = (
        rotation_layer.check_loaded_state,
        rotation_model.check_merge_counts_agree,
        config_utils.check_safetensors_file,
    )
    rotation_layer.check_loaded_state = lambda *args, **kwargs: None  # looked up when the layers are built
    rotation_model.check_merge_counts_agree = lambda *args, **kwargs: None
    config_utils.check_safetensors_file = lambda *args, **kwargs: None
    try:
        yield
    finally:
        (
            rotation_layer.check_loaded_state,
            rotation_model.check_merge_counts_agree,
            config_utils.check_safetensors_file,
        ) = saved


def _checks_alone(model, folder: str) -> float:
    """Seconds of every check on ``model``'s own state dict (already in memory)."""
    from poet_hf.tuners.config_utils import check_safetensors_file
    from poet_hf.tuners.rotation.layer import rotation_layers
    from poet_hf.tuners.rotation.model import check_merge_counts_agree
    from poet_hf.tuners.rotation.state_checks import check_loaded_state

    state = model.state_dict()
    start = time.perf_counter()
    check_safetensors_file(Path(folder) / "adapter_model.safetensors")
    for name, layer in rotation_layers(model):
        check_loaded_state(layer, state, f"{name}.")
    check_merge_counts_agree(model.base_model)
    return time.perf_counter() - start


def _base(quick: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, ffn, layers, heads = (256, 512, 2, 4) if quick else (768, 2048, 12, 12)
    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=32000,
            hidden_size=hidden,
            intermediate_size=ffn,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=heads,
        )
    )


def run(quick: bool = False) -> list[dict[str, Any]]:
    from peft import PeftModel, get_peft_model

    from poet_hf import PoetConfig

    rows = []
    for label, fields in ADAPTERS.items():
        with tempfile.TemporaryDirectory() as folder:
            get_peft_model(_base(quick), PoetConfig(**fields, init_weights=False)).save_pretrained(folder)
            size = (Path(folder) / "adapter_model.safetensors").stat().st_size
            loads: dict[bool, list[float]] = {True: [], False: []}
            for _ in range(1 if quick else 5):
                for checked in (False, True):
                    base = _base(quick)
                    with contextlib.nullcontext() if checked else _checks_off():
                        start = time.perf_counter()
                        model = PeftModel.from_pretrained(base, folder)
                        loads[checked].append(time.perf_counter() - start)
            alone = statistics.median(_checks_alone(model, folder) for _ in range(3))
        on, off = statistics.median(loads[True]), statistics.median(loads[False])
        rows.append(
            {
                "adapter": label,
                "adapter MB": size / 2**20,
                "load s (checked)": on,
                "load s (unchecked)": off,
                "checked / unchecked": on / off,
                "checks alone ms": alone * 1e3,
                "checks alone / load": alone / on,
            }
        )
    return rows
