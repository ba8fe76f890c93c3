"""LipConvNet (ECO paper Table 1) as a Hugging Face image classifier with a provable Lipschitz constant.

Importing this module registers ``LipConvNetConfig`` / ``LipConvNetForImageClassification`` with ``AutoConfig``
and ``AutoModelForImageClassification`` under ``model_type = "poet-lipconvnet"``.

Architecture (``depth = 5·b``): five blocks of ``b`` conv layers, each followed by MaxMin. In block ``i`` the first
``b - 1`` layers keep ``init_channels·2^i`` channels at stride 1; the last maps to ``init_channels·2^(i+1)`` with
``strides[i]`` (paper: 2, 2, 2, 3, 1 from a 24x24 input, so the maps are 24→12→6→3→1→1). Blocks use SOC or ECO
per ``conv_types`` (paper default: SOC in blocks 1–2, ECO in 3–5, Table 3). The head is an orthogonal 1x1 layer
(first ``num_labels`` rows of an orthogonal matrix) or a row-normalised linear layer (LLN).

The model takes ``pixel_values`` in pixel space (``[0, 1]``) and normalises inside, so its Lipschitz constant,
[`LipConvNetForImageClassification.lipschitz_constant`][poet_hf.vision.lipconvnet.LipConvNetForImageClassification.lipschitz_constant],
includes the ``1/min(std)`` factor.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForImageClassification, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import ImageClassifierOutputWithNoAttention

from ..orthogonal.eco import ECO_MAPS, EcoConv2d, EcoMap
from ..orthogonal.lipschitz_layers import MaxMin, RowNormLinear, SocConv2d

__all__ = ["LipConvNetConfig", "LipConvNetForImageClassification", "LIPCONVNET_DEPTHS"]

LIPCONVNET_DEPTHS = (5, 10, 15, 20, 25, 30, 35, 40)
CONV_TYPES = ("eco", "soc")
LAST_LAYERS = ("orthogonal", "lln")


class LipConvNetConfig(PretrainedConfig):
    """Configuration of a LipConvNet.

    Args:
        depth: number of conv layers, one of 5, 10, ..., 40 (``depth / 5`` per block).
        num_channels: input image channels.
        image_size: square input size; every layer's dilation (ECO) and spectrum depend on it.
        init_channels: width of block 1 (paper: 32); block ``i`` widens to ``init_channels·2^(i+1)``.
        kernel_sizes: kernel size per block (paper: 3, 3, 3, 3, 1).
        strides: downsampling stride per block (paper: 2, 2, 2, 3, 1).
        conv_types: ``"soc"`` or ``"eco"`` per block (paper: soc, soc, eco, eco, eco).
        last_layer: ``"orthogonal"`` (certificate ``margin/(√2·L)``) or ``"lln"`` (row-normalised linear).
        image_mean: per-channel input mean, subtracted inside the model.
        image_std: per-channel input standard deviation, divided out inside the model.
        eco_orthogonal_map: ``"taylor"`` or ``"matrix_exp"`` for ECO layers in training.
        eco_train_terms: Taylor terms of ECO in training (paper: 5).
        soc_train_terms: SOC Taylor terms in training (SOC: 5).
        soc_eval_terms: SOC Taylor terms in evaluation (SOC: 10).
        baked: ECO layers hold a stored kernel (set by
            [`LipConvNetForImageClassification.bake`][poet_hf.vision.lipconvnet.LipConvNetForImageClassification.bake]).

    Raises:
        ValueError: a field is out of range, or a block's stride does not divide its input size.
    """

    model_type = "poet-lipconvnet"

    def __init__(
        self,
        depth: int = 5,
        num_channels: int = 3,
        image_size: int = 24,
        init_channels: int = 32,
        kernel_sizes: list[int] | tuple[int, ...] = (3, 3, 3, 3, 1),
        strides: list[int] | tuple[int, ...] = (2, 2, 2, 3, 1),
        conv_types: list[str] | tuple[str, ...] = ("soc", "soc", "eco", "eco", "eco"),
        last_layer: str = "orthogonal",
        image_mean: list[float] | tuple[float, ...] = (0.4914, 0.4822, 0.4465),
        image_std: list[float] | tuple[float, ...] = (0.2507, 0.2507, 0.2507),
        eco_orthogonal_map: EcoMap = "taylor",
        eco_train_terms: int = 5,
        soc_train_terms: int = 5,
        soc_eval_terms: int = 10,
        baked: bool = False,
        **kwargs,
    ) -> None:
        if depth not in LIPCONVNET_DEPTHS:
            raise ValueError(f"LipConvNetConfig: `depth` must be one of {LIPCONVNET_DEPTHS}, got {depth!r}")
        if not isinstance(init_channels, int) or init_channels < 2 or init_channels % 2:
            raise ValueError(
                "LipConvNetConfig: `init_channels` must be an even int >= 2 (MaxMin pairs channels), "
                f"got {init_channels!r}"
            )
        for name, value in (("kernel_sizes", kernel_sizes), ("strides", strides), ("conv_types", conv_types)):
            if len(value) != 5:
                raise ValueError(f"LipConvNetConfig: `{name}` needs one entry per block (5), got {list(value)!r}")
        if any(t not in CONV_TYPES for t in conv_types):
            raise ValueError(
                f"LipConvNetConfig: `conv_types` entries must be in {CONV_TYPES}, got {list(conv_types)!r}"
            )
        if last_layer not in LAST_LAYERS:
            raise ValueError(f"LipConvNetConfig: `last_layer` must be one of {LAST_LAYERS}, got {last_layer!r}")
        if eco_orthogonal_map not in ECO_MAPS:
            raise ValueError(
                f"LipConvNetConfig: `eco_orthogonal_map` must be one of {ECO_MAPS}, got {eco_orthogonal_map!r}"
            )
        if len(image_mean) != num_channels or len(image_std) != num_channels:
            raise ValueError(
                f"LipConvNetConfig: `image_mean` and `image_std` need num_channels={num_channels} entries, got "
                f"{list(image_mean)!r} and {list(image_std)!r}"
            )
        if min(image_std) <= 0:
            raise ValueError(f"LipConvNetConfig: `image_std` must be positive, got {list(image_std)!r}")
        size = image_size
        for block, stride in enumerate(strides):
            if size % stride:
                raise ValueError(
                    f"LipConvNetConfig: block {block + 1} stride {stride} does not divide its {size}x{size} input "
                    f"(image_size={image_size}, strides={list(strides)})"
                )
            size //= stride
        self.depth = depth
        self.num_channels = num_channels
        self.image_size = image_size
        self.init_channels = init_channels
        self.kernel_sizes = list(kernel_sizes)
        self.strides = list(strides)
        self.conv_types = list(conv_types)
        self.last_layer = last_layer
        self.image_mean = [float(v) for v in image_mean]
        self.image_std = [float(v) for v in image_std]
        self.eco_orthogonal_map = eco_orthogonal_map
        self.eco_train_terms = eco_train_terms
        self.soc_train_terms = soc_train_terms
        self.soc_eval_terms = soc_eval_terms
        self.baked = baked
        super().__init__(**kwargs)


def _make_conv(
    config: LipConvNetConfig, kind: str, c_in: int, c_out: int, kernel: int, stride: int, size: int
) -> nn.Module:
    if kind == "eco":
        return EcoConv2d(
            c_in,
            c_out,
            kernel,
            stride,
            input_size=size,
            orthogonal_map=config.eco_orthogonal_map,
            train_terms=config.eco_train_terms,
            baked=config.baked,
        )
    return SocConv2d(
        c_in,
        c_out,
        kernel,
        stride,
        input_size=size,
        train_terms=config.soc_train_terms,
        eval_terms=config.soc_eval_terms,
    )


class LipConvNetForImageClassification(PreTrainedModel):
    """LipConvNet-``depth`` classifier; ``forward(pixel_values, labels=None)`` returns logits (and CE loss).

    Args:
        config: the model's configuration.
    """

    config_class = LipConvNetConfig
    base_model_prefix = "lipconvnet"
    main_input_name = "pixel_values"
    _no_split_modules = []

    def __init__(self, config: LipConvNetConfig) -> None:
        super().__init__(config)
        layers: list[nn.Module] = []
        channels, size = config.num_channels, config.image_size
        per_block = config.depth // 5
        for block in range(5):
            kind, kernel, stride = config.conv_types[block], config.kernel_sizes[block], config.strides[block]
            width = config.init_channels * 2**block
            for _ in range(per_block - 1):
                layers += [_make_conv(config, kind, channels, width, kernel, 1, size), MaxMin()]
                channels = width
            layers += [_make_conv(config, kind, channels, 2 * width, kernel, stride, size), MaxMin()]
            channels, size = 2 * width, size // stride
        self.features = nn.Sequential(*layers)
        self.feature_dim = channels * size * size
        num_labels = cast(int, config.num_labels)  # PretrainedConfig derives it from id2label
        self.head: EcoConv2d | RowNormLinear
        if config.last_layer == "orthogonal":
            # First num_labels rows of an orthogonal matrix: an ECO 1x1 conv on the flattened features.
            self.head = EcoConv2d(self.feature_dim, num_labels, 1, input_size=1, baked=config.baked)
        else:
            self.head = RowNormLinear(self.feature_dim, num_labels)
        self.post_init()

    @classmethod
    def from_pretrained(cls, *args: Any, **kwargs: Any):
        """``PreTrainedModel.from_pretrained``, then baked kernels are copied out of the memory-mapped file.

        oneDNN's CPU convolutions sum in another order for weights at an unaligned address, and a reloaded model
        should give bit-identical logits.
        """
        loaded = super().from_pretrained(*args, **kwargs)
        model = loaded[0] if isinstance(loaded, tuple) else loaded
        for module in model.modules():
            if isinstance(module, EcoConv2d) and module.baked:
                module.weight = module.weight.clone()
        return loaded

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (EcoConv2d, SocConv2d, RowNormLinear)):
            module.reset_parameters()

    def forward(
        self,
        pixel_values: torch.Tensor,
        labels: torch.Tensor | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> ImageClassifierOutputWithNoAttention | tuple:
        """Logits for ``pixel_values`` ``[B, C, H, W]`` in pixel space; cross-entropy ``loss`` if ``labels``."""
        expected = (self.config.num_channels, self.config.image_size, self.config.image_size)
        if tuple(pixel_values.shape[1:]) != expected:
            shape = ", ".join(map(str, expected))
            raise ValueError(f"LipConvNet expects pixel_values of shape [B, {shape}], got {list(pixel_values.shape)}")
        # Normalisation from the config (not a buffer), so L = Π σ_max / min(std) always matches what runs.
        mean = pixel_values.new_tensor(self.config.image_mean).view(1, -1, 1, 1)
        std = pixel_values.new_tensor(self.config.image_std).view(1, -1, 1, 1)
        x = (pixel_values - mean) / std
        features = self.features(x).flatten(1)
        if isinstance(self.head, EcoConv2d):
            logits = self.head(features[:, :, None, None]).flatten(1)
        else:
            logits = self.head(features)
        loss = F.cross_entropy(logits, labels) if labels is not None else None
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        if not return_dict:
            return (logits,) if loss is None else (loss, logits)
        return ImageClassifierOutputWithNoAttention(loss=loss, logits=logits)

    # ---------------------------------------------------------------------------------------------------------
    def conv_layers(self) -> list[EcoConv2d | SocConv2d]:
        """The orthogonal conv layers, in order.

        Returns:
            The conv layers.
        """
        return [m for m in self.features if isinstance(m, (EcoConv2d, SocConv2d))]

    def lipschitz_constant(self, include_head: bool = True) -> float:
        """Upper bound on the ℓ2 Lipschitz constant from pixels to logits (or to the head's input).

        ``1/min(std)`` (input normalisation) times the exact spectral norm of every conv layer in the current
        mode (Sedghi per-frequency SVDs); MaxMin, flattening and pixel-unshuffle are 1-Lipschitz. The head is
        included for the orthogonal head; an LLN head is handled by the pairwise certificate instead.

        Args:
            include_head: include the head (orthogonal heads only).

        Returns:
            The bound.
        """
        bound = 1.0 / min(self.config.image_std)
        for layer in self.conv_layers():
            bound *= layer.lipschitz_constant()
        if include_head and isinstance(self.head, EcoConv2d):
            bound *= self.head.lipschitz_constant()
        return bound

    @torch.no_grad()
    def head_weight(self) -> torch.Tensor:
        """The head as a dense ``[num_labels, feature_dim]`` matrix in the current mode.

        Returns:
            The matrix.
        """
        if isinstance(self.head, EcoConv2d):
            return self.head.kernel()[:, :, 0, 0]
        return self.head.normalized_weight()

    def bake(self) -> LipConvNetForImageClassification:
        """Bake every ECO layer (stored ``matrix_exp`` kernel, no parametrization); sets ``config.baked``.

        SOC layers cannot be baked (their output is a power series in the input) and stay as they are.

        Returns:
            The model itself.
        """
        for module in self.modules():
            if isinstance(module, EcoConv2d):
                module.bake()
        self.config.baked = True
        return self


AutoConfig.register(LipConvNetConfig.model_type, LipConvNetConfig, exist_ok=True)
AutoModelForImageClassification.register(LipConvNetConfig, LipConvNetForImageClassification, exist_ok=True)
