"""A rotation layer's forward: the fused path, its per-step rotation caches, and the plain autograd reference.

`FusedForward` runs ``base(x, Pᵀ W0 Rᵀ)`` (POET eq. 3) through the fused functions of
`poet_hf.orthogonal.rotated_linear`, choosing a strategy per call, and keeps per adapter and side the
[`RotationCache`][poet_hf.orthogonal.rotation_sides.RotationCache] that lets an accumulation window build each
rotation once and run one VJP for it (`caches.py` tracks the windows and the optimizer hooks).
`reference_forward` composes the same forward from the orthogonal primitives under plain autograd: the path of
several adapters at once, and, with the model's `RotationStepState.reference` set (`plain_autograd`), the reference
the fused path is tested against.
"""

from __future__ import annotations

import weakref

import torch

from ...orthogonal.map_protocol import OrthogonalMap
from ...orthogonal.rotated_linear import WEIGHT, RotatedPass, RotationCache, SideRotation, compute_dtypes
from ...orthogonal.spo import SideSpec
from ...orthogonal.strategy_costs import (
    CacheChoice,
    auto_strategy,
    polynomial_products,
    rotation_cache_choice,
    strategy_costs,
)
from ...sharded import full_tensor
from ..config_utils import SIDE_INPUT, SIDE_OUTPUT
from . import caches
from .base_weight import at_least_float32
from .storage_kinds import storage_kind
from .view import RotatedLayerView


