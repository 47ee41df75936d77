"""Training recipes beyond crop and flip, each draw a function of (seed, epoch, sample id): random erasing and
mixup/cutmix per micro-batch on the device, TrivialAugment per image in the CPU workers."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from src.data.draws import sample_uniforms


@dataclass(frozen=True)
class Recipe:
    """Random erasing (its probability) and mixup/cutmix (timm's Mixup, per pair): applied per micro-batch on the
    device; TrivialAugment (auto_augment=trivial): per image in the CPU workers."""

    erasing: float = 0.0
    mixup_alpha: float = 0.0
    cutmix_alpha: float = 0.0
    mix_prob: float = 1.0
    switch_prob: float = 0.5
    trivial: bool = False

    @property
    def mixing(self) -> tuple | None:
        on = self.mix_prob > 0 and (self.mixup_alpha > 0 or self.cutmix_alpha > 0)
        return (self.mixup_alpha, self.cutmix_alpha, self.mix_prob, self.switch_prob) if on else None

    @property
    def on(self) -> bool:
        return bool(self.erasing or self.mixing)

    def draws(self, seed: int, epoch: int, ids: torch.Tensor, size) -> torch.Tensor:
        return recipe_draws(seed, epoch, ids.numpy(), *size, self.erasing, self.mixing)


ERASE_ATTEMPTS = 10  # timm's RandomErasing tries 10 boxes before leaving the image as it is
ERASE_DRAWS = 1 + 4 * ERASE_ATTEMPTS  # per sample: whether, then (area, log-aspect, top, left) per attempt
MIX_DRAWS = 5  # per pair: whether, cutmix or mixup, the Beta draw, the box's centre y, x
RECIPE_COLUMNS = (
    9  # erase box (top, bottom, left, right), own-image mixup weight, cutmix box (top, bottom, left, right)
)


def erase_boxes(u: np.ndarray, h: int, w: int, prob: float, area=(0.02, 1 / 3), aspect=(0.3, 1 / 0.3)) -> np.ndarray:
    """int64 B x 4 (top, bottom, left, right) of timm's RandomErasing (one box, the first of 10 draws that fits,
    where u[:, 0] < prob) from u (B x ERASE_DRAWS uniforms); an empty box elsewhere."""
    a = u[:, 1:].reshape(-1, ERASE_ATTEMPTS, 4)
    target = h * w * (area[0] + (area[1] - area[0]) * a[..., 0])
    ratio = np.exp(math.log(aspect[0]) + (math.log(aspect[1]) - math.log(aspect[0])) * a[..., 1])
    eh = np.round(np.sqrt(target * ratio)).astype(np.int64)
    ew = np.round(np.sqrt(target / ratio)).astype(np.int64)
    fits = (eh < h) & (ew < w)
    first = fits.argmax(axis=1)[:, None]

    def pick(v):
        return np.take_along_axis(v, first, axis=1)[:, 0]

    eh, ew = pick(eh), pick(ew)
    top = np.floor(pick(a[..., 2]) * (h - eh + 1)).astype(np.int64)
    left = np.floor(pick(a[..., 3]) * (w - ew + 1)).astype(np.int64)
    on = (u[:, 0] < prob) & fits.any(axis=1)
    return np.where(on[:, None], np.stack([top, top + eh, left, left + ew], axis=1), 0)


def mix_draws(u: np.ndarray, h: int, w: int, mixup_alpha: float, cutmix_alpha: float, prob: float, switch: float):
    """float64 P x 5 per pair (own-image mixup weight; cutmix box top, bottom, left, right) from u (P x MIX_DRAWS),
    timm's Mixup per pair: mixed where u0 < prob; cutmix where u1 < switch (or only cutmix is on); the weight a
    Beta(alpha, alpha) draw (its inverse CDF at u2); the cutmix box timm's rand_bbox centred at (u3, u4)."""
    from scipy.special import betaincinv

    mixed = u[:, 0] < prob
    cut = mixed & (cutmix_alpha > 0) & ((mixup_alpha <= 0) | (u[:, 1] < switch))
    alpha = np.where(cut, cutmix_alpha, mixup_alpha)
    lam = np.where(mixed & (alpha > 0), betaincinv(np.maximum(alpha, 1e-9), np.maximum(alpha, 1e-9), u[:, 2]), 1.0)
    rat = np.sqrt(1 - lam)
    ch, cw = (h * rat).astype(np.int64), (w * rat).astype(np.int64)
    cy, cx = np.floor(u[:, 3] * h), np.floor(u[:, 4] * w)
    box = np.stack([cy - ch // 2, cy + ch // 2, cx - cw // 2, cx + cw // 2], axis=1)
    box = np.clip(box, 0, [h, h, w, w])
    return np.concatenate([np.where(mixed & ~cut, lam, 1.0)[:, None], np.where(cut[:, None], box, 0)], axis=1)


def recipe_draws(seed: int, epoch: int, ids, h: int, w: int, erasing: float, mixing: tuple | None) -> torch.Tensor:
    """float32 B x RECIPE_COLUMNS for one micro-batch of sample `ids`: each sample's random erasing box, and its
    pair's mixup weight and cutmix box. Pairs are positions (0, 1), (2, 3), ... of the micro-batch, drawn from the
    pair's first id: with even micro-batches, cut from the global batch at even offsets, every layout keeps the
    same pairs (and an odd last sample is paired with itself). timm pairs mirror positions (i, B - 1 - i), which
    would change with the micro-batch. mixing: (mixup_alpha, cutmix_alpha, prob, switch)."""
    ids = np.asarray(ids, dtype=np.int64)
    out = np.zeros((len(ids), RECIPE_COLUMNS))
    out[:, 4] = 1.0
    if erasing:
        out[:, :4] = erase_boxes(sample_uniforms(seed, epoch, ids, ERASE_DRAWS, stream=4), h, w, erasing)
    if mixing:
        pairs = mix_draws(sample_uniforms(seed, epoch, ids[0::2], MIX_DRAWS, stream=5), h, w, *mixing)
        out[:, 4:] = np.repeat(pairs, 2, axis=0)[: len(ids)]
    return torch.from_numpy(out.astype(np.float32))


def _in_box(box: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """bool B x 1 x H x W: inside each sample's box (top, bottom, left, right)."""
    rows = torch.arange(h, device=box.device)
    cols = torch.arange(w, device=box.device)
    in_rows = (rows >= box[:, 0:1]) & (rows < box[:, 1:2])
    in_cols = (cols >= box[:, 2:3]) & (cols < box[:, 3:4])
    return (in_rows[:, :, None] & in_cols[:, None, :])[:, None]


def erase_and_mix(
    x: torch.Tensor, y: torch.Tensor, draws: torch.Tensor, mix: bool = True
) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """Normalized B x C x H x W images and labels -> (images, each sample's dominant label, (its other label, the
    dominant label's weight)): erased boxes set to zero (the dataset mean), then each image mixed with its pair's
    (mixup: a * own + (1 - a) * other; cutmix: the other's pixels inside the box). The target is w * one-hot(y) +
    (1 - w) * one-hot(other), w the share of own pixels (timm's corrected lambda), named from its larger part;
    without `mix`, () for the last."""
    b, _, h, w = x.shape
    x = x.masked_fill(_in_box(draws[:, :4], h, w), 0.0)
    if not mix:
        return x, y, ()
    partner = torch.arange(b, device=x.device) ^ 1
    partner = torch.minimum(partner, torch.full_like(partner, b - 1))
    other = x[partner]
    a = draws[:, 4].view(-1, 1, 1, 1)
    x = torch.where(_in_box(draws[:, 5:], h, w), other, a * x + (1 - a) * other)
    box = draws[:, 5:]
    own = draws[:, 4] * (1 - (box[:, 1] - box[:, 0]) * (box[:, 3] - box[:, 2]) / (h * w))
    y_other = y[partner]
    dominant = own >= 0.5
    return (
        x,
        torch.where(dominant, y, y_other),
        (torch.where(dominant, y_other, y), torch.where(dominant, own, 1 - own)),
    )


def trivial_augment(images: torch.Tensor, seed: int, epoch: int, ids) -> torch.Tensor:
    """uint8 B x C x H x W on the CPU -> each image through torchvision's TrivialAugmentWide, its random choices
    seeded from (seed, epoch, sample id): the same for any worker, rank or world size. One image at a time (its ops
    take one magnitude per call), under fork_rng so the caller's random state is left as it was."""
    from torchvision.transforms import v2

    op = v2.TrivialAugmentWide()
    seeds = (sample_uniforms(seed, epoch, np.asarray(ids), 1, stream=6)[:, 0] * 2**53).astype(np.int64)
    out = torch.empty_like(images)
    with torch.random.fork_rng(devices=[]):
        for k, s in enumerate(seeds.tolist()):
            torch.manual_seed(s)
            out[k] = op(images[k])
    return out
