"""`RotationModel`, what the POET and OFT tuners share, and `merge_and_reinit` (POET's Algorithm 1, step 5)."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import Any, cast

import torch
from peft.config import PeftConfig
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn

from ...orthogonal.statistics import block_statistics
from ..config_utils import holds_full_model
from ..tuner_base import LayerReplacingTuner
from .block_sizes import record_adjusted_block_sizes
from .caches import RotationStepState
from .config import RotationConfig
from .fold_checks import check_finite_rotations, check_foldable_blocks
from .layer import RotationLayer, rotation_layers
from .low_precision import drop_rounding_residual
from .quantization import adopt_base, drop_residual, quantization_of
from .shardable_quantized import ShardableQuantizedLinear
from .state_checks import AdapterStateError


class UntargetedWeightsWarning(UserWarning):
    """POET trains more block weights in full than it rotates (block weights that are not linears)."""


def refuse_float16_training(trained_in_full: list[tuple[str, nn.Parameter]]) -> None:
    """Refuse weights that would train in full in float16, naming them, before the model is built or trained.

    Adam's second moments of a float16 weight underflow float16 (a gradient of 1e-4 squares to 1e-8, below its
    smallest subnormal 6e-8) and its ``eps`` of 1e-8 rounds to 0, so the update divides by zero; an update smaller than
    float16's precision is lost. Mixed precision keeps float32 weights for this reason. The adapters stay float32 and
    a frozen ``W0`` may stay in 16 bits."""
    half = [name for name, param in trained_in_full if param.dtype == torch.float16]
    if half:
        shown = ", ".join(half[:3]) + (f" and {len(half) - 3} more" if len(half) > 3 else "")
        raise ValueError(
            f"`train_other_params` would train {len(half)} float16 weight(s) in full ({shown}): Adam does not train "
            "float16 weights (its moments in float16 underflow, its eps rounds to 0). Build the model in float32 or "
            "bfloat16, e.g. "
            "AutoModelForCausalLM.from_config(config, dtype=torch.float32), whatever the config's torch_dtype says; "
            "a frozen W0 may still be stored in 16 or 4 bits (base_quantization)"
        )


def warn_weights_outside_targets(model: nn.Module, trained_in_full: list[tuple[str, nn.Parameter]]) -> None:
    """Warn where the weights trained in full, embeddings, head and norms aside, outnumber those POET rotates.

    So it is for a family whose block weights are not ``nn.Linear`` modules, e.g. Mixtral's experts, one fused 3-D
    parameter in transformers 5: they train as under AdamW, with its memory.

    Args:
        model: the model the tuner wraps.
        trained_in_full: ``(name, parameter)`` of every parameter outside the tuner's layers.
    """
    rotated = sum(layer.in_features * layer.out_features for _, layer in rotation_layers(model))
    embeddings = [getattr(model, name, lambda: None)() for name in ("get_input_embeddings", "get_output_embeddings")]
    skip = {id(p) for module in embeddings if module is not None for p in module.parameters()}
    full: dict[str, int] = {}
    for name, parameter in trained_in_full:
        if parameter.dim() >= 2 and id(parameter) not in skip:
            module = name.rsplit(".", 2)[-2] if "." in name else name
            full[module] = full.get(module, 0) + parameter.numel()
    if sum(full.values()) > rotated:
        import warnings

        names = ", ".join(f"{name} ({count / 1e6:.1f}M)" for name, count in sorted(full.items()))
        warnings.warn(
            f"POET rotates {rotated / 1e6:.1f}M block weights and trains {sum(full.values()) / 1e6:.1f}M in full "
            f"as under AdamW: {names}; these are not nn.Linear targets",
            UntargetedWeightsWarning,
            stacklevel=2,
        )


def create_tuner_module(
    config: RotationConfig, adapter_name: str, target: nn.Module, layer_name: str, layer_classes: tuple[type, ...]
) -> RotationLayer:
    """Wrap ``target`` in the layer of ``layer_classes`` (Linear, Conv1D, Conv2d) for its type.

    Raises a ``ValueError`` naming any other type.

    bitsandbytes ``Linear4bit`` / ``Linear8bitLt`` targets are dispatched first (as PEFT dispatches LoRA's): they
    subclass ``nn.Linear`` but store packed codes, so the Linear layer reads them through `quantization`
    (`quantization_of` raises for any other bitsandbytes module)."""
    from transformers.pytorch_utils import Conv1D as HFConv1D

    base_layer = target.get_base_layer() if isinstance(target, BaseTunerLayer) else target
    if quantization_of(base_layer) is not None:
        adopt_base(base_layer)
        return layer_classes[0](target, adapter_name, config=config, layer_name=layer_name)
    if isinstance(base_layer, ShardableQuantizedLinear):
        return layer_classes[0](target, adapter_name, config=config, layer_name=layer_name)
    for base_type, layer_cls in zip((nn.Linear, HFConv1D, nn.Conv2d), layer_classes, strict=True):
        if isinstance(base_layer, base_type):
            return layer_cls(target, adapter_name, config=config, layer_name=layer_name)
    raise ValueError(
        f"`target_modules` matched '{layer_name}', a {type(base_layer).__name__}; supported module types are "
        "torch.nn.Linear, transformers Conv1D and torch.nn.Conv2d"
    )


def _release_caches_if_raising(module: nn.Module, args: tuple[object, ...], output: object) -> None:
    """Forward hook (``always_call``): on an exception, apply the deferred rotation gradients and free the caches.

    The exception abandons the micro-batch; the earlier micro-batches' gradients go to ``.grad``, where a loop that
    goes on accumulating keeps them and one that calls ``zero_grad`` drops them."""
    if sys.exc_info()[1] is not None:  # called from the forward's exception handler
        for _, layer in rotation_layers(module):
            layer.flush_rotation_caches(collective=False)


class RotationModel(LayerReplacingTuner):
    """The PEFT tuner POET and OFT share.

    Rotation layers around the targets, merge-count checks on load, the base weights that merges changed in the saved
    adapter, and [`merge_and_reinit`][poet_hf.merge_and_reinit].

    A subclass sets PEFT's ``prefix`` and ``tuner_layer_cls`` and its ``layer_classes`` (Linear, Conv1D, Conv2d).
    """

    tuner_layer_cls: type[RotationLayer] = RotationLayer
    layer_classes: tuple[type[RotationLayer], ...] = ()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.register_load_state_dict_post_hook(check_merge_counts_agree)
        # PEFT reaches the wrapped model through this tuner (task models) or directly (PeftModel): hook both.
        for module in (self, self.model):
            module.register_forward_hook(_release_caches_if_raising, always_call=True)

    def inject_adapter(self, model: nn.Module, adapter_name: str, *args: Any, **kwargs: Any) -> None:
        """PEFT's injection, then the block sizes the layers adjusted recorded in the config, with one warning."""
        super().inject_adapter(model, adapter_name, *args, **kwargs)
        adjusted, dims = {}, {}
        for _, layer in rotation_layers(model, adapter_name):
            sizes = layer.adjusted_block_sizes.pop(adapter_name, None)
            if sizes:
                name = layer.rotation_settings[adapter_name].layer_name
                adjusted[name] = sizes
                dims[name] = {side: spec.dim for side, spec in layer.sides(adapter_name).items()}
        record_adjusted_block_sizes(cast(RotationConfig, self.peft_config[adapter_name]), adjusted, dims)

    @property
    def step_state(self) -> RotationStepState:
        """The per-step state every rotation layer of this model shares (caches, optimizer hooks, reference path)."""
        if "_step_state" not in self.__dict__:
            self.__dict__["_step_state"] = RotationStepState(self.model)
        return self.__dict__["_step_state"]

    def create_layer(self, config: PeftConfig, adapter_name: str, target: nn.Module, layer_name: str) -> RotationLayer:
        layer = create_tuner_module(cast(RotationConfig, config), adapter_name, target, layer_name, self.layer_classes)
        layer.step_state = self.step_state
        return layer

    def _mark_only_adapters_as_trainable(self, model: nn.Module) -> None:
        super()._mark_only_adapters_as_trainable(model)
        configs = [self.peft_config[a] for a in self.active_adapters]
        if any(holds_full_model(config) for config in configs):
            # Pretraining from scratch: embeddings, norms and lm_head train normally beside the POET layers.
            inside_tuner_layers = {
                id(p) for m in model.modules() if isinstance(m, BaseTunerLayer) for p in m.parameters()
            }
            others = [(name, p) for name, p in model.named_parameters() if id(p) not in inside_tuner_layers]
            for _, param in others:
                param.requires_grad = True
            if not all(config.inference_mode for config in configs):
                refuse_float16_training(others)
                warn_weights_outside_targets(model, others)

    @classmethod
    def _get_adapter_state_dict(cls, model, config, adapter_name, state_dict, unwanted_adapter_names):
        """The adapter's entries, and what else a saved model needs to reload exactly.

        That is the base weights the merges changed and the non-targeted parameters trained beside the adapter."""
        to_return = super()._get_adapter_state_dict(model, config, adapter_name, state_dict, unwanted_adapter_names)
        layers = [m for m in model.modules() if isinstance(m, RotationLayer) and adapter_name in m.merge_counts]
        include_base = (
            getattr(config, "base_init", None) is not None
            or any(int(m.merge_counts[adapter_name]) > 0 for m in layers)
            or any(getattr(m.get_base_layer(), "poet_base_changed", False) for m in layers)  # quantization.adopt_base
        )
        if include_base:
            to_return.update({k: v for k, v in state_dict.items() if ".base_layer." in k})
        if holds_full_model(config):
            # Pretraining: every non-adapter weight was trained or re-initialised, so the whole model is saved.
            to_return.update(state_dict)
        return to_return

    def _unload_and_optionally_merge(self, *args: Any, **kwargs: Any) -> nn.Module:  # type: ignore[override]  # PEFT annotates None, returns the model
        """PEFT's unload, which leaves a quantised or 16-bit base without its rounding residual.

        Only the next fold of an adapter would use it."""
        bases = [layer.get_base_layer() for _, layer in rotation_layers(self.model)]
        model = cast(nn.Module, super()._unload_and_optionally_merge(*args, **kwargs))
        for base in bases:
            drop_residual(base)
            drop_rounding_residual(base)
        return model

    def merge_and_reinit(self, adapter_name: str | None = None) -> dict[str, float]:
        """[`merge_and_reinit`][poet_hf.merge_and_reinit] on this model."""
        return merge_and_reinit(self.model, adapter_name or self.active_adapters[0])


@contextlib.contextmanager
def plain_autograd(model: nn.Module) -> Iterator[None]:
    """Run the rotation layers of ``model`` through `reference_forward`, the path the fused one is tested against.

    It sets `RotationStepState.reference` on the layers' shared state while inside; merges are unaffected."""
    states = {id(layer.step_state): layer.step_state for _, layer in rotation_layers(model)}
    previous = {key: state.reference for key, state in states.items()}
    for state in states.values():
        state.reference = True
    try:
        yield
    finally:
        for key, state in states.items():
            state.reference = previous[key]


def check_merge_counts_agree(tuner: nn.Module, incompatible_keys: object = None) -> None:
    """``load_state_dict`` post-hook: the layers of one adapter merge together, so their merge counts must agree.

    Raises [`AdapterStateError`][poet_hf.tuners.rotation.state_checks.AdapterStateError] naming two that disagree."""
    for adapter_name in getattr(tuner, "peft_config", {}):
        layers = rotation_layers(tuner, adapter_name)
        counts = {name: int(layer.merge_counts[adapter_name]) for name, layer in layers}
        if not layers:
            continue
        first = layers[0][0]
        other = next((name for name, count in counts.items() if count != counts[first]), None)
        if other is not None:
            raise AdapterStateError(
                f"merge counts disagree: layer '{first}' has merged {counts[first]} times but '{other}' "
                f"{counts[other]} times; the layers of adapter '{adapter_name}' merge together, so they must hold one "
                "count",
                layers[0][1].rotation_settings[adapter_name].source,
            )


@torch.no_grad()
def prepare_residual_files(model: nn.Module, adapter_name: str = "default") -> None:
    """Give every POET layer of ``model`` its residual store and check the residual folder's free space against what
    their files will take (`ResidualFolder.check_disk_space_once`); before training and before a merge.

    Args:
        model: the model with POET (or OFT) layers.
        adapter_name: the adapter whose ``residual_storage`` and ``requantize`` decide.

    Raises:
        ResidualSpaceError: the residual files would not fit (`poet_hf.tuners.rotation.residual_folder`).
    """
    layers = rotation_layers(model, adapter_name)
    for _, layer in layers:
        layer.attach_residual_store(adapter_name)
    for folder in {
        id(layer.step_state.residual_folder): layer.step_state.residual_folder for _, layer in layers
    }.values():
        folder.check_disk_space_once()


def set_residual_folder(model: nn.Module, path: str | os.PathLike | None) -> None:
    """Write ``model``'s error-feedback residual files under ``path`` from now on (``None``: the system temp folder).

    Args:
        model: the model with POET (or OFT) layers.
        path: the parent folder of the model's ``poet-residuals-<pid>-*`` folder, created if missing.

    Raises:
        ValueError: ``path`` exists and is not a folder.
    """
    for _, layer in rotation_layers(model):
        layer.step_state.residual_folder.set_parent(path)


def merge_and_reinit(
    model: nn.Module,
    adapter_name: str = "default",
    layer_context: Callable[[RotationLayer], AbstractContextManager] | None = None,
) -> dict[str, float]:
    """The POET merge-then-reinitialize step (Algorithm 1, step 5) over every POET layer of ``model``.

    Folds ``R`` and ``P`` into ``W0``, zeroes the skew parameters and draws fresh permutations / index sets from
    generators seeded by (seed, merge count, layer name), so every process draws the same ones. Optimizer state
    is not touched here (see ``poet_hf.training``).

    Returns ``{"layers": n, "merge_count": c, "max_q_norm": …, "max_orth_error": …, "max_neumann_bound": …}``
    computed just before the merge, for logging; with quantised bases also ``max_requantization_error``, the largest
    relative change the requantisation made to a folded ``W0``.

    Args:
        model: the model with POET (or OFT) layers.
        adapter_name: the adapter to merge.
        layer_context: a context each layer folds inside (DeepSpeed ZeRO-3's gather of its parameters,
            `poet_hf.training.zero.gathered_layer`); none by default.

    Returns:
        The statistics described above.

    Raises:
        ValueError: no POET layer holds the adapter.
        ResidualSpaceError: the residual files would not fit the residual folder's disk
            (`poet_hf.tuners.rotation.residual_folder`); nothing is folded.
        RotationFoldError: a layer's rotation is not finite, or not a rotation the map can fold
            (`poet_hf.tuners.rotation.fold_checks`); nothing is folded.
    """
    layers = rotation_layers(model, adapter_name)
    if not layers:
        raise ValueError(f"no POET layer with adapter '{adapter_name}' found in {type(model).__name__}")
    prepare_residual_files(model, adapter_name)  # a refusal before any layer folds leaves the model as it was
    checked = []
    for name, layer in layers:  # every layer is checked before any folds (`fold_checks`)
        with layer_context(layer) if layer_context else nullcontext():
            layer.flush_rotation_caches()  # deferred gradients belong to the rotations about to be checked
            check_finite_rotations(name, layer, adapter_name)
            rotations = layer.float64_rotations(adapter_name)
            check_foldable_blocks(name, layer, adapter_name, rotations)
            checked.append(block_statistics(rotations, layer.rotation_settings[adapter_name].orthogonal_map))
    stats = []
    for (_, layer), layer_stats in zip(layers, checked, strict=True):
        with layer_context(layer) if layer_context else nullcontext():
            stats.append(layer.merge_and_reinit(adapter_name, layer_stats))
    summary = {
        "layers": len(layers),
        "merge_count": int(layers[0][1].merge_counts[adapter_name]),
        "max_q_norm": max(s["q_norm"] for s in stats),
        "max_orth_error": max(s["orth_error"] for s in stats),
        "max_neumann_bound": max(s["neumann_bound"] for s in stats),
    }
    requantized = [s["requantization_error"] for s in stats if "requantization_error" in s]
    if requantized:
        summary["max_requantization_error"] = max(requantized)
    return summary
