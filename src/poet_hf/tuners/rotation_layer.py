"""The PEFT layer plumbing shared by the POET and OFT tuners: adapters made of orthogonal side rotations.

A `RotationLayer` wraps an ``nn.Linear``, a ``transformers`` ``Conv1D`` or an ``nn.Conv2d`` and holds, per
adapter, up to two sides: ``"input"`` (``R``, in × in) and ``"output"`` (``P``, out × out). Each side is a skew
parameter (one row per block) and an index buffer (permutation or subset) placing it. The effective weight is
``Pᵀ · W_t0 · Rᵀ`` (POET eq. 3 in torch orientation); every base weight is handled as the torch matrix ``W_t``
(out × in): ``Linear.weight``, ``Conv1D.weight.T`` (GPT-2 stores in × out), ``Conv2d.weight`` viewed as
out × (in/groups·kh·kw), and the dequantised weight of a bitsandbytes ``Linear4bit`` / ``Linear8bitLt``
(`bnb`: QOFT, QPOET), which every fold requantises. The bias is not rotated.

Subclasses (POET, OFT) declare where their tensors live (PEFT finds adapter state by the tuner's prefix), how a
config becomes sides, and their forward; everything else (merge, unmerge, merge-then-reinitialize, the reference
forward, statistics) is here.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from peft.tuners._buffer_dict import BufferDict
from peft.tuners.tuners_utils import BaseTunerLayer, check_adapters_to_merge
from torch import nn

from ..orthogonal import (
    cayley_neumann,
    num_skew_params,
    orthogonal_from_vector,
    orthogonality_error,
    random_skew_params,
    skew_from_vector,
    spo_generator,
)
from ..orthogonal.cayley import neumann_error_bound_at_norm, skew_norm_scale, skew_spectral_norm
from ..orthogonal.rotated_linear import (
    ACTIVATION,
    ACTIVATION_RECOMPUTE,
    WEIGHT,
    Conv2dOp,
    LinearOp,
    RotationCache,
    SideRotation,
    polynomial_products,
    rotated_forward,
    strategy_costs,
)
from ..orthogonal.spo import SideSpec
from . import bnb, low_precision, residual_store, rotation_cache
from .module_mixin import ModuleMixin
from .state_checks import AdapterStateError, index_problem, merge_count_problem, skew_problem

logger = logging.getLogger(__name__)


# Per side, ``(Q, blocks)`` in float64 (`RotationLayer.float64_rotations`).
SideRotations = dict[str, tuple[torch.Tensor, torch.Tensor]]


class QuantizedMergeWarning(UserWarning):
    """A merge or unmerge into a quantised base changed ``W0`` by a requantisation (its measured size is in the
    message)."""


SIDE_INPUT = "input"  # R, acts on the in dimension
SIDE_OUTPUT = "output"  # P, acts on the out dimension
SIDES = (SIDE_INPUT, SIDE_OUTPUT)

_FUSED = True
PEFT_MERGE = -2  # the merge count that seeds a stochastic requantisation in PEFT's merge / unmerge


@contextlib.contextmanager
def plain_autograd() -> Iterator[None]:
    """Run rotation layers through the plain autograd composition of the orthogonal primitives (the reference the
    fused forward/backward is tested against; slower, and it keeps every intermediate for the backward)."""
    global _FUSED
    previous, _FUSED = _FUSED, False
    try:
        yield
    finally:
        _FUSED = previous


@dataclass(frozen=True)
class RotationSettings:
    """What a layer keeps of an adapter's config: how to build its rotations and draw its indices."""

    layer_name: str
    seed: int
    neumann_terms: int
    forward: str  # "auto", "weight" or "activation"
    source: str | None = None  # the adapter file it was loaded from, for errors that name the file
    requantize: str = "feedback"  # how a fold rounds a quantised or 16-bit W0 (tuners/bnb.py, low_precision.py)
    residual_storage: str = "auto"  # where feedback keeps its residual between folds (tuners/residual_store.py)
    cache_rotations: bool = True  # one build and one VJP per optimizer step under accumulation (rotation_cache.py)
    init_weights: bool = True  # False: a random, non-identity adapter (PEFT's convention)
    base_init: str | None = None  # POET's re-initialisation of W0 (orthogonal/base_init.py)

    @classmethod
    def from_config(cls, config: Any, layer_name: str) -> RotationSettings:
        """What a layer keeps of a ``PoetConfig`` or ``OftConfig`` (OFT has no ``base_init``)."""
        return cls(
            layer_name=layer_name,
            seed=config.seed,
            neumann_terms=config.neumann_terms,
            forward=config.forward,
            source=getattr(config, "loaded_from", None),
            requantize=config.requantize,
            residual_storage=config.residual_storage,
            cache_rotations=config.cache_rotations,
            init_weights=config.init_weights,
            base_init=getattr(config, "base_init", None),
        )


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
    orth_error = float(orthogonality_error(blocks, ord=2).max()) if blocks.numel() else 0.0
    singular = torch.linalg.svdvals(blocks)
    cond = float(singular.max() / singular.min())
    u_store = torch.finfo(weight_dtype).eps / 2
    u_merge = torch.finfo(torch.float32).eps / 2
    bound = u_store * (1 + cond) + math.sqrt(b) * u_merge * cond
    if orth_error <= u_store:
        return blocks.transpose(-1, -2), {
            "method": "transpose",
            "orth_error": orth_error,
            "cond": cond,
            "error_bound": bound + orth_error,
        }
    return torch.linalg.inv(blocks), {"method": "solve", "orth_error": orth_error, "cond": cond, "error_bound": bound}


