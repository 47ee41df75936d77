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


def draw_params(n: int, seed: int, epoch: int, pad: int = CROP_PAD,
                cutout_within: tuple[int, int] | None = None) -> torch.Tensor:
    """int64 N x 3: crop offset y, crop offset x, flip (0/1) for every sample of the epoch;
    N x 5 with `cutout_within=(H, W)`: then also the cutout centre y, x (own stream: crop/flip unchanged)."""
    g = epoch_generator(seed, epoch, stream=1)
    offsets = torch.randint(0, 2 * pad + 1, (n, 2), generator=g)
    flips = torch.randint(0, 2, (n, 1), generator=g)
    parts = [offsets, flips]
    if cutout_within:
        g = epoch_generator(seed, epoch, stream=2)
        parts += [torch.randint(0, cutout_within[0], (n, 1), generator=g),
                  torch.randint(0, cutout_within[1], (n, 1), generator=g)]
    return torch.cat(parts, dim=1)


def _reflect(index: torch.Tensor, size: int) -> torch.Tensor:
    """Indices outside 0..size-1 mirrored about the edge pixels (-1 -> 1, size -> size - 2)."""
    index = index.abs()
    return torch.where(index > size - 1, 2 * (size - 1) - index, index)


def crop_flip(images: torch.Tensor, params: torch.Tensor, pad: int = CROP_PAD, pad_mode: str = "zeros") -> torch.Tensor:
    """Random crop of the image padded by `pad` pixels (pad_mode zeros or reflect) and horizontal flip,
    batched: B x C x H x W -> same shape."""
    b, c, h, w = images.shape
    rows = params[:, 0:1] + torch.arange(h, device=images.device)           # B x H, in padded coordinates
    cols = params[:, 1:2] + torch.arange(w, device=images.device)           # B x W
    if pad_mode == "reflect":  # read the unpadded image at mirrored indices
        source, rows, cols = images, _reflect(rows - pad, h), _reflect(cols - pad, w)
    else:
        source = F.pad(images, (pad, pad, pad, pad))
    cols = torch.where(params[:, 2:3].bool(), cols.flip(1), cols)            # flipping = reversed columns
    batch = torch.arange(b, device=images.device)[:, None, None]
    out = source.permute(0, 2, 3, 1)[batch, rows[:, :, None], cols[:, None, :]]  # B x H x W x C
    return out.permute(0, 3, 1, 2)


def cutout(x: torch.Tensor, centres: torch.Tensor, size: int) -> torch.Tensor:
    """Zero a size x size square (clipped at the border) around each sample's centre (y, x), in place.
    On normalized images zero is the dataset mean."""
    _, _, h, w = x.shape
    top, left = centres[:, 0:1] - size // 2, centres[:, 1:2] - size // 2
    rows = torch.arange(h, device=x.device)
    cols = torch.arange(w, device=x.device)
    in_rows = (rows >= top) & (rows < top + size)                             # B x H
    in_cols = (cols >= left) & (cols < left + size)                           # B x W
    return x.masked_fill_((in_rows[:, :, None] & in_cols[:, None, :])[:, None], 0.0)


def normalize_table(mean, std) -> torch.Tensor:
    """C x 256 float32: (level / 255 - mean) / std for every uint8 level of every channel, computed once on
    the CPU with the arithmetic of `normalize`."""
    levels = torch.arange(256, dtype=torch.uint8).view(1, 1, 1, 256).expand(1, len(mean), 1, 256)
    mean, std = (torch.as_tensor(v, dtype=torch.float32) for v in (mean, std))
    return _arithmetic(levels, mean, std)[0, :, 0]


def _arithmetic(images, mean, std):
    return images.float().div_(255).sub_(mean.view(1, -1, 1, 1)).div_(std.view(1, -1, 1, 1))


def normalize(images: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """uint8 B x C x H x W -> float32 (images / 255 - mean) / std, with the CPU's bits on every device.

    Eager on the CPU: the arithmetic. Elsewhere (CUDA, or under torch.compile): a lookup in `table`
    (normalize_table), which is exact, because the arithmetic rounds differently there: CUDA divides by a
    Python number as a multiplication by its reciprocal (aten's div_true_kernel_cuda), and compiled code
    need not round like eager code (both seen in the CUDA test). Eagerly on the CPU the lookup would be
    ~15x slower for the classic loader's workers."""
    if images.device.type != "cpu" or torch.compiler.is_compiling():
        channels = torch.arange(images.shape[1], device=images.device)[:, None, None]
        return table[channels, images.long()]
    return _arithmetic(images, mean, std)
