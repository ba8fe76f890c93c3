"""A small Glow-style normalizing flow whose 1x1 convolutions are auxiliary reflections (seed-002 §5.3).

Each level squeezes (``C, H, W -> 4C, H/2, W/2``), runs ``steps_per_level`` steps of
``ActNorm -> [fixed rotation] -> AuxiliaryReflection 1x1 -> affine coupling`` and, except at the last level,
factors out half of the channels as latents (RealNVP multi-scale). Latents have a standard normal prior.

``pixel_values`` are quantised images ``k / num_bins`` with ``k`` in ``{0, ..., num_bins - 1}`` (e.g.
``load_digits`` pixels ``/ 17``). Uniform dequantisation noise ``u / num_bins`` is added in training *and* in
evaluation, as Glow evaluates (evaluation draws it from a fixed seed, so a model scores the same batch the same way),
and the reported bits per dimension are ``(-log p(x + u/num_bins) + D log num_bins) / (D log 2)``, whose expectation
over ``u`` bounds the discrete negative log-likelihood from above.

The reflection 1x1 convolutions follow the paper's two variants. ``invertible=True`` (default) is
``W = I + V V^T / (2 sigma_max)`` with ``V = I`` and a fixed random orthogonal ``Q`` before it, provably invertible
(Theorem 2), so ``sample()`` and ``inverse`` always work. ``invertible=False`` is a free ``W`` initialised at
``I - Q`` (exactly Glow's init; the variant that tied with 48 Householder reflections in the paper); it is not
provably invertible, and after training on ``load_digits`` its Newton inverse did fail on some pixels (the
residual check then raises, see ``newton_on_fail``). The inverse runs Newton per pixel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, cast

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.utils import ModelOutput

from ..orthogonal.linalg import random_orthogonal
from ..orthogonal.reflection import ON_FAIL, AuxiliaryReflection

__all__ = ["ReflectionFlowConfig", "ReflectionFlowModel", "ReflectionFlowOutput"]


class ReflectionFlowConfig(PretrainedConfig):
    """Configuration of [`ReflectionFlowModel`][poet_hf.vision.flow.ReflectionFlowModel].

    Args:
        image_size: side of the square input; divisible by ``2 ** num_levels``.
        num_channels: input channels.
        num_levels: squeeze levels.
        steps_per_level: flow steps per level.
        hidden_channels: width of each coupling network.
        invertible: use the provably invertible reflection parameterisation (default; see module docstring).
        num_bins: quantisation levels of the data (256 for 8-bit images, 17 for ``load_digits``).
        newton_iters: Newton iterations of the inverse, at most.
        newton_on_fail: what a Newton inverse that does not converge does: ``"raise"``, ``"warn"`` or ``"ignore"``.
        seed: seed of the random orthogonal initialisations.

    Raises:
        ValueError: a field is out of range (the image size must be divisible by ``2 ** num_levels``).
    """

    model_type = "reflection_flow"

    def __init__(
        self,
        image_size: int = 8,
        num_channels: int = 1,
        num_levels: int = 2,
        steps_per_level: int = 4,
        hidden_channels: int = 32,
        invertible: bool = True,
        num_bins: int = 256,
        newton_iters: int = 30,
        newton_on_fail: Literal["raise", "warn", "ignore"] = "raise",
        seed: int = 0,
        **kwargs,
    ) -> None:
        for name, value in (
            ("image_size", image_size),
            ("num_channels", num_channels),
            ("num_levels", num_levels),
            ("steps_per_level", steps_per_level),
            ("hidden_channels", hidden_channels),
            ("newton_iters", newton_iters),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"`{name}` must be a positive integer, got {value!r}")
        if image_size % (2**num_levels):
            raise ValueError(f"`image_size` ({image_size}) must be divisible by 2 ** num_levels ({2**num_levels})")
        if not isinstance(num_bins, int) or num_bins < 2:
            raise ValueError(f"`num_bins` must be an integer >= 2, got {num_bins!r}")
        if newton_on_fail not in ON_FAIL:
            raise ValueError(f"`newton_on_fail` must be one of {ON_FAIL}, got {newton_on_fail!r}")
        self.image_size = image_size
        self.num_channels = num_channels
        self.num_levels = num_levels
        self.steps_per_level = steps_per_level
        self.hidden_channels = hidden_channels
        self.invertible = invertible
        self.num_bins = num_bins
        self.newton_iters = newton_iters
        self.newton_on_fail = newton_on_fail
        self.seed = seed
        super().__init__(**kwargs)


@dataclass
class ReflectionFlowOutput(ModelOutput):
    """The flow's output: the mean bits per dimension as ``loss``, and per image figures.

    ``bits_per_dim`` and ``log_likelihood`` (nats) per image; ``latents`` (B, D)."""

    loss: torch.Tensor | None = None
    bits_per_dim: torch.Tensor | None = None
    log_likelihood: torch.Tensor | None = None
    latents: torch.Tensor | None = None


def squeeze(x: torch.Tensor) -> torch.Tensor:
    """``(B, C, H, W) -> (B, 4C, H/2, W/2)`` by 2x2 space-to-depth."""
    b, c, h, w = x.shape
    x = x.reshape(b, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4)
    return x.reshape(b, 4 * c, h // 2, w // 2)


def unsqueeze(x: torch.Tensor) -> torch.Tensor:
    """Inverse of `squeeze`."""
    b, c, h, w = x.shape
    x = x.reshape(b, c // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3)
    return x.reshape(b, c // 4, 2 * h, 2 * w)


class ActNorm(nn.Module):
    """Per-channel affine ``(x + bias) * exp(log_scale)``, initialised from the first training batch (Glow)."""

    initialized: torch.Tensor  # a buffer: whether the first batch has set the statistics

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(1, channels, 1, 1))
        self.log_scale = nn.Parameter(torch.zeros(1, channels, 1, 1))
        self.register_buffer("initialized", torch.tensor(False))

    @torch.no_grad()
    def _data_init(self, x: torch.Tensor) -> None:
        mean = x.mean(dim=(0, 2, 3), keepdim=True)
        std = x.std(dim=(0, 2, 3), keepdim=True)
        self.bias.copy_(-mean)
        self.log_scale.copy_(-torch.log(std + 1e-6))
        self.initialized.fill_(True)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.training and not bool(self.initialized):
            self._data_init(x)
        logdet = self.log_scale.sum() * x.shape[2] * x.shape[3]
        return (x + self.bias) * torch.exp(self.log_scale), logdet.expand(x.shape[0])

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        return y * torch.exp(-self.log_scale) - self.bias


class FixedRotation(nn.Module):
    """A fixed random orthogonal 1x1 convolution, the paper's companion of the invertible reflection (seed-002 §5.3)."""

    rotation: torch.Tensor  # a buffer

    def __init__(self, channels: int, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.register_buffer("rotation", random_orthogonal(channels, gen, torch.get_default_dtype()))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # log|det| is 0 only up to the rounding of the stored matrix (e.g. float32 cast to float64): compute it.
        logdet = torch.linalg.slogdet(self.rotation)[1] * x.shape[2] * x.shape[3]
        return F.conv2d(x, self.rotation[:, :, None, None]), logdet.expand(x.shape[0])

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        return F.conv2d(y, torch.linalg.inv(self.rotation)[:, :, None, None])


class AffineCoupling(nn.Module):
    """Glow affine coupling: the second half is scaled by ``sigmoid(h + 2)`` and shifted, given the first half."""

    def __init__(self, channels: int, hidden: int) -> None:
        super().__init__()
        half = channels // 2
        last = nn.Conv2d(hidden, 2 * (channels - half), 3, padding=1)
        # Zero last layer: every coupling starts as the identity (Glow).
        nn.init.zeros_(last.weight)
        if last.bias is not None:
            nn.init.zeros_(last.bias)
        self.net = nn.Sequential(
            nn.Conv2d(half, hidden, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(hidden, hidden, 1),
            nn.ReLU(),
            last,
        )
        self.split = half

    def _scale_shift(self, xa: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.net(xa)
        shift, raw = h[:, 0::2], h[:, 1::2]
        return torch.sigmoid(raw + 2.0), shift

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        xa, xb = x[:, : self.split], x[:, self.split :]
        scale, shift = self._scale_shift(xa)
        return torch.cat([xa, (xb + shift) * scale], 1), torch.log(scale).flatten(1).sum(-1)

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        ya, yb = y[:, : self.split], y[:, self.split :]
        scale, shift = self._scale_shift(ya)
        return torch.cat([ya, yb / scale - shift], 1)


class FlowStep(nn.Module):
    """ActNorm, [fixed rotation,] auxiliary-reflection 1x1 convolution, affine coupling."""

    def __init__(self, channels: int, config: ReflectionFlowConfig, seed: int) -> None:
        super().__init__()
        layers: list[nn.Module] = [ActNorm(channels)]
        if config.invertible:
            layers.append(FixedRotation(channels, seed + 1_000_003))
        self.pre = nn.ModuleList(layers)
        self.reflection = AuxiliaryReflection(
            channels,
            conv1x1=True,
            invertible=config.invertible,
            newton_iters=config.newton_iters,
            on_fail=config.newton_on_fail,
            seed=seed,
        )
        self.coupling = AffineCoupling(channels, config.hidden_channels)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logdet = x.new_zeros(x.shape[0])
        for layer in self.pre:
            x, ld = layer(x)
            logdet = logdet + ld
        x, ld = self.reflection.forward_and_logdet(x)
        logdet = logdet + ld
        x, ld = self.coupling(x)
        return x, logdet + ld

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        x = self.reflection.inverse(self.coupling.inverse(y))
        for layer in reversed(self.pre):
            x = cast("ActNorm | FixedRotation", layer).inverse(x)
        return x


class ReflectionFlowModel(PreTrainedModel):
    """Multi-scale flow with auxiliary-reflection 1x1 convolutions, reporting bits per dimension.

    Args:
        config: the model's configuration.
    """

    config_class = ReflectionFlowConfig
    base_model_prefix = "flow"
    main_input_name = "pixel_values"

    def __init__(self, config: ReflectionFlowConfig) -> None:
        super().__init__(config)
        self.levels = nn.ModuleList()
        channels = config.num_channels
        for level in range(config.num_levels):
            channels *= 4
            seed = config.seed + 1000 * level
            self.levels.append(
                nn.ModuleList(FlowStep(channels, config, seed + step) for step in range(config.steps_per_level))
            )
            if level < config.num_levels - 1:
                channels //= 2
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        # Every module initialises itself in its constructor (orthogonal and zero inits that the default
        # normal(0.02) init would destroy); nothing to add here.
        return

    @property
    def num_dims(self) -> int:
        return self.config.num_channels * self.config.image_size**2

    def encode(self, pixel_values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat latents ``(B, D)`` and ``log|det dz/dx|`` per image, for continuous ``pixel_values`` in ``[0, 1)``.

        Args:
            pixel_values: images ``(B, C, H, W)`` in ``[0, 1)``.

        Returns:
            ``(latents, log|det|)``.
        """
        x = pixel_values - 0.5
        logdet = x.new_zeros(x.shape[0])
        latents = []
        for index, steps in enumerate(self.levels):
            x = squeeze(x)
            for step in cast(nn.ModuleList, steps):
                x, ld = step(x)
                logdet = logdet + ld
            if index < len(self.levels) - 1:
                half = x.shape[1] // 2
                latents.append(x[:, half:].flatten(1))
                x = x[:, :half]
        latents.append(x.flatten(1))
        return torch.cat(latents, 1), logdet

    def _level_shapes(self) -> list[tuple[int, int, int]]:
        """Shapes ``(C, H, W)`` of the latents factored out at each level, in encoding order."""
        shapes = []
        c, size = self.config.num_channels, self.config.image_size
        for index in range(self.config.num_levels):
            c, size = c * 4, size // 2
            if index < self.config.num_levels - 1:
                shapes.append((c - c // 2, size, size))
                c = c // 2
        shapes.append((c, size, size))
        return shapes

    def inverse(self, latents: torch.Tensor) -> torch.Tensor:
        """Images ``(B, C, H, W)`` in ``[0, 1)`` scale from flat latents ``(B, D)`` (Newton for the reflections).

        Args:
            latents: flat latents ``(B, D)``.

        Returns:
            The images.
        """
        shapes = self._level_shapes()
        sizes = [math.prod(s) for s in shapes]
        pieces = [p.reshape(-1, *s) for p, s in zip(latents.split(sizes, dim=1), shapes, strict=True)]
        x = pieces[-1]
        for index in reversed(range(len(self.levels))):
            if index < len(self.levels) - 1:
                x = torch.cat([x, pieces[index]], 1)
            for step in reversed(cast(nn.ModuleList, self.levels[index])):
                x = cast(FlowStep, step).inverse(x)
            x = unsqueeze(x)
        return x + 0.5

    @torch.no_grad()
    def sample(
        self, num_samples: int, temperature: float = 1.0, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """Draw ``num_samples`` images by inverting ``z ~ N(0, temperature^2 I)``.

        Args:
            num_samples: how many images.
            temperature: the latents' standard deviation.
            generator: the generator to draw from.

        Returns:
            The images ``(num_samples, C, H, W)``.
        """
        param = next(self.parameters())
        z = torch.randn(num_samples, self.num_dims, generator=generator, dtype=param.dtype, device=param.device)
        return self.inverse(temperature * z)

    EVAL_NOISE_SEED = 0

    def dequantize_pixels(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``x + u / num_bins`` with ``u ~ U[0, 1)``.

        ``u`` comes from the global RNG in training and from a fixed seed in evaluation.

        Args:
            pixel_values: images quantised to ``num_bins`` levels in ``[0, 1)``.

        Returns:
            The dequantised images, the same shape.
        """
        generator = (
            None if self.training else torch.Generator(device=pixel_values.device).manual_seed(self.EVAL_NOISE_SEED)
        )
        noise = torch.rand(
            pixel_values.shape, generator=generator, dtype=pixel_values.dtype, device=pixel_values.device
        )
        return pixel_values + noise / self.config.num_bins

    def forward(
        self, pixel_values: torch.Tensor, return_dict: bool | None = None, **kwargs
    ) -> ReflectionFlowOutput | tuple:
        """Log-likelihood and bits per dimension of quantised ``pixel_values``.

        The pixels are dequantised first (see
        [`dequantize_pixels`][poet_hf.vision.flow.ReflectionFlowModel.dequantize_pixels])."""
        latents, logdet = self.encode(self.dequantize_pixels(pixel_values))
        log_prior = -0.5 * (latents.pow(2) + math.log(2 * math.pi)).sum(-1)
        log_likelihood = log_prior + logdet
        d = self.num_dims
        bits_per_dim = (-log_likelihood + d * math.log(self.config.num_bins)) / (d * math.log(2))
        out = ReflectionFlowOutput(
            loss=bits_per_dim.mean(), bits_per_dim=bits_per_dim, log_likelihood=log_likelihood, latents=latents
        )
        use_dict = self.config.return_dict if return_dict is None else return_dict
        return out if use_dict else out.to_tuple()
