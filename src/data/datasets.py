"""The `data/` group: load a dataset into train / val / test splits.

Each conf/data/<name>.yaml names its builder with `_target_` (a function taking the data config and returning
a DataBundle); adding a dataset is one such function and one YAML starting with
`defaults: [/data_common@_here_, _self_]`.
Small datasets (digits, CIFAR, synthetic, ImageFolders that fit `data.max_memory_gb`) become uint8
tensors N x C x H x W in memory, which both loaders (src/data/loaders.py) index directly. Larger
ImageFolders (and packed shards, src/data/shards.py) stay on disk as encoded images (src/data/decode.py), decoded
per batch by DataLoader workers or on the training device (`data.decode`).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import math
import os
import pickle
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Annotated

import numpy as np
import torch
from hydra.utils import get_method
from omegaconf import DictConfig, OmegaConf

from src.config.errors import ConfigError
from src.config.renamed import RENAMED_VALUES, moved
from src.config.schema import Fraction, Positive, PositiveReal, Range, check_value, declared, refuse_lookalikes
from src.data.augment import AugmentOptions, check_crop_flip_options, normalize, normalize_table
from src.data.decode import EncodedImages
from src.data.loader_plan import LoaderOptions

log = logging.getLogger(__name__)

CIFAR_STATS = {
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
}
IMAGENET_STATS = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
SPLIT_SEED = 0  # the val/test carve-out is fixed, so runs with different seeds share their test set


# --- the data config: each group of options declared beside the code that reads it ----------------------------

IN_MEMORY_AUGMENTS = ("none", "crop_flip")  # what the loaders apply to in-memory uint8 tensors


@dataclass(frozen=True)
class SplitOptions:
    """How the samples are batched and held out (conf/data_common.yaml)."""

    batch_size: Annotated[int, Positive]  # the GLOBAL batch of one optimizer step
    eval_batch_size: Annotated[int, Positive]  # per device
    val_fraction: Annotated[float, Fraction]


@dataclass(frozen=True)
class DatasetOptions:
    """Options of the builders below that have them: test_fraction (digits), image_size and max_memory_gb
    (ImageFolders, shards), the rest (synthetic)."""

    test_fraction: Annotated[float, Range(0, 1, open_lo=True, open_hi=True)] = 0.2
    image_size: Annotated[int, Positive] | None = None
    max_memory_gb: Annotated[float, PositiveReal] = 8.0
    shape: list[Annotated[int, Positive]] = (3, 32, 32)  # [channels, height, width]
    num_classes: Annotated[int, Range(2)] = 10
    num_samples: Annotated[int, Positive] = 2048
    num_test: Annotated[int, Positive] = 512


BUILDER_KEYS = ("_target_", "name", "root", "download")  # what the builders of src/ read besides the options


def options_of(cfg, spec):
    """The `spec` dataclass of the data config `cfg`; options it does not hold take their declared defaults."""
    return spec(**{f.name: cfg[f.name] for f in fields(spec) if f.name in cfg})


def _check_keys(cfg: DictConfig, builder: Callable, known: list[str]) -> None:
    """A key no builder of src/ reads is a typo (e.g. +data.num_worker=4 would change nothing): refused. A
    builder of your own may read keys of its own: those are refused only when they look like a known key."""
    known = (*known, *BUILDER_KEYS)
    refuse_lookalikes(cfg, "data", known)
    unknown = [key for key in cfg if key not in known]
    if unknown and builder.__module__.startswith("src."):
        raise ConfigError(
            f"data.{unknown[0]} is not an option of data={cfg.get('name')}; the data options are "
            f"{', '.join(k for k in known if not k.startswith('_'))}"
        )


def _take_renamed_values(cfg: DictConfig) -> None:
    """An old value (data.loader=gpu, a builder's old place in data._target_) is taken under its new name, with a
    one-line warning, and set in the config so that the run records, and its ranks read, the new one."""
    target = cfg.get("_target_")
    if isinstance(target, str) and moved(target) != target:
        log.warning("data._target_=%s has moved to %s", target, moved(target))
        cfg._target_ = moved(target)
    for key, renamed in RENAMED_VALUES.get("data", {}).items():
        old = cfg.get(key)
        if isinstance(old, str) and old in renamed:
            log.warning("data.%s=%s is now called data.%s=%s", key, old, key, renamed[old])
            cfg[key] = renamed[old]


def builder_of(cfg: DictConfig) -> Callable[[DictConfig], DataBundle]:
    """The function `data._target_` names."""
    target = cfg.get("_target_")
    if not isinstance(target, str) or not target:
        raise ConfigError(
            "data._target_ is not set; a data YAML names its builder, "
            "e.g. _target_: src.data.image_folder.load_imagefolder"
        )
    hydra_log = logging.getLogger("hydra.utils")  # get_method logs a failure over three lines, then raises it
    was_disabled, hydra_log.disabled = hydra_log.disabled, True
    try:
        return get_method(target)
    except Exception as exc:  # ImportError or ValueError; the last line says what to check
        raise ConfigError(
            f"data._target_={target} cannot be imported as a function ({str(exc).strip().splitlines()[-1]})"
        ) from None
    finally:
        hydra_log.disabled = was_disabled


def check_data_config(cfg: DictConfig) -> None:
    """Every data option against its declaration, and the combinations that cannot run, in the launching process
    before any rank starts (load_data calls it again, for direct callers)."""
    missing = [key for key in cfg if OmegaConf.is_missing(cfg, key)]
    if missing:
        raise ConfigError(f"data.{missing[0]} must be set for data={cfg.get('name')}, e.g. data.{missing[0]}=...")
    _take_renamed_values(cfg)
    builder = builder_of(cfg)
    if not isinstance(cfg.get("name"), str):
        raise ConfigError(f"data.name must be a string (the dataset's label in reports), got {cfg.get('name')!r}")
    specs = (SplitOptions, AugmentOptions, LoaderOptions, DatasetOptions)
    hints = {key: hint for spec in specs for key, hint in declared(spec).items()}
    _check_keys(cfg, builder, list(hints))
    shared = [f.name for spec in specs for f in fields(spec) if f.default is MISSING]
    absent = [key for key in shared if key not in cfg]
    if absent:
        raise ConfigError(
            f"data.{absent[0]} is missing; start the data YAML with `defaults: [/data_common@_here_, _self_]`"
        )
    for key, hint in hints.items():
        if key in cfg:
            check_value(f"data.{key}", cfg[key], hint)
    augment, loader = options_of(cfg, AugmentOptions), options_of(cfg, LoaderOptions)
    check_crop_flip_options(augment.cutout, augment.augment, augment.flip)
    loader.check(augment.trivial)
    if (augment.mixup_alpha or augment.cutmix_alpha) and loader.skip_bad_images:
        raise ConfigError(  # a skipped image would shift the pairs of its micro-batch
            "data.mixup_alpha/cutmix_alpha pair the samples of each micro-batch, which data.skip_bad_images=true "
            "would shift; set data.skip_bad_images=false (and repack or remove the bad images)"
        )


@dataclass
class Split:
    labels: torch.Tensor  # int64 N
    images: torch.Tensor | None = None  # uint8 N x C x H x W when in memory
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
    augment: str  # none | crop_flip | random_resized_crop
    classes: list[str] = field(default_factory=list)

    @property
    def in_memory(self) -> bool:
        return self.train.images is not None

    def train_sample(self, n: int) -> torch.Tensor:
        """n training images spread evenly over the split (its files may be in class order), normalized, float32
        on the CPU and not augmented: what a model fits a layer to (model.fit_to_images)."""
        images = self.train.images
        picked = images[:: max(1, len(images) // n)][:n]
        return normalize(picked, torch.tensor(self.mean), torch.tensor(self.std), normalize_table(self.mean, self.std))


def user_cache() -> Path:
    """Where ddplab keeps what it derived from files it did not write ($XDG_CACHE_HOME/ddplab, ~/.cache/ddplab)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ddplab"


def _cached(name: str, make: Callable[[], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """`make()`'s tensors, kept in user_cache() for the next process: what scikit-learn computes, because importing
    it takes ~0.9 s of each process's start. An unreadable entry is made again; an unwritable cache is skipped."""
    path = user_cache() / f"{name}.pt"
    try:
        return torch.load(path, weights_only=True)
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError):
        pass
    tensors = make()
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(tensors, tmp)
        os.replace(tmp, path)  # whole or not at all, whichever process writes it first
    except OSError:
        tmp.unlink(missing_ok=True)
    return tensors


def _sklearn_version() -> str:
    return importlib.metadata.version("scikit-learn")  # without importing it


def stratified_split(labels: torch.Tensor, fraction: float, key: str = "data.val_fraction", seed: int = SPLIT_SEED):
    """Indices (kept, held out) with `fraction` of every class held out; `key` names the setting in errors."""
    idx = np.arange(len(labels))
    if fraction <= 0:
        return torch.from_numpy(idx), torch.empty(0, dtype=torch.long)
    digest = hashlib.sha1(labels.numpy().tobytes()).hexdigest()[:16]
    name = f"split-{digest}-{fraction}-{seed}-sklearn{_sklearn_version()}"
    split = _cached(name, lambda: _sklearn_split(labels, fraction, key, seed))
    return split["kept"], split["held"]


def _sklearn_split(labels: torch.Tensor, fraction: float, key: str, seed: int) -> dict[str, torch.Tensor]:
    from sklearn.model_selection import train_test_split

    idx = np.arange(len(labels))
    try:
        keep, held = train_test_split(idx, test_size=fraction, random_state=seed, stratify=labels.numpy())
    except ValueError:  # sklearn: a side too small to hold every class once
        n, (classes, counts) = len(labels), labels.unique(return_counts=True)
        if counts.min() < 2:
            raise ConfigError(
                f"{key}={fraction}: class {int(classes[counts.argmin()])} has only 1 sample, too few to hold out "
                f"part of every class; {'set it to 0 or ' if key.endswith('val_fraction') else ''}add samples"
            ) from None
        classes = len(classes)
        # sklearn holds out ceil(fraction * n); both sides need every class once
        ok = [k / 100 for k in range(1, 100) if classes <= math.ceil(k / 100 * n) <= n - classes]
        fits = f"set {key} between {ok[0]} and {ok[-1]}" if ok else f"{n} samples are too few for {key}"
        raise ConfigError(
            f"{key}={fraction} cannot split {n} samples of {classes} classes so that both sides hold every class; "
            f"{fits}{', or 0 for none' if key.endswith('val_fraction') else ''}"
        ) from None
    return {"kept": torch.from_numpy(np.sort(keep)), "held": torch.from_numpy(np.sort(held))}


def _subset(split: Split, idx: torch.Tensor) -> Split:
    if split.images is not None:
        return Split(split.labels[idx], images=split.images[idx])
    if isinstance(split.files, EncodedImages):
        return Split(split.labels[idx], files=split.files.subset(idx))
    return Split(split.labels[idx], files=torch.utils.data.Subset(split.files, idx.tolist()))


def carve_val(train: Split, fraction: float) -> tuple[Split, Split]:
    """(train, val) with `fraction` of every class of `train` moved to val (data.val_fraction)."""
    keep, held = stratified_split(train.labels, fraction)
    return _subset(train, keep), _subset(train, held)


def channel_stats(images: torch.Tensor):
    x = images.double() / 255
    return tuple(x.mean(dim=(0, 2, 3)).tolist()), tuple(x.std(dim=(0, 2, 3)).clamp_min(1e-3).tolist())


def load_digits_data(cfg: DictConfig) -> DataBundle:
    def read() -> dict[str, torch.Tensor]:
        from sklearn.datasets import load_digits

        raw = load_digits()
        images = torch.from_numpy(np.round(raw.images * (255 / 16)).astype(np.uint8)).unsqueeze(1)
        return {"images": images, "labels": torch.from_numpy(raw.target.astype(np.int64))}

    digits = _cached(f"digits-sklearn{_sklearn_version()}", read)
    images, labels = digits["images"], digits["labels"]
    train_idx, test_idx = stratified_split(labels, cfg.get("test_fraction", 0.2), "data.test_fraction")
    full = Split(labels, images=images)
    train, val = carve_val(_subset(full, train_idx), cfg.val_fraction)
    mean, std = channel_stats(train.images)
    return DataBundle(
        cfg.name,
        train,
        val,
        _subset(full, test_idx),
        10,
        1,
        (8, 8),
        mean,
        std,
        cfg.get("augment", "none"),
        [str(i) for i in range(10)],
    )


def _load_cifar(cfg: DictConfig, which: str) -> DataBundle:
    import torchvision

    cls = torchvision.datasets.CIFAR10 if which == "cifar10" else torchvision.datasets.CIFAR100
    root = Path(cfg.root)
    archive = "cifar-10-python.tar.gz" if which == "cifar10" else "cifar-100-python.tar.gz"
    try:
        parts = [cls(str(root), train=flag, download=cfg.download) for flag in (True, False)]
    except Exception as exc:  # torchvision raises RuntimeError / URLError / OSError
        raise ConfigError(
            f"{which} is not in {root} and could not be downloaded ({type(exc).__name__}); "
            f"place {archive} (or its extracted folder) in {root}, or set data.root"
        ) from None

    def to_split(ds) -> Split:
        return Split(
            torch.tensor(ds.targets, dtype=torch.long),
            images=torch.from_numpy(ds.data).permute(0, 3, 1, 2).contiguous(),
        )

    train, val = carve_val(to_split(parts[0]), cfg.val_fraction)
    mean, std = CIFAR_STATS[which]
    return DataBundle(
        cfg.name,
        train,
        val,
        to_split(parts[1]),
        len(parts[0].classes),
        3,
        (32, 32),
        mean,
        std,
        cfg.get("augment", "crop_flip"),
        list(parts[0].classes),
    )


def load_cifar10(cfg: DictConfig) -> DataBundle:
    return _load_cifar(cfg, "cifar10")


def load_cifar100(cfg: DictConfig) -> DataBundle:
    return _load_cifar(cfg, "cifar100")


def load_synthetic(cfg: DictConfig) -> DataBundle:
    g = torch.Generator().manual_seed(SPLIT_SEED)
    if len(cfg.shape) != 3:
        raise ConfigError(f"data.shape must be [channels, height, width], got {list(cfg.shape)}")
    c, h, w = cfg.shape

    def make(n: int) -> Split:
        return Split(
            torch.randint(0, cfg.num_classes, (n,), generator=g),
            images=torch.randint(0, 256, (n, c, h, w), dtype=torch.uint8, generator=g),
        )

    train, val = carve_val(make(cfg.num_samples), cfg.val_fraction)
    return DataBundle(
        cfg.name,
        train,
        val,
        make(cfg.num_test),
        cfg.num_classes,
        c,
        (h, w),
        (0.5,) * c,
        (0.29,) * c,
        cfg.get("augment", "none"),
    )


# --- ImageFolder ---------------------------------------------------------------------------------


def resolve_augment(augment: str, h: int, w: int) -> str:
    """data.augment=auto: crop_flip for small (CIFAR-like) images, random resized crops for larger ones."""
    return augment if augment != "auto" else ("crop_flip" if max(h, w) <= 64 else "random_resized_crop")


def train_val_test(splits: dict[str, Split], val_fraction: float) -> tuple[Split, Split, Split]:
    """train/ with val/ and test/, or a validation share carved from train when one of them is missing."""
    if "val" in splits and "test" in splits:
        return splits["train"], splits["val"], splits["test"]
    train, val = carve_val(splits["train"], val_fraction)
    return train, val, splits.get("test", splits.get("val"))


def disk_bundle(
    cfg: DictConfig, files: dict[str, EncodedImages], classes: list[str], size: tuple[int, int], augment: str
) -> DataBundle:
    """The DataBundle of splits that stay on disk (an ImageFolder too big for memory, packed shards): each batch
    is decoded by the loader, cropped to `size` (random resized crops when training with random_resized_crop,
    else resize + centre crop) and normalized with ImageNet's statistics."""
    splits = {name: Split(f.labels, files=f) for name, f in files.items()}
    train, val, test = train_val_test(splits, cfg.val_fraction)
    mean, std = IMAGENET_STATS
    return DataBundle(
        cfg.name,
        train,
        val,
        test,
        len(classes),
        3,
        tuple(size),
        mean,
        std,
        resolve_augment(augment, *size),
        list(classes),
    )


def load_data(cfg: DictConfig) -> DataBundle:
    """Check the data config, call the builder `data._target_` names, and check what it returned."""
    check_data_config(cfg)
    data = builder_of(cfg)(cfg)
    if not isinstance(data, DataBundle):
        raise ConfigError(f"data._target_={cfg._target_} returned {type(data).__name__}, not a DataBundle")
    if data.in_memory and data.augment not in IN_MEMORY_AUGMENTS:
        raise ConfigError(
            f"data.augment={data.augment} needs images read from disk (data=imagefolder); "
            f"for {cfg.name} use one of {', '.join(IN_MEMORY_AUGMENTS)}"
        )
    check_crop_flip_options(cfg.get("cutout", 0), data.augment, cfg.get("flip", "random"))  # data.augment=auto resolved
    for split in ("train", "test"):
        if not len(getattr(data, split)):
            raise ConfigError(
                f"the {split} split of data={cfg.name} is empty; lower data.val_fraction (or data.test_fraction)"
            )
    return data
