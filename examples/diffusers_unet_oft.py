"""Subject-driven fine-tuning of a ``diffusers`` ``UNet2DConditionModel`` with OFT, the use OFT was made for.

What it shows: ``OftConfig`` on the UNet's attention projections (``to_q``, ``to_k``, ``to_v``, ``to_out.0``) and on
its ResNet convolutions (``conv1``, ``conv2``), trained DreamBooth-style on a few images of one subject with the
usual noise-prediction loss; the adapter is saved, loaded onto a fresh UNet, and merged into plain weights. OFT
rotates every filter of a convolution alike (the ``in·kh·kw`` axis of its weight), so the merged UNet is an ordinary
``UNet2DConditionModel`` with exactly the adapter's outputs.

By default it runs on a CPU in seconds: a small UNet built from a config (no download), trained to denoise 16 × 16
images of the digit 3 (scikit-learn's digits) under a fixed "subject" prompt embedding. On a real model, train the
UNet of a Stable Diffusion checkpoint on latents of your subject's photos and their caption's text embeddings:

    unet = UNet2DConditionModel.from_pretrained("stable-diffusion-v1-5/stable-diffusion-v1-5", subfolder="unet")
    unet = get_peft_model(unet, oft_config(block_size=32))

Needs the ``[examples]`` extra (``pip install -e ".[examples]"``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max_steps", type=int, default=60)
    parser.add_argument("--learning_rate", type=float, default=1e-2)
    parser.add_argument("--block_size", type=int, default=16)
    parser.add_argument("--output_dir", default="outputs/unet-oft")
    return parser.parse_args(argv)


def small_unet():
    """A two-level UNet with cross-attention, built from a config (seeded)."""
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    return UNet2DConditionModel(
        sample_size=16,
        in_channels=1,
        out_channels=1,
        layers_per_block=1,
        block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32,
        attention_head_dim=8,
        norm_num_groups=8,
    )


def oft_config(block_size: int):
    from poet_hf import OftConfig

    return OftConfig(block_size=block_size, target_modules=["to_q", "to_k", "to_v", "to_out.0", "conv1", "conv2"])


def subject_images(count: int = 8) -> torch.Tensor:
    """``count`` images of the digit 3, 16 × 16, scaled to [-1, 1]: the subject."""
    import torch.nn.functional as F
    from sklearn.datasets import load_digits

    digits = load_digits()
    threes = torch.tensor(digits.images[digits.target == 3][:count], dtype=torch.float32)[:, None] / 16
    return F.interpolate(threes, size=16, mode="bilinear", align_corners=False) * 2 - 1


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Train, save, reload and merge; returns the losses and the reload / merge gaps."""
    from diffusers import DDPMScheduler
    from peft import PeftModel, get_peft_model

    import poet_hf  # noqa: F401  (registers the tuners with PEFT)

    unet = get_peft_model(small_unet(), oft_config(args.block_size))
    scheduler = DDPMScheduler(num_train_timesteps=100)
    images = subject_images()
    prompt = torch.randn(1, 4, 32, generator=torch.Generator().manual_seed(1))  # the "a photo of sks" embedding
    generator = torch.Generator().manual_seed(2)
    optimizer = torch.optim.AdamW([p for p in unet.parameters() if p.requires_grad], lr=args.learning_rate)

    def loss_on(noise: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        noisy = scheduler.add_noise(images, noise, timesteps)
        prediction = unet(noisy, timesteps, encoder_hidden_states=prompt.expand(len(images), -1, -1)).sample
        return torch.nn.functional.mse_loss(prediction, noise)

    probe_noise = torch.randn(images.shape, generator=torch.Generator().manual_seed(3))
    probe_steps = torch.full((len(images),), 50)
    with torch.no_grad():
        before = float(loss_on(probe_noise, probe_steps))
    unet.train()
    for _ in range(args.max_steps):
        noise = torch.randn(images.shape, generator=generator)
        timesteps = torch.randint(0, 100, (len(images),), generator=generator)
        loss_on(noise, timesteps).backward()
        optimizer.step()
        optimizer.zero_grad()
    unet.eval()
    with torch.no_grad():
        after = float(loss_on(probe_noise, probe_steps))

    adapter_dir = Path(args.output_dir) / "adapter"
    unet.save_pretrained(adapter_dir)
    reloaded = PeftModel.from_pretrained(small_unet(), adapter_dir).eval()
    sample = scheduler.add_noise(images, probe_noise, probe_steps)
    condition = {"encoder_hidden_states": prompt.expand(len(images), -1, -1)}
    with torch.no_grad():
        trained_out = unet(sample, probe_steps, **condition).sample
        reload_gap = float((reloaded(sample, probe_steps, **condition).sample - trained_out).abs().max())
        merged = reloaded.merge_and_unload()  # a plain UNet2DConditionModel
        merge_gap = float((merged(sample, probe_steps, **condition).sample - trained_out).abs().max())
    result = {
        "denoising_loss_before": before,
        "denoising_loss_after": after,
        "reload_max_abs_gap": reload_gap,
        "merged_max_abs_gap": merge_gap,
        "output_scale": float(trained_out.abs().max()),
        "merged_class": type(merged).__name__,
        "adapter_dir": str(adapter_dir),
    }
    (Path(args.output_dir) / "result.json").write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    print(json.dumps(run(parse_args()), indent=2))
