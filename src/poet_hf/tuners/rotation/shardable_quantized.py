"""A quantised frozen ``W0`` held as plain tensors a row at a time, which FSDP2 and ZeRO-3 shard: the ``*-shardable``
storage kinds (`storage_kinds.KINDS`).

A bitsandbytes layer keeps its quantisation state (scales, code book, shape) on its parameter, which an engine that
shards parameters drops. Here the codes and their scales are two parameters of their own, each row of ``W0`` in one
row of each:

- ``nf4-shardable``: QLoRA's 4-bit NormalFloat codes, two to a byte (``out × in/2``, rows zero-padded to whole blocks
  of 64), and a float32 absmax per block of 64 entries of a row (``out × in/64``), quantised and dequantised by
  bitsandbytes' ``quantize_4bit`` / ``dequantize_4bit`` (no double quantisation: its offset is a mean over every
  block, which no split by rows keeps);
- ``int8-shardable``: LLM.int8()'s weight codes, one per entry, and a float32 scale per row (absmax / 127).

Every statistic is its row's own, so a process that holds rows ``a:b`` of the codes holds everything they need: under
FSDP2 a fold quantises, on each process, only the rows it holds, which are the codes one process would give them, and
FSDP2 gathers them as it gathers any parameter (mixed dtypes are all-gathered as bytes).
"""

from __future__ import annotations

import math
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from ...orthogonal.rotation_sides import WeightSource
from ...sharded import full_tensor, is_dtensor, local_part, local_tensor, write_local
from . import quantization, residual_store
from .frozen_weight import FrozenWeight
from .storage_kinds import FOUR_BIT_BLOCK, StorageKind, storage_kind

__all__ = ["ShardableQuantizedLinear", "ShardableQuantizedWeight", "encode", "decode"]


