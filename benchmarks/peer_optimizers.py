"""The peers' low-memory optimizers, layer-wise, for `benchmarks.suites.pretrain_step.measure` (``optim=``):
GaLore 8-bit (galore-torch) and APOLLO-Mini (apollo-torch), the ``[bench]`` extra."""

from __future__ import annotations

import torch

GALORE = {"rank": 256, "update_proj_gap": 200, "scale": 0.25, "proj_type": "std"}
APOLLO_MINI = {
    "rank": 1,
    "proj": "random",
    "scale_type": "tensor",
    "scale": 128,
    "update_proj_gap": 200,
    "proj_type": "std",
}
PEER_OPTIMIZERS = ("galore_8bit_layerwise", "apollo_mini_layerwise")


def peer_optimizer(model: torch.nn.Module, optim: str, lr: float = 1e-3) -> torch.optim.Optimizer:
    """A layer-wise peer optimizer (`PEER_OPTIMIZERS`): the low-rank method on the blocks' 2-D weights, its plain
    AdamW on the rest, every parameter stepping in the backward (`poet_hf.training.FusedStepOptimizer`)."""
    from poet_hf.training import FusedStepOptimizer

    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    projected = [p for n, p in trainable if p.dim() == 2 and ".layers." in n]
    rest = [p for n, p in trainable if not (p.dim() == 2 and ".layers." in n)]
    if optim == "galore_8bit_layerwise":
        from galore_torch import GaLoreAdamW8bit

        if not torch.cuda.is_available():  # its step calls torch.cuda.synchronize(), meaningless on a CPU
            torch.cuda.synchronize = lambda device=None: None

        groups = [{"params": rest}, {"params": projected, **GALORE}]
        return FusedStepOptimizer(groups, GaLoreAdamW8bit, lr=lr)
    if optim == "apollo_mini_layerwise":
        from apollo_torch import APOLLOAdamW

        groups = [{"params": rest}, {"params": projected, **APOLLO_MINI}]
        return FusedStepOptimizer(groups, APOLLOAdamW, lr=lr)
    raise ValueError(f"`optim` must be one of {PEER_OPTIMIZERS}, got {optim!r}")
