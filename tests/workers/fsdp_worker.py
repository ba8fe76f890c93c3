"""Run under ``torchrun --nproc_per_node 2`` (gloo, CPU): POET training under DDP or FSDP2 with poet_hf's own merge,
optimizer reset, checkpoint and export code. Writes OUT/rank<k>.json.

Usage: fsdp_worker.py OUT ENGINE SPO [--steps N] [--save-at S] [--resume-from DIR] [--optim OPTIM]
                       [--base_quantization KIND] [--check_merges] [--meta] [--checkpointing]
                       [--loss_chunk_tokens C]
  ENGINE: ddp | fsdp2;  SPO: block | full;  OPTIM: adamw (torch's, the default) or a TrainingArguments optim name
  built by create_poet_optimizer (adamw_torch_8bit, adamw_bnb_8bit); a refusal is written as OUT/rank<k>.json's "error".
  KIND: a base_quantization of W0 (nf4-shardable, int8-shardable), folded by rounding to nearest; the report then
  holds a hash of its whole codes. --check_merges: before each merge rank 0 gathers an unsharded replica, merges it
  as one process does, and reports whether the sharded merge's gathered codes and scales equal the replica's.
  --meta: build the model on the meta device, for shard_model to materialize shard by shard.
  --checkpointing: transformers' activation checkpointing (non-reentrant), each block recomputed in the backward.
  --loss_chunk_tokens: the loss by poet_hf.training.chunked_loss, C token rows of logits at a time (under FSDP2 the
  sharded head's loss, which never gathers the head).
"""

import argparse
import hashlib
import json
import os
import sys
import weakref
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "helpers"))

MERGE_EVERY, GLOBAL_BATCH = 12, 4  # 30 steps: merges at 12 and 24


def buffer_hash(model) -> str:
    digest = hashlib.sha256()
    for name, buffer in sorted(model.named_buffers()):
        if "poet_" in name:
            digest.update(name.encode())
            digest.update(buffer.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def track_gathers():
    """Record the most gathered-weight bytes alive at once while merges run (weakrefs, no copies kept)."""
    import poet_hf.tuners.rotation.layer as rotation_layer

    record = {"alive": 0, "peak": 0}
    original = rotation_layer.full_tensor

    def full_tensor(tensor):
        result = original(tensor)
        if result is not tensor:  # a gather happened
            size = result.numel() * result.element_size()
            record["alive"] += size
            record["peak"] = max(record["peak"], record["alive"])
            weakref.finalize(result, lambda n=size: record.__setitem__("alive", record["alive"] - n))
        return result

    rotation_layer.full_tensor = full_tensor
    return record


def codes_hash(model) -> str:
    """A hash of every quantised W0's whole codes and scales (gathered: every rank calls it)."""
    from poet_hf.sharded import full_tensor

    digest = hashlib.sha256()
    for name, parameter in sorted(model.named_parameters()):
        if name.endswith(("base_layer.codes", "base_layer.scales")):
            digest.update(name.encode())
            digest.update(full_tensor(parameter.detach()).contiguous().numpy().tobytes())
    return digest.hexdigest()


def merged_like_one_process(model, replica) -> bool | None:
    """Whether the sharded model's codes and scales, gathered after its merge, equal those of ``replica`` (rank 0's
    unsharded copy from before it) merged by one process; ``None`` off rank 0."""
    from poet_hf import merge_and_reinit
    from poet_hf.sharded import full_tensor

    merged = {
        name: full_tensor(parameter.detach())
        for name, parameter in model.named_parameters()
        if name.endswith(("base_layer.codes", "base_layer.scales"))
    }
    if replica is None:
        return None
    merge_and_reinit(replica)
    expected = dict(replica.named_parameters())
    return bool(merged) and all(torch.equal(merged[name], expected[name]) for name in merged)


def build_optimizer(model, optim: str) -> torch.optim.Optimizer:
    """torch's AdamW at 3e-3, or ``optim`` as `create_poet_optimizer` builds it (one rate, 3e-3, for every group)."""
    if optim == "adamw":
        return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    from types import SimpleNamespace

    from poet_hf.training import create_poet_optimizer

    if optim == "adamw_torch_8bit":
        from torchao.optim import AdamW8bit as optimizer_cls
    else:
        from bitsandbytes.optim import AdamW8bit as optimizer_cls
    args = SimpleNamespace(optim=optim, learning_rate=3e-3, poet_learning_rate=3e-3, weight_decay=0.0)
    return create_poet_optimizer(model, args, optimizer_cls_and_kwargs=(optimizer_cls, {"lr": 3e-3}))


def batches(rows: torch.Tensor, steps: int, global_batch: int) -> torch.Tensor:
    """``steps`` global batches of ``global_batch`` of ``rows``, in one shuffled order (seed 7) on any process
    count."""
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(7))
    return rows[order[: steps * global_batch]].reshape(steps, global_batch, -1)


