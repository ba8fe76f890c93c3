"""One pretraining step (forward, backward, AdamW) of the paper's LLaMA shapes: POET against AdamW on every weight.

Each (configuration, method) runs in fresh subprocesses started as a user starts one (glibc's default allocator,
no variable in the environment), so its peak memory is its own: peak RSS minus the RSS after imports on CPU (the
CUDA allocator's peak on GPU), and the whole process's peak beside it. Memory and time come from the same children,
the median of ``REPEATS``. Each row carries ``poet_hf.plan_memory``'s prediction for the same run beside the
measured peak. fp32 (bf16 autocast on GPU), ``tie_word_embeddings=False``, vocabulary 32000, POET with
``base_init="normalized"`` and trainable embeddings, norms and ``lm_head`` as in the paper.

Besides the measured ratios, every row carries what the arithmetic estimates (not floors: each leaves out a cost
only AdamW pays in full, its update's temporaries and memory-bound traffic, so a measured ratio can fall below it):

- ``analytic MB``: an estimate, AdamW's peak minus what AdamW keeps and POET does not: 12 bytes per frozen
  ``W0`` entry (gradient and two Adam states) less 16 bytes per skew parameter (parameter, gradient, two states).
- ``at-peak MB``: the same without the gradients. AdamW peaks in the loss / ``lm_head`` backward, before the
  gradients of the blocks exist, so at that moment only ``8 B·W0 − 12 B·skew`` can be saved.
- ``flop ratio``: POET's multiply-adds over AdamW's for the whole optimizer step, counting everything the fused
  layers must compute when they keep nothing but the layer inputs: the base products and the rotations (of the
  weight or of the activations, whichever is cheaper per layer: forward, rebuilt and differentiated in the
  backward) per micro-batch, and the Cayley–Neumann polynomial (forward, rebuilt, and its vector-Jacobian product)
  once per optimizer step. The ``lm_head``, embeddings and attention cost the same in both.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import optimizer_step, reset_peak_rss, status_mb, timed_seconds

ROOT = Path(__file__).resolve().parents[2]
VOCAB, SEQ = 32000, 256
REPEATS = 2
SETTINGS = {
    "allocator": "glibc default, as a user runs it",
    "memory": "peak RSS above the RSS after imports (and the whole process's), each method in its own process",
    "repeats": f"median of {REPEATS} children, each giving memory and time",
}

# (preset, micro-batch, optimizer steps timed, micro-batches per optimizer step)
CONFIGS = [
    ("llama-60m", 4, 5, 1),
    ("llama-130m", 4, 5, 1),
    ("llama-130m", 16, 3, 1),
    ("llama-130m", 4, 2, 2),
    ("llama-130m", 4, 1, 8),
    ("llama-350m", 2, 3, 1),
]
QUICK_CONFIGS = [("tiny", 4, 2, 1), ("tiny", 4, 2, 4)]
METHODS = ("adamw", "poet-bs", "poet-fs")


def measure(
    method: str,
    preset_name: str,
    batch: int,
    steps: int,
    quantization: str | None = None,
    requantize: str = "feedback",
    accumulation: int = 1,
    cache_rotations: bool = True,
    compiled: bool = False,
    checkpointing: bool = False,
    optim: str = "adamw",
    fused_step: bool = False,
    peak_after_build: bool = False,
) -> dict:
    """In the child process: build, warm up one step, then time ``steps`` optimizer steps of ``accumulation``
    micro-batches of ``batch`` sequences each; report memory and its parts (``cache_mb``: the rotation caches held
    across the micro-batches of a step). ``compiled``: ``torch.compile`` (Inductor) the model, compiled in the
    warm-up step (``compile_s``); ``checkpointing``: non-reentrant activation checkpointing per block; ``optim``:
    ``"adamw"`` (torch) or ``"adamw_8bit"`` (bitsandbytes' AdamW8bit, POET's same two rates), or a peer's
    layer-wise optimizer (`benchmarks.peer_optimizers.PEER_OPTIMIZERS`); ``fused_step``: each parameter steps in the
    backward (`poet_hf.training.FusedStepOptimizer`); ``peak_after_build``: the peak of the steps alone (the
    high-water mark reset once the model is built; a quantised ``W0`` is then built on ``meta`` and quantised layer
    by layer).

    ``quantization`` (POET only) quantises every ``W0`` (``PoetConfig.base_quantization``); one merge-then-reinitialise
    then runs before the warm-up, so that the requantisation residual of ``requantize="feedback"`` exists, as in
    any run past its first merge. ``w0_bytes`` is what the frozen ``W0`` occupies (codes, statistics, residual)."""
    from peft import get_peft_model

    import poet_hf  # noqa: F401
    from poet_hf import PoetConfig, merge_and_reinit
    from poet_hf.recipes.presets import PRESETS, build_llama
    from poet_hf.training import poet_param_groups
    from poet_hf.tuners.rotation.layer import rotation_layers

    after_imports = status_mb("VmRSS")
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    preset = PRESETS[preset_name]
    on_meta = peak_after_build and quantization is not None
    model = build_llama(
        preset, "poet-bs" if method == "poet-bs" else "adamw", VOCAB, SEQ, seed=0, device="meta" if on_meta else "cpu"
    )
    if method != "adamw":
        spo = {"spo": "block", "block_size": preset.block_size} if method == "poet-bs" else {"spo": "full"}
        model = get_peft_model(
            model,
            PoetConfig(
                **spo,
                base_init="normalized",
                base_quantization=quantization,
                requantize=requantize,
                cache_rotations=cache_rotations,
            ),
        )
        if on_meta:
            from poet_hf.initialization import materialize_model

            materialize_model(model, seed=0, device="cpu")
        if quantization:
            merge_and_reinit(model)
    model.to(dev)
    if checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    groups = poet_param_groups(model, 1e-3, 1e-3, 0.0, [])
    optimizer_cls: type[torch.optim.Optimizer] = torch.optim.AdamW
    if optim == "adamw_8bit":
        import bitsandbytes

        from poet_hf.training.optimizer import keep_32bit_states

        optimizer_cls = bitsandbytes.optim.AdamW8bit
        keep_32bit_states(model, optimizer_cls, {"optim_bits": 8})  # the embeddings, as Trainer and POET's optimizer
    if optim not in ("adamw", "adamw_8bit"):
        from benchmarks.peer_optimizers import peer_optimizer

        optimizer: torch.optim.Optimizer = peer_optimizer(model, optim)
    elif fused_step:
        from poet_hf.training import FusedStepOptimizer

        optimizer = FusedStepOptimizer(groups, optimizer_cls, model=model)
    else:
        optimizer = optimizer_cls(groups)
    if peak_after_build and dev.type == "cpu":
        reset_peak_rss()  # the peak restarts at the built model's RSS
    runner = torch.compile(model) if compiled else model
    ids = torch.randint(0, VOCAB, (batch, SEQ), device=dev)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=dev.type == "cuda")
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def loss() -> torch.Tensor:
        with autocast:
            return runner(input_ids=ids, labels=ids).loss

    start = time.perf_counter()
    optimizer_step(model, optimizer, loss)  # warm-up: allocates the optimizer states (and compiles)
    sync()
    compile_s = time.perf_counter() - start if compiled else 0.0
    times, caches = [], []
    for _ in range(steps):
        times.append(timed_seconds(lambda: caches.append(optimizer_step(model, optimizer, loss, accumulation)), dev))
    cache_mb = caches[-1]["cache_mb"]
    trainable = [p for p in model.parameters() if p.requires_grad]
    layers = [layer for _, layer in rotation_layers(model)]
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    if layers:  # the W0 entries: a quantised weight stores fewer (packed) elements than it has entries
        frozen = sum(layer.in_features * layer.out_features for layer in layers)
    w0_bytes = sum(layer.base_weight_bytes() for layer in layers) if layers else 4 * frozen
    skew = sum(p.numel() for n, p in model.named_parameters() if p.requires_grad and "poet_" in n)
    peak = (
        torch.cuda.max_memory_allocated() / 2**20
        if dev.type == "cuda"
        else (status_mb("VmHWM") if peak_after_build else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
        - after_imports
    )
    params_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    return {
        "step_s": statistics.median(times),
        "compile_s": compile_s,
        "peak_mb": peak,
        "whole_peak_mb": peak + after_imports if dev.type == "cpu" else peak,
        "params_mb": params_mb,
        "grads_mb": sum(p.numel() * p.element_size() for p in trainable) / 2**20,
        "states_mb": sum(
            t.numel() * t.element_size()
            for s in optimizer.state.values()
            for t in s.values()
            if torch.is_tensor(t) and t.dim() > 0
        )
        / 2**20,
        "frozen": frozen,
        "skew": skew,
        "w0_bytes": w0_bytes,
        "cache_mb": cache_mb,
        "cache_floor_mb": 4
        * sum(
            2 * layer.rotation_parameter(a, side).shape[0] * spec.block**2
            for layer in layers
            for a, specs in layer.rotation_specs.items()
            for side, spec in specs.items()
        )
        / 2**20
        if accumulation > 1 and cache_rotations
        else 0.0,
    }


def flops_per_step(
    preset_name: str, batch: int, method: str, terms: int = 5, accumulation: int = 1, amortized: bool = True
) -> float:
    """Multiply-adds ×2 of one optimizer step of ``accumulation`` micro-batches, counted from the shapes (see the
    module docstring). Each POET layer is counted at the strategy ``forward="auto"`` picks
    (:func:`~poet_hf.orthogonal.strategy_costs.auto_strategy`; at these widths one that keeps nothing but the layer
    input). ``amortized``: the
    Cayley–Neumann polynomial runs once per optimizer step whatever ``accumulation`` is (built in the first forward,
    rebuilt and differentiated in the last backward); otherwise once per micro-batch (``cache_rotations=False``)."""
    from poet_hf.orthogonal import CayleyNeumann
    from poet_hf.orthogonal.spo import SideSpec, subset_size
    from poet_hf.orthogonal.strategy_costs import auto_strategy, polynomial_products, strategy_costs
    from poet_hf.recipes.presets import PRESETS

    preset = PRESETS[preset_name]
    tokens, d = batch * SEQ, preset.hidden
    ffn = preset.intermediate_bs if method == "poet-bs" else preset.intermediate
    shapes = [(d, d)] * 4 + [(d, ffn), (d, ffn), (ffn, d)]  # (in, out) of q, k, v, o, gate, up, down
    # per optimizer step (amortized) or per micro-batch; the Cayley–Neumann product count does not depend on b
    polynomial = polynomial_products(CayleyNeumann(terms), preset.block_size, "uncached")
    total = 0.0
    for d_in, d_out in shapes:
        if method == "adamw":
            total += accumulation * 3 * tokens * d_in * d_out  # y, ∂L/∂x, ∂L/∂W
            continue
        r, p = (
            SideSpec("block", dim, preset.block_size)
            if method == "poet-bs"
            else SideSpec("full", dim, subset_size(dim, 0.5))
            for dim in (d_in, d_out)
        )
        costs = strategy_costs(tokens, d_in, d_out, r, p, training=True)
        total += accumulation * costs[auto_strategy(costs, d_in, d_out)]["macs"]
        total += (1 if amortized else accumulation) * polynomial * sum(s.num_blocks * s.block**3 for s in (r, p))
    total *= 2 * preset.layers
    total += accumulation * 6 * tokens * d * VOCAB  # lm_head (trained in both)
    total += accumulation * preset.layers * 3 * 2 * 2 * batch * SEQ * SEQ * d  # attention scores and values
    return total


def _child(method: str, preset: str, batch: int, steps: int, env: dict | None = None, **options: Any) -> dict:
    code = (
        f"import json, sys; sys.path.insert(0, {str(ROOT)!r}); from benchmarks.suites.pretrain_step import measure; "
        f"print(json.dumps(measure({method!r}, {preset!r}, {batch}, {steps}, **{options!r})))"
    )
    env = {**os.environ, **(env or {})}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def _planned_mb(method: str, preset: str, batch: int, accumulation: int, cache_rotations: bool = True) -> float:
    """``poet_hf.plan_memory``'s per-process total for the run `measure` makes (one process, float32)."""
    from poet_hf import plan_memory
    from poet_hf.recipes.presets import PRESETS

    plan = plan_memory(
        preset,
        method,
        block_size=PRESETS[preset].block_size,
        batch_size=batch,
        seq_len=SEQ,
        accumulation=accumulation,
        cache_rotations=cache_rotations,
    )
    return plan.total_bytes / 2**20


