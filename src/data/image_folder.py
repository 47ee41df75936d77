"""`data=imagefolder`: a folder of train/ and val/ or test/, each with one folder of images per class. Images that fit
`data.max_memory_gb` are decoded once into a uint8 array cached next to the folder; larger ones stay on disk as
files decoded per batch (src/data/decode.py), with a one-line hint to pack them smaller where they are large."""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig

from src.config.commands import module_command, train_command
from src.config.errors import ConfigError
from src.data.datasets import DataBundle, Split, channel_stats, disk_bundle, resolve_augment, train_val_test
from src.data.decode import FileImages, decode_file, unreadable

log = logging.getLogger(__name__)

CACHE_VERSION = 3  # hashed into every decode-cache key: bump it when decoding changes


def check_folder(path: Path) -> None:
    if not path.is_dir():
        raise ConfigError(f"data.root: {path} does not exist; set data.root to a folder with train/ and val/ or test/")
    if not any(p.is_dir() for p in path.iterdir()):
        raise ConfigError(f"{path} has no class folders; expected {path}/<class>/<image> (ImageFolder layout)")


def image_folder(folder: Path, transform=None):
    import torchvision

    ds = torchvision.datasets.ImageFolder(str(folder), transform=transform, loader=decode_file, allow_empty=True)
    empty = sorted(set(ds.classes) - {ds.classes[t] for t in ds.targets})
    if empty:  # torchvision's own error is a FileNotFoundError traceback
        raise ConfigError(
            f"{folder}: class folder(s) {', '.join(empty[:5])} hold no images (.jpg, .png, ...); "
            f"add images or remove the folder(s)"
        )
    return ds


def _decode_folder(ds, size: int | None) -> torch.Tensor:
    from PIL import Image

    images = []
    for path, _ in ds.samples:
        img = decode_file(path).permute(1, 2, 0).numpy()  # the decoding of every other path (src/data/decode.py)
        if size is not None and img.shape[:2] != (size, size):
            img = np.asarray(Image.fromarray(img).resize((size, size), Image.BILINEAR))
        images.append(img)
    shapes = {a.shape for a in images}
    if len(shapes) > 1:
        raise ConfigError(f"{ds.root}: images differ in size {sorted(shapes)[:3]}...; set data.image_size")
    return torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).contiguous()


def _cache_key(folder: Path, samples: list, size: int | None) -> str:
    """A hash of everything the decoded array depends on: each file's path, label, size, mtime and inode."""
    h = hashlib.sha256(f"v{CACHE_VERSION} size={size}\n".encode())
    for path, label in samples:
        try:
            st = os.stat(path)
        except OSError as exc:  # e.g. a broken symlink
            raise unreadable(path, exc) from None
        # the inode too: renaming folders (two classes swapped) keeps every file's name, size and mtime
        h.update(f"{os.path.relpath(path, folder)}\0{label}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}\n".encode())
    return h.hexdigest()[:24]


def _read_cache(cache: Path, count: int) -> torch.Tensor | None:
    """The cached images, or None (with a warning) when the file is truncated, corrupt or not ours."""
    try:
        images = torch.load(cache, weights_only=True)["images"]
        if (
            isinstance(images, torch.Tensor)
            and images.dtype == torch.uint8
            and images.dim() == 4
            and len(images) == count
        ):
            return images
        why = "unexpected contents"
    except Exception as exc:  # torch raises RuntimeError, EOFError, UnpicklingError... for a damaged file
        why = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    log.warning("decode cache %s is unreadable (%s); decoding the images again", cache, why)
    return None


