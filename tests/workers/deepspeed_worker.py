"""Run under `accelerate launch` with a DeepSpeed ZeRO config: a short POET run with merges every 3 steps and a
checkpoint at step 4, then write the logged losses, a hash of the whole (gathered) state and its merge count per
rank to OUT/rank<k>.json. Without a launcher it is the single-process reference. METHOD: poet, poet-nf4 (its W0
stored as ``nf4-shardable``, folded to nearest, with activation checkpointing), poet-nf4-chunked (the same with the
loss computed 8 tokens at a time, ``loss_chunk_tokens``), or oft (OFT with a merge every 3 steps too).
PER_DEVICE_BATCH is ``B`` or ``BxK``: K micro-batches of B per optimizer step, the rotations cached across them
(``cache_rotations=True``: every micro-batch but the last defers its rotation gradients).
Usage: deepspeed_worker.py OUT MAX_STEPS PER_DEVICE_BATCH METHOD [CHECKPOINT_TO_RESUME]."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "helpers"))
from models import tiny_llama  # noqa: E402
from peft import get_peft_model  # noqa: E402
from training_utils import state_hash, tiny_dataset, tiny_poet_model, tiny_trainer  # noqa: E402

from poet_hf import OftConfig  # noqa: E402
from poet_hf.training.zero import gathered  # noqa: E402


def main() -> None:
    out, steps, method = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[4]
    batch, _, micro_batches = sys.argv[3].partition("x")
    accumulation = int(micro_batches or 1)
    cache = {"cache_rotations": True} if accumulation > 1 else {}
    resume = sys.argv[5] if len(sys.argv) > 5 else None
    dataset, tokenizer = tiny_dataset()
    savings = method.startswith("poet-nf4")
    if method == "oft":
        base = tiny_llama(0, hidden=32, intermediate=64, vocab=len(tokenizer), heads=2, max_position_embeddings=64)
        model = get_peft_model(base.train(), OftConfig(block_size=8, merge_every=3, **cache))
    else:
        quantized = {"base_quantization": "nf4-shardable", "requantize": "nearest"} if savings else {}
        model = tiny_poet_model(len(tokenizer), merge_every=3, **cache, **quantized)
    schedule = {"max_steps": steps, "save_strategy": "steps", "save_steps": 4}
    schedule["gradient_accumulation_steps"] = accumulation
    schedule["activation_checkpointing"] = savings
    if method == "poet-nf4-chunked":
        schedule["loss_chunk_tokens"] = 8
    trainer = tiny_trainer(out / "run", model, dataset, per_device_train_batch_size=int(batch), **schedule)
    trainer.train(resume_from_checkpoint=resume)
    losses = {log["step"]: log["loss"] for log in trainer.state.log_history if "loss" in log}
    with gathered(model.parameters(), modify=False):  # ZeRO-3: the whole tensors
        digest = state_hash(model)
        skews = sum(float(p.detach().abs().sum()) for n, p in model.named_parameters() if "poet_" in n or "oft_" in n)
    merges = int(next(m for m in model.modules() if hasattr(m, "merge_counts")).merge_counts["default"])
    (out / f"rank{trainer.args.process_index}.json").write_text(
        json.dumps(
            {
                "hash": digest,
                "losses": losses,
                "merges": merges,
                "skews": skews,
                "world": trainer.args.world_size,
                "checkpointing": model.is_activation_checkpointing,
            }
        )
    )


if __name__ == "__main__":
    main()
    from poet_hf.training.distributed import end_distributed

    end_distributed(exit_process=True)  # the gloo group: exit before it can abort the finalization
