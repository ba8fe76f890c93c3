"""bitsandbytes 4-bit and 8-bit frozen bases for the rotation tuners (QOFT and QPOET).

A rotation layer whose base is a ``bnb.nn.Linear4bit`` (nf4 or fp4, with or without double quantisation) or a
``bnb.nn.Linear8bitLt`` reads its ``W0`` through this module, the way PEFT's LoRA reads its bitsandbytes bases
(``peft/tuners/lora/bnb.py``) through PEFT's quantisation backends (``peft.utils.quantization_utils``):

- the logical ``(out, in)`` shape is the layer's, never the packed storage's;
- the forward gets a `QuantizedWeight`, which dequantises ``W0`` when called (once in the forward, once in the
  backward; `DenseWeight`), a 4-bit one a block of rows at a time;
- a fold (merge, unmerge, merge-then-reinitialise) dequantises, rotates and requantises with the same quantisation
  settings (type, block size, double quantisation, storage), by PEFT's backends.

bitsandbytes is the ``quant`` extra (``pip install 'poet_hf[quant]'``) and is imported only when a quantised base is
met or asked for.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Iterator
from typing import Any, Protocol, cast

import torch
from torch import nn

from . import residual_store
from .storage_kinds import EIGHT_BIT, StorageKind, storage_kind

logger = logging.getLogger(__name__)

REQUANTIZE_MODES = ("feedback", "nearest", "stochastic")
RESIDUAL_BLOCK = 64  # entries per scale of the int8 requantisation residual (error feedback)
RESIDUAL_CODES, RESIDUAL_SCALES = "poet_residual_codes", "poet_residual_scales"  # buffers on the quantised base
RESIDUAL_NAMES = (RESIDUAL_CODES, RESIDUAL_SCALES)
_INSTALL_HINT = "pip install 'poet_hf[quant]' (the `quant` extra: bitsandbytes)"


# A bnb.nn.Linear4bit or Linear8bitLt: bitsandbytes ships no type information, so its layers are typed loosely.
BnbLayer = Any


def import_bitsandbytes() -> Any:
    """``bitsandbytes``, or an ``ImportError`` that names the extra to install."""
    try:
        import bitsandbytes
    except ImportError as error:
        raise ImportError(f"a quantised base needs bitsandbytes: {_INSTALL_HINT}") from error
    return bitsandbytes


def is_bnb_module(module: nn.Module) -> bool:
    """Whether ``module`` comes from bitsandbytes.

    It is checked by the class's module, so bitsandbytes is not imported for a model that has none."""
    return type(module).__module__.split(".")[0] == "bitsandbytes"


def quantization_of(module: nn.Module) -> str | None:
    """The storage kind's name (`storage_kinds.KINDS`) of a ``Linear4bit`` / ``Linear8bitLt``; ``None`` outside
    bitsandbytes.

    Any other bitsandbytes module raises a ``ValueError`` naming its type."""
    if not is_bnb_module(module):
        return None
    bnb = import_bitsandbytes()
    if isinstance(module, bnb.nn.Linear4bit):
        return module.weight.quant_type
    if isinstance(module, bnb.nn.Linear8bitLt):
        if module.state.has_fp16_weights:
            raise ValueError(
                "a bnb.nn.Linear8bitLt with has_fp16_weights=True keeps a trainable float weight; "
                "rotation adapters need a frozen int8 base (has_fp16_weights=False)"
            )
        return EIGHT_BIT.name
    raise ValueError(
        f"{type(module).__name__} from bitsandbytes is not supported as a rotation base; supported "
        "quantised types are bnb.nn.Linear4bit (nf4, fp4) and bnb.nn.Linear8bitLt"
    )


def _kind_of(module: BnbLayer) -> StorageKind:
    """The storage kind of a bitsandbytes layer (`quantization_of`)."""
    return storage_kind(cast(str, quantization_of(module)))


class HoldsBaseLayer(Protocol):
    """A PEFT layer as PEFT's quantisation backends write its base: they replace ``base_layer``."""

    base_layer: nn.Module

    def get_base_layer(self) -> nn.Module: ...


def _backend(module: BnbLayer) -> Any:
    from peft.utils.quantization_utils import resolve_quantization_backend

    return resolve_quantization_backend(module)


class QuantizedBaseRepackedWarning(UserWarning):
    """A 4-bit base was repacked for bitsandbytes' CPU kernels before poet_hf wrapped it.

    Its scales were rounded to bfloat16, so its ``W0`` is no longer the checkpoint's (`keep_quantized_layout` prevents
    it)."""


