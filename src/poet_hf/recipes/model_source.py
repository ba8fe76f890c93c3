"""Where a pretraining run's model comes from: a preset's LLaMA shape, any causal-LM config, or a checkpoint.

``scripts/pretrain.py`` takes transformers' ``run_clm.py`` flags for it: ``--config_name`` (a ``config.json``, its
folder or a Hub id), ``--config_overrides`` (``"num_hidden_layers=2,hidden_size=256"``) and ``--model_name_or_path``
(continued pretraining: POET on a checkpoint's weights, which become ``W0``), beside ``--preset``, whose recipe the
run keeps in every case. A family is trained where POET knows its block linears
(`poet_hf.recipes.presets.targets_for`, e.g. LLaMA, Mistral, Qwen2, Gemma, GPT-2's ``Conv1D``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedTokenizerBase

from ..initialization import materialize_model
from .presets import PRESETS, meta_model, preset_config, without_zero3_init
from .recipe import ModelSummary

__all__ = ["apply_overrides", "build_model", "load_model_config", "model_summary", "read_config"]


def read_config(name_or_path: str) -> PretrainedConfig:
    """A config from a ``config.json`` file (any name), its folder, or a Hub id."""
    path = Path(name_or_path)
    if path.is_file():
        return AutoConfig.for_model(**json.loads(path.read_text()))
    return AutoConfig.from_pretrained(name_or_path)


def apply_overrides(config: PretrainedConfig, overrides: str) -> PretrainedConfig:
    """``config`` with fields set from ``"key=value,key=value"`` (``run_clm.py``'s ``--config_overrides``).

    A value reads as ``true``/``false``, ``none``, an integer or a float where it is one, else as a string. The config
    is built again from its values, so that fields derived from others follow them: a new ``num_hidden_layers``
    gets the family's default ``layer_types`` (Qwen2, Gemma 2), unless ``layer_types`` is set too. Unlike
    ``PretrainedConfig.update_from_string``, a field that is ``None`` can be set (GPT-2's ``n_inner``).

    Raises:
        ValueError: an entry is not ``key=value``, or names no field of the config.
    """
    values = config.to_dict()
    given = {}
    for entry in filter(None, (part.strip() for part in overrides.split(","))):
        key, sep, text = entry.partition("=")
        if not sep or not hasattr(config, key.strip()):
            raise ValueError(
                f"`config_overrides` entry {entry!r} is not key=value with a field of {type(config).__name__}"
            )
        given[key.strip()] = _literal(text.strip())
    if "num_hidden_layers" in given or "n_layer" in given:
        values.pop("layer_types", None)
    values.update(given)
    return type(config)(**{k: v for k, v in values.items() if k not in ("model_type", "transformers_version")})


def _literal(text: str) -> bool | int | float | str | None:
    words = {"true": True, "false": False, "none": None, "null": None}
    if text.lower() in words:
        return words[text.lower()]
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def load_model_config(
    preset: str,
    method: str,
    vocab_size: int | None,
    seq_len: int,
    config_name: str | None = None,
    config_overrides: str | None = None,
    model_name_or_path: str | None = None,
) -> PretrainedConfig:
    """The config of the model a run trains.

    A checkpoint's (``model_name_or_path``), else ``config_name``'s, else the preset's LLaMA; then
    ``config_overrides`` applied (`apply_overrides`). A config keeps its vocabulary, grown to
    the tokenizer's where that is larger (as ``run_clm.py`` resizes the embeddings); a preset takes the tokenizer's.

    Args:
        preset: the preset whose shape applies when neither a config nor a checkpoint is given.
        method: the method (a preset's FFN size depends on it).
        vocab_size: the tokenizer's size; ``None``: not known yet (a config's own is kept, a preset's is 32000).
        seq_len: tokens per sequence; a config must have room for it (``max_position_embeddings``).
        config_name: a ``config.json``, its folder or a Hub id.
        config_overrides: comma-separated ``key=value`` settings of the config.
        model_name_or_path: a checkpoint (folder or Hub id).

    Raises:
        ValueError: an override names no field of the config, the config's positions are fewer than ``seq_len``, or
            a preset's vocabulary, or one set by ``config_overrides``, is smaller than the tokenizer's.
    """
    source = model_name_or_path or config_name
    if source is None:
        config: PretrainedConfig = preset_config(PRESETS[preset], method, vocab_size or 32000, seq_len)
    else:
        config = read_config(source)
    if config_overrides:
        config = apply_overrides(config, config_overrides)
    if vocab_size is not None and vocab_size > config.vocab_size:
        overridden = "vocab_size" in {item.split("=")[0].strip() for item in (config_overrides or "").split(",")}
        if source is None or overridden:
            raise ValueError(
                f"the model's vocabulary (`vocab_size`={config.vocab_size}"
                f"{', from --config_overrides' if overridden else ''}) is smaller than the tokenizer's {vocab_size} "
                f"tokens, so token ids from {config.vocab_size} up would have no embedding: pass the model's own "
                f"tokenizer (--tokenizer_name), or a vocab_size of at least {vocab_size}"
            )
        config.vocab_size = vocab_size
    positions = getattr(config, "max_position_embeddings", None)
    if positions is not None and positions < seq_len:
        raise ValueError(
            f"`seq_len`={seq_len} is longer than the model's `max_position_embeddings`={positions}; "
            "lower --seq_len or raise it with --config_overrides max_position_embeddings=N"
        )
    return config


def adopt_special_tokens(model: nn.Module, tokenizer: PreTrainedTokenizerBase) -> None:
    """Give a new model's config and generation config the tokenizer's BOS, EOS and PAD ids, those it defines.

    A preset's model is trained from scratch, so its special tokens are the tokenizer's; ``transformers.Trainer``
    would otherwise align them itself and warn (``align_special_tokens``). Set on the built model, as the Trainer
    does, so the embedding's ``padding_idx`` stays the config's (a PAD that is also the EOS keeps learning)."""
    configs = [model.config, getattr(model, "generation_config", None)]
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        token_id = getattr(tokenizer, name, None)
        for config in configs:
            if token_id is not None and config is not None:
                setattr(config, name, token_id)


def build_model(
    config: PretrainedConfig, seed: int, model_name_or_path: str | None = None, device: str = "meta"
) -> nn.Module:
    """The causal LM to train: a checkpoint's weights in float32, or ``config``'s model built on ``meta``.

    Args:
        config: the model's config (`load_model_config`).
        seed: the seed of the keyed initialisation of a model built from its config.
        model_name_or_path: a checkpoint; its embeddings grow to ``config.vocab_size`` where that is larger.
        device: ``"meta"`` leaves a model built from its config unmaterialized (the trainer materializes it, shard by
            shard under FSDP2); another device materializes it there (`materialize_model`).
    """
    if model_name_or_path is not None:
        with without_zero3_init():
            model = AutoModelForCausalLM.from_pretrained(model_name_or_path, config=config, dtype=torch.float32)
        if model.get_input_embeddings().num_embeddings < config.vocab_size:
            model.resize_token_embeddings(config.vocab_size)
        return model
    built = meta_model(config)
    return built if device == "meta" else materialize_model(built, seed=seed, device=device)


def model_summary(config: PretrainedConfig, seq_len: int, source: str) -> ModelSummary:
    """The model block of a recipe: where it comes from, its family and its shape."""
    hidden = config.hidden_size
    ffn = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * hidden
    return {
        "source": source,
        "model_type": config.model_type,
        "hidden": hidden,
        "intermediate": ffn,
        "heads": config.num_attention_heads,
        "layers": config.num_hidden_layers,
        "seq_len": seq_len,
        "vocab": config.vocab_size,
        "tie_word_embeddings": bool(getattr(config, "tie_word_embeddings", False)),
    }
