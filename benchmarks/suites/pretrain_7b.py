"""A Llama-2-7B POET training step on this machine: built on ``meta``, quantised layer by layer, trained in float32.

The shape is ``configs/models/llama-2-7b.json``. The model is built under ``torch.device("meta")``, wrapped with
``PoetConfig(base_quantization="nf4")`` and materialized by ``materialize_model``, which initialises each layer (keyed)
and quantises it before the next one gets storage. The run then trains with everything on:

- nf4 ``W0``, with error feedback keeping its residual off the steps' memory (``residual_storage="auto"``: a file per
  layer on the CPU);
- optimizer steps fused into the backward (`poet_hf.training.FusedStepOptimizer`);
- bitsandbytes' 8-bit AdamW states for the skews and ``lm_head``, 32-bit ones for the input embeddings (as
  `create_poet_optimizer` keeps them, `poet_hf.training.optimizer.keep_32bit_states`);
- the head and the input embeddings, and their 32-bit moments, stored in bfloat16 with stochastic rounding
  (``vocab_weights_dtype``, `poet_hf.training.bf16_storage`);
- activation checkpointing per block (non-reentrant).

The fused steps keep the clip (``max_grad_norm`` 1.0, against the running global-norm estimate of
`FusedStepOptimizer`).

Measured in its own process, started as a user starts one: no allocator variable in its environment (the package fixes
glibc's mmap threshold itself where the savings run, `poet_hf.allocator`). Each phase's peak is measured on its own
(Linux's ``clear_refs`` resets the high-water mark): the build, the training steps, a merge (``merge_and_reinit`` of
every layer, each 4-bit ``W0`` folded a group of rows at a time, `poet_hf.tuners.rotation.row_fold`, its residual read
and written a layer at a time) and a step after it; each as the whole process's peak RSS (imports included) and as the
peak above the RSS after the imports. Beside the measured step peak, `poet_hf.plan_memory`'s figure for the same run
(above the imports, as the planner counts), for ``1 × 2048`` in bfloat16 on a GPU, and for the head and embeddings in
float32; and the size of the residual files and their folder.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import PLAN_EVERYTHING_ON, measure_as_a_user, reset_peak_rss, status_mb

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "models" / "llama-2-7b.json"
BLOCK_SIZE = 256
RECIPE = {"vocab_weights_dtype": "bfloat16"}  # what the measured run adds to `measure`'s defaults


def measure(
    steps: int = 2,
    batch: int = 1,
    seq: int = 256,
    layers: int | None = None,
    max_grad_norm: float = 1.0,
    config: str = str(CONFIG),
    vocab_weights_dtype: str = "float32",
) -> dict[str, Any]:
    """In the child process: build, train ``steps`` steps, merge, train one more; each phase's peak and time.
    ``layers``: fewer blocks than the shape's (a smoke run); ``config``: the shape's ``config.json``;
    ``vocab_weights_dtype``: the head's and embeddings' storage (`FusedStepOptimizer`)."""
    import bitsandbytes
    from peft import get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    import poet_hf  # noqa: F401
    from poet_hf import PoetConfig, merge_and_reinit
    from poet_hf.allocator import bound_allocator_slack
    from poet_hf.initialization import materialize_model
    from poet_hf.training import FusedStepOptimizer, poet_param_groups, poet_parameters, reset_optimizer_state
    from poet_hf.training.optimizer import keep_32bit_states
    from poet_hf.tuners.rotation.layer import rotation_layers

    after_imports = status_mb("VmRSS")
    imports_peak = status_mb("VmHWM")
    shape = config
    config = LlamaConfig.from_json_file(shape)
    config.num_hidden_layers = layers or config.num_hidden_layers
    config.max_position_embeddings = seq
    torch.manual_seed(0)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    poet = PoetConfig(block_size=BLOCK_SIZE, base_init="normalized", base_quantization="nf4", train_other_params=True)
    model = get_peft_model(model, poet)
    report: dict[str, Any] = {
        "shape": Path(shape).stem,
        "vocab_weights_dtype": vocab_weights_dtype,
        "layers": config.num_hidden_layers,
        "batch": batch,
        "seq": seq,
        "max_grad_norm": max_grad_norm,
        "imports_rss_mb": after_imports,
        "imports_peak_mb": imports_peak,
    }

    def phase(name: str, work) -> None:
        reset_peak_rss()
        start = time.perf_counter()
        work()
        report[f"{name}_s"] = time.perf_counter() - start
        report[f"{name}_whole_peak_mb"] = status_mb("VmHWM")
        report[f"{name}_peak_mb"] = report[f"{name}_whole_peak_mb"] - after_imports

    phase("build", lambda: materialize_model(model, seed=0, device="cpu"))
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    groups = poet_param_groups(model, 1e-3, 1e-3, 0.0, [])
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)  # before the head is chunked
    keep_32bit_states(model, bitsandbytes.optim.AdamW8bit, {"optim_bits": 8})  # as create_poet_optimizer does
    optimizer = FusedStepOptimizer(
        groups,
        bitsandbytes.optim.AdamW8bit,
        max_grad_norm=max_grad_norm,
        model=model,
        vocab_weights_dtype=None if vocab_weights_dtype == "float32" else getattr(torch, vocab_weights_dtype),
    )
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))
    losses: list[float] = []

    def train(count: int) -> None:
        for _ in range(count):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(loss.detach()))

    def merge() -> None:
        merge_and_reinit(model)
        reset_optimizer_state(optimizer, poet_parameters(model))

    phase("steps", lambda: train(steps))
    report["step_s"] = report.pop("steps_s") / steps
    phase("merge", merge)
    phase("after_merge", lambda: train(1))
    layers_ = [layer for _, layer in rotation_layers(model)]
    entries = sum(layer.in_features * layer.out_features for layer in layers_)
    report.update(
        losses=losses,
        w0_bytes_per_entry=sum(layer.base_weight_bytes() for layer in layers_) / entries,
        skew_params=sum(p.numel() for p in poet_parameters(model)),
        trainable_params=trainable,
        whole_peak_mb=max(report[f"{name}_whole_peak_mb"] for name in ("build", "steps", "merge", "after_merge")),
        allocator_bounded=bound_allocator_slack(),
        residual_folder=residual_folder(layers_),
        residual_file_mb=residual_file_mb(layers_),
        states_mb=sum(
            t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)
        )
        / 2**20,
    )
    return report


def residual_folder(layers: list) -> str | None:
    """The folder of the model's residual files (`poet_hf.tuners.rotation.residual_folder`), if any were written."""
    folder = layers[0].step_state.residual_folder.current() if layers else None
    return str(folder) if folder is not None else None


