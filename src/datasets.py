"""The `data/` group: load a dataset into train / val / test splits.

Small datasets (digits, CIFAR, synthetic, ImageFolders that fit `data.max_memory_gb`) become uint8
tensors N x C x H x W in memory, which both loaders (src/loaders.py) index directly. Larger
ImageFolders stay on disk and are decoded by DataLoader workers.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig

from src.config import ConfigError

log = logging.getLogger(__name__)

CIFAR_STATS = {
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
}
IMAGENET_STATS = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
SPLIT_SEED = 0  # the val/test carve-out is fixed, so runs with different seeds share their test set


@dataclass
class Split:
    labels: torch.Tensor                      # int64 N
    images: torch.Tensor | None = None        # uint8 N x C x H x W when in memory
    files: torch.utils.data.Dataset | None = None  # on-disk samples when not

    def __len__(self) -> int:
        return len(self.labels)


@dataclass
class DataBundle:
    name: str
    train: Split
    val: Split
    test: Split
    num_classes: int
    channels: int
    image_size: tuple[int, int]
    mean: tuple[float, ...]
    std: tuple[float, ...]
    augment: str                               # none | crop_flip | random_resized_crop
    classes: list[str] = field(default_factory=list)

    @property
    def in_memory(self) -> bool:
        return self.train.images is not None


def stratified_split(labels: torch.Tensor, fraction: float, seed: int = SPLIT_SEED):
    """Indices (kept, held out) with `fraction` of every class held out."""
    from sklearn.model_selection import train_test_split

    idx = np.arange(len(labels))
    if fraction <= 0:
        return torch.from_numpy(idx), torch.empty(0, dtype=torch.long)
    keep, held = train_test_split(idx, test_size=fraction, random_state=seed, stratify=labels.numpy())
    return torch.from_numpy(np.sort(keep)), torch.from_numpy(np.sort(held))


def _subset(split: Split, idx: torch.Tensor) -> Split:
    if split.images is not None:
        return Split(split.labels[idx], images=split.images[idx])
    return Split(split.labels[idx], files=torch.utils.data.Subset(split.files, idx.tolist()))


def _carve_val(train: Split, fraction: float) -> tuple[Split, Split]:
    keep, held = stratified_split(train.labels, fraction)
    return _subset(train, keep), _subset(train, held)


def _channel_stats(images: torch.Tensor):
    x = images.double() / 255
    return tuple(x.mean(dim=(0, 2, 3)).tolist()), tuple(x.std(dim=(0, 2, 3)).clamp_min(1e-3).tolist())


def load_digits_data(cfg: DictConfig) -> DataBundle:
    from sklearn.datasets import load_digits

    raw = load_digits()
    images = torch.from_numpy(np.round(raw.images * (255 / 16)).astype(np.uint8)).unsqueeze(1)
    labels = torch.from_numpy(raw.target.astype(np.int64))
    train_idx, test_idx = stratified_split(labels, cfg.get("test_fraction", 0.2))
    full = Split(labels, images=images)
    train, val = _carve_val(_subset(full, train_idx), cfg.val_fraction)
    mean, std = _channel_stats(train.images)
    return DataBundle("digits", train, val, _subset(full, test_idx), 10, 1, (8, 8), mean, std,
                      cfg.get("augment", "none"), [str(i) for i in range(10)])


def load_cifar(cfg: DictConfig) -> DataBundle:
    import torchvision

    cls = torchvision.datasets.CIFAR10 if cfg.name == "cifar10" else torchvision.datasets.CIFAR100
    root = Path(cfg.root)
    archive = "cifar-10-python.tar.gz" if cfg.name == "cifar10" else "cifar-100-python.tar.gz"
    try:
        parts = [cls(str(root), train=flag, download=cfg.download) for flag in (True, False)]
    except Exception as exc:  # torchvision raises RuntimeError / URLError / OSError
        raise ConfigError(f"{cfg.name} is not in {root} and could not be downloaded ({type(exc).__name__}); "
                          f"place {archive} (or its extracted folder) in {root}, or set data.root") from None

    def to_split(ds) -> Split:
        return Split(torch.tensor(ds.targets, dtype=torch.long),
                     images=torch.from_numpy(ds.data).permute(0, 3, 1, 2).contiguous())

    train, val = _carve_val(to_split(parts[0]), cfg.val_fraction)
    mean, std = CIFAR_STATS[cfg.name]
    return DataBundle(cfg.name, train, val, to_split(parts[1]), len(parts[0].classes), 3, (32, 32), mean, std,
                      cfg.get("augment", "crop_flip"), list(parts[0].classes))


def load_synthetic(cfg: DictConfig) -> DataBundle:
    g = torch.Generator().manual_seed(SPLIT_SEED)
    c, h, w = cfg.shape

    def make(n: int) -> Split:
        return Split(torch.randint(0, cfg.num_classes, (n,), generator=g),
                     images=torch.randint(0, 256, (n, c, h, w), dtype=torch.uint8, generator=g))

    train, val = _carve_val(make(cfg.num_samples), cfg.val_fraction)
    return DataBundle("synthetic", train, val, make(cfg.num_test), cfg.num_classes, c, (h, w),
                      (0.5,) * c, (0.29,) * c, cfg.get("augment", "none"))


# --- ImageFolder ---------------------------------------------------------------------------------

def _check_folder(path: Path) -> None:
    if not path.is_dir():
        raise ConfigError(f"data.root: {path} does not exist; set data.root to a folder with train/ and val/ or test/")
    if not any(p.is_dir() for p in path.iterdir()):
        raise ConfigError(f"{path} has no class folders; expected {path}/<class>/<image> (ImageFolder layout)")


def _decode_folder(ds, size: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    from PIL import Image

    images, labels = [], []
    for path, label in ds.samples:
        with Image.open(path) as img:
            img = img.convert("RGB")
            if size is not None and img.size != (size, size):
                img = img.resize((size, size), Image.BILINEAR)
            images.append(np.asarray(img))
        labels.append(label)
    shapes = {a.shape for a in images}
    if len(shapes) > 1:
        raise ConfigError(f"{ds.root}: images differ in size {sorted(shapes)[:3]}...; set data.image_size")
    return torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).contiguous(), torch.tensor(labels)


def _cached_decode(folder: Path, ds, size: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode once; keep the uint8 array next to the data so the next run skips decoding."""
    cache = folder.parent / ".ddplab-cache" / f"{folder.name}-{size or 'native'}-{len(ds.samples)}.pt"
    if cache.exists():
        blob = torch.load(cache, weights_only=True)
        return blob["images"], blob["labels"]
    images, labels = _decode_folder(ds, size)
    try:
        cache.parent.mkdir(exist_ok=True)
        tmp = cache.with_suffix(f".tmp{os.getpid()}")
        torch.save({"images": images, "labels": labels}, tmp)
        os.replace(tmp, cache)
    except OSError as exc:
        log.warning("could not cache decoded images at %s (%s)", cache, exc)
    return images, labels