def keep_layout(module: BnbLayer) -> None:
    """Stop bitsandbytes from repacking a 4-bit layer for its CPU kernels at an inference forward.

    bitsandbytes (0.50 here) repacks a ``Linear4bit`` on a CPU with AVX512-BF16 at its first forward in eval mode
    without gradients, and rounds the layer's scales to bfloat16 while doing so: the dequantised weight moves by up
    to 2⁻⁸ of each block's largest entry, and cannot be restored."""
    if hasattr(module, "support_avx512bf16_for_cpu"):
        module.support_avx512bf16_for_cpu = False


def keep_quantized_layout(model: nn.Module) -> int:
    """Keep every 4-bit bitsandbytes layer of ``model`` in its checkpoint's layout (`keep_layout`).

    An inference forward on a CPU then does not round its scales before an adapter is attached. Call it right after
    loading a quantised model you evaluate before wrapping; the adapters do it for the layers they wrap, and
    `quantize_linear` for the layers it builds.

    Args:
        model: a model with bitsandbytes layers (any others are left alone).

    Returns:
        How many layers it set.
    """
    layers = [m for m in model.modules() if is_bnb_module(m) and hasattr(m, "support_avx512bf16_for_cpu")]
    for module in layers:
        keep_layout(module)
    return len(layers)


def _restore_packed(module: BnbLayer) -> bool:
    """Give a 4-bit weight that bitsandbytes repacked for its CPU kernels its standard layout back, and warn.

    The codes go back in order with one float32 scale per block, the bfloat16-rounded scales kept as they are
    (bitsandbytes' own inverse would requantise them with double quantisation, a second rounding, and leaves them
    transposed without it). Returns whether the layer was repacked."""
    weight = module.weight
    state: Any = getattr(weight, "quant_state", None)
    if not getattr(state, "packing_format_for_cpu", False):
        return False
    from bitsandbytes.functional import _convert_weight_packed_for_cpu_inverse

    scales = state.absmax.T.reshape(-1).float()  # packed as (in / blocksize, out) bfloat16: back to block order
    state.original_nested = False
    weight.data, weight.quant_state = _convert_weight_packed_for_cpu_inverse(weight.data, state)
    weight.quant_state.absmax = scales
    module.poet_base_changed = True  # the adapter saves this W0, so a reload gives the one it trained on
    keep_layout(module)
    warnings.warn(
        f"a {module.out_features}×{module.in_features} 4-bit bitsandbytes layer was repacked for bitsandbytes' CPU "
        "kernels by an inference forward (eval mode, no gradients) before poet_hf wrapped it; the repacking "
        "rounded its scales to bfloat16, so its W0 differs from the checkpoint's by up to 2^-8 of each block's "
        "largest entry. The adapter trains on this W0 and saves it with the adapter. To keep the checkpoint's W0, "
        "call poet_hf.keep_quantized_layout(model) right after loading the model",
        QuantizedBaseRepackedWarning,
        stacklevel=3,
    )
    return True


def adopt_base(module: BnbLayer) -> None:
    """Prepare a bitsandbytes layer for an adapter: undo (and warn about) a CPU repacking, and prevent the next."""
    _restore_packed(module)
    keep_layout(module)


def dequantize(module: BnbLayer) -> torch.Tensor:
    """The dense ``out × in`` weight of a bitsandbytes linear layer, in the dtype it was quantised from."""
    _restore_packed(module)
    return _backend(module).get_base_weight(module)


class QuantizedWeight:
    """A quantised layer's ``W0`` as the fused forward takes it: called, it returns the dense matrix in ``dtype``;
    `row_blocks` gives it a block of rows at a time.

    Only the module is referenced, so nothing dense outlives a call (one layer's ``W0``, or one block of its rows, at
    a time)."""

    def __init__(self, module: BnbLayer, dtype: torch.dtype) -> None:
        self.module = module
        self.dtype = dtype
        self.dequantize_cost = _kind_of(module).dequantize_cost

    def __call__(self) -> torch.Tensor:
        return dequantize(self.module).to(self.dtype)

    def row_blocks(self) -> Iterator[tuple[int, int, torch.Tensor]]:
        """``(start, stop, W0[start:stop])`` for consecutive blocks of rows, each dequantised alone
        (`poet_hf.tuners.rotation.quantized_rows`)."""
        from .quantized_rows import dequantized_row_blocks

        _restore_packed(self.module)
        return dequantized_row_blocks(self.module, self.dtype, self)


