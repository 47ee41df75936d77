"""Batched augmentation on uint8 images, on any device.

The random choices of an epoch (crop offset and flip of every sample) are drawn once from
(seed, epoch) and indexed by sample id, so a sample is augmented the same way whatever the
strategy, world size, loader or device: single, dp, ddp and fsdp see identical batches.
Images read from disk (each of its own size) get random resized crops whose choices come from
(seed, epoch, sample id) alone (`sample_uniforms`), computed for just the batch at hand.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Literal

import numpy as np
import torch
import torch.nn.functional as F

from src.config.errors import ConfigError
from src.config.schema import NonNegative, Range

CROP_PAD = 4
Probability = Range(0, 1)


@dataclass(frozen=True)
class Span(Range):
    """A [low, high] pair of numbers within the bounds, low <= high; `meaning` says what they measure."""

    meaning: str = ""

    def holds(self, v) -> bool:
        return len(v) == 2 and super().holds(v[0]) and super().holds(v[1]) and v[0] <= v[1]

    def __str__(self) -> str:
        low = "" if self.lo is None else f"{self.lo:g} {'<' if self.open_lo else '<='} "
        high = "" if self.hi is None else f" {'<' if self.open_hi else '<='} {self.hi:g}"
        return f"pair [low, high] with {low}low <= high{high} ({self.meaning})"


@dataclass(frozen=True)
class AugmentOptions:
    """The data group's augmentation options (conf/data_common.yaml; rrc_*: images read from disk), checked by
    check_data_config and read by the loaders."""

    augment: Literal["none", "crop_flip", "random_resized_crop", "auto"]
    cutout: Annotated[int, NonNegative]  # the side of a zeroed square per training image (crop_flip); 0: off
    flip: Literal["random", "alternate"]  # crop_flip's mirror: per image and epoch, or every other epoch
    pad_mode: Literal["zeros", "reflect"]  # the crop's padding
    auto_augment: Literal["none", "trivial"]  # trivial: TrivialAugmentWide per image in the CPU workers
    random_erasing: Annotated[float, Probability]
    mixup_alpha: Annotated[float, NonNegative]
    cutmix_alpha: Annotated[float, NonNegative]
    mix_prob: Annotated[float, Probability]
    mix_switch_prob: Annotated[float, Probability]
    rrc_scale: Annotated[list[float], Span(0, 1, open_lo=True, meaning="share of the image area")] = (0.08, 1.0)
    rrc_ratio: Annotated[list[float], Span(0, open_lo=True, meaning="width / height")] = (3 / 4, 4 / 3)

    @property
    def trivial(self) -> bool:
        return self.auto_augment == "trivial"


def check_crop_flip_options(cutout: int, augment: str, flip: str = "random") -> None:
    """Cutout and alternating flips change crop_flip's crops: refused with any other augmentation (auto is checked
    again once the images tell what it becomes)."""
    if cutout and augment not in ("crop_flip", "auto"):
        raise ConfigError(f"data.cutout={cutout} needs data.augment=crop_flip, got {augment!r}; set data.cutout=0")
    if flip != "random" and augment not in ("crop_flip", "auto"):
        raise ConfigError(f"data.flip={flip} needs data.augment=crop_flip, got {augment!r}; set data.flip=random")


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

    @classmethod
    def of(cls, options: AugmentOptions) -> Recipe:
        o = options
        numbers = (o.random_erasing, o.mixup_alpha, o.cutmix_alpha, o.mix_prob, o.mix_switch_prob)
        return cls(*map(float, numbers), trivial=o.trivial)

    @property
    def mixing(self) -> tuple | None:
        on = self.mix_prob > 0 and (self.mixup_alpha > 0 or self.cutmix_alpha > 0)
        return (self.mixup_alpha, self.cutmix_alpha, self.mix_prob, self.switch_prob) if on else None

    @property
    def on(self) -> bool:
        return bool(self.erasing or self.mixing)

    def draws(self, seed: int, epoch: int, ids: torch.Tensor, size) -> torch.Tensor:
        return recipe_draws(seed, epoch, ids.numpy(), *size, self.erasing, self.mixing)


RRC_ATTEMPTS = 10  # torchvision's RandomResizedCrop tries 10 boxes before falling back to a centre crop
RRC_DRAWS = 4 * RRC_ATTEMPTS + 1  # per sample: (area, aspect, top, left) per attempt, and the flip


def epoch_generator(seed: int, epoch: int, stream: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + epoch * 1009 + stream)


def draw_params(
    n: int,
    seed: int,
    epoch: int,
    pad: int = CROP_PAD,
    cutout_within: tuple[int, int] | None = None,
    alternate_flips: bool = False,
) -> torch.Tensor:
    """int64 N x 3: crop offset y, crop offset x, flip (0/1) for every sample of the epoch;
    N x 5 with `cutout_within=(H, W)`: then also the cutout centre y, x (own stream: crop/flip unchanged).
    alternate_flips: each sample's flip is drawn once per run and inverted in odd epochs (every image is seen
    mirrored every other epoch), in place of a fresh draw per epoch."""
    g = epoch_generator(seed, epoch, stream=1)
    offsets = torch.randint(0, 2 * pad + 1, (n, 2), generator=g)
    if alternate_flips:
        flips = torch.randint(0, 2, (n, 1), generator=epoch_generator(seed, 0, stream=4)) ^ (epoch % 2)
    else:
        flips = torch.randint(0, 2, (n, 1), generator=g)
    parts = [offsets, flips]
    if cutout_within:
        g = epoch_generator(seed, epoch, stream=2)
        parts += [
            torch.randint(0, cutout_within[0], (n, 1), generator=g),
            torch.randint(0, cutout_within[1], (n, 1), generator=g),
        ]
    return torch.cat(parts, dim=1)


def _reflect(index: torch.Tensor, size: int) -> torch.Tensor:
    """Indices outside 0..size-1 mirrored about the edge pixels (-1 -> 1, size -> size - 2)."""
    index = index.abs()
    return torch.where(index > size - 1, 2 * (size - 1) - index, index)


def crop_flip(images: torch.Tensor, params: torch.Tensor, pad: int = CROP_PAD, pad_mode: str = "zeros") -> torch.Tensor:
    """Random crop of the image padded by `pad` pixels (pad_mode zeros or reflect) and horizontal flip,
    batched: B x C x H x W -> same shape."""
    b, c, h, w = images.shape
    rows = params[:, 0:1] + torch.arange(h, device=images.device)  # B x H, in padded coordinates
    cols = params[:, 1:2] + torch.arange(w, device=images.device)  # B x W
    if pad_mode == "reflect":  # read the unpadded image at mirrored indices
        source, rows, cols = images, _reflect(rows - pad, h), _reflect(cols - pad, w)
    else:
        source = F.pad(images, (pad, pad, pad, pad))
    cols = torch.where(params[:, 2:3].bool(), cols.flip(1), cols)  # flipping = reversed columns
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
    in_rows = (rows >= top) & (rows < top + size)  # B x H
    in_cols = (cols >= left) & (cols < left + size)  # B x W
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
    ~15x slower for the DataLoader workers."""
    if images.device.type != "cpu" or torch.compiler.is_compiling():
        channels = torch.arange(images.shape[1], device=images.device)[:, None, None]
        return table[channels, images.long()]
    return _arithmetic(images, mean, std)


