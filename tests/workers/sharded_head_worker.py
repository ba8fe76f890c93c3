"""Run in 2 processes (gloo, CPU): the sharded head's chunked loss (poet_hf.training.sharded_head_loss) in float64
against the dense cross-entropy of each process's whole logits, and the sharded embedding lookup
(poet_hf.training.sharded_embedding) against ``F.embedding`` on the whole table. Writes OUT/rank<k>.json.

Usage: sharded_head_worker.py OUT
  The head (11 × 4) is split by rows, 6 and 5; rank 0 has 7 tokens and rank 1 has 5 (one ignored each), so the
  steps of 3 rows (2 per process) pad rank 1. Reported: each rank's loss and its hidden states' gradient against
  the dense ones, the gathered head gradient against the mean over processes of the dense ones, for each process's own
  count and for a shared ``num_items_in_batch``; and whether scaling the two losses differently is refused.
  The lookup: the same table as an ``nn.Embedding`` (padding row 3) split 6 + 5, each rank's token ids (1 × 7 and
  1 × 5, the padding row among them) looked up 3 positions at a time; its output, and the table gradient of a random
  weighting of it, against the dense ones (the gradient: the mean over processes).
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from poet_hf.training.chunked_loss import IGNORE_INDEX
from poet_hf.training.sharded_embedding import ShardedEmbeddingLookup, looks_up_its_own_table, splits_by_rows
from poet_hf.training.sharded_head_loss import sharded_head_cross_entropy

VOCAB, WIDTH, TOKENS, PADDING = 11, 4, (7, 5), 3


def data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + rank)
    hidden = torch.randn(TOKENS[rank], WIDTH, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, VOCAB, (TOKENS[rank],), generator=generator)
    labels[1] = IGNORE_INDEX
    return hidden, labels


def dense(weight: torch.Tensor, rank: int, normalizer: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s loss, its hidden states' gradient and the head's, by torch's cross-entropy on whole logits."""
    hidden, labels = data(rank)
    hidden.requires_grad_(True)
    full = weight.clone().requires_grad_(True)
    loss = torch.nn.functional.cross_entropy(hidden @ full.T, labels, ignore_index=IGNORE_INDEX, reduction="sum")
    loss = loss / normalizer
    loss.backward()
    return loss.detach(), hidden.grad, full.grad


def lookup_errors(weight: torch.Tensor, mesh, rank: int) -> dict[str, float]:
    """The sharded lookup's output and table gradient against ``F.embedding``'s on the whole table."""

    def ids_and_weighting(r: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(200 + r)
        ids = torch.randint(0, VOCAB, (1, TOKENS[r]), generator=generator)
        ids[0, 0] = PADDING
        return ids, torch.randn(1, TOKENS[r], WIDTH, generator=generator, dtype=torch.float64)

    embedding = torch.nn.Embedding(VOCAB, WIDTH, padding_idx=PADDING, dtype=torch.float64)
    embedding.weight = torch.nn.Parameter(distribute_tensor(weight, mesh, [Shard(0)]))
    assert looks_up_its_own_table(embedding, None) and splits_by_rows(embedding)
    ids, weighting = ids_and_weighting(rank)
    out = ShardedEmbeddingLookup(embedding, chunk_tokens=3, dtype=torch.float64)(ids)
    (out * weighting).sum().backward()
    gradients = []
    for r in range(2):
        table = weight.clone().requires_grad_(True)
        r_ids, r_weighting = ids_and_weighting(r)
        looked_up = torch.nn.functional.embedding(r_ids, table, padding_idx=PADDING)
        (looked_up * r_weighting).sum().backward()
        gradients.append(table.grad)
        if r == rank:
            output_error = float((out - looked_up).abs().max())
    mean = (gradients[0] + gradients[1]) / 2
    return {
        "output": output_error,
        "table": float((embedding.weight.grad.full_tensor() - mean).abs().max()),
        "table_scale": float(mean.abs().max()),
        "padding_row": float(embedding.weight.grad.full_tensor()[PADDING].abs().max()),
    }


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    weight = torch.randn(VOCAB, WIDTH, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    report = {}
    for case, shared in (("own counts", None), ("shared count", 9.0)):
        counts = [float((data(r)[1] != IGNORE_INDEX).sum()) if shared is None else shared for r in range(2)]
        sharded = torch.nn.Parameter(distribute_tensor(weight, mesh, [Shard(0)]))
        hidden, labels = data(rank)
        hidden.requires_grad_(True)
        normalizer = torch.tensor(counts[rank], dtype=torch.float32)
        loss = sharded_head_cross_entropy(hidden, sharded, labels, chunk_tokens=3, normalizer=normalizer)
        loss.backward()
        references = [dense(weight, r, counts[r]) for r in range(2)]
        mean_head = (references[0][2] + references[1][2]) / 2
        report[case] = {
            "loss": abs(float(loss) - float(references[rank][0])),
            "hidden": float((hidden.grad - references[rank][1]).abs().max()),
            "head": float((sharded.grad.full_tensor() - mean_head).abs().max()),
            "head_scale": float(mean_head.abs().max()),
        }
    report["lookup"] = lookup_errors(weight, mesh, rank)
    hidden, labels = data(rank)
    hidden.requires_grad_(True)
    sharded = torch.nn.Parameter(distribute_tensor(weight, mesh, [Shard(0)]))
    loss = sharded_head_cross_entropy(hidden, sharded, labels, chunk_tokens=3, normalizer=torch.tensor(5.0))
    try:
        (loss * (rank + 1)).backward()
        report["unequal scales"] = "accepted"
    except ValueError as error:
        report["unequal scales"] = str(error)
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
