"""Choices and default target modules shared by the POET, OFT and orthogonal tuners."""

from __future__ import annotations

SIDE_INPUT = "input"  # R, acts on the in dimension
SIDE_OUTPUT = "output"  # P, acts on the out dimension
SIDES = (SIDE_INPUT, SIDE_OUTPUT)

SPO_CHOICES = ("block", "full", "contiguous")
SIDES_CHOICES = ("both", "input", "output")
FORWARD_CHOICES = ("auto", "weight", "activation")
BIAS_CHOICES = {name: ("none", "all", f"{name}_only") for name in ("poet", "oft", "orthogonal")}

_LLAMA_LIKE = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# BERT-like encoders name their block linears `dense` too, like the pooler and heads outside the blocks,
# so they are matched by a regex anchored in `encoder.layer.<i>`.
_ENCODER_BLOCKS = (
    r".*encoder\.layer\.\d+\."
    r"(attention\.(self|attention)\.(query|key|value)|attention\.output\.dense|intermediate\.dense|output\.dense)"
)
# ViT in transformers 5 names its block linears like LLaMA's attention plus fc1/fc2; the pooler is outside.
_VIT_BLOCKS = r".*layers\.\d+\.(attention\.(q_proj|k_proj|v_proj|o_proj)|mlp\.(fc1|fc2))"

# Every Linear inside the transformer blocks, never embeddings or lm_head (POET §3.3).
DEFAULT_TARGET_MODULES: dict[str, list[str] | str] = {
    "llama": _LLAMA_LIKE,
    "mistral": _LLAMA_LIKE,
    "mixtral": ["q_proj", "k_proj", "v_proj", "o_proj", "w1", "w2", "w3"],
    "qwen2": _LLAMA_LIKE,
    "qwen3": _LLAMA_LIKE,
    "gemma": _LLAMA_LIKE,
    "gemma2": _LLAMA_LIKE,
    "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
    "gpt2": ["c_attn", "c_proj", "c_fc"],
    "gpt_neox": ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"],
    "bert": _ENCODER_BLOCKS,
    "roberta": _ENCODER_BLOCKS,
    "vit": _VIT_BLOCKS,
    "bart": ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"],
    "t5": ["q", "k", "v", "o", "wi", "wo", "wi_0", "wi_1"],
}
