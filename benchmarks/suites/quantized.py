"""Quantised frozen bases (QPOET, QOFT): requantisation drift, pretraining and fine-tuning steps.

- ``drift``: a POET layer with a quantised ``W0`` goes through ``K`` merge-then-reinitialise steps with random
  rotations of the size measured in training; an exact float64 copy of ``W0`` gets the same rotations. Reported:
  ``‖dequant(W0) − W_exact‖_F / ‖W_exact‖_F`` and the spectrum drift ``‖σ(dequant W0) − σ(W_exact)‖ / ‖σ(W_exact)‖``
  for nf4, int8 and none, by nearest and stochastic rounding. The exact copy starts from the dequantised ``W0``, so
  the figures are what the merges add to the first quantisation (nf4 9 %, int8 0.4 % relative).
- ``pretrain``: one step of llama-130m, 4 × 256 (``benchmarks.suites.pretrain_step.measure``) with an nf4 or int8 ``W0``
  against AdamW and against POET with a float32 ``W0``, each in its own process.
- ``finetune``: one step of the SmolLM-135M shape, 8 × 128, on a 4-bit base: QOFT and QPOET against PEFT's LoRA r 8
  on the same base (QLoRA), each in its own process.

The step rows run each method in processes started as a user starts one (glibc's default allocator, no variable in
the environment); memory and time come from the same processes, the median of ``REPEATS``, interleaved so that the
machine's noise hits every method alike.
- ``quality``: the README's tiny pretraining run with a float32, int8 and nf4 ``W0``: validation perplexity.
"""

from __future__ import annotations

import statistics
import sys

import torch

from benchmarks.common import readme_job_rows
from poet_hf.tuners.rotation.low_precision import LOW_PRECISION_DTYPES

# Rotation sizes: the median largest ||Q||_2 per layer and side at a merge of the README's tiny pretraining run
# (block 32, 50 steps between merges; measured 0.17), and a tenth of it (shorter intervals or lower rates).
TRAINING_Q_NORM = 0.17
MERGES = (1, 5, 10, 20, 50)
REPEATS = 2
SETTINGS = {"allocator": "glibc default, as a user runs it", "repeats": f"median of {REPEATS}, interleaved"}


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def drift(
    quantization: str | None,
    requantize: str,
    q_norm: float = TRAINING_Q_NORM,
    merges: tuple = MERGES,
    dim: int = 512,
    block: int = 32,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    residual_storage: str = "layer",
) -> dict[int, dict[str, float]]:
    """``{K: {"weight": …, "spectrum": …, "held": …}}`` after ``K`` merges (see the module docstring), ``"held"``
    the bytes per ``W0`` entry the layer holds between folds (``residual_storage``: where feedback keeps its
    residual); for a 16-bit ``W0`` (``dtype``) also ``"roundings"``: ``‖W0 − W_exact‖_F / ‖fl(W_exact) − W_exact‖_F``,
    the error in units of one rounding of the exact weight to ``dtype``."""
    from peft import get_peft_model

    import poet_hf  # noqa: F401
    from poet_hf import PoetConfig
    from poet_hf.orthogonal import random_skew_params

    torch.manual_seed(seed)
    config = PoetConfig(
        target_modules=["proj"],
        block_size=block,
        base_init="normalized",
        seed=seed,
        base_quantization=quantization,
        requantize=requantize,
        residual_storage=residual_storage,
        train_other_params=False,
    )
    model = get_peft_model(_holder(dim).to(dtype), config)
    layer = next(m for m in model.modules() if hasattr(m, "rotation_specs"))
    exact = layer.weight_matrix().double()
    sigma = torch.linalg.svdvals
    generator = torch.Generator().manual_seed(seed + 1)
    report = {}
    for k in range(1, max(merges) + 1):
        with torch.no_grad():
            for side, spec in layer.sides("default").items():
                param = layer.rotation_parameter("default", side)
                param.copy_(random_skew_params(param.shape, spec.block, generator, q_norm))
            exact = layer.rotate_weight(exact, "default")
            layer.merge_and_reinit("default")
        if k in merges:
            current = layer.weight_matrix().double()
            report[k] = {"weight": _relative(current, exact), "spectrum": _relative(sigma(current), sigma(exact))}
            report[k]["held"] = layer.base_weight_bytes() / current.numel()
            if dtype in LOW_PRECISION_DTYPES:  # in units of one nearest rounding of the exact weight
                report[k]["roundings"] = float((current - exact).norm() / (exact.to(dtype).double() - exact).norm())
    return report


