"""Batched augmentation on uint8 images, on any device.

The random choices of an epoch (crop offset and flip of every sample) are drawn once from
(seed, epoch) and indexed by sample id, so a sample is augmented the same way whatever the
strategy, world size, loader or device: single, dp, ddp and fsdp see identical batches.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

CROP_PAD = 4


def epoch_generator(seed: int, epoch: int, stream: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + epoch * 1009 + stream)


def draw_params(n: int, seed: int, epoch: int, pad: int = CROP_PAD) -> torch.Tensor:
    """int64 N x 3: crop offset y, crop offset x, flip (0/1) for every sample of the epoch."""
    g = epoch_generator(seed, epoch, stream=1)
    offsets = torch.randint(0, 2 * pad + 1, (n, 2), generator=g)
    flips = torch.randint(0, 2, (n, 1), generator=g)
    return torch.cat([offsets, flips], dim=1)


def crop_flip(images: torch.Tensor, params: torch.Tensor, pad: int = CROP_PAD) -> torch.Tensor:
    """Random crop with `pad` zero padding and horizontal flip, batched: B x C x H x W -> same shape."""
    b, c, h, w = images.shape
    padded = F.pad(images, (pad, pad, pad, pad))
    rows = params[:, 0:1] + torch.arange(h, device=images.device)           # B x H
    cols = params[:, 1:2] + torch.arange(w, device=images.device)           # B x W
    cols = torch.where(params[:, 2:3].bool(), cols.flip(1), cols)            # flipping = reversed columns
    batch = torch.arange(b, device=images.device)[:, None, None]
    out = padded.permute(0, 2, 3, 1)[batch, rows[:, :, None], cols[:, None, :]]  # B x H x W x C
    return out.permute(0, 3, 1, 2)


def normalize(images: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, channels_last: bool) -> torch.Tensor:
    """uint8 -> float32 normalized, optionally in channels_last memory format."""
    x = images.float().div_(255).sub_(mean.view(1, -1, 1, 1)).div_(std.view(1, -1, 1, 1))
    return x.contiguous(memory_format=torch.channels_last) if channels_last else x.contiguous()