def _cached_decode(folder: Path, ds, size: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode once; keep the uint8 array next to the data, named by a hash of the files it came from,
    so any change to them (added, removed, edited, relabelled) decodes again."""
    stem = f"{folder.name}-{size or 'native'}"
    cache = folder.parent / ".ddplab-cache" / f"{stem}-{_cache_key(folder, ds.samples, size)}.pt"
    labels = torch.tensor(ds.targets, dtype=torch.long)  # always from the folders, never from the cache
    images = _read_cache(cache, len(labels)) if cache.exists() else None
    if images is not None:
        return images, labels
    log.info("decoding %d images of %s (cached in %s)", len(labels), folder, cache.parent)
    images = _decode_folder(ds, size)
    try:
        cache.parent.mkdir(exist_ok=True)
        tmp = cache.with_suffix(f".tmp{os.getpid()}")
        torch.save({"images": images, "labels": labels}, tmp)
        os.replace(tmp, cache)
        for stale in cache.parent.glob(f"{stem}-*.pt"):  # earlier versions of this split: never read again
            if stale != cache:
                stale.unlink(missing_ok=True)
    except OSError as exc:
        log.warning("could not cache decoded images at %s (%s)", cache, exc)
    return images, labels


def check_imagefolder(root: Path) -> list[Path]:
    """An ImageFolder root's layout checked, no image read: train/ and val/ or test/, each with class folders.
    Returns its evaluation folders."""
    check_folder(root)
    check_folder(root / "train")
    evals = [root / name for name in ("val", "test") if (root / name).is_dir()]
    if not evals:
        raise ConfigError(f"{root} has train/ but neither val/ nor test/; add one of them")
    for folder in evals:
        check_folder(folder)
    return evals


def load_imagefolder(cfg: DictConfig) -> DataBundle:
    root = Path(str(cfg.root))
    evals = check_imagefolder(root)
    base = {f.name: image_folder(f) for f in [root / "train", *evals]}
    classes = base["train"].classes
    for name, ds in base.items():
        if ds.classes != classes:
            raise ConfigError(
                f"{root}/{name} has classes {ds.classes[:5]}... but train/ has {classes[:5]}...; "
                f"every split needs the same class folders"
            )
    size = cfg.image_size
    h, w = (size, size) if size else decode_file(base["train"].samples[0][0]).shape[1:]
    augment = resolve_augment(cfg.augment, h, w)
    n_total = sum(len(ds) for ds in base.values())
    if n_total * 3 * h * w > cfg.max_memory_gb * 2**30 or augment == "random_resized_crop":
        files = {
            name: FileImages([path for path, _ in ds.samples], torch.tensor(ds.targets, dtype=torch.long))
            for name, ds in base.items()
        }
        _suggest_packing(root, [path for path, _ in base["train"].samples], max(h, w))
        return disk_bundle(cfg, files, classes, (h, w), augment)
    splits = {}
    for name, ds in base.items():
        images, labels = _cached_decode(root / name, ds, size)
        splits[name] = Split(labels, images=images)
    train, val, test = train_val_test(splits, cfg.val_fraction)
    mean, std = channel_stats(train.images[:: max(1, len(train) // 5000)])
    return DataBundle(cfg.name, train, val, test, len(classes), 3, (h, w), mean, std, augment, classes)


PACK_SIDE = 256  # the shorter side `shards pack --max-side` re-encodes to for crops up to 224 px


def _suggest_packing(root: Path, train: list[str], crop: int, sample: int = 16) -> None:
    """Images read from disk are decoded every epoch, at a cost that grows with their pixels: where a folder's
    images are much larger than the crops need, one line says how to pack them smaller (a core decodes 256-px
    JPEGs ~2.8x faster than ~375-px ones)."""
    from PIL import Image

    if crop > 224 or not train:
        return
    sides = []
    for path in train[:: max(1, len(train) // sample)][:sample]:
        try:
            with Image.open(path) as img:  # the header only
                sides.append(min(img.size))
        except Exception:  # an unreadable file is the loader's to report
            continue
    side = sorted(sides)[len(sides) // 2] if sides else 0  # the median
    if side <= 1.25 * PACK_SIDE:
        return
    packed = Path(f"{root}-shards{PACK_SIDE}")
    log.info(
        "%s holds images of ~%d px on the shorter side, decoded every epoch; packed to %d px they decode ~2.8x "
        "faster: %s, then %s",
        root,
        side,
        PACK_SIDE,
        module_command("src.data.shards", "pack", root, packed, "--max-side", PACK_SIDE),
        train_command(("data", "shards"), ("data.root", packed)),
    )
