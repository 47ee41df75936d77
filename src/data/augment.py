"""Batched augmentation on uint8 images, on any device: the data group's augmentation options, crop and flip,
cutout, normalization, and `Augmentation`, which takes a split from uint8 images to the normalized batch.

The random choices of an epoch (crop offset and flip of every sample) are drawn once from
(seed, epoch) and indexed by sample id, so a sample is augmented the same way whatever the
strategy, world size, loader or device: single, dp, ddp and fsdp see identical batches.
Images read from disk get their crops in `disk_crops.py`; erasing and mixing come from `recipes.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

import torch
import torch.nn.functional as F

from src.config.errors import ConfigError
from src.config.schema import NonNegative, Range
from src.data.draws import epoch_generator
from src.data.recipes import Recipe, erase_and_mix

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

    @property
    def recipe(self) -> Recipe:
        """What these options ask for beyond crop and flip: erasing, mixing, TrivialAugment."""
        numbers = (self.random_erasing, self.mixup_alpha, self.cutmix_alpha, self.mix_prob, self.mix_switch_prob)
        return Recipe(*map(float, numbers), trivial=self.trivial)


def check_crop_flip_options(cutout: int, augment: str, flip: str = "random") -> None:
    """Cutout and alternating flips change crop_flip's crops: refused with any other augmentation (auto is checked
    again once the images tell what it becomes)."""
    if cutout and augment not in ("crop_flip", "auto"):
        raise ConfigError(f"data.cutout={cutout} needs data.augment=crop_flip, got {augment!r}; set data.cutout=0")
    if flip != "random" and augment not in ("crop_flip", "auto"):
        raise ConfigError(f"data.flip={flip} needs data.augment=crop_flip, got {augment!r}; set data.flip=random")


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


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without waiting for the device: staged in pinned memory, which torch keeps
    until the copy is done (an asynchronous copy from pageable memory may read it after it is freed)."""
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return (t if t.is_pinned() else t.pin_memory()).to(device, non_blocking=True)


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
