"""One training step at the widths people pretrain and fine-tune: POET against AdamW and LoRA on 7B-class layers.

Two decoder blocks of Llama-2-7B's shape (hidden 4096, FFN 11008, 32 heads) and of Llama-3-8B's (hidden 4096,
FFN 14336, 8 key-value heads), a 256-token vocabulary so that the blocks are the step (in the real models the
embeddings and head are about 4 % of it and train the same way under every method), 1 × 2048 tokens. Each method
in its own process, started as a user starts one: a warm-up step, then the median of ``STEPS`` optimizer steps
(forward, backward, the optimizer), and the peak RSS above the RSS after the imports. ``float32``, and
``bfloat16`` autocast for AdamW and POET-BS.

- ``adamw``: every weight trained by torch's AdamW;
- ``poet-bs``: POET, block-stochastic, ``b = 256`` (``forward="auto"``), its rotations and the non-block weights by
  AdamW (`poet_hf.training.poet_param_groups`);
- ``lora``: PEFT's LoRA, rank 16 on every Linear of the blocks.

POET-FS is not timed: at half of each width per side its rotations and polynomial count 7-12x AdamW's
multiply-adds here (`linear_flop_ratio`). Beside each POET row, the flop ratio of its blocks' Linear layers against
AdamW's (``strategy_costs`` at the strategy ``auto`` picks, the polynomial included): what the arithmetic allows, not
a floor (AdamW's update and the memory-bound work are left out).
"""

from __future__ import annotations

import resource
import statistics
import time
from typing import Any

import torch

from benchmarks.common import measure_as_a_user, optimizer_step, status_mb

SHAPES = {  # LlamaConfig fields of each real model's blocks
    name: {"hidden_size": 4096, "intermediate_size": ffn, "num_attention_heads": 32, "num_key_value_heads": kv}
    for name, ffn, kv in (("llama-2-7b", 11008, 32), ("llama-3-8b", 14336, 8))
}
BLOCKS, TOKENS, VOCAB, STEPS = 2, 2048, 256, 2
METHODS = ("adamw", "poet-bs", "lora")  # POET-FS: its flop ratio only (`linear_flop_ratio`), 7-12x AdamW's here
AUTOCAST_METHODS = ("adamw", "poet-bs")
SETTINGS = {
    "model": f"{BLOCKS} decoder blocks, vocabulary {VOCAB}, 1 x {TOKENS} tokens",
    "timing": f"a warm-up step, then the median of {STEPS} optimizer steps",
    "memory": "peak RSS above the RSS after imports, each method in its own process",
}


def build(method: str, shape: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model of ``shape`` with ``method``'s trainable parameters, and its optimizer (learning rate 1e-3)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    import poet_hf  # noqa: F401  (registers the tuner)
    from poet_hf import PoetConfig
    from poet_hf.training import poet_param_groups

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, num_hidden_layers=BLOCKS, max_position_embeddings=TOKENS, **SHAPES[shape])
    model: torch.nn.Module = LlamaForCausalLM(config)
    if method == "lora":
        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    elif method != "adamw":
        spo = {"block_size": 256} if method == "poet-bs" else {"spo": "full"}
        model = get_peft_model(model, PoetConfig(**spo))
        return model, torch.optim.AdamW(poet_param_groups(model, 1e-3, 1e-3, 0.0, []))
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)


def measure(method: str, shape: str, autocast: bool = False, steps: int = STEPS) -> dict[str, Any]:
    """In the child process: build, warm up one step, time ``steps`` steps; memory above the imports."""
    after_imports = status_mb("VmRSS")
    model, optimizer = build(method, shape)
    ids = torch.randint(0, VOCAB, (1, TOKENS), generator=torch.Generator().manual_seed(0))

    def loss() -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return model(input_ids=ids, labels=ids).loss

    optimizer_step(model, optimizer, loss)  # warm-up: allocates the optimizer states
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        optimizer_step(model, optimizer, loss)
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - after_imports
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"step_s": statistics.median(times), "peak_mb": peak, "trainable_m": trainable / 1e6}


def linear_flop_ratio(method: str, shape: str) -> float:
    """The blocks' Linear layers: POET's multiply-adds at ``auto``'s strategy over AdamW's ``3·T·N`` per layer."""
    from poet_hf import PoetConfig
    from poet_hf.orthogonal import map_from_config
    from poet_hf.orthogonal.spo import SideSpec, subset_size
    from poet_hf.orthogonal.strategy_costs import auto_strategy, polynomial_products, strategy_costs

    fields = SHAPES[shape]
    d, ffn = fields["hidden_size"], fields["intermediate_size"]
    kv = d * fields["num_key_value_heads"] // fields["num_attention_heads"]
    shapes = [(d, d), (d, kv), (d, kv), (d, d), (d, ffn), (d, ffn), (ffn, d)]
    polynomial = polynomial_products(map_from_config(PoetConfig()), 256, "uncached")  # the default map, b = 256
    poet = adamw = 0.0
    for d_in, d_out in shapes:
        sides = [
            SideSpec("block", dim, 256) if method == "poet-bs" else SideSpec("full", dim, subset_size(dim, 0.5))
            for dim in (d_in, d_out)
        ]
        costs = strategy_costs(TOKENS, d_in, d_out, *sides, True, polynomial=polynomial)
        poet += costs[auto_strategy(costs, d_in, d_out)]["macs"]
        adamw += 3 * TOKENS * d_in * d_out
    return poet / adamw


def run(quick: bool = False) -> list[dict]:
    """Every (shape, precision, method), each in its own process; ratios against AdamW of the same run."""
    rows = []
    for shape in ("llama-2-7b",) if quick else SHAPES:
        for autocast in (False,) if quick else (False, True):
            methods = AUTOCAST_METHODS if autocast else METHODS
            results = {m: measure_as_a_user("wide_step", method=m, shape=shape, autocast=autocast) for m in methods}
            adamw = results["adamw"]
            for method, result in results.items():
                row = {"shape": shape, "precision": "bfloat16 autocast" if autocast else "float32", "method": method}
                row |= result | {
                    "time / AdamW": result["step_s"] / adamw["step_s"],
                    "memory / AdamW": result["peak_mb"] / adamw["peak_mb"],
                }
                if method.startswith("poet"):
                    row["linear flop ratio"] = linear_flop_ratio(method, shape)
                rows.append(row)
    return rows