def residual_file_mb(layers: list) -> float:
    """What the residual files hold on disk, in MB."""
    folder = residual_folder(layers)
    return sum(p.stat().st_size for p in Path(folder).iterdir()) / 2**20 if folder else 0.0


@functools.cache  # the planner builds the model on meta: once per settings
def plan(
    batch: int,
    seq: int,
    dtype: str = "float32",
    layers: int | None = None,
    method: str = "poet-bs",
    config: str = str(CONFIG),
    vocab_weights_dtype: str = "float32",
) -> Any:
    """`poet_hf.plan_memory`'s plan for the run `measure` makes (or for ``dtype``, or ``method`` with the same
    savings: AdamW with 8-bit states and fused steps, checkpointed)."""
    from transformers import LlamaConfig

    from poet_hf import plan_memory

    shape = LlamaConfig.from_json_file(config)
    shape.num_hidden_layers = layers or shape.num_hidden_layers
    savings = dict(PLAN_EVERYTHING_ON, vocab_weights_dtype=vocab_weights_dtype)
    if method != "poet-bs":
        savings.pop("base_quantization")
    return plan_memory(shape, method, block_size=BLOCK_SIZE, dtype=dtype, batch_size=batch, seq_len=seq, **savings)


def planned_mb(batch: int, seq: int, dtype: str = "float32", layers: int | None = None, **shape: Any) -> float:
    """The per-process total of `plan`, in MB (above the imports, as the planner counts)."""
    return plan(batch, seq, dtype, layers, **shape).total_bytes / 2**20


def run(quick: bool = False) -> list[dict]:
    """One row: the measured phases of a 7B step (``quick``: two blocks of the shape) and the planner's figures."""
    layers = 2 if quick else None
    row = measure_as_a_user("pretrain_7b", steps=2, batch=1, seq=256, layers=layers, **RECIPE)
    row["planned_mb"] = planned_mb(1, 256, layers=layers, **RECIPE)
    row["planned_vs_measured"] = row["planned_mb"] / row["steps_peak_mb"]  # both above the imports
    row["planned_gpu_bf16_1x2048_mb"] = planned_mb(1, 2048, "bfloat16", layers=layers, **RECIPE)
    row["planned_adamw_same_savings_mb"] = planned_mb(1, 256, layers=layers, method="adamw", **RECIPE)
    row["planned_float32_vocab_mb"] = planned_mb(1, 256, layers=layers)
    return [row]