class RotationLayer(BaseTunerLayer, ModuleMixin):
    """Adapter state of one wrapped module: skew parameters per side and the index buffers that place them.

    A subclass sets ``adapter_layer_names`` / ``other_param_names`` (PEFT's contract), creates its containers in
    `_init_containers`, maps a side to them in `side_containers`, and adds adapters with
    `add_rotation_adapter`.
    """

    def __init__(self, base_layer: nn.Module, **kwargs: Any) -> None:
        self.base_layer = base_layer
        self.poet_specs: dict[str, dict[str, SideSpec]] = {}
        self.poet_settings: dict[str, RotationSettings] = {}
        self.unmerge_report: dict[str, dict[str, Any]] = {}
        self._disable_adapters = False
        self.merged_adapters: list[str] = []
        self.kwargs = kwargs
        self._weight_transposed = _is_conv1d(
            base_layer.get_base_layer() if isinstance(base_layer, BaseTunerLayer) else base_layer
        )
        self.requantization_error: float | None = None  # relative error of the last fold into a quantised W0
        self.pending_quantization: str | None = None  # base_quantization of a meta base, for materialize_model
        self._rotation_caches: dict[tuple[str, str], RotationCache] = {}  # (adapter, side): one step's rotations
        self._init_containers()
        out_dim, in_dim = self.weight_shape
        self.in_features, self.out_features = in_dim, out_dim
        self.register_load_state_dict_pre_hook(RotationLayer._check_loaded_state)
        self.register_load_state_dict_pre_hook(RotationLayer._load_base_state)
        self.register_load_state_dict_pre_hook(RotationLayer._drop_caches_on_load)

    # --- where the tensors live (the tuner's PEFT prefix) --------------------------------------------------------
    def _init_containers(self) -> None:
        raise NotImplementedError

    def update_layer(self, adapter_name: str, config: Any, layer_name: str) -> None:
        """Add ``adapter_name`` from the tuner's ``config`` (each method builds its own sides)."""
        raise NotImplementedError

    def side_containers(self, side: str) -> tuple[nn.ParameterDict, BufferDict]:
        """The skew parameters and index buffers of ``side``, keyed by adapter name."""
        raise NotImplementedError

    @property
    def merge_counts(self) -> BufferDict:
        """Per adapter, how many merge-then-reinitialize steps have been folded into ``W0``."""
        raise NotImplementedError

    def skew_parameter(self, adapter_name: str, side: str) -> nn.Parameter:
        """The skew parameter ``(rows, b(b-1)/2)`` of one adapter and side."""
        return self.side_containers(side)[0][adapter_name]

    def index_buffer(self, adapter_name: str, side: str) -> torch.Tensor:
        """The permutation (block), index subset (full) or empty tensor (contiguous) of one adapter and side."""
        return self.side_containers(side)[1][adapter_name]

    def skew_parameters(self) -> list[nn.Parameter]:
        """Every adapter's skew parameters."""
        return [self.skew_parameter(a, side) for a, specs in self.poet_specs.items() for side in specs]

    def sides(self, adapter_name: str) -> dict[str, SideSpec]:
        return self.poet_specs.get(adapter_name, {})

    def _check_loaded_state(self, state_dict: dict[str, torch.Tensor], prefix: str, *args: Any) -> None:
        """``load_state_dict`` pre-hook: every incoming index, skew and merge-count tensor of this layer must be what
        the math needs (`state_checks`); raises [`AdapterStateError`][poet_hf.tuners.state_checks.AdapterStateError]
        naming it."""
        names = {id(child): name for name, child in self.named_children()}
        for adapter_name, specs in self.poet_specs.items():
            checks: list[tuple[nn.Module, Callable[[torch.Tensor], str | None]]] = [
                (self.merge_counts, merge_count_problem)
            ]
            for side, spec in specs.items():
                params, indices = self.side_containers(side)
                checks.append((indices, functools.partial(index_problem, spec=spec)))
                shape = params[adapter_name].shape
                checks.append((params, functools.partial(skew_problem, expected_shape=shape, spec=spec)))
            for container, problem_of in checks:
                key = f"{prefix}{names[id(container)]}.{adapter_name}"
                problem = problem_of(state_dict[key]) if key in state_dict else None
                if problem:
                    raise AdapterStateError(f"tensor '{key}' {problem}", self.poet_settings[adapter_name].source)

    # --- the base weight as an out × in matrix, and the base operation -------------------------------------------
    @property
    def base_quantization(self) -> str | None:
        """``"nf4"``, ``"fp4"`` or ``"int8"`` when the base is a bitsandbytes layer, else ``None``."""
        return bnb.quantization_of(self.get_base_layer())

    def _base_weight(self) -> torch.Tensor:
        """The stored weight of a float base (``Linear``, ``Conv1D``, ``Conv2d``)."""
        return cast(torch.Tensor, self.get_base_layer().weight)

    def _base_bias(self) -> torch.Tensor | None:
        return cast("torch.Tensor | None", self.get_base_layer().bias)

    @property
    def weight_shape(self) -> tuple[int, int]:
        """The logical ``(out, in)`` shape of the base weight (never a quantised layer's packed storage)."""
        base = self.get_base_layer()
        if self.base_quantization is not None:
            return cast(int, base.out_features), cast(int, base.in_features)
        shape = self._base_weight().shape
        return (shape[1], shape[0]) if self._weight_transposed else (shape[0], math.prod(shape[1:]))

    @property
    def weight_dtype(self) -> torch.dtype:
        """The dtype the base weight is used in (a quantised base's compute dtype)."""
        if self.base_quantization is not None:
            return bnb.compute_dtype(self.get_base_layer())
        return self._base_weight().dtype

    def weight_matrix(self) -> torch.Tensor:
        """The out × in base weight: a view of the stored weight, or a quantised base dequantised (a new tensor)."""
        base = self.get_base_layer()
        if self.base_quantization is not None:
            return bnb.dequantize(base).to(self.weight_dtype)
        weight = self._base_weight()
        return weight.T if self._weight_transposed else weight.reshape(weight.shape[0], -1)

    def dense_weight(self) -> torch.Tensor | bnb.QuantizedWeight:
        """What the fused forward takes as ``W0``: the weight matrix, or a quantised base's dequantising callable
        (so no dequantised copy is kept between forward and backward)."""
        if self.base_quantization is not None:
            return bnb.QuantizedWeight(self.get_base_layer(), self.weight_dtype)
        return self.weight_matrix()

    def full_weight_matrix(self) -> torch.Tensor:
        """The whole out × in matrix, gathered when FSDP2 has sharded the weight (then a collective: every rank
        calls it). Only this layer's weight is gathered, never the model's."""
        if self.base_quantization is not None:
            return self.weight_matrix()
        weight = full_tensor(self._base_weight())
        return weight.T if self._weight_transposed else weight.reshape(weight.shape[0], -1)

    def set_weight_matrix(
        self, matrix: torch.Tensor, requantize: str = "nearest", generator: torch.Generator | None = None
    ) -> None:
        """Write the whole out × in ``matrix`` into the base weight; under FSDP2 each rank keeps its own shard.

        A quantised base is requantised by `requantize` (``requantize``: "feedback",
        "nearest", or "stochastic" drawing from ``generator``); the relative error this caused is kept in
        `requantization_error`. A bfloat16 or float16 base is rounded the same three ways
        (`poet_hf.tuners.low_precision`; nearest when FSDP2 shards it)."""
        if self.base_quantization is not None:
            self.requantization_error = bnb.requantize(self, matrix, requantize, generator)
            return
        weight = self._base_weight()
        full = matrix.T if self._weight_transposed else matrix.reshape(weight.shape)
        if weight.dtype in low_precision.LOW_PRECISION_DTYPES and not is_dtensor(weight):
            full = low_precision.store(self.get_base_layer(), full, requantize, generator)
        write_full(weight, full)

    def check_quantizable(self, quantization: str, layer_name: str) -> None:
        """Raise a ``ValueError`` naming the layer unless its base can be quantised as ``quantization`` (an
        ``nn.Linear``, or a bitsandbytes layer already quantised the same way)."""
        current = self.base_quantization
        base = self.get_base_layer()
        if current is None and type(base) is not nn.Linear:
            raise ValueError(
                f"`base_quantization`={quantization!r} quantises nn.Linear targets with bitsandbytes; "
                f"target '{layer_name}' is a {type(base).__name__}"
            )
        if current is not None and current != quantization:
            raise ValueError(
                f"`base_quantization`={quantization!r}, but target '{layer_name}' is already quantised as {current!r}"
            )

    def quantize_base(self, quantization: str) -> None:
        """Replace an ``nn.Linear`` base by its bitsandbytes quantisation (``"nf4"``, ``"fp4"``, ``"int8"``)."""
        if self.base_quantization is None:
            self.base_layer = bnb.quantize_linear(cast(nn.Linear, self.get_base_layer()), quantization)
        self.pending_quantization = None

    def base_weight_bytes(self) -> int:
        """Bytes the stored ``W0`` occupies: the weight, or a quantised base's codes, statistics and residual."""
        if self.base_quantization is None:
            weight = self._base_weight()
            return weight.numel() * weight.element_size() + low_precision.residual_bytes(self.get_base_layer())
        return bnb.quantized_bytes(self.get_base_layer())

    def _load_base_state(self, state_dict: dict[str, torch.Tensor], prefix: str, *args: Any) -> None:
        """``load_state_dict`` pre-hook: a quantised base's codes arrive with their statistics (4-bit quant state,
        int8 row scales), which ``nn.Module``'s loader would drop, so they are installed here together; a 16-bit
        base gets room for its saved rounding residual."""
        if self.poet_settings:
            self._attach_residual_store(next(iter(self.poet_settings)))
        if self.base_quantization is not None:
            bnb.load_quantized_state(self.get_base_layer(), state_dict, f"{prefix}base_layer.")
            return
        low_precision.load_residual(self.get_base_layer(), state_dict, f"{prefix}base_layer.")

    def _attach_residual_store(self, adapter_name: str) -> None:
        """Keep the base's error-feedback residual where the adapter's ``residual_storage`` says
        (`poet_hf.tuners.residual_store`)."""
        names = bnb.RESIDUAL_NAMES if self.base_quantization is not None else (low_precision.ROUNDING_RESIDUAL,)
        residual_store.attach(self.get_base_layer(), self.poet_settings[adapter_name].residual_storage, names)

    @property
    def is_conv2d(self) -> bool:
        return isinstance(self.get_base_layer(), nn.Conv2d)

    def _pads_input(self) -> bool:
        """Whether the input is padded before an unpadded convolution: a ``padding_mode`` other than zeros (as
        ``nn.Conv2d`` does), or ``padding="same"``/``"valid"``, which ``convolution_backward`` does not take."""
        base = self.get_base_layer()
        return isinstance(base, nn.Conv2d) and (base.padding_mode != "zeros" or isinstance(base.padding, str))

    def base_operation(self) -> LinearOp | Conv2dOp:
        """The base layer's operation with its weight given as the out × in matrix."""
        base = self.get_base_layer()
        if not isinstance(base, nn.Conv2d):
            return LinearOp()
        padding = (0, 0) if self._pads_input() else cast(tuple[int, ...], base.padding)
        return Conv2dOp(tuple(base.weight.shape), base.stride, padding, base.dilation, base.groups)

    def _pad_input(self, x: torch.Tensor) -> torch.Tensor:
        """Pad ``x`` as the base convolution would (`_pads_input`), with ``nn.Conv2d``'s own left/right split."""
        if not self._pads_input():
            return x
        base = cast(nn.Conv2d, self.get_base_layer())
        mode = "constant" if base.padding_mode == "zeros" else base.padding_mode
        return F.pad(x, base._reversed_padding_repeated_twice, mode=mode)

    # --- adapters ----------------------------------------------------------------------------------------------------
    def add_rotation_adapter(
        self, adapter_name: str, settings: RotationSettings, specs: dict[str, SideSpec], rows: dict[str, int]
    ) -> None:
        """Create the skew parameters (``rows[side]`` rows) and index buffers, and give them their initial state
        (`reset_rotation_state`); on the ``meta`` device that waits for
        [`materialize_model`][poet_hf.initialization.materialize_model]."""
        self.poet_specs[adapter_name] = specs
        self.poet_settings[adapter_name] = settings
        device = self._base_weight().device
        self.merge_counts[adapter_name] = torch.zeros((), dtype=torch.long, device=device)
        for side, spec in specs.items():
            params, indices = self.side_containers(side)
            params[adapter_name] = nn.Parameter(torch.zeros(rows[side], num_skew_params(spec.block), device=device))
            indices[adapter_name] = torch.empty(spec.index_shape, dtype=torch.long, device=device)
        self._move_adapter_to_device_of_base_layer(adapter_name)  # PEFT then upcasts half adapters (autocast)
        if device.type != "meta":
            self.reset_rotation_state(adapter_name)
        self.set_adapter(self.active_adapters)

    @torch.no_grad()
    def reset_rotation_state(self, adapter_name: str) -> None:
        """The adapter's state at creation, drawn from generators keyed by (seed, adapter, layer, side), so that it is
        the same on every process, whether the layer was built on a device or on ``meta`` and sharded: merge count
        0, the merge-0 permutations / index sets, and zero skew vectors (the identity), or random ones with
        ``init_weights=False``. Sharded (FSDP2) tensors keep their own shard of each draw."""
        settings = self.poet_settings[adapter_name]
        self.merge_counts[adapter_name].zero_()
        for side in self.sides(adapter_name):
            params, indices = self.side_containers(side)
            indices[adapter_name].copy_(self._draw_index(adapter_name, side, merge_count=0))
            params[adapter_name].zero_()
            if not getattr(params[adapter_name], "_poet_anchored", False):
                # so that zero_grad drops a deferred gradient with the rest of the gradient (rotation_cache.py)
                params[adapter_name].register_post_accumulate_grad_hook(rotation_cache.anchor_to_gradient)
                params[adapter_name]._poet_anchored = True
        if not settings.init_weights:
            self.randomize_skew(
                adapter_name, spo_generator(settings.seed, 0, settings.layer_name, "init", adapter_name)
            )

    def _draw_index(self, adapter_name: str, side: str, merge_count: int) -> torch.Tensor:
        settings = self.poet_settings[adapter_name]
        generator = spo_generator(settings.seed, merge_count, settings.layer_name, side, adapter_name)
        return self.poet_specs[adapter_name][side].sample_index(generator)

    @torch.no_grad()
    def randomize_skew(self, adapter_name: str, generator: torch.Generator, op_norm: float = 0.1) -> None:
        """Random skew parameters whose blocks have operator norm about ``op_norm`` (non-identity adapter)."""
        for side, spec in self.sides(adapter_name).items():
            param = self.skew_parameter(adapter_name, side)
            write_full(param, random_skew_params(param.shape, spec.block, generator, op_norm))

    # --- rotations (reference path: merge, unmerge, statistics, the plain-autograd forward) --------------------------
    def rotation_blocks(
        self, adapter_name: str, side: str, dtype: torch.dtype = torch.float32, keep: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The ``(num_blocks, b, b)`` orthogonal blocks of one side, computed in ``dtype`` (float32 or wider);
        blocks flagged ``False`` in ``keep`` are the identity."""
        param = full_tensor(self.skew_parameter(adapter_name, side)).to(dtype)
        blocks = self._blocks_from_vector(param, adapter_name, side)
        if keep is not None:
            eye = torch.eye(blocks.shape[-1], dtype=dtype, device=blocks.device)
            blocks = torch.where(keep[:, None, None], blocks, eye)
        return blocks

    def _blocks_from_vector(self, param: torch.Tensor, adapter_name: str, side: str) -> torch.Tensor:
        spec = self.sides(adapter_name)[side]
        terms = self.poet_settings[adapter_name].neumann_terms
        if _FUSED:
            blocks = orthogonal_from_vector(param, spec.block, terms)
        else:
            q = skew_from_vector(param, spec.block)
            scale = skew_norm_scale(q, terms)
            blocks = cayley_neumann(q if scale is None else q * scale, terms)
        if blocks.shape[0] != spec.num_blocks:  # one block shared by all
            blocks = blocks.expand(spec.num_blocks, -1, -1)
        return blocks

    @torch.no_grad()
    def float64_rotations(self, adapter_name: str) -> SideRotations:
        """Per side, ``(Q, blocks)``: the skew blocks and the ``(num_blocks, b, b)`` orthogonal blocks, in float64.
        Every statistic (`rotation_stats`, `paper_metrics`, ``diagnostics.poet_statistics``) is computed from these;
        computing them once per logging step and passing them on is what keeps logging cheap."""
        rotations = {}
        for side, spec in self.sides(adapter_name).items():
            param = full_tensor(self.skew_parameter(adapter_name, side)).double()
            rotations[side] = (skew_from_vector(param, spec.block), self._blocks_from_vector(param, adapter_name, side))
        return rotations

    def rotate_weight(
        self, matrix: torch.Tensor, adapter_name: str, inverse: bool = False, report: dict[str, Any] | None = None
    ) -> torch.Tensor:
        """``P^T · matrix · R^T`` (or its inverse map ``P^{-T} · matrix · R^{-T}``).

        The inverse uses each side's transpose where the blocks are orthogonal to the working precision of the
        stored weight, and an exact blockwise inverse otherwise; ``report`` (if given) receives, per side, the
        method, the orthogonality error and the estimated relative restoration error (see `invert_blocks`).
        """
        for side, spec in self.sides(adapter_name).items():
            index = self.index_buffer(adapter_name, side)
            if inverse:
                blocks = self.rotation_blocks(adapter_name, side, dtype=torch.float64)
                blocks, side_report = invert_blocks(blocks, self.weight_dtype)
                blocks = blocks.to(matrix.dtype)
                if report is not None:
                    report[side] = side_report
            else:
                blocks = self.rotation_blocks(adapter_name, side, dtype=matrix.dtype)
            blocks = blocks.transpose(-1, -2)
            matrix = (
                spec.matmul_right(matrix, index, blocks)
                if side == SIDE_INPUT
                else spec.matmul_left(matrix, index, blocks)
            )
        return matrix

    def _weight_for_folding(self, adapter_name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The base weight matrix in the dtype a fold is computed in (float32, or float64 for a float64 base; or
        ``dtype``), with the residual of the last requantisation added back when the adapter folds by error
        feedback."""
        matrix = self.full_weight_matrix()
        matrix = matrix.to(dtype or _at_least_float32(matrix.dtype))
        if self.poet_settings[adapter_name].requantize == "feedback":
            residual = self._rounding_residual()
            if residual is not None:
                matrix = matrix + residual.to(matrix.dtype)
        return matrix

    def _rounding_residual(self) -> torch.Tensor | None:
        """What the last fold's rounding of ``W0`` dropped (error feedback), as an out × in matrix, or ``None``."""
        base = self.get_base_layer()
        if self.base_quantization is not None:
            return bnb.residual(base)
        kept = low_precision.residual(base)
        if kept is None:
            return None
        return kept.T if self._weight_transposed else kept.reshape(kept.shape[0], -1)

    def _fold_into_base(self, matrix: torch.Tensor, adapter_name: str, merge_count: int) -> None:
        """Write a folded weight back; a quantised base is requantised by the adapter's ``requantize`` mode (a
        stochastic one draws from a generator seeded by (seed, merge count, layer): the same on every rank)."""
        settings = self.poet_settings[adapter_name]
        generator = spo_generator(settings.seed, merge_count, settings.layer_name, "requantize", adapter_name)
        self._attach_residual_store(adapter_name)
        self.set_weight_matrix(matrix, settings.requantize, generator)

    def effective_weight_matrix(
        self, adapter_names: list[str] | None = None, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """``P^T W_t0 R^T`` for the given adapters (applied in order), as an out × in matrix in ``dtype``."""
        matrix = self.full_weight_matrix().to(dtype)
        for adapter_name in adapter_names if adapter_names is not None else self.active_adapters:
            matrix = self.rotate_weight(matrix, adapter_name)
        return matrix

    def reference_forward(
        self, x: torch.Tensor, adapter_names: list[str], activation: bool, keep: dict[str, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """The forward as a plain autograd composition (several adapters compose in order); ``keep`` maps an
        adapter to the input-side blocks it keeps (OFT's module dropout)."""
        bias = self._base_bias()
        op = self.base_operation()
        x = self._pad_input(x)
        keep = keep or {}
        if not activation:
            base_weight = self.weight_matrix()
            matrix = base_weight.to(_at_least_float32(base_weight.dtype))
            for a in adapter_names:
                for side, spec in self.sides(a).items():
                    blocks = self.rotation_blocks(
                        a, side, dtype=matrix.dtype, keep=keep.get(a) if side == SIDE_INPUT else None
                    ).mT
                    index = self.index_buffer(a, side)
                    matrix = (
                        spec.matmul_right(matrix, index, blocks)
                        if side == SIDE_INPUT
                        else spec.matmul_left(matrix, index, blocks)
                    )
            return op.forward(x, matrix.to(base_weight.dtype), None if bias is None else bias.to(x.dtype))
        # y = x R W0^T P: R-rotations compose innermost-last, P-rotations in adapter order.
        compute = _at_least_float32(x.dtype)
        h = x.to(compute)
        for a in reversed(adapter_names):
            if SIDE_INPUT in self.sides(a):
                blocks = self.rotation_blocks(a, SIDE_INPUT, dtype=compute, keep=keep.get(a))
                h = self.sides(a)[SIDE_INPUT].matmul_right(h, self.index_buffer(a, SIDE_INPUT), blocks)
        output_side = any(SIDE_OUTPUT in self.sides(a) for a in adapter_names)
        h = op.forward(
            h.to(x.dtype), self.weight_matrix(), None if bias is None or output_side else bias.to(x.dtype)
        ).to(compute)
        for a in adapter_names:
            if SIDE_OUTPUT in self.sides(a):
                blocks = self.rotation_blocks(a, SIDE_OUTPUT, dtype=compute)
                h = self.sides(a)[SIDE_OUTPUT].matmul_right(h, self.index_buffer(a, SIDE_OUTPUT), blocks)
        out = h.to(x.dtype)
        return out if bias is None or not output_side else out + bias.to(out.dtype)

    # --- the fused forward -------------------------------------------------------------------------------------------
    def side_rotation(
        self,
        adapter_name: str,
        side: str,
        keep: torch.Tensor | None = None,
        cache: RotationCache | None = None,
        defer: bool = False,
    ) -> SideRotation:
        return SideRotation(
            self.sides(adapter_name)[side],
            self.index_buffer(adapter_name, side),
            self.poet_settings[adapter_name].neumann_terms,
            keep,
            cache,
            defer,
        )

    def choose_strategy(
        self, adapter_name: str, tokens: int, training: bool, polynomial_phase: str = "uncached"
    ) -> str:
        """The fused strategy for one call (`STRATEGIES`).

        ``forward="weight"`` / ``"activation"`` are taken as given; ``"auto"`` takes the fewest multiply-adds by
        `strategy_costs` among the strategies that keep nothing but the
        layer input for the backward, so that ``auto`` never costs more memory than the frozen layer would. The
        polynomial is counted as this call pays it (``polynomial_phase``, see
        `polynomial_products`): the same in every strategy, so amortizing
        it over an accumulation window lowers every total and leaves the choice as it was.
        Conv2d always uses the weight strategy.
        """
        choice = self.poet_settings[adapter_name].forward
        if self.is_conv2d:
            return WEIGHT
        if choice != "auto":
            return choice
        sides = self.sides(adapter_name)
        quantization = self.base_quantization
        terms = self.poet_settings[adapter_name].neumann_terms
        costs = strategy_costs(
            tokens,
            self.in_features,
            self.out_features,
            sides.get(SIDE_INPUT),
            sides.get(SIDE_OUTPUT),
            training,
            dequantize_cost=bnb.DEQUANTIZE_COST[quantization] if quantization else 0.0,
            polynomial=polynomial_products(terms, polynomial_phase) if training else 0,
        )
        # (macs, order, name): the cheapest, the first listed on a tie; a plain min, which Dynamo traces.
        affordable = [(cost["macs"], i, name) for i, (name, cost) in enumerate(costs.items()) if cost["kept"] == 0]
        return min(affordable)[2]

    def fused_forward(self, x: torch.Tensor, adapter_name: str, keep: torch.Tensor | None = None) -> torch.Tensor:
        """``base(x, P^T W0 R^T)`` through the fused functions of `rotated_linear`."""
        sides = self.sides(adapter_name)
        training = torch.is_grad_enabled() and any(self.skew_parameter(adapter_name, s).requires_grad for s in sides)
        tokens = x.numel() // x.shape[-1] if not self.is_conv2d else 0
        rotations, phases = {}, set()
        for side in sides:
            vec = self.skew_parameter(adapter_name, side)
            cache, defer = self._rotation_cache(adapter_name, side, vec, training and vec.requires_grad)
            phases.add(_polynomial_phase(cache, defer))
            rotations[side] = (
                self.side_rotation(adapter_name, side, keep if side == SIDE_INPUT else None, cache, defer),
                vec,
            )
        strategy = self.choose_strategy(
            adapter_name, tokens, training, phases.pop() if len(phases) == 1 else "uncached"
        )
        r_side, r_vec = rotations.get(SIDE_INPUT, (None, None))
        p_side, p_vec = rotations.get(SIDE_OUTPUT, (None, None))
        return rotated_forward(
            strategy,
            self._pad_input(x),
            self.dense_weight(),
            self._base_bias(),
            r_side,
            r_vec,
            p_side,
            p_vec,
            op=self.base_operation(),
        )

    @staticmethod
    def fused_enabled() -> bool:
        return _FUSED

    # --- one optimizer step's rotations, shared by its micro-batches (tuners/rotation_cache.py) -----------------------
    def _rotation_cache(
        self, adapter_name: str, side: str, vec: torch.Tensor, training: bool
    ) -> tuple[RotationCache | None, bool]:
        """The cache this call reads its blocks from (``None``: none is open and this micro-batch does not defer) and
        whether the call defers its VJP. Raises ``RuntimeError`` if the skew vector changed under deferred
        gradients other than by an optimizer step or a merge (their Jacobian would be lost).

        Under ``torch.compile`` there is no cache: every micro-batch evaluates its rotation and its own VJP (the same
        gradient; the cache only saves the repeated polynomial, and it lives outside the graph)."""
        if torch.compiler.is_compiling():
            return None, False
        defer = training and self.poet_settings[adapter_name].cache_rotations and rotation_cache.deferring()
        cache = self._rotation_caches.get((adapter_name, side))
        if cache is None:
            if not defer:
                return None, False
            cache = self._rotation_caches[(adapter_name, side)] = RotationCache()
            vec._poet_rotation_cache = cache  # type: ignore[attr-defined]  # on the tensor, for anchor_to_gradient
            rotation_cache.track(self)
        if rotation_cache.gradient_was_reset(vec, cache):
            cache.clear()  # zero_grad(set_to_none=False) since the last micro-batch: the step was abandoned
        key = (int(self.merge_counts[adapter_name]), float(torch.linalg.vector_norm(vec.detach())))
        if cache.key is not None and cache.key != key:
            if cache.pending is not None:
                raise RuntimeError(
                    f"the skew parameter of adapter '{adapter_name}' ({side} side) of "
                    f"'{self.poet_settings[adapter_name].layer_name}' changed while its gradient was deferred over "
                    "an accumulation window; apply the deferred gradients first with "
                    "poet_hf.flush_rotation_caches(model)"
                )
            cache.clear()
        cache.key = key
        return cache, defer

    def _drop_caches_on_load(self, *args: Any) -> None:
        self.drop_rotation_caches()

    def rotation_cache_bytes(self) -> int:
        """Bytes held by this layer's rotation caches (blocks and deferred gradients)."""
        return sum(cache.nbytes for cache in self._rotation_caches.values())

    def has_deferred_grads(self) -> bool:
        return any(cache.pending is not None for cache in self._rotation_caches.values())

    def drop_rotation_caches(self) -> None:
        """Free the caches, deferred gradients included (they are lost: for a step that is abandoned)."""
        for cache in self._rotation_caches.values():
            cache.clear()

    @torch.no_grad()
    def flush_rotation_caches(self, collective: bool = True) -> None:
        """Add the deferred gradients to the skew parameters' ``.grad`` now (exactly what the micro-batches would have
        added without deferral) and free the caches.

        Under FSDP2 (a sharded skew parameter) this needs collectives: the local gradient is averaged over the
        processes, as FSDP2's reduce-scatter does, and each keeps its shard. With ``collective=False`` (an exception
        handler, ``eval()``) such a cache is left as it is, for the step's last micro-batch or the optimizer step."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        for (adapter_name, side), cache in self._rotation_caches.items():
            param = self.skew_parameter(adapter_name, side)
            sharded = isinstance(param, DTensor)
            if sharded and not collective:
                continue
            pending = cache.pending
            cache.clear()
            if pending is None:
                continue
            grad = self.side_rotation(adapter_name, side).vector_grad(None, pending, full_tensor(param))
            if sharded:
                torch.distributed.all_reduce(grad, op=torch.distributed.ReduceOp.AVG)
                grad = distribute_tensor(grad, param.device_mesh, param.placements, src_data_rank=None)  # type: ignore[attr-defined]  # a DTensor
            param.grad = grad if param.grad is None else param.grad.add_(grad)

    def train(self, mode: bool = True) -> Any:
        """``eval()`` ends any accumulation window: deferred gradients are applied and the caches freed."""
        if not mode:
            self.flush_rotation_caches(collective=False)
        return nn.Module.train(cast(nn.Module, self), mode)  # the concrete layers are nn.Modules

    def adapter_forward(self, x: torch.Tensor, adapter_names: list[str]) -> torch.Tensor:
        """The forward with the given active adapters (a subclass adds its own options around it)."""
        if _FUSED and len(adapter_names) == 1:
            return self.fused_forward(x, adapter_names[0])
        tokens = x.numel() // x.shape[-1] if not self.is_conv2d else 0
        strategies = {self.choose_strategy(a, tokens, torch.is_grad_enabled()) for a in adapter_names}
        return self.reference_forward(x, adapter_names, activation=strategies <= {ACTIVATION, ACTIVATION_RECOMPUTE})

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
        return self.adapter_forward(x, active)

    # --- PEFT merge / unmerge (inference-time folds; the adapter keeps its state) ------------------------------------
    @torch.no_grad()
    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        """Fold the adapters into the base weight (``W_t ← P^T W_t R^T``) without changing them."""
        adapter_names = check_adapters_to_merge(self, adapter_names)
        self.flush_rotation_caches()
        for adapter_name in adapter_names:
            if adapter_name not in self.poet_specs:
                continue
            merged = self.rotate_weight(self._weight_for_folding(adapter_name), adapter_name)
            if safe_merge and not torch.isfinite(merged).all():
                raise ValueError(f"NaNs or infs found while merging adapter '{adapter_name}'; it is broken")
            self._fold_into_base(merged, adapter_name, PEFT_MERGE)
            self.merged_adapters.append(adapter_name)
            self._warn_requantized("merging", adapter_name)

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
            restored = self.rotate_weight(
                self._weight_for_folding(adapter_name, torch.float64), adapter_name, inverse=True, report=report
            )
            self._fold_into_base(restored, adapter_name, PEFT_MERGE)
            self._warn_requantized("unmerging", adapter_name)
            report["error_bound"] = sum(r["error_bound"] for r in report.values())
            self.unmerge_report[adapter_name] = report
            if any(r["method"] == "solve" for r in report.values() if isinstance(r, dict)):
                logger.info(
                    "unmerged adapter '%s' by an exact solve (rotation not orthogonal to working precision): %s",
                    adapter_name,
                    report,
                )

    def _warn_requantized(self, action: str, adapter_name: str) -> None:
        """A fold into a quantised base changes the weight by a requantisation: say by how much (measured)."""
        if self.base_quantization is not None:
            warnings.warn(
                f"{action} adapter '{adapter_name}' into the {self.base_quantization} base of "
                f"'{self.poet_settings[adapter_name].layer_name}' requantised W0: relative error "
                f"{self.requantization_error:.2e} (||dequant(Q(W)) - W||_F / ||W||_F, measured)",
                QuantizedMergeWarning,
                stacklevel=3,
            )

    # --- POET training-time merge-then-reinitialize -------------------------------------------------------------------
    @torch.no_grad()
    def merge_and_reinit(self, adapter_name: str) -> dict[str, float]:
        """Fold R and P into ``W0``, zero the skew parameters, and draw fresh permutations / index sets.

        A quantised ``W0`` is dequantised, rotated and requantised by the adapter's ``requantize`` mode
        (`requantize`).

        Returns the pre-merge statistics of `rotation_stats`, with ``requantization_error`` for a quantised
        base.
        """
        if self.merged:
            raise RuntimeError("merge_and_reinit needs an unmerged layer; call unmerge() first")
        self.flush_rotation_caches()  # deferred gradients belong to the rotations about to be folded
        stats = self.rotation_stats(adapter_name)
        count = int(self.merge_counts[adapter_name]) + 1
        self._fold_into_base(
            self.rotate_weight(self._weight_for_folding(adapter_name), adapter_name), adapter_name, count
        )
        if self.requantization_error is not None and self.base_quantization is not None:
            stats["requantization_error"] = self.requantization_error
        self.merge_counts[adapter_name].fill_(count)
        for side in self.sides(adapter_name):
            params, indices = self.side_containers(side)
            params[adapter_name].zero_()
            indices[adapter_name].copy_(self._draw_index(adapter_name, side, count))
        return stats

    @torch.no_grad()
    def rotation_angle(self, adapter_name: str) -> float:
        """How far, in degrees, the live rotations can turn the layer: the sum over sides of the largest angle one
        side turns a vector by, ``2·atan(||Q||_2)`` (exact for the Cayley transform, whose eigenvalues are
        ``e^{±2i·atan θ}``; ``||Q||_2`` by power iteration). POET's two sides add up; OFT has one."""
        return sum(
            math.degrees(
                2
                * math.atan(
                    float(
                        skew_spectral_norm(
                            skew_from_vector(full_tensor(self.skew_parameter(adapter_name, side)).float(), spec.block)
                        ).max()
                    )
                )
            )
            for side, spec in self.sides(adapter_name).items()
        )

    @torch.no_grad()
    def paper_metrics(self, adapter_name: str, rotations: SideRotations | None = None) -> dict[str, dict[str, float]]:
        """Per side, the POET paper's ``e_orth = ||R Rᵀ − I||_F / ||I||_F`` and trace metric ``Tr(R)/m`` (appendices A,
        G, J) of the whole ``m × m`` rotation, from its blocks in float64 (``rotations``, from `float64_rotations`, when
        the caller has them): a permutation changes neither, and the identity outside a fully stochastic block adds
        nothing to the error and ``m − b`` to the trace."""
        rotations = rotations if rotations is not None else self.float64_rotations(adapter_name)
        metrics = {}
        for side, spec in self.sides(adapter_name).items():
            blocks = rotations[side][1]
            # ||RRᵀ − I||_F² is the sum over blocks of ||BBᵀ − I||_F² = b · orthogonality_error(B)².
            squared_error = float((orthogonality_error(blocks) ** 2).sum()) * spec.block
            trace = float(blocks.diagonal(dim1=-2, dim2=-1).sum()) + (spec.dim - spec.block * blocks.shape[0])
            metrics[side] = {"e_orth": math.sqrt(squared_error / spec.dim), "trace": trace / spec.dim}
        return metrics

    @torch.no_grad()
    def rotation_stats(self, adapter_name: str, rotations: SideRotations | None = None) -> dict[str, float]:
        """``q_norm`` (largest ``||Q||_2``), ``orth_error`` (largest ``||R R^T − I||_F/√b``) and ``neumann_bound``
        (the bound on any singular value's relative change the live rotations cause, from
        [`neumann_error_bound`][poet_hf.orthogonal.neumann_error_bound]), over blocks and sides; from ``rotations``
        (`float64_rotations`) when the caller has them."""
        rotations = rotations if rotations is not None else self.float64_rotations(adapter_name)
        stats = {"q_norm": 0.0, "orth_error": 0.0, "neumann_bound": 0.0}
        bound = 1.0
        terms = self.poet_settings[adapter_name].neumann_terms
        for q, blocks in rotations.values():
            largest_norm = torch.linalg.matrix_norm(q, ord=2).max()
            stats["q_norm"] = max(stats["q_norm"], float(largest_norm))
            stats["orth_error"] = max(stats["orth_error"], float(orthogonality_error(blocks).max()))
            # The bound grows with ||Q||_2, so the block with the largest norm has the largest bound.
            bound *= 1 + float(neumann_error_bound_at_norm(largest_norm, terms))
        stats["neumann_bound"] = bound - 1
        return stats


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole of a tensor FSDP2 may have sharded into a ``DTensor`` (then a collective: every rank calls it)."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


@torch.no_grad()
def write_full(param: torch.Tensor, full: torch.Tensor) -> None:
    """Write the whole tensor ``full`` into ``param``; for a sharded ``DTensor`` each rank copies its own shard of
    ``full`` (which every rank computed identically, so no communication is needed)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    full = full.to(param.dtype)
    if isinstance(param, DTensor):
        param.copy_(distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None))
    else:
        param.data.copy_(full)


def is_dtensor(tensor: torch.Tensor) -> bool:
    """Whether FSDP2 has sharded ``tensor`` into a ``DTensor``."""
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def _at_least_float32(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _is_conv1d(module: nn.Module) -> bool:
    from transformers.pytorch_utils import Conv1D

    return isinstance(module, Conv1D)


def _polynomial_phase(cache: RotationCache | None, defer: bool) -> str:
    """Where a call stands in its optimizer step (`polynomial_products`)."""
    if cache is None:
        return "uncached"
    if not defer:
        return "closing"
    return "building" if cache.blocks is None else "deferred"


def flush_rotation_caches(model: nn.Module) -> None:
    """Apply every deferred rotation gradient of ``model`` to its skew parameter's ``.grad`` and free the rotation
    caches (under FSDP2 a collective: every process calls it). Needed only after changing skew parameters by hand in
    the middle of an accumulation window; steps, merges, ``eval()`` and exceptions in the forward do it themselves.

    Args:
        model: the model whose layers to flush.
    """
    for _, layer in rotation_layers(model):
        layer.flush_rotation_caches()


def rotation_layers(model: nn.Module, adapter_name: str | None = None) -> list[tuple[str, RotationLayer]]:
    """``(name, layer)`` for every POET or OFT layer of ``model`` (with ``adapter_name`` if given)."""
    return [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, RotationLayer) and (adapter_name is None or adapter_name in m.poet_specs)
    ]
