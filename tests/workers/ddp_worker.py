"""Run under `accelerate launch`: a short POET run, then write losses and a hash of every parameter and buffer
per rank to OUT/rank<k>.json. Without a quantised base the model is built on the meta device and PoetTrainer
materializes it in each process. Usage: ddp_worker.py OUT PER_DEVICE_BATCH [BASE_QUANTIZATION[+savings] |
fused[:bfloat16] [ACCUMULATION]]: ``fused`` steps in the backward with the clip off (its running norm estimate depends
on the order parameters finish, which DDP's buckets change), the head and embeddings stored as ``:bfloat16`` says;
``+savings`` adds bitsandbytes' 8-bit states (the model 256 wide, so that the head's rows fill its state blocks),
activation checkpointing and the loss 16 tokens at a time."""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "helpers"))
from training_utils import state_hash, tiny_dataset, tiny_poet_model, tiny_trainer  # noqa: E402


def main() -> None:
    out, batch = Path(sys.argv[1]), int(sys.argv[2])
    option = sys.argv[3] if len(sys.argv) > 3 else None
    fused = option is not None and option.startswith("fused")
    quantization, _, savings = (None, "", "") if fused or option is None else option.partition("+")
    overrides = {}
    if savings:
        overrides = {"optim": "adamw_bnb_8bit", "activation_checkpointing": True, "loss_chunk_tokens": 16}
    if fused:
        vocab = option.partition(":")[2] or "float32"
        accumulation = int(sys.argv[4]) if len(sys.argv) > 4 else 1
        overrides = {"fused_optimizer_step": True, "max_grad_norm": 0.0, "vocab_weights_dtype": vocab}
        overrides["gradient_accumulation_steps"] = accumulation
    dataset, tokenizer = tiny_dataset()
    # Built on the meta device where it can be (a quantised base needs real weights): PoetTrainer materializes it.
    hidden = 256 if savings else 32
    model = tiny_poet_model(len(tokenizer), base_quantization=quantization, meta=quantization is None, hidden=hidden)
    trainer = tiny_trainer(out / "run", model, dataset, per_device_train_batch_size=batch, max_steps=6, **overrides)
    trainer.train()
    rank = trainer.args.process_index
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    merges = int(next(m for m in model.modules() if hasattr(m, "poet_merge_count")).poet_merge_count["default"])
    record = {"hash": state_hash(model), "losses": losses, "merges": merges, "world": trainer.args.world_size}
    eight_bit_states = any(
        t.dtype == torch.uint8
        for state in trainer.optimizer.state.values()
        for t in state.values()
        if torch.is_tensor(t)
    )
    record["savings"] = [eight_bit_states, model.is_activation_checkpointing, trainer.args.loss_chunk_tokens]
    (out / f"rank{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
    from poet_hf.training.distributed import end_distributed

    end_distributed(exit_process=True)  # accelerate's gloo group: exit before it can abort the finalization