def _holder(dim: int) -> torch.nn.Module:
    from torch import nn

    holder = nn.Module()
    holder.proj = nn.Linear(dim, dim, bias=False)
    return holder


def drift_rows(q_norms: tuple = (TRAINING_Q_NORM, TRAINING_Q_NORM / 10)) -> list[dict]:
    """The drift table: one row per (rotation size, quantisation, rounding), a column per ``K``."""
    from poet_hf.tuners.rotation.quantization import REQUANTIZE_MODES

    rows = []
    bases = [(None, torch.float32), *((None, dtype) for dtype in LOW_PRECISION_DTYPES)]
    bases += [(quantization, torch.float32) for quantization in ("int8", "nf4")]
    for q_norm in q_norms:
        for quantization, dtype in bases:
            modes = ("nearest",) if dtype == torch.float32 and quantization is None else REQUANTIZE_MODES
            for requantize, storage in [(m, "layer") for m in modes] + [("feedback", "disk")] * ("feedback" in modes):
                result = drift(quantization, requantize, q_norm, dtype=dtype, residual_storage=storage)
                name = quantization or str(dtype).removeprefix("torch.")
                row = {"||Q||_2": q_norm, "W0": name, "requantize": requantize, "residual_storage": storage}
                for key in ("weight", "spectrum", "roundings", "held"):
                    row.update({f"K={k} {key}": r[key] for k, r in result.items() if key in r})
                rows.append(row)
    return rows


PRETRAIN = ("llama-130m", 4)  # preset, micro-batch (× 256 tokens)
PRETRAIN_METHODS = (
    ("adamw", None, "nearest"),
    ("poet-bs", None, "nearest"),
    ("poet-bs", "nf4", "feedback"),
    ("poet-bs", "nf4", "nearest"),
    ("poet-bs", "int8", "feedback"),
)


def _median(runs: list[dict]) -> dict:
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]}


def pretrain_rows(quick: bool = False, repeats: int = REPEATS) -> list[dict]:
    """One llama-130m pretraining step (``benchmarks.suites.pretrain_step.measure``) per W0 storage, against AdamW.

    Floors, in bytes, with ``N`` the ``W0`` entries, ``S`` the skew parameters and ``B`` the bytes ``W0`` occupies:
    AdamW keeps ``16·N`` for those weights (parameter, gradient, two states) where POET keeps ``B + 16·S``
    (``analytic``); at AdamW's peak (the ``lm_head`` backward) its block gradients do not exist yet, so only
    ``12·N − B − 12·S`` can be saved there (``at-peak``)."""
    from benchmarks.suites.pretrain_step import _child

    preset, batch = ("tiny", 4) if quick else PRETRAIN
    steps = 2 if quick else 3
    runs: dict[tuple, list[dict]] = {m: [] for m in PRETRAIN_METHODS}
    for _ in range(1 if quick else repeats):  # interleaved: noise hits every method alike
        for key in PRETRAIN_METHODS:
            method, quantization, requantize = key
            options = {"quantization": quantization, "requantize": requantize} if quantization else {}
            runs[key].append(_child(method, preset, batch, steps, **options))
    adamw, poet = _median(runs[PRETRAIN_METHODS[0]]), _median(runs[PRETRAIN_METHODS[1]])
    adamw_peak, adamw_time, poet_time = adamw["peak_mb"], adamw["step_s"], poet["step_s"]
    rows = []
    for key in PRETRAIN_METHODS[1:]:
        method, quantization, requantize = key
        mem = _median(runs[key])
        step = mem["step_s"]
        n, skew, stored = mem["frozen"], mem["skew"], mem["w0_bytes"]
        analytic = (16 * n - stored - 16 * skew) / 2**20
        at_peak = (12 * n - stored - 12 * skew) / 2**20
        saved = adamw_peak - mem["peak_mb"]
        rows.append(
            {
                "model, batch": f"{preset}, {batch}x256",
                "W0": quantization or "float32",
                "requantize": requantize if quantization else "",
                "W0 bytes/entry": stored / n,
                "AdamW peak MB": adamw_peak,
                "POET peak MB": mem["peak_mb"],
                "AdamW whole peak MB": adamw["whole_peak_mb"],
                "POET whole peak MB": mem["whole_peak_mb"],
                "memory ratio": mem["peak_mb"] / adamw_peak,
                "analytic estimate": (adamw_peak - analytic) / adamw_peak,
                "at-peak estimate": (adamw_peak - at_peak) / adamw_peak,
                "saving / analytic": saved / analytic,
                "saving / at-peak": saved / at_peak,
                "step s": step,
                "time / POET fp32 W0": step / poet_time,
                "time / AdamW": step / adamw_time,
            }
        )
    return rows


