"""Run under ``torchrun --nproc_per_node 2`` (gloo, CPU): tiny POET LLaMAs built on the meta device, sharded by
``poet_hf.training.distributed.shard_model`` and materialized shard by shard, in four cases: from keyed initialisation
for POET-BS and POET-FS (``init-block``, ``init-full``), then from CHECKPOINT, which rank 0 scatters or broadcasts
(``checkpoint-scatter``, ``checkpoint-broadcast``). For each case rank 0 writes the gathered state (parameters and
buffers) to OUT/<case>/<stage>.pt: at ``init``, and for the ``init`` cases after each of two merges of random rotations;
every rank writes OUT/<case>/rank<k>.json with the largest share of any parameter it holds.

Usage: materialize_worker.py OUT CHECKPOINT
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "helpers"))


def gathered(model) -> dict:
    """Every parameter (gathered whole) and buffer (every process holds them whole) of ``model``, on rank 0."""
    from poet_hf.training.distributed import gather_full_state_dict

    state = {name: tensor.clone() for name, tensor in gather_full_state_dict(model).items()}  # buffers are live
    return {**state, **{f"buffer:{name}": b.clone() for name, b in model.named_buffers()}}


def run_case(out: Path, case: str, checkpoint: str) -> None:
    from training_utils import meta_poet_model, randomize_rotations

    from poet_hf import merge_and_reinit
    from poet_hf.training.distributed import shard_model

    source, variant = case.split("-")
    if source == "init":
        model = shard_model(meta_poet_model(variant), seed=3)
    else:
        model = shard_model(
            meta_poet_model("full", base_init=None, config_from=checkpoint),
            seed=3,
            checkpoint=checkpoint,
            loading=variant,
        )
    stages = {"init": gathered(model)}
    if source == "init":
        for merge in (1, 2):
            randomize_rotations(model, merge)
            merge_and_reinit(model)
            stages[f"merge{merge}"] = gathered(model)
    rank = dist.get_rank()
    (out / case).mkdir(parents=True, exist_ok=True)
    if rank == 0:
        for stage, state in stages.items():
            torch.save(state, out / case / f"{stage}.pt")
    share = max(p.to_local().numel() / p.numel() for p in model.parameters())
    (out / case / f"rank{rank}.json").write_text(json.dumps({"largest_share": share}))


def main() -> None:
    out, checkpoint = Path(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo")
    for case in ("init-block", "init-full", "checkpoint-scatter", "checkpoint-broadcast"):
        run_case(out, case, checkpoint)
    from poet_hf.training.distributed import end_distributed

    end_distributed(exit_process=True)  # barrier, destroy, then exit before gloo can abort the finalization


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
