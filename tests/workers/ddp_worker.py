"""Run under `accelerate launch`: a short POET run, then write losses and a hash of every parameter and buffer
per rank to OUT/rank<k>.json. Without a quantised base the model is built on the meta device and PoetTrainer
materializes it in each process. Usage: ddp_worker.py OUT PER_DEVICE_BATCH [BASE_QUANTIZATION | fused[:bfloat16]
[ACCUMULATION]]: ``fused`` steps in the backward with the clip off (its running norm estimate depends on the order
parameters finish, which DDP's buckets change), the head and embeddings stored as ``:bfloat16`` says."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "helpers"))
from training_utils import state_hash, tiny_dataset, tiny_poet_model, tiny_trainer  # noqa: E402


def main() -> None:
    out, batch = Path(sys.argv[1]), int(sys.argv[2])
    option = sys.argv[3] if len(sys.argv) > 3 else None
    fused = option is not None and option.startswith("fused")
    quantization = None if fused else option
    overrides = {}
    if fused:
        vocab = option.partition(":")[2] or "float32"
        accumulation = int(sys.argv[4]) if len(sys.argv) > 4 else 1
        overrides = {"fused_optimizer_step": True, "max_grad_norm": 0.0, "vocab_weights_dtype": vocab}
        overrides["gradient_accumulation_steps"] = accumulation
    dataset, tokenizer = tiny_dataset()
    # Built on the meta device where it can be (a quantised base needs real weights): PoetTrainer materializes it.
    model = tiny_poet_model(len(tokenizer), base_quantization=quantization, meta=quantization is None)
    trainer = tiny_trainer(out / "run", model, dataset, per_device_train_batch_size=batch, max_steps=6, **overrides)
    trainer.train()
    rank = trainer.args.process_index
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    merges = int(next(m for m in model.modules() if hasattr(m, "poet_merge_count")).poet_merge_count["default"])
    (out / f"rank{rank}.json").write_text(
        json.dumps({"hash": state_hash(model), "losses": losses, "merges": merges, "world": trainer.args.world_size})
    )


if __name__ == "__main__":
    main()
    from poet_hf.training.distributed import end_distributed

    end_distributed(exit_process=True)  # accelerate's gloo group: exit before it can abort the finalization