def compute_dtype(module: BnbLayer) -> torch.dtype:
    """The dtype a bitsandbytes layer computes in: its ``compute_dtype`` (4-bit), else its quantisation source."""
    dtype = getattr(module, "compute_dtype", None)
    if dtype is None:
        state = getattr(module.weight, "quant_state", None)
        dtype = state.dtype if state is not None else torch.float32
    return dtype


def stochastic_round(
    matrix: torch.Tensor,
    grid: torch.Tensor,
    scale: torch.Tensor,
    generator: torch.Generator,
) -> torch.Tensor:
    """Round every entry of ``matrix`` to one of its two neighbours on ``scale · grid``, without bias.

    ``grid`` is sorted ascending and ``scale`` broadcasts over ``matrix``. An entry rounds up with probability equal to
    its distance from the lower neighbour over the gap, so ``E[round(w)] = w`` inside the grid's range."""
    normalized = (matrix / scale).clamp(grid[0], grid[-1]).contiguous()
    upper = torch.searchsorted(grid, normalized).clamp(1, grid.numel() - 1)
    low, high = grid[upper - 1], grid[upper]
    up = torch.rand(normalized.shape, generator=generator, device=matrix.device, dtype=normalized.dtype)
    chosen = torch.where(up < (normalized - low) / (high - low), high, low)
    return chosen * scale


