"""Shared tiny training set-up for the training tests and the DDP worker."""

from __future__ import annotations

import torch
from datasets import Dataset
from models import TINY_LLAMA, tiny_llama
from peft import get_peft_model
from transformers import LlamaConfig, default_data_collator

from poet_hf import PoetConfig, PoetTrainer, PoetTrainingArguments
from poet_hf.data import load_embedded_corpus, load_tokenizer, pack_sequences


def state_hash(model: torch.nn.Module) -> str:
    """A SHA-256 of every parameter and buffer of ``model`` (bit-exact equality of two trained models)."""
    import hashlib

    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())  # any dtype
    return digest.hexdigest()


def free_port() -> int:
    """A TCP port no one listens on now (so that suites running side by side do not collide)."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def tiny_dataset(seq_len: int = 32, chars: int = 40_000):
    tokenizer = load_tokenizer()
    text = load_embedded_corpus()["train"][0]["text"][:chars]
    return pack_sequences(Dataset.from_dict({"text": [text]}), tokenizer, seq_len), tokenizer


def tiny_poet_model(vocab: int, seed: int = 0, meta: bool = False, hidden: int = 32, **poet_kwargs):
    """A tiny POET LLaMA ``hidden`` wide; with ``meta`` built on the meta device, for PoetTrainer to materialize."""
    fields = {"block_size": 8, "merge_every": 2, "base_init": "normalized", **poet_kwargs}
    base = tiny_llama(seed, meta, hidden=hidden, intermediate=64, vocab=vocab, heads=2, max_position_embeddings=64)
    return get_peft_model(base.train(), PoetConfig(**fields))


def tiny_trainer(output_dir, model, dataset, **arg_overrides) -> PoetTrainer:
    fields = {
        "output_dir": str(output_dir),
        "max_steps": 6,
        "per_device_train_batch_size": 4,
        "learning_rate": 3e-3,
        "poet_learning_rate": 3e-3,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "seed": 0,
        "data_seed": 0,
        "use_cpu": True,
        "dataloader_drop_last": True,
        "max_grad_norm": 1.0,
        "lr_scheduler_type": "constant",
    }
    fields.update(arg_overrides)
    return PoetTrainer(
        model=model, args=PoetTrainingArguments(**fields), train_dataset=dataset, data_collator=default_data_collator
    )


# An odd vocabulary: the embeddings and head split into uneven shards.


def meta_poet_model(spo: str, base_init: str | None = "normalized", config_from: str | None = None, **poet_kwargs):
    """A tiny POET LLaMA built on the meta device (its config from ``config_from``'s folder if given)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(config_from) if config_from else LlamaConfig(**TINY_LLAMA)
    fields = {"spo": spo, "block_size": 8, "budget": 0.5, "base_init": base_init, "init_weights": False, **poet_kwargs}
    with torch.device("meta"):
        return get_peft_model(AutoModelForCausalLM.from_config(config), PoetConfig(**fields))


def randomize_rotations(model: torch.nn.Module, round_: int) -> None:
    """Random skew vectors (operator norm about 0.3) in every POET layer, keyed by the round and the layer's name, so
    that every process and every build draws the same ones."""
    from poet_hf.orthogonal import spo_generator
    from poet_hf.tuners.rotation.layer import rotation_layers

    for name, layer in rotation_layers(model):
        layer.randomize_adapter("default", spo_generator(11, round_, name, "test"), op_norm=0.3)


class TrainingForwards:
    """Records, while active, what the training forwards did (a global forward hook, so it sees models a script builds
    itself): the dtype of every ``nn.Linear`` output computed with gradients, and how many module forwards ran inside a
    backward pass, which is what activation checkpointing's recomputation is."""

    def __enter__(self) -> TrainingForwards:
        self.linear_dtypes: set[torch.dtype] = set()
        self.recomputed = 0

        def hook(module, args, output):
            if torch._C._current_graph_task_id() != -1:  # running inside autograd's backward
                self.recomputed += 1
            if isinstance(module, torch.nn.Linear) and torch.is_grad_enabled() and torch.is_tensor(output):
                self.linear_dtypes.add(output.dtype)

        self._handle = torch.nn.modules.module.register_module_forward_hook(hook)
        return self

    def __exit__(self, *exc) -> None:
        self._handle.remove()