def run(quick: bool = False, repeats: int = REPEATS, configs: list[tuple] | None = None) -> list[dict]:
    rows = []
    for preset, batch, steps, accumulation in configs or (QUICK_CONFIGS if quick else CONFIGS):
        variants = {m: (m, {}) for m in METHODS}
        if accumulation > 1:  # the same run rebuilding the rotations per micro-batch, as before the cache
            variants["poet-bs, cache off"] = ("poet-bs", {"cache_rotations": False})
        result = {}
        for name, (m, options) in variants.items():
            runs = [
                _child(m, preset, batch, steps, accumulation=accumulation, **options)
                for _ in range(1 if quick else repeats)
            ]
            result[name] = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
            result[name]["planned_mb"] = _planned_mb(m, preset, batch, accumulation, **options)
        adamw = result["adamw"]
        for method in [name for name in result if name != "adamw"]:
            poet = result[method]
            frozen, skew = poet["frozen"], poet["skew"]  # frozen: exactly the W0 entries (the rest trains)
            # With accumulation AdamW holds every gradient at its peak, and POET holds its rotation caches.
            analytic = (12 * frozen - 16 * skew) / 2**20 - poet["cache_floor_mb"]
            at_peak = analytic if accumulation > 1 else (8 * frozen - 12 * skew) / 2**20
            saved = adamw["peak_mb"] - poet["peak_mb"]
            rows.append(
                {
                    "preset": preset,
                    "batch": f"{batch}x{SEQ}",
                    "accumulation": accumulation,
                    "method": method,
                    "AdamW peak MB": adamw["peak_mb"],
                    "POET peak MB": poet["peak_mb"],
                    "AdamW whole peak MB": adamw["whole_peak_mb"],
                    "POET whole peak MB": poet["whole_peak_mb"],
                    "AdamW planned MB": adamw["planned_mb"],
                    "POET planned MB": poet["planned_mb"],
                    "AdamW measured / planned": adamw["peak_mb"] / adamw["planned_mb"],
                    "POET measured / planned": poet["peak_mb"] / poet["planned_mb"],
                    "memory ratio": poet["peak_mb"] / adamw["peak_mb"],
                    "analytic estimate ratio": (adamw["peak_mb"] - analytic) / adamw["peak_mb"],
                    "saving / analytic": saved / analytic,
                    "saving / at-peak": saved / at_peak,
                    "POET params MB": poet["params_mb"],
                    "POET grads MB": poet["grads_mb"],
                    "POET states MB": poet["states_mb"],
                    "POET other MB": poet["peak_mb"] - poet["params_mb"] - poet["grads_mb"] - poet["states_mb"],
                    "POET cache MB": poet["cache_mb"],
                    "cache floor MB": poet["cache_floor_mb"],
                    "AdamW step s": adamw["step_s"],
                    "POET step s": poet["step_s"],
                    "time ratio": poet["step_s"] / adamw["step_s"],
                    "flop ratio": (
                        flops_per_step(
                            preset,
                            batch,
                            variants[method][0],
                            accumulation=accumulation,
                            amortized="cache off" not in method,
                        )
                        / flops_per_step(preset, batch, "adamw", accumulation=accumulation)
                    ),
                }
            )
    return rows
