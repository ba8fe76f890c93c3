"""Tiny randomly initialised Hugging Face models for tests (no hub downloads)."""

from __future__ import annotations

import torch
from torch import nn
from transformers import BertConfig, BertModel, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM


def tiny_llama(
    hidden: int = 64, intermediate: int = 128, layers: int = 2, vocab: int = 128, heads: int = 4, kv_heads: int = 4
) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=128,
    )
    return LlamaForCausalLM(config).eval()


def tiny_gpt2(hidden: int = 64, layers: int = 2, vocab: int = 128) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=4, n_positions=64)
    return GPT2LMHeadModel(config).eval()


def tiny_bert(hidden: int = 64, layers: int = 2, vocab: int = 128) -> BertModel:
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
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
