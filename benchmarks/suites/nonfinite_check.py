"""What `PoetTrainer`'s non-finite step check costs one llama-130m POET-BS step (`poet_hf.training.nonfinite`).

The check replaces Trainer's clip (Accelerate's ``clip_grad_norm_``: the global gradient norm, then the scale) by the
same two halves with the check between them: the norm's and the loss's finiteness, read with one host sync. Both
clips run here on the gradients of one real step of the paper's llama-130m (POET-BS 256, trainable embeddings, norms
and head, 4 × 256 tokens, float32), alternating, median of the repeats; the forward and backward are timed in the
same process, so the check's extra time is a fraction of a step (the optimizer's update would only add to the step).
"""

from __future__ import annotations

import statistics
import time

import torch

REPEATS, QUICK_REPEATS = 21, 3
BATCH, SEQ, VOCAB = 4, 256, 32000


def _seconds(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def run(quick: bool = False) -> list[dict]:
    from accelerate import Accelerator
    from peft import get_peft_model

    from poet_hf import PoetConfig
    from poet_hf.recipes.presets import PRESETS, build_llama
    from poet_hf.training.nonfinite import NonFiniteGuard, clip_to_norm, total_grad_norm

    preset = PRESETS["llama-130m"] if not quick else PRESETS["tiny"]
    model = build_llama(preset, "poet-bs", VOCAB, SEQ, seed=0)
    config = PoetConfig(block_size=preset.block_size, base_init="normalized", train_other_params=True)
    model = get_peft_model(model, config).train()
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    params = [p for p in model.parameters() if p.requires_grad]
    accelerator, guard = Accelerator(cpu=True), NonFiniteGuard(limit=10)

    def forward_backward() -> None:
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        guard.note_loss(loss.detach())

    def trainer_clip() -> None:
        accelerator.clip_grad_norm_(params, 1.0)

    def checked_clip() -> None:
        total = total_grad_norm(params)
        if guard.step_is_finite(total)[0]:
            clip_to_norm(params, 1.0, total)

    repeats = QUICK_REPEATS if quick else REPEATS
    step_s = statistics.median(_seconds(forward_backward) for _ in range(3))
    times: dict[str, list[float]] = {"trainer": [], "checked": []}
    for _ in range(repeats):
        guard.note_loss(torch.tensor(1.0))
        times["checked"].append(_seconds(checked_clip))
        times["trainer"].append(_seconds(trainer_clip))
    trainer_ms, checked_ms = (1e3 * statistics.median(times[k]) for k in ("trainer", "checked"))
    return [
        {
            "preset": "llama-130m" if not quick else "tiny",
            "tokens": f"{BATCH} x {SEQ}",
            "repeats": repeats,
            "trainable parameters (M)": sum(p.numel() for p in params) / 1e6,
            "forward+backward s": step_s,
            "Trainer's clip ms": trainer_ms,
            "checked clip ms": checked_ms,
            "check cost / step": (checked_ms - trainer_ms) / (1e3 * step_s),
        }
    ]
