"""One fine-tuning step of a small pretrained-shaped LLaMA: POET (both sides) against OFT and LoRA.

The model has SmolLM-135M's shape (hidden 576, 30 layers, FFN 1536, 9 heads and 3 key-value heads, vocabulary
49152, tied embeddings); step time and memory do not depend on the weights' values, so it is built randomly, the
way ``scripts/finetune.py`` would load a checkpoint of that shape. Batch 8 × 128 and block 32 are
``scripts/finetune.py``'s defaults; every method wraps every Linear of the blocks and trains only its adapter.
Each method runs in a fresh subprocess (peak RSS minus the RSS after imports); ratios are against OFT at the same
block size.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from benchmarks.common import device, optimizer_step, status_mb, timed_seconds

if TYPE_CHECKING:
    from transformers import LlamaConfig, LlamaForCausalLM

ROOT = Path(__file__).resolve().parents[2]
METHODS = ("oft", "poet", "lora")
ACCUMULATION, ACCUMULATED_METHODS = 4, ("oft", "poet")  # rows per optimizer step of 4 micro-batches
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def smollm_shape(layers: int) -> LlamaConfig:
    """SmolLM-135M's architecture with ``layers`` decoder layers."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        num_hidden_layers=layers,
        intermediate_size=1536,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )


def quantized_checkpoint(layers: int, quantization: str) -> LlamaForCausalLM:
    """A random SmolLM-shaped checkpoint (saved once into the git-ignored ``.cache/bench``) loaded the way a user
    loads one for QLoRA: ``from_pretrained`` with a ``BitsAndBytesConfig`` (nf4 with double quantisation, float32
    compute on CPU; or int8)."""
    from transformers import BitsAndBytesConfig, LlamaForCausalLM

    folder = ROOT / ".cache" / "bench" / f"smollm-shape-{layers}"
    if not (folder / "config.json").exists():
        torch.manual_seed(0)
        LlamaForCausalLM(smollm_shape(layers)).save_pretrained(folder)
    bnb_config = (
        BitsAndBytesConfig(load_in_8bit=True)
        if quantization == "int8"
        else BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=quantization,
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.float32,
        )
    )
    return LlamaForCausalLM.from_pretrained(folder, quantization_config=bnb_config, dtype=torch.float32)


def measure(
    method: str,
    quick: bool,
    steps: int,
    quantization: str | None = None,
    lora_rank: int = 16,
    poet_spo: str = "block",
    accumulation: int = 1,
) -> dict:
    """In the child process: one warm-up step, then ``steps`` timed optimizer steps of ``method`` (each of
    ``accumulation`` micro-batches) on a float32 base, or on a base loaded quantised (``quantization``: ``"nf4"``,
    ``"int8"``); POET's blocks laid out by ``poet_spo``."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    import poet_hf  # noqa: F401
    from poet_hf import OftConfig, PoetConfig

    layers, batch, seq = (4, 2, 64) if quick else (30, 8, 128)
    if quantization:
        quantized_checkpoint(layers, quantization)  # written once, before the baseline RSS is read
    after_imports = status_mb("VmRSS")
    torch.manual_seed(0)
    model = quantized_checkpoint(layers, quantization) if quantization else LlamaForCausalLM(smollm_shape(layers))
    adapter = {
        "poet": PoetConfig(spo=poet_spo, block_size=32, target_modules=TARGETS),
        "oft": OftConfig(block_size=32, target_modules=TARGETS),
        "lora": LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, target_modules=TARGETS),
    }[method]
    dev = device()
    model = get_peft_model(model, adapter).to(dev)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(0, 49152, (batch, seq), device=dev)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=dev.type == "cuda")

    def loss() -> torch.Tensor:
        with autocast:
            return model(input_ids=ids, labels=ids).loss

    optimizer_step(model, optimizer, loss)
    times = [timed_seconds(lambda: optimizer_step(model, optimizer, loss, accumulation), dev) for _ in range(steps)]
    peak = (
        torch.cuda.max_memory_allocated() / 2**20
        if dev.type == "cuda"
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - after_imports
    )
    return {
        "step_s": statistics.median(times),
        "peak_mb": peak,
        "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
    }


def _child(method: str, quick: bool, steps: int, env: dict | None = None, **options: Any) -> dict:
    code = (
        f"import json, sys; sys.path.insert(0, {str(ROOT)!r}); from benchmarks.suites.finetune_step import measure; "
        f"print(json.dumps(measure({method!r}, {quick}, {steps}, **{options!r})))"
    )
    env = {**os.environ, **(env or {})}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def run(quick: bool = False, repeats: int = 3) -> list[dict]:
    """Rows per optimizer step, against OFT: every method without accumulation, then OFT and POET with
    :data:`ACCUMULATION` micro-batches per step (both build their rotations once per step)."""
    rows = []
    for accumulation, methods in ((1, METHODS), (ACCUMULATION, ACCUMULATED_METHODS)):
        steps = 2 if quick or accumulation > 1 else 5
        runs: dict[str, list[dict]] = {m: [] for m in methods}
        for _ in range(1 if quick else repeats):  # interleaved repeats: noise hits every method alike
            for method in methods:
                runs[method].append(_child(method, quick, steps, accumulation=accumulation))
        result = {m: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for m, rs in runs.items()}
        oft = result["oft"]
        rows += [
            {
                "method": m,
                "accumulation": accumulation,
                "trainable (M)": r["trainable"] / 1e6,
                "step s": r["step_s"],
                "peak MB": r["peak_mb"],
                "time / OFT": r["step_s"] / oft["step_s"],
                "memory / OFT": r["peak_mb"] / oft["peak_mb"],
            }
            for m, r in result.items()
        ]
    return rows