FINETUNE_METHODS = (("lora", "nf4"), ("oft", "nf4"), ("poet", "nf4"), ("lora", "int8"), ("oft", "int8"))


def finetune_rows(quick: bool = False, repeats: int = REPEATS) -> list[dict]:
    """One fine-tuning step of the SmolLM-135M shape (``benchmarks.suites.finetune_step``) on a base loaded in 4-bit or
    8-bit through ``BitsAndBytesConfig``: QOFT and QPOET (block 32; POET in the contiguous layout of
    ``scripts/finetune.py``'s default recipe) against PEFT's LoRA r 8 on the same base."""
    from benchmarks.suites.finetune_step import _child

    steps = 2 if quick else 5
    runs: dict[tuple, list[dict]] = {m: [] for m in FINETUNE_METHODS}
    for _ in range(1 if quick else repeats):  # interleaved: noise hits every method alike
        for key in FINETUNE_METHODS:
            method, quantization = key
            options = {"quantization": quantization, "lora_rank": 8, "poet_spo": "contiguous"}
            runs[key].append(_child(method, quick, steps, **options))
    rows = []
    for key in FINETUNE_METHODS:
        method, quantization = key
        mem, base_mem = _median(runs[key]), _median(runs[("lora", quantization)])
        step, base_step = mem["step_s"], base_mem["step_s"]
        rows.append(
            {
                "base": quantization,
                "method": {"lora": "LoRA r 8", "oft": "QOFT", "poet": "QPOET"}[method],
                "trainable (M)": mem["trainable"] / 1e6,
                "step s": step,
                "peak MB": mem["peak_mb"],
                "time / QLoRA": step / base_step,
                "memory / QLoRA": mem["peak_mb"] / base_mem["peak_mb"],
            }
        )
    return rows


def quality_rows(quick: bool = False) -> list[dict]:
    """The README's main job (``scripts/pretrain.py``: tiny preset, embedded corpus, 200 steps, 4 merges) with a
    float32, an int8 and an nf4 ``W0``: validation perplexity at the same steps, each in its own process."""
    variants = {"float32": [], "int8": ["--base_quantization", "int8"], "nf4": ["--base_quantization", "nf4"]}
    return readme_job_rows("W0", variants, quick)


def run(quick: bool = False, repeats: int = REPEATS) -> list[dict]:
    drift_table = drift_rows((TRAINING_Q_NORM,) if quick else (TRAINING_Q_NORM, TRAINING_Q_NORM / 10))
    return (
        [{"table": "drift", **row} for row in drift_table]
        + [{"table": "pretrain step", **row} for row in pretrain_rows(quick, repeats)]
        + [{"table": "fine-tune step", **row} for row in finetune_rows(quick, repeats)]
        + [{"table": "quality", **row} for row in quality_rows(quick)]
    )


if __name__ == "__main__":
    for row in run(quick="--quick" in sys.argv):
        print(row)