def _grid_rounded(module: BnbLayer, matrix: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """``matrix`` stochastically rounded onto the grid the module's quantiser will use.

    Requantising it then keeps the chosen codes: per block of ``blocksize`` (4-bit, scaled by the block's absmax over
    the code book) or per row (int8, 127 levels each way)."""
    work = matrix.float()
    if _kind_of(module).bits == 8:
        scale = work.half().float().abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127
        grid = torch.arange(-127, 128, dtype=work.dtype, device=work.device)
        return stochastic_round(work, grid, scale, generator)
    state = module.weight.quant_state
    blocks = work.reshape(-1, state.blocksize)
    scale = blocks.abs().amax(dim=1, keepdim=True).clamp_min(1e-12)
    grid = state.code.to(work.device, work.dtype).sort().values
    return stochastic_round(blocks, grid, scale, generator).reshape(matrix.shape)


def requantize(
    peft_layer: HoldsBaseLayer, matrix: torch.Tensor, mode: str = "nearest", generator: torch.Generator | None = None
) -> float:
    """Store the dense ``matrix`` into the quantised base of ``peft_layer``, with the same quantisation settings.

    Returns the relative error this requantisation caused, ``‖dequant(Q(M)) − M‖/‖M‖`` (PEFT's backends store it).

    ``mode`` (`REQUANTIZE_MODES`):

    - ``"nearest"``: every entry to its nearest code.
    - ``"stochastic"`` (needs ``generator``): to a neighbouring code at random, unbiased, so that an update smaller
      than half a quantisation step survives on average instead of vanishing.
    - ``"feedback"``: error feedback. ``matrix`` is taken to include the residual the previous requantisation left
      (the caller adds `residual`), and the new residual ``M − dequant(Q(M))`` is stored beside the codes
      (int8 per block of `RESIDUAL_BLOCK`, about 1 byte per entry) for the next fold. The error of the stored
      weight then stays one quantisation step instead of growing with every fold.
    """
    module = peft_layer.get_base_layer()
    if mode not in REQUANTIZE_MODES:
        raise ValueError(f"`requantize` must be one of {REQUANTIZE_MODES}, got {mode!r}")
    if mode == "stochastic":
        if generator is None:
            raise ValueError("requantize='stochastic' needs a seeded generator")
        matrix = _grid_rounded(module, matrix, generator)
    dtype = compute_dtype(module) if _kind_of(module).bits == 4 else matrix.dtype
    _restore_packed(module)
    buffers = {name: b for name in RESIDUAL_NAMES if (b := module._buffers.get(name)) is not None}
    _backend(module).set_base_weight(peft_layer, matrix.to(dtype).contiguous())
    residual_store.carry(module, peft_layer.get_base_layer())  # the residual stays with the codes it corrects
    module = peft_layer.get_base_layer()
    restored = dequantize(module).to(matrix.dtype)
    if mode == "feedback":
        codes, scales = encode_residual(matrix.float() - restored.float())
        buffers = {RESIDUAL_CODES: codes, RESIDUAL_SCALES: scales}
    if buffers:
        residual_store.keep(module, buffers)
    return float((restored - matrix).norm() / matrix.norm().clamp_min(torch.finfo(matrix.dtype).tiny))


def encode_residual(residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual`` as int8 codes of its shape and one float32 absmax scale per `RESIDUAL_BLOCK` entries.

    The last block is zero-padded."""
    flat = residual.reshape(-1)
    padded = torch.nn.functional.pad(flat, (0, -flat.numel() % RESIDUAL_BLOCK)).reshape(-1, RESIDUAL_BLOCK)
    scales = padded.abs().amax(dim=1, keepdim=True) / 127
    codes = torch.round(padded / scales.clamp_min(torch.finfo(torch.float32).tiny)).clamp(-127, 127)
    return codes.to(torch.int8).reshape(-1)[: flat.numel()].reshape(residual.shape), scales.reshape(-1)


def residual_bytes(entries: int) -> int:
    """Bytes of the residual `encode_residual` keeps for a ``W0`` of ``entries``: an int8 code per entry and a
    float32 scale per `RESIDUAL_BLOCK`."""
    return entries + 4 * math.ceil(entries / RESIDUAL_BLOCK)


def decode_residual(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 residual `encode_residual` stored."""
    flat = codes.reshape(-1).float()
    padded = torch.nn.functional.pad(flat, (0, -flat.numel() % RESIDUAL_BLOCK)).reshape(-1, RESIDUAL_BLOCK)
    return (padded * scales[:, None]).reshape(-1)[: flat.numel()].reshape(codes.shape)


def drop_residual(module: BnbLayer) -> None:
    """Remove the requantisation residual from a quantised base (when it leaves its adapter)."""
    residual_store.drop(module, RESIDUAL_NAMES)


def residual(module: BnbLayer) -> torch.Tensor | None:
    """The requantisation residual kept for a quantised base (error feedback; `residual_store`), or ``None``."""
    kept = residual_store.read(module, RESIDUAL_NAMES)
    return None if kept is None else decode_residual(kept[RESIDUAL_CODES], kept[RESIDUAL_SCALES])


def quantize_linear(
    linear: nn.Linear, quantization: str, compute_dtype: torch.dtype | None = None, double_quant: bool = True
) -> BnbLayer:
    """A bitsandbytes layer holding ``linear``'s weight, quantised, and its bias, on ``linear``'s device.

    A 4-bit kind (`storage_kinds.KINDS`) gives a ``bnb.nn.Linear4bit``, an 8-bit one a ``bnb.nn.Linear8bitLt``."""
    kind = storage_kind(quantization)
    bnb = import_bitsandbytes()
    weight = linear.weight.detach()
    has_bias = linear.bias is not None
    if kind.bits == 8:
        module = bnb.nn.Linear8bitLt(
            linear.in_features, linear.out_features, bias=has_bias, has_fp16_weights=False, device="meta"
        )
        module.weight = bnb.nn.Int8Params(weight.to("cpu"), requires_grad=False, has_fp16_weights=False)
    else:
        dtype = compute_dtype or weight.dtype
        module = bnb.nn.Linear4bit(
            linear.in_features,
            linear.out_features,
            bias=has_bias,
            compute_dtype=dtype,
            compress_statistics=double_quant,
            quant_type=kind.name,
            device="meta",
        )
        module.weight = bnb.nn.Params4bit(
            weight.to("cpu", dtype),
            requires_grad=False,
            quant_type=kind.name,
            compress_statistics=double_quant,
            module=module,
        )
    if has_bias:
        module.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=linear.bias.requires_grad)
    keep_layout(module)
    return module.to(weight.device)


def quantized_bytes(module: BnbLayer) -> int:
    """Bytes a quantised layer holds for its weight.

    The codes, the quantisation statistics, and the requantisation residual (error feedback) when it is kept on the
    layer (`residual_store`)."""
    weight = module.weight
    total = weight.numel() * weight.element_size()
    state = getattr(weight, "quant_state", None)
    if state is not None:
        total += sum(t.numel() * t.element_size() for t in state.as_dict(packed=True).values() if torch.is_tensor(t))
    scb = getattr(weight, "SCB", None)
    if scb is None:
        scb = getattr(getattr(module, "state", None), "SCB", None)
    scales = 0 if scb is None else scb.numel() * scb.element_size()
    return total + scales + residual_store.resident_bytes(module, RESIDUAL_NAMES)


def load_quantized_state(module: BnbLayer, state_dict: dict[str, torch.Tensor], prefix: str) -> None:
    """Install the quantised weight ``state_dict`` holds under ``prefix`` into the bitsandbytes layer ``module``.

    The codes (at ``weight``) and their statistics go in together, before ``load_state_dict`` copies the codes.

    A 4-bit layer gets a new ``Params4bit`` from the saved quant state (whose keys are consumed here, as
    ``transformers`` does when it loads a 4-bit checkpoint); an int8 layer gets its row scales ready for
    ``Linear8bitLt``'s own loader."""
    residual_store.load_from_state_dict(module, state_dict, prefix, RESIDUAL_NAMES)  # a feedback fold's residual
    weight_key = f"{prefix}weight"
    if weight_key not in state_dict:
        return
    module.poet_base_changed = True  # a saved W0 was saved because it differs from the checkpoint's
    bnb = import_bitsandbytes()
    data, device = state_dict[weight_key], module.weight.device
    if isinstance(module, bnb.nn.Linear4bit):
        stats = {
            key[len(weight_key) + 1 :]: state_dict.pop(key)
            for key in list(state_dict)
            if key.startswith(f"{weight_key}.")
        }
        if not stats:
            raise ValueError(
                f"'{weight_key}' is a plain weight but the layer is a 4-bit bitsandbytes layer; load a "
                "state saved from the same quantised model"
            )
        module.weight = bnb.nn.Params4bit.from_prequantized(
            data=data.to(device), quantized_stats=stats, requires_grad=False, device=device, module=module
        )
        return
    scale = state_dict.get(f"{prefix}SCB")
    if scale is None or data.dtype != torch.int8:
        raise ValueError(
            f"'{weight_key}' is not an int8 weight with its row scales '{prefix}SCB'; load a state saved "
            "from the same quantised model"
        )
    module.weight = bnb.nn.Int8Params(
        data.to(device).clone(), requires_grad=False, has_fp16_weights=False, CB=None, SCB=scale.to(device).clone()
    )
    module.weight.CB = module.weight.data
    module.state.reset_grads()


def dense_linear(module: BnbLayer, dtype: torch.dtype | None = None) -> nn.Linear:
    """A plain ``nn.Linear`` holding a bitsandbytes layer's dequantised weight and its bias.

    The weight is in ``dtype``, by default the layer's compute dtype or float32."""
    weight = dequantize(module).to(dtype or torch.promote_types(compute_dtype(module), torch.float32))
    return linear_holding(weight, module.bias)


def linear_holding(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """A plain ``nn.Linear`` holding ``weight`` (``out × in``, frozen) and a copy of ``bias`` in its dtype."""
    dense = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    dense.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        dense.bias = nn.Parameter(bias.detach().to(weight.dtype).clone(), requires_grad=bias.requires_grad)
    return dense


def dequantize_modules(model: nn.Module) -> dict[str, Any] | None:
    """Replace every bitsandbytes layer of ``model`` by a plain ``nn.Linear`` (`dense_linear`).

    ``transformers``' quantisation state (its ``hf_quantizer`` and ``config.quantization_config``) is dropped too, so
    that the model saves as a full-precision checkpoint. Returns the quantisation config it had (``transformers``'
    ``BitsAndBytesConfig`` as a dict, or one describing the layers found), ``None`` if nothing was quantised."""
    kinds: set[str] = set()
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if is_bnb_module(child):
                kinds.add(cast(str, quantization_of(child)))
                double_quant = bool(getattr(getattr(child.weight, "quant_state", None), "nested", False))
                setattr(parent, name, dense_linear(child))
    if not kinds:
        return None
    from transformers import PreTrainedModel

    holder = next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)
    config = getattr(getattr(holder, "config", None), "quantization_config", None)
    recorded = (
        (config.to_dict() if hasattr(config, "to_dict") else dict(config))
        if config is not None
        else bits_and_bytes_config(kinds.pop(), double_quant=double_quant).to_dict()
    )
    if holder is not None:
        quantizer = getattr(holder, "hf_quantizer", None)
        if quantizer is not None:
            quantizer.remove_quantization_config(holder)
        elif hasattr(holder.config, "quantization_config"):
            del holder.config.quantization_config
    return recorded


def bits_and_bytes_config(
    quantization: str, compute_dtype: torch.dtype = torch.float32, double_quant: bool = True
) -> Any:
    """The ``transformers.BitsAndBytesConfig`` that loads a checkpoint's Linear layers quantised, the QLoRA way.

    A 4-bit kind (`storage_kinds.KINDS`) loads with ``compute_dtype``; an 8-bit one loads 8-bit."""
    from transformers import BitsAndBytesConfig

    kind = storage_kind(quantization)
    import_bitsandbytes()
    if kind.bits == 8:
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=kind.name,
        bnb_4bit_use_double_quant=double_quant,
        bnb_4bit_compute_dtype=compute_dtype,
    )
