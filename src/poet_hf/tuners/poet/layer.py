"""POET tuner layers for ``nn.Linear``, ``transformers`` ``Conv1D`` and ``nn.Conv2d``.

Every base weight is handled as the torch matrix ``W_t`` (out × in): ``Linear.weight``, ``Conv1D.weight.T``
(GPT-2 stores in × out), ``Conv2d.weight.view(out, in·kh·kw)``. The effective weight is ``P^T · W_t0 · R^T``:
R (in×in) rotates inputs and P (out×out) rotates outputs, ``Y = ((X @ R) @ W_t0.T) @ P`` (POET eq. 3).
The bias is not rotated.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from peft.tuners._buffer_dict import BufferDict
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn

from ...orthogonal import (
    block_matmul_left,
    block_matmul_right,
    init_base_weight,
    neumann_error_bound,
    num_skew_params,
    orthogonal_from_vector,
    orthogonality_error,
    sample_permutation,
    sample_subset,
    skew_from_vector,
    spo_generator,
    subset_matmul_left,
    subset_matmul_right,
    subset_size,
)

logger = logging.getLogger(__name__)

# Per multiply-add, a blockwise rotation (gathers + batched b×b matmuls) runs this much slower than a dense
# matmul; measured by `scripts/benchmark.py --suite poet_layer` (CPU, torch 2.13: 3.4 on both paths).
ROTATION_SLOWDOWN = 3.4

SIDE_INPUT = "input"  # R, acts on the in dimension
SIDE_OUTPUT = "output"  # P, acts on the out dimension


@dataclass(frozen=True)
class SideSpec:
    """Static shape of one side's primitive: ``kind`` is 'block', 'contiguous' (unpermuted blocks) or 'full'."""

    kind: str
    dim: int
    block: int

    @property
    def num_blocks(self) -> int:
        return 1 if self.kind == "full" else self.dim // self.block

    @property
    def num_params(self) -> int:
        return self.num_blocks * num_skew_params(self.block)

    def sample_index(self, generator: torch.Generator) -> torch.Tensor:
        """The permutation (block) or sorted index subset (full) for this side; empty for contiguous blocks."""
        if self.kind == "block":
            return sample_permutation(self.dim, generator)
        if self.kind == "full":
            return sample_subset(self.dim, self.block, generator)
        return torch.empty(0, dtype=torch.long)

    def matmul_right(self, x: torch.Tensor, index: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """``x @ G`` on the last dimension."""
        if self.kind == "full":
            return subset_matmul_right(x, index, blocks[0])
        return block_matmul_right(x, index if self.kind == "block" else None, blocks)

    def matmul_left(self, x: torch.Tensor, index: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """``G @ x`` on the first dimension."""
        if self.kind == "full":
            return subset_matmul_left(x, index, blocks[0])
        return block_matmul_left(x, index if self.kind == "block" else None, blocks)

    def apply_cost(self, other_dim: int) -> int:
        """Multiply-adds of rotating ``other_dim`` vectors of length ``dim``."""
        return other_dim * (self.block**2 if self.kind == "full" else self.dim * self.block)


def make_side_spec(spo: str, dim: int, block_size: int, budget: float, layer_name: str, field: str) -> SideSpec:
    """Validate and build one side's spec; errors name the config field, the layer and its size."""
    if spo == "full":
        return SideSpec("full", dim, subset_size(dim, budget))
    if dim % block_size:
        raise ValueError(
            f"`{field}`={block_size} does not divide the {dim}-dimensional side of target module "
            f"'{layer_name}'; choose a block size that divides every targeted dimension"
        )
    return SideSpec("contiguous" if spo == "contiguous" else "block", dim, block_size)


@torch.no_grad()
def invert_blocks(blocks: torch.Tensor, weight_dtype: torch.dtype) -> tuple[torch.Tensor, dict[str, Any]]:
    """Inverse of a batch of (nearly) orthogonal float64 blocks, and how exactly it restores a merged weight.

    Returns ``B^T`` or ``B^{-1}`` and a report ``{"method", "orth_error", "cond", "error_bound"}``.

    The transpose is used where ``||B^T B − I||_2`` is below the unit roundoff ``u`` of ``weight_dtype`` (then it
    is as exact as the stored weight can be), an exact inverse otherwise. The returned ``error_bound`` estimates
    the relative error ``||W_restored − W0||_F / ||W0||_F`` of one merge/unmerge round trip: the weight is stored
    rounded after the merge, an error the inverse amplifies by the condition number ``κ`` of the blocks
    (``u·(1 + κ)``), plus the float32 merge matmul (``√b·u32·κ``, the usual probabilistic rounding growth), plus,
    on the transpose path, the orthogonality error itself.
    """
    b = blocks.shape[-1]
    eye = torch.eye(b, dtype=blocks.dtype, device=blocks.device)
    gram_error = torch.linalg.matrix_norm(blocks.transpose(-1, -2) @ blocks - eye, ord=2)
    orth_error = float(gram_error.max()) if blocks.numel() else 0.0
    singular = torch.linalg.svdvals(blocks)
    cond = float(singular.max() / singular.min())
    u_store = torch.finfo(weight_dtype).eps / 2
    u_merge = torch.finfo(torch.float32).eps / 2
    bound = u_store * (1 + cond) + math.sqrt(b) * u_merge * cond
    if orth_error <= u_store:
        return blocks.transpose(-1, -2), {"method": "transpose", "orth_error": orth_error, "cond": cond,
                        "error_bound": bound + orth_error}
    return torch.linalg.inv(blocks), {"method": "solve", "orth_error": orth_error, "cond": cond,
                                      "error_bound": bound}


class PoetLayer(BaseTunerLayer):
    """Adapter state of one wrapped module: skew parameters per side and the index buffers that place them."""

    adapter_layer_names = ("poet_R", "poet_P")
    other_param_names = ("poet_R_index", "poet_P_index", "poet_merge_count", "poet_specs", "poet_settings")

    def __init__(self, base_layer: nn.Module, **kwargs: Any) -> None:
        self.base_layer = base_layer
        self._init_adapter_state()
        self.poet_specs: dict[str, dict[str, SideSpec]] = {}
        self.poet_settings: dict[str, dict[str, Any]] = {}
        self.unmerge_report: dict[str, dict[str, Any]] = {}
        self._disable_adapters = False
        self.merged_adapters: list[str] = []
        self.kwargs = kwargs
        out_dim, in_dim = self.weight_matrix().shape
        self.in_features, self.out_features = in_dim, out_dim

    def _init_adapter_state(self) -> None:
        """Create the per-adapter parameter and buffer containers.

        A hook: a subclass registered with PEFT under another prefix (OFT: ``poet_oft_``) stores them under names
        that start with its prefix, and overrides :meth:`_side_containers` and :attr:`merge_counts` to match.
        """
        self.poet_R = nn.ParameterDict({})
        self.poet_P = nn.ParameterDict({})
        self.poet_R_index = BufferDict({}, persistent=True)
        self.poet_P_index = BufferDict({}, persistent=True)
        self.poet_merge_count = BufferDict({}, persistent=True)

    @property
    def merge_counts(self) -> BufferDict:
        """Per adapter, how many merge-then-reinitialize steps have been folded into ``W0``."""
        return self.poet_merge_count

    def _num_param_rows(self, adapter_name: str, side: str, spec: SideSpec) -> int:
        """Rows of the skew parameter of one side: one per block (a hook: OFT's ``block_share`` uses 1)."""
        return spec.num_blocks

    # --- the base weight as an out × in matrix (overridden per module type) -----------------------------------
    def weight_matrix(self) -> torch.Tensor:
        return self.get_base_layer().weight

    def set_weight_matrix(self, matrix: torch.Tensor) -> None:
        weight = self.get_base_layer().weight
        weight.data.copy_(matrix.reshape(weight.shape).to(weight.dtype))

    def base_op(self, x: torch.Tensor, matrix: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The base computation for an out × in weight matrix (bias fused where given: one addmm)."""
        return F.linear(x, matrix, None if bias is None else bias.to(x.dtype))

    supports_activation_forward = True

    # --- adapter creation --------------------------------------------------------------------------------------
    def update_layer(self, adapter_name: str, config: Any, layer_name: str, spo: Optional[str] = None) -> None:
        """Add adapter ``adapter_name`` described by a ``PoetConfig``-like ``config`` (OFT passes ``spo``)."""
        spo = spo or config.spo
        if config.forward == "activation" and not self.supports_activation_forward:
            raise ValueError(
                f"`forward`='activation' is not supported for {type(self.get_base_layer()).__name__} target "
                f"'{layer_name}'; use 'weight' or 'auto'"
            )
        specs = {}
        if config.sides in ("both", "input"):
            specs[SIDE_INPUT] = make_side_spec(spo, self.in_features, config.block_size, config.budget, layer_name,
                                               "block_size")
        if config.sides in ("both", "output"):
            specs[SIDE_OUTPUT] = make_side_spec(spo, self.out_features, config.block_size, config.budget, layer_name,
                                                "block_size")
        self.poet_specs[adapter_name] = specs
        self.poet_settings[adapter_name] = {
            "neumann_terms": config.neumann_terms,
            "forward": config.forward,
            "seed": config.seed,
            "layer_name": layer_name,
        }
        device = self.weight_matrix().device
        self.merge_counts[adapter_name] = torch.zeros((), dtype=torch.long, device=device)
        for side, spec in specs.items():
            params, indices = self._side_containers(side)
            rows = self._num_param_rows(adapter_name, side, spec)
            params[adapter_name] = nn.Parameter(torch.zeros(rows, num_skew_params(spec.block), device=device))
            indices[adapter_name] = self._draw_index(adapter_name, side, merge_count=0).to(device)
        if not config.init_weights:
            self.randomize_skew(adapter_name, torch.Generator().manual_seed(config.seed))
        if getattr(config, "base_init", None) is not None:
            generator = spo_generator(config.seed, 0, layer_name, "base_init")
            self.set_weight_matrix(init_base_weight(self.weight_matrix(), config.base_init, generator))
        self.set_adapter(self.active_adapters)

    def _side_containers(self, side: str) -> tuple[nn.ParameterDict, BufferDict]:
        return (self.poet_R, self.poet_R_index) if side == SIDE_INPUT else (self.poet_P, self.poet_P_index)

    def skew_parameter(self, adapter_name: str, side: str) -> nn.Parameter:
        """The skew parameter ``(rows, b(b-1)/2)`` of one adapter and side."""
        return self._side_containers(side)[0][adapter_name]

    def index_buffer(self, adapter_name: str, side: str) -> torch.Tensor:
        """The permutation (block), index subset (full) or empty tensor (contiguous) of one adapter and side."""
        return self._side_containers(side)[1][adapter_name]

    def skew_parameters(self) -> list[nn.Parameter]:
        """Every adapter's skew parameters, whatever the subclass names its containers."""
        return [self.skew_parameter(a, side) for a, specs in self.poet_specs.items() for side in specs]

    def _draw_index(self, adapter_name: str, side: str, merge_count: int) -> torch.Tensor:
        settings = self.poet_settings[adapter_name]
        generator = spo_generator(settings["seed"], merge_count, settings["layer_name"], side)
        return self.poet_specs[adapter_name][side].sample_index(generator)

    @torch.no_grad()
    def randomize_skew(self, adapter_name: str, generator: torch.Generator, op_norm: float = 0.1) -> None:
        """Random skew parameters whose blocks have operator norm about ``op_norm`` (non-identity adapter)."""
        for side, spec in self.poet_specs[adapter_name].items():
            param = self._side_containers(side)[0][adapter_name]
            # A b×b Gaussian skew matrix with entry std s has operator norm about 2·s·sqrt(b).
            std = op_norm / (2 * math.sqrt(spec.block))
            param.copy_(torch.randn(param.shape, generator=generator) * std)

    # --- rotations ---------------------------------------------------------------------------------------------
    def rotation_blocks(self, adapter_name: str, side: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The ``(num_blocks, b, b)`` orthogonal blocks of one side, computed in ``dtype`` (float32 or wider)."""
        spec = self.poet_specs[adapter_name][side]
        param = self._side_containers(side)[0][adapter_name]
        terms = self.poet_settings[adapter_name]["neumann_terms"]
        return orthogonal_from_vector(param.to(dtype), spec.block, terms)

    def _sides(self, adapter_name: str) -> dict[str, SideSpec]:
        return self.poet_specs.get(adapter_name, {})

    def rotate_weight(self, matrix: torch.Tensor, adapter_name: str, inverse: bool = False,
                      report: Optional[dict[str, Any]] = None) -> torch.Tensor:
        """``P^T · matrix · R^T`` (or its inverse map ``P^{-T} · matrix · R^{-T}``).

        The inverse uses each side's transpose where the blocks are orthogonal to the working precision of the
        stored weight, and an exact blockwise inverse otherwise; ``report`` (if given) receives, per side, the
        method, the orthogonality error and the estimated relative restoration error (see :func:`invert_blocks`).
        """
        for side, spec in self._sides(adapter_name).items():
            index = self._side_containers(side)[1][adapter_name]
            if inverse:
                blocks = self.rotation_blocks(adapter_name, side, dtype=torch.float64)
                blocks, side_report = invert_blocks(blocks, self.weight_matrix().dtype)
                blocks = blocks.to(matrix.dtype)
                if report is not None:
                    report[side] = side_report
            else:
                blocks = self.rotation_blocks(adapter_name, side, dtype=matrix.dtype)
            blocks = blocks.transpose(-1, -2)
            if side == SIDE_INPUT:
                matrix = spec.matmul_right(matrix, index, blocks)
            else:
                matrix = spec.matmul_left(matrix, index, blocks)
        return matrix

    def effective_weight_matrix(self, adapter_names: Optional[list[str]] = None,
                                dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``P^T W_t0 R^T`` for the given adapters (applied in order), as an out × in matrix in ``dtype``."""
        matrix = self.weight_matrix().to(dtype)
        for adapter_name in adapter_names if adapter_names is not None else self.active_adapters:
            matrix = self.rotate_weight(matrix, adapter_name)
        return matrix

    def _use_activation_path(self, adapter_names: list[str], tokens: int, needs_grad: bool = False,
                             input_needs_grad: bool = False) -> bool:
        """Pick the cheaper forward by multiply-adds.

        Inference: rotating ``tokens`` activations vs rotating the weight. Training (``needs_grad``): every
        rotation also costs about twice its forward in backward, and the weight path needs ``dL/dW_eff``
        (``tokens·in·out``) on top of ``dL/dx`` when the input needs a gradient, while the activation path's
        ``dL/d(xR)`` through the frozen ``W0`` is needed either way, so that path saves one full matmul.
        """
        choices = {self.poet_settings[a]["forward"] for a in adapter_names}
        if choices == {"activation"}:
            return True
        if "weight" in choices or not self.supports_activation_forward:
            return False
        weight_cost = activation_cost = 0
        for a in adapter_names:
            for side, spec in self._sides(a).items():
                other = self.out_features if side == SIDE_INPUT else self.in_features
                weight_cost += spec.apply_cost(other)
                activation_cost += spec.apply_cost(tokens)
        if needs_grad and input_needs_grad:
            # Rotations count about 3× their forward (forward + two backward products) and run ROTATION_SLOWDOWN×
            # slower per multiply-add than the dense matmul the weight path adds.
            weight_cost += tokens * self.in_features * self.out_features / (3 * ROTATION_SLOWDOWN)
        return activation_cost < weight_cost

    def _poet_forward(self, x: torch.Tensor, adapter_names: list[str]) -> torch.Tensor:
        base = self.get_base_layer()
        bias = base.bias
        tokens = x.numel() // self.in_features if self.supports_activation_forward else 0
        grad = torch.is_grad_enabled()
        needs_grad = grad and any(self._side_containers(side)[0][a].requires_grad
                                  for a in adapter_names for side in self._sides(a))
        if not self._use_activation_path(adapter_names, tokens, needs_grad, grad and x.requires_grad):
            matrix = self.effective_weight_matrix(adapter_names).to(self.weight_matrix().dtype)
            return self.base_op(x, matrix, bias)
        # y = x R W0^T P: R-rotations compose innermost-last, P-rotations in adapter order.
        compute = torch.promote_types(x.dtype, torch.float32)
        h = x.to(compute)
        for a in reversed(adapter_names):
            if SIDE_INPUT in self._sides(a):
                index = self._side_containers(SIDE_INPUT)[1][a]
                h = self._sides(a)[SIDE_INPUT].matmul_right(h, index, self.rotation_blocks(a, SIDE_INPUT))
        # The bias is not rotated: fuse it into the base op unless output rotations follow.
        output_side = any(SIDE_OUTPUT in self._sides(a) for a in adapter_names)
        h = self.base_op(h.to(x.dtype), self.weight_matrix(), None if output_side else bias).to(compute)
        for a in adapter_names:
            if SIDE_OUTPUT in self._sides(a):
                index = self._side_containers(SIDE_OUTPUT)[1][a]
                h = self._sides(a)[SIDE_OUTPUT].matmul_right(h, index, self.rotation_blocks(a, SIDE_OUTPUT))
        out = h.to(x.dtype)
        return out if bias is None or not output_side else self._add_bias(out, bias)

    def _add_bias(self, out: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return out + bias.to(out.dtype)

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.disable_adapters:
            if self.merged:
                self.unmerge()
            return self.base_layer(x, *args, **kwargs)
        if self.merged:
            return self.base_layer(x, *args, **kwargs)
        active = [a for a in self.active_adapters if a in self.poet_specs]
        if not active:
            return self.base_layer(x, *args, **kwargs)
        return self._poet_forward(x, active)

    # --- PEFT merge / unmerge (inference-time folds; the adapter keeps its state) --------------------------------
    @torch.no_grad()
    def merge(self, safe_merge: bool = False, adapter_names: Optional[list[str]] = None) -> None:
        """Fold the adapters into the base weight (``W_t ← P^T W_t R^T``) without changing them."""
        from peft.tuners.tuners_utils import check_adapters_to_merge

        adapter_names = check_adapters_to_merge(self, adapter_names)
        for adapter_name in adapter_names:
            if adapter_name not in self.poet_specs:
                continue
            merged = self.rotate_weight(self.weight_matrix().float(), adapter_name)
            if safe_merge and not torch.isfinite(merged).all():
                raise ValueError(f"NaNs or infs found while merging POET adapter '{adapter_name}'; it is broken")
            self.set_weight_matrix(merged)
            self.merged_adapters.append(adapter_name)

    @torch.no_grad()
    def unmerge(self) -> None:
        """Restore the base weight, newest merged adapter first.

        Each rotation is undone by its transpose where it is orthogonal to the weight's working precision, and by
        an exact blockwise inverse otherwise (a truncated Cayley–Neumann rotation with a large ``||Q||``).
        ``self.unmerge_report[adapter]`` records, per side, the method, the orthogonality error and the estimated
        relative error of the restored weight; a solve is also logged.
        """
        while self.merged_adapters:
            adapter_name = self.merged_adapters.pop()
            report: dict[str, Any] = {}
            restored = self.rotate_weight(self.weight_matrix().double(), adapter_name, inverse=True, report=report)
            self.set_weight_matrix(restored)
            report["error_bound"] = sum(r["error_bound"] for r in report.values())
            self.unmerge_report[adapter_name] = report
            if any(r["method"] == "solve" for r in report.values() if isinstance(r, dict)):
                logger.info("unmerged adapter '%s' by an exact solve (rotation not orthogonal to working precision): %s",
                            adapter_name, report)

    # --- POET training-time merge-then-reinitialize ----------------------------------------------------------------
    @torch.no_grad()
    def merge_and_reinit(self, adapter_name: str) -> dict[str, float]:
        """Fold R and P into ``W0``, zero the skew parameters, and draw fresh permutations / index sets.

        Returns the pre-merge statistics: ``q_norm`` (largest ``||Q||_2``), ``orth_error`` (largest
        ``||R R^T − I||_F/√b``) and ``neumann_bound`` (the bound on any singular value's relative change this
        merge causes, from :func:`neumann_error_bound`).
        """
        if self.merged:
            raise RuntimeError("merge_and_reinit needs an unmerged layer; call unmerge() first")
        stats = self.rotation_stats(adapter_name)
        self.set_weight_matrix(self.rotate_weight(self.weight_matrix().float(), adapter_name))
        count = int(self.merge_counts[adapter_name]) + 1
        self.merge_counts[adapter_name].fill_(count)
        for side in self._sides(adapter_name):
            params, indices = self._side_containers(side)
            params[adapter_name].zero_()
            indices[adapter_name].copy_(self._draw_index(adapter_name, side, count))
        return stats

    @torch.no_grad()
    def rotation_stats(self, adapter_name: str) -> dict[str, float]:
        """``||Q||_2``, orthogonality error and the Neumann bound of the live primitives (max over blocks/sides)."""
        stats = {"q_norm": 0.0, "orth_error": 0.0, "neumann_bound": 0.0}
        bound = 1.0
        for side, spec in self._sides(adapter_name).items():
            param = self._side_containers(side)[0][adapter_name].double()
            q = skew_from_vector(param, spec.block)
            terms = self.poet_settings[adapter_name]["neumann_terms"]
            blocks = self.rotation_blocks(adapter_name, side, dtype=torch.float64)
            stats["q_norm"] = max(stats["q_norm"], float(torch.linalg.matrix_norm(q, ord=2).max()))
            stats["orth_error"] = max(stats["orth_error"], float(orthogonality_error(blocks).max()))
            bound *= 1 + float(neumann_error_bound(q, terms).max())
        stats["neumann_bound"] = bound - 1
        return stats


class Linear(nn.Module, PoetLayer):
    """POET around an ``nn.Linear``."""

    def __init__(self, base_layer: nn.Module, adapter_name: str, config: Any, layer_name: str, **kwargs: Any) -> None:
        super().__init__()
        PoetLayer.__init__(self, base_layer, **kwargs)
        self._active_adapter = adapter_name
        self.update_layer(adapter_name, config, layer_name, spo=kwargs.get("spo"))

    forward = PoetLayer.forward  # nn.Module precedes PoetLayer in the MRO, as in PEFT's own layers

    def __repr__(self) -> str:
        return "poet." + super().__repr__()


class Conv1D(Linear):
    """POET around a ``transformers`` ``Conv1D`` (GPT-2), whose weight is stored in × out."""

    def weight_matrix(self) -> torch.Tensor:
        return self.get_base_layer().weight.T

    def set_weight_matrix(self, matrix: torch.Tensor) -> None:
        weight = self.get_base_layer().weight
        weight.data.copy_(matrix.T.to(weight.dtype))


class Conv2d(Linear):
    """POET around an ``nn.Conv2d``, whose weight is the matrix out × (in·kh·kw).

    R rotates the ``in·kh·kw`` axis of the weight, which is not an activation-space rotation, so this layer
    always materialises the weight (it is small) and calls the base convolution with it.
    """

    supports_activation_forward = False

    def __init__(self, base_layer: nn.Module, adapter_name: str, config: Any, layer_name: str, **kwargs: Any) -> None:
        if base_layer.groups != 1:
            raise ValueError(
                f"target module '{layer_name}' is a grouped Conv2d (groups={base_layer.groups}); POET needs groups=1 "
                "because P mixes output channels across groups"
            )
        super().__init__(base_layer, adapter_name, config, layer_name, **kwargs)

    def weight_matrix(self) -> torch.Tensor:
        weight = self.get_base_layer().weight
        return weight.reshape(weight.shape[0], -1)

    def base_op(self, x: torch.Tensor, matrix: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        base = self.get_base_layer()
        weight = matrix.reshape(base.weight.shape)
        bias = None if bias is None else bias.to(x.dtype)
        if base.padding_mode != "zeros":
            x = F.pad(x, base._reversed_padding_repeated_twice, mode=base.padding_mode)
            return F.conv2d(x, weight, bias, base.stride, 0, base.dilation, base.groups)
        return F.conv2d(x, weight, bias, base.stride, base.padding, base.dilation, base.groups)

    def _add_bias(self, out: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return out + bias.to(out.dtype).view(1, -1, 1, 1)
