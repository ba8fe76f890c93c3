"""The PEFT layer shared by the POET and OFT tuners: adapters made of orthogonal side rotations.

A `RotationLayer` wraps an ``nn.Linear``, a ``transformers`` ``Conv1D`` or an ``nn.Conv2d`` and holds, per adapter,
up to two sides: ``"input"`` (``R``, in × in) and ``"output"`` (``P``, out × out). Each side is a rotation parameter
(one row per block) and an index buffer (permutation or subset) placing it. The effective weight is
``Pᵀ · W_t0 · Rᵀ`` (POET eq. 3 in torch orientation), with ``W_t0`` the base weight as an out × in matrix
(`base_weight.py`).

Here: the adapter state, its construction, merge / unmerge and merge-then-reinitialize. The forward paths are in
`forward.py` and the statistics in [`poet_hf.diagnostics`][poet_hf.diagnostics]. Subclasses (POET, OFT) declare
where their tensors live, how a config becomes sides, and their forward options.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, cast

import torch
from peft.tuners._buffer_dict import BufferDict
from peft.tuners.tuners_utils import BaseTunerLayer, check_adapters_to_merge
from torch import nn

from ...orthogonal import spo_generator
from ...orthogonal.linalg import invert_blocks
from ...orthogonal.rotated_linear import ACTIVATION, ACTIVATION_RECOMPUTE
from ...orthogonal.rotation_sides import side_blocks
from ...orthogonal.spo import SideSpec
from ...orthogonal.statistics import block_statistics
from ...sharded import full_tensor, write_full
from ..config_utils import SIDE_INPUT
from ..tuner_base import ModuleMixin
from .base_weight import BaseWeightMixin, QuantizedMergeWarning
from .caches import RotationStepState
from .config import RotationConfig
from .forward import FusedForward, reference_forward
from .row_fold import fold_by_rows, foldable_by_rows
from .settings import RotationSettings
from .state_checks import check_loaded_state

if TYPE_CHECKING:
    from typing_extensions import Self

logger = logging.getLogger(__name__)

__all__ = ["RotationLayer", "RotationSettings", "QuantizedMergeWarning", "rotation_layers", "flush_rotation_caches"]

PEFT_MERGE = -2  # the merge count that seeds a stochastic requantisation in PEFT's merge / unmerge

# Per side, ``(generator norms, blocks)`` in float64 (`RotationLayer.float64_rotations`).
SideRotations = dict[str, tuple[torch.Tensor, torch.Tensor]]


class RotationLayer(BaseWeightMixin, BaseTunerLayer, ModuleMixin):
    """Adapter state of one wrapped module: rotation parameters per side and the index buffers that place them.

    A subclass sets ``adapter_layer_names`` / ``other_param_names`` (PEFT's contract), creates its containers in
    `_init_containers`, maps a side to them in `side_containers`, and adds adapters with
    `add_rotation_adapter`.
    """

    def __init__(self, base_layer: nn.Module, **kwargs: Any) -> None:
        self.base_layer = base_layer
        self.rotation_specs: dict[str, dict[str, SideSpec]] = {}
        self.rotation_settings: dict[str, RotationSettings] = {}
        self.unmerge_report: dict[str, dict[str, Any]] = {}
        self._disable_adapters = False
        self.merged_adapters: list[str] = []
        self.kwargs = kwargs
        self._init_weight_access(base_layer)
        self.fused = FusedForward()
        self.step_state = RotationStepState()  # the model's, once it injects this layer
        self.adjusted_block_sizes: dict[str, dict[str, int]] = {}  # until the tuner records them (block_sizes.py)
        self._init_containers()
        out_dim, in_dim = self.weight_shape
        self.in_features, self.out_features = in_dim, out_dim
        self.register_load_state_dict_pre_hook(check_loaded_state)
        self.register_load_state_dict_pre_hook(RotationLayer._load_base_state)
        self.register_load_state_dict_pre_hook(_drop_caches_on_load)

    def _init_containers(self) -> None:
        raise NotImplementedError

    def update_layer(self, adapter_name: str, config: RotationConfig, layer_name: str) -> None:
        """Add ``adapter_name`` from the tuner's ``config`` (each method builds its own sides)."""
        raise NotImplementedError

    def side_containers(self, side: str) -> tuple[nn.ParameterDict, BufferDict]:
        """The rotation parameters and index buffers of ``side``, keyed by adapter name."""
        raise NotImplementedError

    @property
    def merge_counts(self) -> BufferDict:
        """Per adapter, how many merge-then-reinitialize steps have been folded into ``W0``."""
        raise NotImplementedError

    def rotation_parameter(self, adapter_name: str, side: str) -> nn.Parameter:
        """The parameter ``(rows, num_params(b))`` of one adapter and side: the skew vectors of Cayley–Neumann, the
        reflection vectors of Householder products (`OrthogonalMap.num_params`)."""
        return self.side_containers(side)[0][adapter_name]

    def index_buffer(self, adapter_name: str, side: str) -> torch.Tensor:
        """The permutation (block), index subset (full) or empty tensor (contiguous) of one adapter and side."""
        return self.side_containers(side)[1][adapter_name]

    def rotation_parameters(self) -> list[nn.Parameter]:
        """Every adapter's rotation parameters."""
        return [self.rotation_parameter(a, side) for a, specs in self.rotation_specs.items() for side in specs]

    def sides(self, adapter_name: str) -> dict[str, SideSpec]:
        return self.rotation_specs.get(adapter_name, {})

    def add_rotation_adapter(
        self, adapter_name: str, settings: RotationSettings, specs: dict[str, SideSpec], rows: dict[str, int]
    ) -> None:
        """Create an adapter's rotation parameters (``rows[side]`` rows) and index buffers in their initial state.

        On the ``meta`` device the state (`reset_rotation_state`) waits for
        [`materialize_model`][poet_hf.initialization.materialize_model]."""
        self.rotation_specs[adapter_name] = specs
        self.rotation_settings[adapter_name] = settings
        device = self.base_weight().device
        self.merge_counts[adapter_name] = torch.zeros((), dtype=torch.long, device=device)
        for side, spec in specs.items():
            params, indices = self.side_containers(side)
            width = settings.orthogonal_map.num_params(spec.block)
            params[adapter_name] = nn.Parameter(torch.zeros(rows[side], width, device=device))
            indices[adapter_name] = torch.empty(spec.index_shape, dtype=torch.long, device=device)
        self._move_adapter_to_device_of_base_layer(adapter_name)  # PEFT then upcasts half adapters (autocast)
        if device.type != "meta":
            self.reset_rotation_state(adapter_name)
        self.set_adapter(self.active_adapters)

    @torch.no_grad()
    def reset_rotation_state(self, adapter_name: str) -> None:
        """Give the adapter its state at creation: merge count 0, the merge-0 indices, identity rotations.

        The draws come from generators keyed by (seed, adapter, layer, side), so they are the same on every process
        and on every way of building the layer; sharded (FSDP2) tensors keep their own shard of each. With
        ``init_weights=False`` the rotations are random instead of the identity."""
        settings = self.rotation_settings[adapter_name]
        self.merge_counts[adapter_name].zero_()
        for side in self.sides(adapter_name):
            _, indices = self.side_containers(side)
            indices[adapter_name].copy_(self._draw_index(adapter_name, side, merge_count=0))
            _reset_to_identity(self, adapter_name, side, merge_count=0)
        if not settings.init_weights:
            self.randomize_adapter(
                adapter_name, spo_generator(settings.seed, 0, settings.layer_name, "init", adapter_name)
            )

    def _draw_index(self, adapter_name: str, side: str, merge_count: int) -> torch.Tensor:
        settings = self.rotation_settings[adapter_name]
        generator = spo_generator(settings.seed, merge_count, settings.layer_name, side, adapter_name)
        return self.rotation_specs[adapter_name][side].sample_index(generator)

    @torch.no_grad()
    def randomize_adapter(self, adapter_name: str, generator: torch.Generator, op_norm: float = 0.1) -> None:
        """Random parameters whose blocks turn vectors by about ``2·atan(op_norm)`` (a non-identity adapter)."""
        orthogonal_map = self.rotation_settings[adapter_name].orthogonal_map
        for side, spec in self.sides(adapter_name).items():
            param = self.rotation_parameter(adapter_name, side)
            write_full(param, orthogonal_map.random_params(tuple(param.shape), spec.block, generator, op_norm))

    def rotation_blocks(
        self,
        adapter_name: str,
        side: str,
        dtype: torch.dtype = torch.float32,
        keep: torch.Tensor | None = None,
        plain: bool = False,
    ) -> torch.Tensor:
        """The ``(num_blocks, b, b)`` orthogonal blocks of one side, in ``dtype`` (float32 or wider).

        Blocks flagged ``False`` in ``keep`` are the identity. ``plain`` composes the map from its definition under
        plain autograd instead of its fast path (`OrthogonalMap.reference_blocks`)."""
        param = full_tensor(self.rotation_parameter(adapter_name, side)).to(dtype)
        orthogonal_map = self.rotation_settings[adapter_name].orthogonal_map
        blocks = side_blocks(param, self.sides(adapter_name)[side], orthogonal_map, plain)
        if keep is not None:
            eye = torch.eye(blocks.shape[-1], dtype=dtype, device=blocks.device)
            blocks = torch.where(keep[:, None, None], blocks, eye)
        return blocks

    @torch.no_grad()
    def float64_rotations(self, adapter_name: str) -> SideRotations:
        """Per side, ``(norms, blocks)`` in float64: the blocks, and ``||Q||_2`` of the generators they are built from.

        Every statistic of `poet_hf.diagnostics` is computed from these, evaluated once per logging step."""
        rotations, orthogonal_map = {}, self.rotation_settings[adapter_name].orthogonal_map
        for side, spec in self.sides(adapter_name).items():
            param = full_tensor(self.rotation_parameter(adapter_name, side)).double()
            blocks = side_blocks(param, spec, orthogonal_map)
            rotations[side] = (orthogonal_map.generator_norms(param, spec.block, blocks, capped=True), blocks)
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
                blocks, side_report = invert_blocks(blocks, self.frozen.dtype)
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

    def effective_weight_matrix(
        self, adapter_names: list[str] | None = None, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """``P^T W_t0 R^T`` for the given adapters (applied in order), as an out × in matrix in ``dtype``."""
        matrix = self.frozen.full_matrix().to(dtype)
        for adapter_name in adapter_names if adapter_names is not None else self.active_adapters:
            matrix = self.rotate_weight(matrix, adapter_name)
        return matrix

    def choose_strategy(
        self, adapter_name: str, tokens: int, training: bool, polynomial_phase: str = "uncached"
    ) -> str:
        """The fused strategy for one call of ``tokens`` tokens; see `FusedForward.choose_strategy`."""
        return self.fused.choose_strategy(self, adapter_name, tokens, training, polynomial_phase)

    def flush_rotation_caches(self, collective: bool = True) -> None:
        """Apply this layer's deferred rotation gradients and free its caches; see `FusedForward.flush`."""
        self.fused.flush(self, collective)

    def rotation_cache_bytes(self) -> int:
        """Bytes held by this layer's rotation caches (blocks and deferred gradients)."""
        return self.fused.nbytes()

    def train(self, mode: bool = True) -> Self:
        """``eval()`` ends any accumulation window: deferred gradients are applied and the caches freed."""
        if not mode:
            self.flush_rotation_caches(collective=False)
        nn.Module.train(cast(nn.Module, self), mode)  # the concrete layers are nn.Modules
        return self

    def adapter_forward(
        self, x: torch.Tensor, adapter_names: list[str], keep: dict[str, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """The forward with the given active adapters; ``keep`` maps an adapter to the input-side blocks it keeps.

        One adapter runs the fused forward; several compose through `reference_forward`, rotating activations when
        every adapter's strategy does. A subclass adds its own options around it."""
        if not self.step_state.reference and len(adapter_names) == 1:
            return self.fused(self, x, adapter_names[0], keep.get(adapter_names[0]) if keep else None)
        tokens = x.numel() // x.shape[-1] if not self.is_conv2d else 0
        strategies = {self.choose_strategy(a, tokens, torch.is_grad_enabled()) for a in adapter_names}
        activation = strategies <= {ACTIVATION, ACTIVATION_RECOMPUTE}
        return reference_forward(self, x, adapter_names, activation=activation, keep=keep)

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.disable_adapters:
            if self.merged:
                self.unmerge()
            return self.base_layer(x, *args, **kwargs)
        if self.merged:
            return self.base_layer(x, *args, **kwargs)
        active = [a for a in self.active_adapters if a in self.rotation_specs]
        if not active:
            return self.base_layer(x, *args, **kwargs)
        return self.adapter_forward(x, active)

    @torch.no_grad()
    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        """Fold the adapters into the base weight (``W_t ← P^T W_t R^T``) without changing them."""
        adapter_names = check_adapters_to_merge(self, adapter_names)
        self.flush_rotation_caches()
        for adapter_name in adapter_names:
            if adapter_name not in self.rotation_specs:
                continue
            merged = self.rotate_weight(self._weight_for_folding(adapter_name), adapter_name)
            if safe_merge and not torch.isfinite(merged).all():
                raise ValueError(f"NaNs or infs found while merging adapter '{adapter_name}'; it is broken")
            self._fold_into_base(merged, adapter_name, PEFT_MERGE)
            self.merged_adapters.append(adapter_name)
            self.warn_requantized("merging", adapter_name)

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
            self.warn_requantized("unmerging", adapter_name)
            report["error_bound"] = sum(r["error_bound"] for r in report.values())
            self.unmerge_report[adapter_name] = report
            if any(r["method"] == "solve" for r in report.values() if isinstance(r, dict)):
                logger.info(
                    "unmerged adapter '%s' by an exact solve (rotation not orthogonal to working precision): %s",
                    adapter_name,
                    report,
                )

    @torch.no_grad()
    def merge_and_reinit(self, adapter_name: str, stats: dict[str, float] | None = None) -> dict[str, float]:
        """Fold R and P into ``W0``, reset the rotations to the identity, and draw fresh permutations / index sets.

        A quantised ``W0`` is dequantised, rotated and requantised by the adapter's ``requantize`` mode
        (`requantize`), a large 4-bit one by groups of rows (`row_fold`); `fold_checks` first, for the model.

        Returns the pre-merge [`block_statistics`][poet_hf.orthogonal.statistics.block_statistics] (``stats``, where
        the caller computed them), with ``requantization_error`` for a quantised base.
        """
        if self.merged:
            raise RuntimeError("merge_and_reinit needs an unmerged layer; call unmerge() first")
        self.flush_rotation_caches()  # deferred gradients belong to the rotations about to be folded
        if stats is None:
            stats = block_statistics(
                self.float64_rotations(adapter_name), self.rotation_settings[adapter_name].orthogonal_map
            )
        count = int(self.merge_counts[adapter_name]) + 1
        if foldable_by_rows(self, adapter_name):  # a large 4-bit W0: a group of rows at a time
            self.attach_residual_store(adapter_name)
            self.requantization_error = fold_by_rows(self, adapter_name)
        else:
            self._fold_into_base(
                self.rotate_weight(self._weight_for_folding(adapter_name), adapter_name), adapter_name, count
            )
        if self.requantization_error is not None and self.base_quantization is not None:
            stats["requantization_error"] = self.requantization_error
        self.merge_counts[adapter_name].fill_(count)
        for side in self.sides(adapter_name):
            _, indices = self.side_containers(side)
            _reset_to_identity(self, adapter_name, side, count)
            indices[adapter_name].copy_(self._draw_index(adapter_name, side, count))
        return stats


@torch.no_grad()
def reset_rotation(layer: RotationLayer, adapter_name: str, side: str) -> None:
    """Reset one side's rotation to the identity, as a merge does, without folding it: the layer computes what it
    computed after its last merge (the permutations stay).

    Args:
        layer: the rotation layer.
        adapter_name: the adapter.
        side: ``"input"`` (R) or ``"output"`` (P).
    """
    layer.fused.drop()  # rotation blocks cached from the parameters being replaced
    _reset_to_identity(layer, adapter_name, side, int(layer.merge_counts[adapter_name]))


def _reset_to_identity(layer: RotationLayer, adapter_name: str, side: str, merge_count: int) -> None:
    """Give one side the map's identity parameters (zero for Cayley–Neumann, drawn for some maps)."""
    settings = layer.rotation_settings[adapter_name]
    param, block = layer.rotation_parameter(adapter_name, side), layer.sides(adapter_name)[side].block
    generator = spo_generator(settings.seed, merge_count, settings.layer_name, f"{side}-identity", adapter_name)
    write_full(param, settings.orthogonal_map.identity_params(tuple(param.shape), block, generator))


def _drop_caches_on_load(layer: RotationLayer, *args: Any) -> None:
    layer.fused.drop()


def flush_rotation_caches(model: nn.Module) -> None:
    """Apply every deferred rotation gradient of ``model`` to ``.grad`` and free the rotation caches.

    Under FSDP2 this is a collective: every process calls it. It is needed only after changing rotation parameters by
    hand in the middle of an accumulation window; steps, merges, ``eval()`` and exceptions in the forward do it.

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
        if isinstance(m, RotationLayer) and (adapter_name is None or adapter_name in m.rotation_specs)
    ]
