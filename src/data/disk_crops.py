"""Fixed-size crops of images of any size (read from disk): torchvision's random resized crops, drawn from (seed,
epoch, sample id) for just the batch at hand, and evaluation's centre crops; the resizes batched, since antialiased
bilinear resizing is separable: two matrix products per group of similar sizes."""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from src.data.augment import to_device
from src.data.draws import sample_uniforms

RRC_ATTEMPTS = 10  # torchvision's RandomResizedCrop tries 10 boxes before falling back to a centre crop
RRC_DRAWS = 4 * RRC_ATTEMPTS + 1  # per sample: (area, aspect, top, left) per attempt, and the flip


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
