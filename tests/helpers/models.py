"""Tiny randomly initialised Hugging Face models for tests (no hub downloads)."""

from __future__ import annotations

import torch
from torch import nn
from transformers import BertConfig, BertModel, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM


def llama_config(
    hidden: int = 64,
    intermediate: int = 128,
    layers: int = 2,
    vocab: int = 128,
    heads: int = 4,
    kv_heads: int | None = None,
    **overrides,
) -> LlamaConfig:
    """The one LLaMA config factory of the tests; ``overrides`` are other ``LlamaConfig`` fields."""
    fields = {"max_position_embeddings": 128, **overrides}
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads or heads,
        **fields,
    )


# The LlamaConfig fields of the small LLaMA the training, materialization and checkpoint tests share (an odd
# vocabulary, an untied head).
TINY_LLAMA = {
    "vocab_size": 97,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}


def tiny_llama(seed: int = 0, meta: bool = False, **config_fields) -> LlamaForCausalLM:
    """A randomly initialised LLaMA of `llama_config` (seeded), in eval mode; on the meta device with ``meta``."""
    torch.manual_seed(seed)
    with torch.device("meta" if meta else "cpu"):
        return LlamaForCausalLM(llama_config(**config_fields)).eval()


def tiny_gpt2(hidden: int = 64, layers: int = 2, vocab: int = 128) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=4, n_positions=64)
    return GPT2LMHeadModel(config).eval()


def tiny_bert(
    hidden: int = 64,
    layers: int = 2,
    vocab: int = 128,
    heads: int = 4,
    intermediate: int = 128,
    seed: int = 0,
    **fields,
) -> BertModel:
    """A randomly initialised BERT encoder (seeded), in eval mode; ``fields`` are other ``BertConfig`` fields."""
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=intermediate,
        **{"max_position_embeddings": 64, **fields},
    )
    return BertModel(config).eval()


class TinyCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv1 = nn.Conv2d(4, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, stride=2, padding=1)
        self.head = nn.Linear(8 * 4 * 4, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv1(x))
        x = torch.relu(self.conv2(x))
        return self.head(x.flatten(1))