def _image_size_of(ds) -> tuple[int, int]:
    from PIL import Image

    with Image.open(ds.samples[0][0]) as img:
        return img.size[1], img.size[0]


def load_imagefolder(cfg: DictConfig) -> DataBundle:
    import torchvision
    from torchvision.transforms import v2 as T

    root = Path(str(cfg.root))
    _check_folder(root)
    _check_folder(root / "train")
    evals = [root / name for name in ("val", "test") if (root / name).is_dir()]
    if not evals:
        raise ConfigError(f"{root} has train/ but neither val/ nor test/; add one of them")
    for folder in evals:
        _check_folder(folder)
    base = {f.name: torchvision.datasets.ImageFolder(str(f)) for f in [root / "train", *evals]}
    classes = base["train"].classes
    for name, ds in base.items():
        if ds.classes != classes:
            raise ConfigError(f"{root}/{name} has classes {ds.classes[:5]}... but train/ has {classes[:5]}...; "
                              f"every split needs the same class folders")
    size = cfg.image_size
    h, w = (size, size) if size else _image_size_of(base["train"])
    augment = cfg.augment if cfg.augment != "auto" else ("crop_flip" if max(h, w) <= 64 else "random_resized_crop")
    n_total = sum(len(ds) for ds in base.values())
    fits = n_total * 3 * h * w <= cfg.max_memory_gb * 2**30 and augment != "random_resized_crop"

    if fits:
        splits = {name: Split(*reversed(_cached_decode(root / name, ds, size))) for name, ds in base.items()}
    else:
        train_tf = T.Compose([T.RandomResizedCrop((h, w), antialias=True), T.RandomHorizontalFlip(),
                              T.PILToTensor()])
        eval_tf = T.Compose([T.Resize(int(round(max(h, w) * 8 / 7)), antialias=True), T.CenterCrop((h, w)),
                             T.PILToTensor()])
        splits = {name: Split(torch.tensor(ds.targets),
                              files=torchvision.datasets.ImageFolder(str(root / name),
                                                                     transform=train_tf if name == "train" else eval_tf))
                  for name, ds in base.items()}
    train = splits["train"]
    if "val" in splits and "test" in splits:
        val, test = splits["val"], splits["test"]
    else:
        train, val = _carve_val(train, cfg.val_fraction)
        test = splits.get("test", splits.get("val"))
    if fits:
        mean, std = _channel_stats(train.images[:: max(1, len(train) // 5000)])
    else:
        mean, std = IMAGENET_STATS
    return DataBundle("imagefolder", train, val, test, len(classes), 3, (h, w), mean, std, augment, classes)


LOADERS = {"digits": load_digits_data, "cifar10": load_cifar, "cifar100": load_cifar,
           "imagefolder": load_imagefolder, "synthetic": load_synthetic}


def load_data(cfg: DictConfig) -> DataBundle:
    if cfg.name not in LOADERS:
        raise ConfigError(f"data.name={cfg.name!r} is unknown; choose one of {sorted(LOADERS)}")
    return LOADERS[cfg.name](cfg)