class FusedForward:
    """The fused forward of one rotation layer and its per-step rotation caches, keyed by ``(adapter, side)``.

    Every method takes the layer it serves, so the collaborator holds no reference back to it.
    """

    def __init__(self) -> None:
        self.caches: dict[tuple[str, str], RotationCache] = {}
        self.anchored: dict[tuple[str, str], weakref.ref] = {}  # the skew parameter holding each side's anchor hook
        self.cache_choices: dict[str, CacheChoice] = {}  # cache_rotations="auto", per adapter, at its first window

    def side_rotation(
        self,
        layer: RotatedLayerView,
        adapter_name: str,
        side: str,
        keep: torch.Tensor | None = None,
        cache: RotationCache | None = None,
        defer: bool = False,
    ) -> SideRotation:
        """One side's rotation as the fused functions take it; ``keep`` flags the blocks OFT's dropout keeps."""
        settings = layer.rotation_settings[adapter_name]
        spec = layer.sides(adapter_name)[side]
        index = layer.index_buffer(adapter_name, side)
        return SideRotation(spec, index, settings.orthogonal_map, keep, cache, defer, layer.step_state.norm_cap)

    def choose_strategy(
        self,
        layer: RotatedLayerView,
        adapter_name: str,
        tokens: int,
        training: bool,
        polynomial_phase: str = "uncached",
    ) -> str:
        """The fused strategy for one call of ``tokens`` tokens.

        ``forward="weight"``, ``"activation"`` or ``"activation-recompute"`` is taken as given. ``"auto"`` takes
        `auto_strategy` of the multiply-adds (`strategy_costs`), with the polynomial counted as this call pays it
        (`polynomial_products`). Conv2d always uses the weight strategy."""
        settings = layer.rotation_settings[adapter_name]
        if layer.is_conv2d:
            return WEIGHT
        if settings.forward != "auto":
            return str(settings.forward)
        sides = layer.sides(adapter_name)
        base_quantization = layer.base_quantization
        costs = strategy_costs(
            tokens,
            layer.in_features,
            layer.out_features,
            sides.get(SIDE_INPUT),
            sides.get(SIDE_OUTPUT),
            training,
            dequantize_cost=quantization_cost(base_quantization),
            polynomial=_map_products(settings.orthogonal_map, sides, polynomial_phase) if training else 0,
        )
        return auto_strategy(costs, layer.in_features, layer.out_features)

    def __call__(
        self, layer: RotatedLayerView, x: torch.Tensor, adapter_name: str, keep: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``base(x, Pᵀ W0 Rᵀ)`` for one adapter."""
        sides = layer.sides(adapter_name)
        trainable = any(layer.rotation_parameter(adapter_name, side).requires_grad for side in sides)
        training = torch.is_grad_enabled() and trainable
        tokens = x.numel() // x.shape[-1] if not layer.is_conv2d else 0
        rotations, phases = {}, set()
        weight = layer.dense_weight()
        # no cache under torch.compile: it lives outside the graph (`cache_for`)
        deferring = training and not torch.compiler.is_compiling() and caches.deferring()
        # what a new cache keeps its blocks in
        rotation_dtype = compute_dtypes(x, weight).rotation if deferring else None
        caching = deferring and self.caching(layer, adapter_name, tokens, rotation_dtype)
        for side in sides:
            vec = layer.rotation_parameter(adapter_name, side)
            cache, defer = self.cache_for(layer, adapter_name, side, vec, caching and vec.requires_grad, rotation_dtype)
            phases.add(_polynomial_phase(cache, defer))
            side_keep = keep if side == SIDE_INPUT else None
            rotations[side] = (self.side_rotation(layer, adapter_name, side, side_keep, cache, defer), vec)
        phase = phases.pop() if len(phases) == 1 else "uncached"
        strategy = self.choose_strategy(layer, adapter_name, tokens, training, phase)
        r_side, r_vec = rotations.get(SIDE_INPUT, (None, None))
        p_side, p_vec = rotations.get(SIDE_OUTPUT, (None, None))
        rotated = RotatedPass(strategy, r_side, p_side, layer.base_operation())
        return rotated(layer.pad_input(x), weight, layer.base_bias(), r_vec, p_vec)

    def caching(
        self, layer: RotatedLayerView, adapter_name: str, tokens: int, rotation_dtype: torch.dtype | None
    ) -> bool:
        """Whether a deferring call of ``tokens`` tokens caches the rotations (``cache_rotations``).

        ``True`` and ``False`` are taken as given; ``"auto"`` is decided once per adapter, at its first deferring call,
        by `rotation_cache_choice` (the shapes, the tokens, the compute dtype and the processes the model's
        parameters are sharded over), and noted in the model's `RotationStepState`, which logs it."""
        setting = layer.rotation_settings[adapter_name].cache_rotations
        if setting != "auto":
            return bool(setting)
        choice = self.cache_choices.get(adapter_name)
        if choice is None:
            sides = layer.sides(adapter_name)
            quantization = layer.base_quantization
            choice = self.cache_choices[adapter_name] = rotation_cache_choice(
                tokens,
                layer.in_features,
                layer.out_features,
                sides.get(SIDE_INPUT),
                sides.get(SIDE_OUTPUT),
                layer.rotation_settings[adapter_name].orthogonal_map,
                shards=layer.step_state.process_shards(),
                block_bytes=torch.finfo(rotation_dtype or torch.float32).bits // 8,
                dequantize_cost=quantization_cost(quantization),
            )
            layer.step_state.note_cache_choice(layer.rotation_settings[adapter_name].layer_name, choice)
        return choice.cache

    def cache_for(
        self,
        layer: RotatedLayerView,
        adapter_name: str,
        side: str,
        vec: torch.Tensor,
        defer: bool,
        dtype: torch.dtype | None = None,
    ) -> tuple[RotationCache | None, bool]:
        """The cache a call reads its blocks from (kept in ``dtype``), and whether the call defers its VJP.

        ``defer``: the call is not its step's last (`caches.deferring`) and its layer caches (`caching`). The cache is
        ``None`` when none is open and the call does not defer, and always under ``torch.compile`` (the cache lives
        outside the graph).

        Raises:
            RuntimeError: the skew vector changed under deferred gradients other than by a step or a merge.
        """
        if torch.compiler.is_compiling():
            return None, False
        settings = layer.rotation_settings[adapter_name]
        cache = self.caches.get((adapter_name, side))
        if cache is None:
            if not defer:
                return None, False
            cache = self.caches[(adapter_name, side)] = RotationCache(dtype)
            self._anchor_gradient(layer, adapter_name, side)
            layer.step_state.track(layer)
        if caches.gradient_was_reset(vec, cache):
            cache.clear()  # zero_grad(set_to_none=False) since the last micro-batch: the step was abandoned
        key = (int(layer.merge_counts[adapter_name]), float(torch.linalg.vector_norm(vec.detach())))
        if cache.key is not None and cache.key != key:
            if cache.pending is not None:
                raise RuntimeError(
                    f"the skew parameter of adapter '{adapter_name}' ({side} side) of '{settings.layer_name}' changed "
                    "while its gradient was deferred over an accumulation window; apply the deferred gradients first "
                    "with poet_hf.flush_rotation_caches(model)"
                )
            cache.clear()
        cache.key = key
        return cache, defer

    def _anchor_gradient(self, layer: RotatedLayerView, adapter_name: str, side: str) -> None:
        """Hook the layer's skew parameter (once) so that ``zero_grad`` drops its deferred gradient too
        (`caches.gradient_anchor`)."""
        param = layer.rotation_parameter(adapter_name, side)
        anchored = self.anchored.get((adapter_name, side))
        if anchored is None or anchored() is not param:
            param.register_post_accumulate_grad_hook(caches.gradient_anchor(self, layer, adapter_name, side))
            self.anchored[(adapter_name, side)] = weakref.ref(param)

    def __getstate__(self) -> dict:
        """Copied and pickled without its hooks' record: a copy's parameters carry no hook until it caches."""
        return {**self.__dict__, "anchored": {}}

    def nbytes(self) -> int:
        """Bytes the caches hold (blocks and deferred gradients)."""
        return sum(cache.nbytes for cache in self.caches.values())

    def has_deferred_grads(self) -> bool:
        return any(cache.pending is not None for cache in self.caches.values())

    def drop(self) -> None:
        """Free the caches, deferred gradients included (for a step that is abandoned)."""
        for cache in self.caches.values():
            cache.clear()

    @torch.no_grad()
    def flush(self, layer: RotatedLayerView, collective: bool = True) -> None:
        """Add the deferred gradients to the skew parameters' ``.grad`` and free the caches.

        The sum is what the micro-batches would have added without deferral. A sharded (FSDP2) parameter's gradient
        is averaged over the processes, as FSDP2's reduce-scatter does; with ``collective=False`` its cache is left
        for a later flush."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        for (adapter_name, side), cache in self.caches.items():
            param = layer.rotation_parameter(adapter_name, side)
            sharded = isinstance(param, DTensor)
            if sharded and not collective:
                continue
            pending = cache.pending
            cache.clear()
            if pending is None:
                continue
            grad = self.side_rotation(layer, adapter_name, side).vector_grad(None, pending, full_tensor(param))
            if isinstance(param, DTensor):
                torch.distributed.all_reduce(grad, op=torch.distributed.ReduceOp.AVG)
                grad = distribute_tensor(grad, param.device_mesh, param.placements, src_data_rank=None)
            param.grad = grad if param.grad is None else param.grad.add_(grad)


def reference_forward(
    layer: RotatedLayerView,
    x: torch.Tensor,
    adapter_names: list[str],
    activation: bool,
    keep: dict[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The forward as a plain autograd composition of the orthogonal primitives.

    Several adapters compose in order; ``keep`` maps an adapter to the input-side blocks it keeps (OFT's module
    dropout); ``activation`` rotates the activations instead of the weight."""
    plain = layer.step_state.reference  # build the blocks by plain autograd too
    bias = layer.base_bias()
    op = layer.base_operation()
    x = layer.pad_input(x)
    keep = keep or {}
    if not activation:
        base_weight = layer.weight_matrix()
        matrix = base_weight.to(at_least_float32(base_weight.dtype))
        for a in adapter_names:
            for side, spec in layer.sides(a).items():
                side_keep = keep.get(a) if side == SIDE_INPUT else None
                blocks = layer.rotation_blocks(a, side, dtype=matrix.dtype, keep=side_keep, plain=plain).mT
                index = layer.index_buffer(a, side)
                matrix = (
                    spec.matmul_right(matrix, index, blocks)
                    if side == SIDE_INPUT
                    else spec.matmul_left(matrix, index, blocks)
                )
        return op.forward(x, matrix.to(base_weight.dtype), None if bias is None else bias.to(x.dtype))
    # y = x R W0^T P: R-rotations compose innermost-last, P-rotations in adapter order.
    compute = at_least_float32(x.dtype)
    h = x.to(compute)
    for a in reversed(adapter_names):
        if SIDE_INPUT in layer.sides(a):
            blocks = layer.rotation_blocks(a, SIDE_INPUT, dtype=compute, keep=keep.get(a), plain=plain)
            h = layer.sides(a)[SIDE_INPUT].matmul_right(h, layer.index_buffer(a, SIDE_INPUT), blocks)
    output_side = any(SIDE_OUTPUT in layer.sides(a) for a in adapter_names)
    h = op.forward(h.to(x.dtype), layer.weight_matrix(), None if bias is None or output_side else bias.to(x.dtype)).to(
        compute
    )
    for a in adapter_names:
        if SIDE_OUTPUT in layer.sides(a):
            blocks = layer.rotation_blocks(a, SIDE_OUTPUT, dtype=compute, plain=plain)
            h = layer.sides(a)[SIDE_OUTPUT].matmul_right(h, layer.index_buffer(a, SIDE_OUTPUT), blocks)
    out = h.to(x.dtype)
    return out if bias is None or not output_side else out + bias.to(out.dtype)


def quantization_cost(base_quantization: str | None) -> float:
    """Multiply-adds per ``W0`` entry of dequantising it once (0 for a float ``W0``)."""
    return storage_kind(base_quantization).dequantize_cost if base_quantization else 0.0


def _polynomial_phase(cache: RotationCache | None, defer: bool) -> str:
    """Where a call stands in its optimizer step (`polynomial_products`)."""
    if cache is None:
        return "uncached"
    if not defer:
        return "closing"
    return "building" if cache.blocks is None else "deferred"


def _map_products(orthogonal_map: OrthogonalMap, sides: dict[str, SideSpec], phase: str) -> int:
    """`polynomial_products` of the map at the sides' largest block."""
    return polynomial_products(orthogonal_map, max(spec.block for spec in sides.values()), phase)