def train_step(
    module: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor, chunk: int | None = None
) -> float:
    """One optimizer step on this rank's share of the global ``batch`` (the loss chunked by ``chunk`` token rows when
    given); the global batch's mean loss."""
    from poet_hf.training.chunked_loss import causal_lm_loss

    rank, world = dist.get_rank(), dist.get_world_size()
    share = batch.chunk(world)[rank]
    inputs = {"input_ids": share, "labels": share}
    loss = module(**inputs).loss if chunk is None else causal_lm_loss(module, inputs, chunk)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    return float(mean) / world


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("engine", choices=["ddp", "fsdp2"])
    parser.add_argument("spo", choices=["block", "full"])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--save-at", type=int, default=0)
    parser.add_argument("--resume-from", type=Path, default=None)
    parser.add_argument("--optim", default="adamw")
    parser.add_argument("--base_quantization", default=None)
    parser.add_argument("--check_merges", action="store_true")
    parser.add_argument("--meta", action="store_true")
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--loss_chunk_tokens", type=int, default=None)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    args.out.mkdir(parents=True, exist_ok=True)

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from training_utils import tiny_dataset, tiny_poet_model

    import poet_hf  # noqa: F401
    from poet_hf import export_merged, merge_and_reinit
    from poet_hf.training import poet_parameters, reset_optimizer_state
    from poet_hf.training.distributed import end_distributed, save_pretrained_unsharded, shard_model, unsharded_replica

    dataset, tokenizer = tiny_dataset()
    model = tiny_poet_model(
        len(tokenizer),
        spo=args.spo,
        budget=0.5,
        merge_every=MERGE_EVERY,
        base_quantization=args.base_quantization,
        requantize="nearest",
        meta=args.meta,
    )
    if args.checkpointing:
        model.get_base_model().gradient_checkpointing_enable({"use_reentrant": False})
    if args.engine == "fsdp2":
        shard_model(model)
        wrapped = model
    else:
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
    initial_codes = codes_hash(model)
    try:
        optimizer = build_optimizer(model, args.optim)
    except ValueError as error:
        (args.out / f"rank{rank}.json").write_text(json.dumps({"error": str(error)}))
        end_distributed(exit_process=True)
    rows = torch.tensor(dataset["input_ids"])
    data = batches(rows, args.steps, GLOBAL_BATCH)
    start = 0
    if args.resume_from is not None:
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optim_state}
        dcp.load(state, checkpoint_id=str(args.resume_from))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        start = json.loads((args.resume_from / "step.json").read_text())["step"]
    gathers = track_gathers()
    head_calls = []  # FSDP2 gathers the head's unit before each call of it
    model.get_base_model().get_output_embeddings().register_forward_pre_hook(lambda *_: head_calls.append(1))
    embedding_calls = []  # and the input embeddings' unit before each call of it
    model.get_base_model().get_input_embeddings().register_forward_pre_hook(lambda *_: embedding_calls.append(1))
    losses, merges, merges_equal = {}, [], []
    for step in range(start, args.steps):
        losses[step + 1] = train_step(wrapped, optimizer, data[step], args.loss_chunk_tokens)
        if (step + 1) % MERGE_EVERY == 0:
            replica = unsharded_replica(model) if args.check_merges else None
            merges.append(merge_and_reinit(model)["merge_count"])
            if args.check_merges:
                merges_equal.append(merged_like_one_process(model, replica))
            reset_optimizer_state(optimizer, poet_parameters(model))
        if step + 1 == args.save_at:
            model_state, optim_state = get_state_dict(model, optimizer)
            dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(args.out / "ckpt"))
            if rank == 0:
                (args.out / "ckpt" / "step.json").write_text(json.dumps({"step": step + 1}))
    report = {
        "losses": losses,
        # optimizer states held in 8 bits (torchao's quantized tensor subclass), on this rank's shards
        "eight_bit_states": sum(
            "8bit" in type(value.to_local() if hasattr(value, "to_local") else value).__name__
            for state in optimizer.state.values()
            for value in state.values()
        ),
        "merges": merges,
        "buffers": buffer_hash(model),
        "codes": codes_hash(model),
        "initial_codes": initial_codes,
        "checkpointing": model.get_base_model().is_gradient_checkpointing,
        "merges_equal": merges_equal,
        "head_calls": len(head_calls),
        "embedding_calls": len(embedding_calls),
        "world": world,
        "peak_gathered_bytes": gathers["peak"],
        "largest_weight_bytes": max(
            p.numel() * p.element_size() for n, p in model.named_parameters() if "base_layer" in n
        ),
        "largest_skew_bytes": max(p.numel() * p.element_size() for p in poet_parameters(model)),
        # the largest share of a skew parameter one process holds (1 when unsharded)
        "skew_local_share": max(
            (p.to_local() if hasattr(p, "to_local") else p).numel() / p.numel() for p in poet_parameters(model)
        ),
    }
    if args.steps == 30 and args.resume_from is None:
        export_merged(model, args.out / "export", overwrite=True, spectrum=False)
        save_pretrained_unsharded(model, args.out / "adapter")
    with torch.no_grad():  # the trained model's logits, to compare with the exports
        ids = rows[:2, :12]
        torch.save(wrapped(input_ids=ids).logits.detach(), args.out / f"logits{rank}.pt")
    (args.out / f"rank{rank}.json").write_text(json.dumps(report))
    end_distributed(exit_process=True)  # barrier, destroy, then exit before gloo can abort the finalization


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