# --- random resized crops of images of any size (read from disk) ----------------------------------------

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: a bijection of uint64 whose outputs pass statistical tests as random."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def sample_uniforms(seed: int, epoch: int, ids, count: int, stream: int = 3) -> np.ndarray:
    """float64 len(ids) x count in [0, 1): sample `id`'s numbers of the epoch, a function of (seed, epoch, id)
    alone (counter-based, splitmix64), so a worker computes only its batch's and nothing per epoch is stored
    (ImageNet: 1.28M x 41 numbers), whatever the batch, rank or resume point."""
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps by design
        key = np.array([seed % 2**64], dtype=np.uint64)
        for part in (epoch, stream):
            key = _mix64(key ^ np.uint64(part % 2**64)) + _GOLDEN
        counters = np.asarray(ids, dtype=np.uint64)[:, None] * np.uint64(count) + np.arange(count, dtype=np.uint64)
        bits = _mix64(key + counters * _GOLDEN)
    return (bits >> np.uint64(11)).astype(np.float64) * 2.0**-53


def rrc_boxes(u: np.ndarray, heights, widths, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)) -> np.ndarray:
    """int64 B x 4 (top, left, height, width): torchvision's RandomResizedCrop.get_params for every image at
    once, from `u` (B x RRC_ATTEMPTS x 4 uniforms): the first of 10 (area, log-aspect) draws that fits, at a
    uniform position; if none fits, the whole image trimmed to the nearest allowed aspect ratio, centred."""
    H, W = (np.asarray(v, dtype=np.int64)[:, None] for v in (heights, widths))
    area = (H * W).astype(np.float64)
    target = area * (scale[0] + (scale[1] - scale[0]) * u[..., 0])
    lo, hi = math.log(ratio[0]), math.log(ratio[1])
    aspect = np.exp(lo + (hi - lo) * u[..., 1])
    w = np.round(np.sqrt(target * aspect)).astype(np.int64)  # round half to even, like Python's round()
    h = np.round(np.sqrt(target / aspect)).astype(np.int64)
    fits = (w > 0) & (w <= W) & (h > 0) & (h <= H)
    first = fits.argmax(axis=1)[:, None]

    def pick(a):
        return np.take_along_axis(a, first, axis=1)[:, 0]

    h, w, H, W = pick(h), pick(w), H[:, 0], W[:, 0]
    top = np.floor(pick(u[..., 2]) * (H - h + 1)).astype(np.int64)
    left = np.floor(pick(u[..., 3]) * (W - w + 1)).astype(np.int64)
    wide, narrow = W / H > max(ratio), W / H < min(ratio)
    fh = np.where(narrow, np.round(W / min(ratio)).astype(np.int64), H)
    fw = np.where(wide, np.round(H * max(ratio)).astype(np.int64), W)
    fallback = ~fits.any(axis=1)
    boxes = np.stack([top, left, h, w], axis=1)
    boxes[fallback] = np.stack([(H - fh) // 2, (W - fw) // 2, fh, fw], axis=1)[fallback]
    return boxes


def rrc_params(seed: int, epoch: int, ids, heights, widths, scale, ratio) -> tuple[np.ndarray, np.ndarray]:
    """(boxes B x 4, flips bool B) of the epoch's random resized crop of samples `ids`, images H x W."""
    u = sample_uniforms(seed, epoch, ids, RRC_DRAWS)
    return rrc_boxes(u[:, :-1].reshape(-1, RRC_ATTEMPTS, 4), heights, widths, scale, ratio), u[:, -1] < 0.5


def _resize(image: torch.Tensor, size) -> torch.Tensor:
    """C x h x w -> uint8 C x size, bilinear with antialiasing, on the CPU's uint8 kernel (~2x its float one)."""
    return F.interpolate(image[None], size=tuple(size), mode="bilinear", antialias=True, align_corners=False)[0]


def resized_crops(images: list[torch.Tensor], boxes: np.ndarray, flips: np.ndarray, size) -> torch.Tensor:
    """uint8 B x C x size: image k cropped to boxes[k] (top, left, height, width), resized, mirrored where
    flips[k]. On the CPU one resize per image; elsewhere a few batched matrix products (`resample`)."""
    boxes = np.asarray(boxes, dtype=np.int64).reshape(-1, 4)
    flips = np.asarray(flips, dtype=bool)
    if images[0].device.type != "cpu":
        zero = np.zeros(len(images), dtype=np.int64)
        rows = np.stack([boxes[:, 0], boxes[:, 2], np.full_like(zero, size[0]), zero], axis=1)
        cols = np.stack([boxes[:, 1], boxes[:, 3], np.full_like(zero, size[1]), zero], axis=1)
        return resample(images, rows, cols, flips, size)
    out = torch.empty(len(images), images[0].shape[0], *size, dtype=torch.uint8)
    for k, (image, (top, left, h, w), flip) in enumerate(zip(images, boxes.tolist(), flips.tolist())):
        crop = _resize(image[:, top : top + h, left : left + w], size)
        out[k] = crop.flip(-1) if flip else crop  # per image: a batched where + flip cost as much as the resizes
    return out


def eval_geometry(height: int, width: int, short: int, size) -> tuple[tuple[int, int], tuple[int, int]]:
    """((resized h, w), (crop top, left)) of torchvision's Resize(short) + CenterCrop(size) on an H x W image."""
    if height <= width:
        resized = (short, int(short * width / height))
    else:
        resized = (int(short * height / width), short)
    return resized, (int(round((resized[0] - size[0]) / 2.0)), int(round((resized[1] - size[1]) / 2.0)))


def resize_center_crops(images: list[torch.Tensor], short: int, size) -> torch.Tensor:
    """uint8 B x C x size: each image's shorter side resized to `short`, then its centre `size` crop."""
    geometry = [eval_geometry(image.shape[1], image.shape[2], short, size) for image in images]
    if images[0].device.type != "cpu":
        spans = [
            [(0, image.shape[1], resized[0], top), (0, image.shape[2], resized[1], left)]
            for image, (resized, (top, left)) in zip(images, geometry)
        ]
        spans = np.asarray(spans, dtype=np.int64).reshape(-1, 2, 4)
        return resample(images, spans[:, 0], spans[:, 1], np.zeros(len(images), dtype=bool), size)
    out = torch.empty(len(images), images[0].shape[0], *size, dtype=torch.uint8)
    for k, (image, (resized, (top, left))) in enumerate(zip(images, geometry)):
        out[k] = _resize(image, resized)[:, top : top + size[0], left : left + size[1]]
    return out


# --- the same resizes batched: antialiased bilinear resizing is separable, so a resize is two matrix products


def aa_weights(spans: torch.Tensor, out: int, padded: int) -> torch.Tensor:
    """float32 B x out x padded: row i of sample b holds the weights of F.interpolate(..., "bilinear",
    antialias=True) for output pixel offset + i of an image axis of `length` pixels (from `start` on a padded
    axis) resized to `total` pixels; spans[b] = (start, length, total, offset), on the device. As torch's kernel
    does: a triangle widened by the downscale factor, cut at the image's edges, normalized to sum 1."""
    start, length, total, offset = spans.float().view(-1, 4, 1, 1).unbind(1)
    scale = length / total
    centre = scale * (offset + torch.arange(out, device=spans.device).view(1, -1, 1) + 0.5)
    j = torch.arange(padded, device=spans.device).view(1, 1, -1) - start  # position in the image
    w = (1 - ((j + 0.5 - centre) / scale.clamp(min=1)).abs()).clamp_(min=0)
    w = w * ((j >= 0) & (j < length))
    return w / w.sum(-1, keepdim=True)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without waiting for the device: staged in pinned memory, which torch keeps
    until the copy is done (an asynchronous copy from pageable memory may read it after it is freed)."""
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return (t if t.is_pinned() else t.pin_memory()).to(device, non_blocking=True)


def size_groups(shapes: list[tuple[int, int]], waste: float = 1.5) -> list[list[int]]:
    """Indices of images to pad to one size together, so that the padded pixels stay below `waste` times the
    images' own (one huge image must not make every image of the batch its size)."""
    order = sorted(range(len(shapes)), key=lambda k: shapes[k])
    groups, area, hmax, wmax = [], 0, 0, 0
    for k in order:
        h, w = shapes[k]
        hm, wm = max(hmax, h), max(wmax, w)
        if groups and (len(groups[-1]) + 1) * hm * wm <= waste * (area + h * w):
            groups[-1].append(k)
            area, hmax, wmax = area + h * w, hm, wm
        else:
            groups.append([k])
            area, hmax, wmax = h * w, h, w
    return groups


def resample(images, rows: np.ndarray, cols: np.ndarray, flips: np.ndarray, size, dtype=torch.float16):
    """uint8 B x C x size from images of any sizes on one device: rows[k], cols[k] = (start, length, total,
    offset) of image k's vertical and horizontal resize (`aa_weights`), mirrored where flips[k]. Per group of
    similar sizes: one gather into a padded batch, then two batched matrix products (fp16 inputs, fp32
    accumulation: within a level of torch's own kernel), instead of one resize kernel per image. The training
    process runs this for every batch of crops, so its kernels do not grow with the images: one host-to-device
    table, the weights of every image at once, a gather and two products per group, one rounding pass."""
    device, channels = images[0].device, images[0].shape[0]
    shapes = np.array([image.shape[1:] for image in images], dtype=np.int64).reshape(-1, 2)
    groups = size_groups([tuple(shape) for shape in shapes.tolist()])
    order = np.concatenate(groups)  # the groups one after another: each is a slice of the rows below
    flat = torch.cat([images[k].reshape(-1) for k in order.tolist()])
    starts = np.concatenate([[0], np.cumsum(shapes[order].prod(1) * channels)[:-1]])
    # per row (image order[i]): rows 0-3, cols 4-7, flip 8, (h, w) 9-10, start in flat 11; column 12 is not the
    # row's: the position in `order` of image i, which puts the batch back in its order
    columns = [rows[order], cols[order], flips[order, None], shapes[order], starts[:, None], np.argsort(order)[:, None]]
    table = to_device(torch.from_numpy(np.concatenate(columns, 1).astype(np.int64)), device)  # one copy per batch
    wy = aa_weights(table[:, :4], size[0], int(shapes[:, 0].max())).to(dtype)
    wx = aa_weights(table[:, 4:8], size[1], int(shapes[:, 1].max()))
    wx = torch.where(table[:, 8:9].bool().view(-1, 1, 1), wx.flip(1), wx).to(dtype)  # mirrored: rows reversed
    y = torch.empty(len(images), size[0] * channels, size[1], dtype=dtype, device=device)  # rows first
    first = 0
    for group in groups:
        n, part, first = len(group), slice(first, first + len(group)), first + len(group)
        hp, wp = (int(shapes[group, d].max()) for d in (0, 1))
        x = _padded(flat, table[part, 9:12], channels, hp, wp).to(dtype).view(n, hp, channels * wp)
        t = torch.bmm(wy[part, :, :hp], x).view(n, size[0] * channels, wp)
        torch.bmm(t, wx[part, :, :wp].transpose(1, 2), out=y[part])
    y = y.view(len(images), size[0], channels, size[1]).permute(0, 2, 1, 3)
    y = y.float().round_().clamp_(0, 255).to(torch.uint8)
    return y.contiguous() if (order == np.arange(len(images))).all() else y[table[:, 12]].contiguous()


def _padded(flat: torch.Tensor, where: torch.Tensor, channels: int, hp: int, wp: int) -> torch.Tensor:
    """uint8 G x hp x C x wp: images stored back to back in `flat` (C x h x w each; where[g] = (h, w, start)),
    each at the top left of hp x wp, in one gather. The padding repeats edge pixels: aa_weights gives it no
    weight, so it need not be zeros."""
    kind = torch.int32 if flat.numel() < 2**31 else torch.int64  # int32: half the bytes of the index
    h, w, start = (v.view(-1, 1, 1, 1).to(kind) for v in where.unbind(1))
    row, channel, col = (torch.arange(n, device=flat.device, dtype=kind) for n in (hp, channels, wp))
    row = torch.minimum(row.view(1, -1, 1, 1), h - 1)
    col = torch.minimum(col.view(1, 1, 1, -1), w - 1)
    return flat[start + channel.view(1, 1, -1, 1) * (h * w) + row * w + col]


class DiskCrops:
    """Fixed-size uint8 crops of images of any size, wherever the images are. Training with random resized crops
    (`random`): each sample's crop and flip of the epoch, drawn from (seed, epoch, sample id). Evaluation, and
    training under the other augmentations: the shorter side resized to 8/7 of the size, then the centre."""

    def __init__(self, size, random: bool, seed: int, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)):
        self.size, self.random, self.seed = tuple(size), random, seed
        self.short = int(round(max(self.size) * 8 / 7))
        self.scale, self.ratio = tuple(scale), tuple(ratio)

    def __call__(self, images: list[torch.Tensor], ids: torch.Tensor, epoch: int | None) -> torch.Tensor:
        cut = self.regions(images, ids, epoch)
        return self.resize(*cut) if cut else resize_center_crops(images, self.short, self.size)

    def regions(self, images: list[torch.Tensor], ids: torch.Tensor, epoch: int | None) -> tuple | None:
        """(each image cut to its random resized crop's box, as a view; whether each is mirrored): what `resize`
        finishes. None where the crop is the centre's (evaluation, the other augmentations)."""
        if epoch is None or not self.random:
            return None
        heights, widths = ([image.shape[d] for image in images] for d in (1, 2))
        boxes, flips = rrc_params(self.seed, epoch, ids.numpy(), heights, widths, self.scale, self.ratio)
        cut = [image[:, top : top + h, left : left + w] for image, (top, left, h, w) in zip(images, boxes.tolist())]
        return cut, flips

    def resize(self, regions: list[torch.Tensor], flips: np.ndarray) -> torch.Tensor:
        """uint8 B x C x size: each region (`regions`) resized whole, mirrored where flips[k]."""
        whole = np.array([(0, 0, region.shape[1], region.shape[2]) for region in regions], dtype=np.int64)
        return resized_crops(regions, whole, np.asarray(flips, dtype=bool), self.size)


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


# --- batch recipes: random erasing, mixup and cutmix, drawn per micro-batch from (seed, epoch, sample id) ---------

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


# --- one split's augmentation, from uint8 images to the normalized batch -------------------------------------


class Augmentation:
    """uint8 images -> normalized float batch on `device`, augmented with the epoch's draws: crop_flip (in a
    loader's workers or on the device), then normalization, cutout and layout, then the recipe (erasing, mixing)."""

    def __init__(
        self,
        data,
        channels_last: bool,
        device: torch.device,
        cutout: int = 0,
        pad_mode: str = "zeros",
        recipe: Recipe = Recipe(),
        flip: str = "random",
    ):
        self.recipe, self.device, self.flip = recipe, device, flip
        self.mean = torch.tensor(data.mean, device=device)
        self.std = torch.tensor(data.std, device=device)
        self.table = normalize_table(data.mean, data.std).to(device)
        self.crop_flip = data.augment == "crop_flip"
        self.cutout, self.pad_mode = cutout, pad_mode
        self.image_size = tuple(data.image_size)
        self.channels_last = channels_last

    def for_workers(self, data) -> Augmentation:
        """The same augmentation on the CPU of a loader's workers, in plain layout."""
        return Augmentation(data, False, torch.device("cpu"), self.cutout, self.pad_mode, self.recipe, self.flip)

    def draw(self, n: int, seed: int, epoch: int) -> torch.Tensor:
        """The random choices of one epoch for samples 0..n-1 (indexed by sample id)."""
        cutout_within = self.image_size if self.cutout else None
        return draw_params(n, seed, epoch, cutout_within=cutout_within, alternate_flips=self.flip == "alternate")

    def augment(self, images: torch.Tensor, params: torch.Tensor | None) -> torch.Tensor:
        """uint8 -> uint8: the padded crop and flip."""
        if params is not None and self.crop_flip:
            return crop_flip(images, params[:, :3], pad_mode=self.pad_mode)
        return images

    def finish(self, images: torch.Tensor, params: torch.Tensor | None) -> torch.Tensor:
        """uint8 -> normalized float, cutout, layout (always on the training device)."""
        x = normalize(images, self.mean, self.std, self.table)
        if params is not None and self.crop_flip and self.cutout:
            x = cutout(x, params[:, 3:5], self.cutout)
        return self.layout(x)

    def layout(self, x: torch.Tensor) -> torch.Tensor:
        if self.channels_last:  # spelled out: torch.compile drops contiguous(memory_format=channels_last)
            return x.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
        return x.contiguous()

    def recipe_draws(self, seed: int, epoch: int, ids: torch.Tensor) -> torch.Tensor:
        """The micro-batch's erasing and mixing draws (CPU ids -> CPU tensor)."""
        return self.recipe.draws(seed, epoch, ids, self.image_size)

    def apply_recipe(self, x: torch.Tensor, y: torch.Tensor, draws: torch.Tensor | None) -> tuple:
        """(x, y, mix) of a finished training micro-batch: erased and mixed where the recipe says."""
        if draws is None:
            return x, y, ()
        x, y, mix = erase_and_mix(x, y, draws, mix=self.recipe.mixing is not None)
        return self.layout(x), y, mix

    def __call__(self, images: torch.Tensor, params: torch.Tensor | None) -> torch.Tensor:
        return self.finish(self.augment(images, params), params)


class EpochDraws:
    """The epoch's crop_flip draws of a split (indexed by sample id), drawn once per epoch; None for evaluations
    and the other augmentations."""

    def __init__(self, augmentation: Augmentation, n: int, seed: int, device: torch.device | None = None):
        self.augmentation, self.n, self.seed, self.device = augmentation, n, seed, device
        self.cached: tuple[int | None, torch.Tensor | None] = (None, None)

    def __call__(self, epoch: int | None, ids: torch.Tensor) -> torch.Tensor | None:
        if epoch is None or not self.augmentation.crop_flip:
            return None
        if self.cached[0] != epoch:
            draws = self.augmentation.draw(self.n, self.seed, epoch)
            self.cached = (epoch, draws if self.device is None else draws.to(self.device))
        return self.cached[1][ids.to(self.cached[1].device)]