def _padded_columns(columns: int, kind: StorageKind) -> int:
    """A row's length in codes: whole blocks of `FOUR_BIT_BLOCK` for a 4-bit kind."""
    return -(-columns // FOUR_BIT_BLOCK) * FOUR_BIT_BLOCK if kind.bits == 4 else columns


def _padded(work: torch.Tensor, kind: StorageKind) -> torch.Tensor:
    """``work``'s rows zero-padded to `_padded_columns`."""
    return F.pad(work, (0, _padded_columns(work.shape[1], kind) - work.shape[1]))


def _row_scales(work: torch.Tensor) -> torch.Tensor:
    """The int8 kinds' scale of each row: its absmax over 127 (never zero)."""
    return (work.abs().amax(dim=1, keepdim=True) / 127).clamp_min(torch.finfo(torch.float32).tiny)


def encode(kind: StorageKind, matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The codes and scales of the ``out × in`` ``matrix`` (module docstring), quantised to nearest.

    Args:
        kind: a shardable storage kind.
        matrix: the weight, any float dtype (quantised from float32).
    """
    work = matrix.detach().float()
    if kind.bits == 8:
        scales = _row_scales(work)
        return torch.round(work / scales).clamp(-127, 127).to(torch.int8), scales
    import bitsandbytes.functional as bnb_functional

    codes, state = bnb_functional.quantize_4bit(
        _padded(work, kind).contiguous(), blocksize=FOUR_BIT_BLOCK, quant_type=kind.code_book, compress_statistics=False
    )
    return codes.reshape(work.shape[0], -1), state.absmax.float().reshape(work.shape[0], -1)


def decode(kind: StorageKind, codes: torch.Tensor, scales: torch.Tensor, columns: int) -> torch.Tensor:
    """The float32 ``rows × columns`` matrix that ``codes`` and ``scales`` (`encode`'s layout) hold.

    Args:
        kind: the storage kind they were encoded with.
        codes: the codes of some rows.
        scales: the scales of the same rows.
        columns: the weight's ``in`` (without the padding).
    """
    if kind.bits == 8:
        return codes.float() * scales
    import bitsandbytes.functional as bnb_functional

    rows, padded = codes.shape[0], _padded_columns(columns, kind)
    state = bnb_functional.QuantState(
        absmax=scales.reshape(-1).float(),
        shape=torch.Size([rows, padded]),
        code=bnb_functional.get_4bit_type(kind.code_book, device=codes.device),
        blocksize=FOUR_BIT_BLOCK,
        quant_type=kind.code_book,
        dtype=torch.float32,
    )
    return bnb_functional.dequantize_4bit(codes.reshape(-1, 1), state)[:, :columns]


def _grid_rounded(kind: StorageKind, matrix: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """``matrix`` stochastically rounded onto the grid `encode` will quantise it to, so that `encode` keeps the chosen
    codes: per row (int8, 127 levels each way) or per block of 64 of a row (4-bit, the kind's code book)."""
    work = matrix.float()
    if kind.bits == 8:
        grid = torch.arange(-127, 128, dtype=work.dtype, device=work.device)
        return quantization.stochastic_round(work, grid, _row_scales(work), generator)
    import bitsandbytes.functional as bnb_functional

    rows, columns = work.shape
    blocks = _padded(work, kind).reshape(-1, FOUR_BIT_BLOCK)
    scale = blocks.abs().amax(dim=1, keepdim=True).clamp_min(1e-12)
    grid = bnb_functional.get_4bit_type(kind.code_book, device=work.device).float().sort().values
    rounded = quantization.stochastic_round(blocks, grid, scale, generator)
    return rounded.reshape(rows, -1)[:, :columns]


class ShardableQuantizedLinear(nn.Module):
    """A linear layer whose frozen weight is stored as a shardable kind's codes and scales (module docstring).

    Args:
        in_features: the weight's ``in``.
        out_features: the weight's ``out``.
        kind: the name of a shardable storage kind (``"nf4-shardable"``, ``"int8-shardable"``).
        bias: whether the layer has a bias.
        compute_dtype: the dtype the forward dequantises to.
        device: where to allocate (``"meta"`` for a model built without memory).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        kind: str,
        bias: bool = True,
        compute_dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.kind = storage_kind(kind)
        if not self.kind.shardable:
            raise ValueError(f"ShardableQuantizedLinear stores a shardable kind; {kind!r} is a bitsandbytes layer's")
        self.in_features, self.out_features, self.compute_dtype = in_features, out_features, compute_dtype
        padded = _padded_columns(in_features, self.kind)
        code_shape, scale_columns = (
            ((out_features, in_features), 1) if self.kind.bits == 8 else ((out_features, padded // 2), padded // 64)
        )
        code_dtype = torch.int8 if self.kind.bits == 8 else torch.uint8
        self.codes = nn.Parameter(torch.zeros(code_shape, dtype=code_dtype, device=device), requires_grad=False)
        self.scales = nn.Parameter(torch.zeros(out_features, scale_columns, device=device), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features, device=device)) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, kind: str) -> ShardableQuantizedLinear:
        """``linear``'s weight quantised as ``kind`` (to nearest), with its bias, on its device (on ``meta``: empty,
        for `reset_parameters` or a fold to fill)."""
        weight = linear.weight.detach()
        layer = cls(linear.in_features, linear.out_features, kind, linear.bias is not None, weight.dtype, weight.device)
        if weight.device.type != "meta":
            layer.store(weight)
        if linear.bias is not None:
            layer.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=linear.bias.requires_grad)
        return layer

    def reset_parameters(self) -> None:
        """A fresh weight and bias drawn as ``nn.Linear`` draws them, the weight quantised (what
        `poet_hf.initialization.materialize_model` calls for a layer built on ``meta``)."""
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None)
        self.store(linear.weight.detach())
        if self.bias is not None:
            with torch.no_grad():
                self.bias.copy_(linear.bias)

    def dequantize(self) -> torch.Tensor:
        """The whole ``out × in`` weight in float32 (under FSDP2, the codes are gathered: a collective)."""
        return decode(self.kind, full_tensor(self.codes), full_tensor(self.scales), self.in_features)

    def held_weight(self) -> torch.Tensor:
        """The float32 weight the codes held now give: whole outside FSDP2, and inside its forward and backward,
        where it has gathered them."""
        return decode(self.kind, self.codes, self.scales, self.in_features)

    def store(self, matrix: torch.Tensor) -> torch.Tensor:
        """Quantise the whole ``matrix`` into the codes and scales, each process the rows it holds (a row's codes are
        its own: under FSDP2 each quantises only its rows); the float32 rows they now hold."""
        codes, scales = encode(self.kind, local_part(self.codes, matrix))
        write_local(self.codes, codes)
        write_local(self.scales, scales)
        return decode(self.kind, codes, scales, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.held_weight().to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kind={self.kind.name}"


class _DequantizedOnCall:
    """``W0`` as the fused forward takes it (`DenseWeight`): dequantised from the codes the module holds when called
    (FSDP2's gathered ones inside a forward or backward), so nothing dense outlives a call."""

    def __init__(self, module: ShardableQuantizedLinear, dtype: torch.dtype) -> None:
        self.module, self.dtype = module, dtype
        self.dequantize_cost = module.kind.dequantize_cost

    def __call__(self) -> torch.Tensor:
        return self.module.held_weight().to(self.dtype)


class ShardableQuantizedWeight(FrozenWeight):
    """The ``W0`` of a `ShardableQuantizedLinear`: dequantised to read, requantised to write.

    Under FSDP2 a fold gathers the codes and scales, and each process quantises the rows it holds of the folded
    matrix (a stochastic rounding draws the whole matrix's noise from the same generator everywhere). A sharded ``W0``
    rounds to nearest where error feedback is asked, as a sharded 16-bit ``W0`` does: its residual would be a tensor
    per process that ``torch.distributed.checkpoint`` cannot save beside the shards.

    Args:
        module: the layer.
    """

    module: ShardableQuantizedLinear

    def __init__(self, module: nn.Module) -> None:
        super().__init__(module)
        self.quantization = cast(ShardableQuantizedLinear, module).kind.name

    @property
    def shape(self) -> tuple[int, int]:
        return self.module.out_features, self.module.in_features

    @property
    def dtype(self) -> torch.dtype:
        return self.module.compute_dtype

    def matrix(self) -> torch.Tensor:
        return self.module.dequantize().to(self.dtype)

    def dense(self) -> WeightSource:
        return cast(WeightSource, _DequantizedOnCall(self.module, self.dtype))

    def full_matrix(self) -> torch.Tensor:
        return self.matrix()

    def write(self, matrix: torch.Tensor, requantize: str, generator: torch.Generator | None) -> float | None:
        if requantize not in quantization.REQUANTIZE_MODES:
            raise ValueError(f"`requantize` must be one of {quantization.REQUANTIZE_MODES}, got {requantize!r}")
        exact = target = matrix.float()
        if requantize == "feedback" and is_dtensor(self.module.codes):
            requantize = "nearest"
        if requantize == "stochastic":
            if generator is None:
                raise ValueError("requantize='stochastic' needs a seeded generator")
            target = _grid_rounded(self.module.kind, target, generator)
        restored = self.module.store(target)  # this process's rows
        rows = local_part(self.module.codes, exact)
        if requantize == "feedback":
            codes, scales = quantization.encode_residual(rows - restored)
            residual_store.keep(self.module, {quantization.RESIDUAL_CODES: codes, quantization.RESIDUAL_SCALES: scales})
        squares = torch.stack([(restored - rows).square().sum(), rows.square().sum()])
        if is_dtensor(self.module.codes):  # the whole matrix's norms: every rank calls the fold
            torch.distributed.all_reduce(squares)
        return float(squares[0].sqrt() / squares[1].sqrt().clamp_min(torch.finfo(torch.float32).tiny))

    def nbytes(self) -> int:
        """Bytes of this process's codes and scales, and of the residual kept on the module."""
        held = sum(local_tensor(t).nbytes for t in (self.module.codes, self.module.scales))
        return held + residual_store.resident_bytes(self.module, quantization.RESIDUAL_NAMES)

    def residual(self) -> torch.Tensor | None:
        kept = residual_store.read(self.module, quantization.RESIDUAL_NAMES)
        if kept is None:
            return None
        return quantization.decode_residual(kept[quantization.RESIDUAL_CODES], kept[quantization.RESIDUAL_SCALES])

    def residual_names(self) -> tuple[str, ...]:
        return quantization.RESIDUAL_NAMES

    def expected_residual_bytes(self) -> int:
        return 0 if is_dtensor(self.module.codes) else quantization.residual_bytes(math.prod(self.shape))

    def load(self, state_dict: dict[str, torch.Tensor], prefix: str, layer_prefix: str, base_init: bool) -> None:
        """The residual a feedback fold saved; the codes and scales are parameters, loaded as any."""
        residual_store.load_from_state_dict(self.module, state_dict, prefix, quantization.RESIDUAL_NAMES)


def stored_quantization(module: nn.Module) -> str | None:
    """The storage kind's name of a quantised base layer (a bitsandbytes one or a `ShardableQuantizedLinear`), else
    ``None``."""
    if isinstance(module, ShardableQuantizedLinear):
        return module.kind.name
    return quantization.quantization_of(module)


def dequantize_shardable_modules(model: nn.Module) -> int:
    """Replace every `ShardableQuantizedLinear` of ``model`` by a plain float32 ``nn.Linear`` holding its dequantised
    weight and its bias (for an export, which folds into full precision).

    Returns:
        How many layers were replaced.
    """
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, ShardableQuantizedLinear):
                bias = None if child.bias is None else full_tensor(child.bias.detach())
                setattr(parent, name, quantization.linear_holding(child.dequantize(), bias))
                replaced += 1
    return replaced
