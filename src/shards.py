"""Packed shards: an ImageFolder's encoded images in a few large files, read with few large reads.

    python -m src.shards pack <imagefolder root> <out dir> [--max-side N] [--shard-size-mb 256]
    python train.py data=shards data.root=<out dir> ...

A folder of a million small files costs an open, a stat and a read per image, per epoch; shards are read
with pread of contiguous byte ranges (neighbouring samples of a batch in one read: evaluation's contiguous
shards read a batch at once). Each rank reads only the samples of its own micro-batches. Layout of <out dir>:
`<split>-00000.shard ...` (the images' bytes back to back), `<split>-index.npz` (shard, offset, length,
label per sample, in ImageFolder order), `<split>-names.txt` (each sample's path in the folder, for error
messages) and `meta.json` (classes, splits, options; written last, so its presence means a complete pack).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shlex
import sys
from multiprocessing import Pool
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from omegaconf import DictConfig

from src.config import ConfigError
from src.decode import EncodedImages, as_tensor, decode_cpu, unreadable

if TYPE_CHECKING:
    from src.datasets import DataBundle

VERSION = 1
SPLITS = ("train", "val", "test")
MERGE_GAP = 256 * 1024  # read through gaps up to this many bytes: one read instead of two


class ShardImages(EncodedImages):
    """One split of a pack; files are opened once per process (DataLoader workers are forked)."""

    def __init__(self, root: Path, split: str, shards: list[str]):
        index = np.load(root / f"{split}-index.npz")
        super().__init__(torch.from_numpy(index["label"].astype(np.int64)))
        self.root, self.split, self.shards = root, split, shards
        self.shard, self.offset, self.length = index["shard"], index["offset"], index["length"]
        self._files: tuple[int, list[int]] | None = None  # (pid, file descriptors)
        self._names: list[str] | None = None

    def __getstate__(self):  # a pickled copy (spawned worker) opens its own files
        return {**self.__dict__, "_files": None}

    def _fds(self) -> list[int]:
        if self._files is None or self._files[0] != os.getpid():
            try:
                self._files = (os.getpid(), [os.open(self.root / name, os.O_RDONLY) for name in self.shards])
            except OSError as exc:
                raise ConfigError(
                    f"{self.root}: cannot open shard {exc.filename} ({exc.strerror}); "
                    f"pack the folder again (python -m src.shards pack)"
                ) from None
        return self._files[1]

    def _name(self, row: int) -> str:
        if self._names is None:
            self._names = (self.root / f"{self.split}-names.txt").read_text().splitlines()
        return f"{self.root}/{self.shards[self.shard[row]]}@{self.offset[row]} ({self._names[row]})"

    def _read(self, rows: np.ndarray) -> list:
        """Each run of samples that lie close together in one shard is one pread into one buffer."""
        shard, start, end = self.shard[rows], self.offset[rows], self.offset[rows] + self.length[rows]
        order = np.lexsort((start, shard))
        out: list = [None] * len(rows)
        fds, first = self._fds(), 0
        while first < len(order):
            last, stop = first, end[order[first]]
            while (
                last + 1 < len(order)
                and shard[order[last + 1]] == shard[order[first]]
                and start[order[last + 1]] - stop <= MERGE_GAP
            ):
                last += 1
                stop = max(stop, end[order[last]])
            run = order[first : last + 1]
            base = start[order[first]]
            buffer = bytearray(int(stop - base))
            got = os.preadv(fds[shard[order[first]]], [buffer], int(base))
            for k in run.tolist():
                if got < end[k] - base:
                    out[k] = ConfigError(
                        f"{self._name(int(rows[k]))}: the shard ends early (truncated?); pack the folder again"
                    )
                else:
                    out[k] = memoryview(buffer)[start[k] - base : end[k] - base]
            first = last + 1
        return out


def load_shards(cfg: DictConfig) -> DataBundle:
    """data=shards: a pack written by `python -m src.shards pack`, read like an on-disk ImageFolder."""
    from src.datasets import disk_bundle

    root = Path(str(cfg.root))
    meta = root / "meta.json"
    if not meta.is_file():
        raise ConfigError(
            f"data.root: {root} holds no packed shards (no meta.json); write them with "
            f"python -m src.shards pack <imagefolder root> {shlex.quote(str(root))}"
        )
    info = json.loads(meta.read_text())
    if info.get("version") != VERSION:
        raise ConfigError(
            f"{meta}: shard format version {info.get('version')}, this code reads {VERSION}; pack the folder again"
        )
    files = {name: ShardImages(root, name, split["shards"]) for name, split in info["splits"].items()}
    size = cfg.image_size
    if size:
        h, w = size, size
    else:  # the first training image's size, as for an ImageFolder
        _, h, w = files["train"][0][0].shape
    return disk_bundle(cfg, files, info["classes"], (h, w), cfg.augment)


# --- packing ----------------------------------------------------------------------------------------


def _payload(job: tuple[str, int | None, int]) -> bytes:
    """The bytes to store for one file: as they are, or, decoded as every path decodes it (decode_cpu),
    re-encoded as JPEG with the shorter side at most max_side pixels."""
    from PIL import Image

    path, max_side, quality = job
    try:
        data = Path(path).read_bytes()
        if not max_side:
            return data
        with Image.open(io.BytesIO(data)) as img:  # the header: its size
            width, height = img.size
    except Exception as exc:  # OSError, PIL's UnidentifiedImageError, ValueError...
        raise unreadable(path, exc) from None
    if min(width, height) <= max_side:
        return data
    scale = max_side / min(width, height)
    size = (max(1, round(width * scale)), max(1, round(height * scale)))
    rgb = decode_cpu(as_tensor(data), path).permute(1, 2, 0).numpy()
    out = io.BytesIO()
    Image.fromarray(rgb).resize(size, Image.Resampling.BICUBIC).save(out, "JPEG", quality=quality)
    return out.getvalue()


def pack_split(
    folder: Path, out: Path, name: str, max_side: int | None, shard_bytes: int, quality: int, workers: int
) -> dict:
    """Write one split's shards, index and names; returns its meta.json entry."""
    from src.datasets import _image_folder

    ds = _image_folder(folder)
    jobs = [(path, max_side, quality) for path, _ in ds.samples]
    shard, offset, length, shards = [], [], [], []
    current, written = None, 0
    with Pool(workers) if max_side and workers > 1 else _Serial() as pool:
        for data in pool.imap(_payload, jobs, chunksize=64):
            if current is None or (written and written + len(data) > shard_bytes):
                if current is not None:
                    current.close()
                shards.append(f"{name}-{len(shards):05d}.shard")
                current, written = open(out / shards[-1], "wb"), 0
            shard.append(len(shards) - 1)
            offset.append(written)
            length.append(len(data))
            current.write(data)
            written += len(data)
    if current is not None:
        current.close()
    np.savez(
        out / f"{name}-index.npz",
        shard=np.array(shard, dtype=np.int32),
        offset=np.array(offset, dtype=np.int64),
        length=np.array(length, dtype=np.int64),
        label=np.array(ds.targets, dtype=np.int64),
    )
    (out / f"{name}-names.txt").write_text("".join(os.path.relpath(p, folder.parent) + "\n" for p, _ in ds.samples))
    return {"count": len(ds.samples), "shards": shards, "classes": ds.classes}


class _Serial:
    """Pool's imap in this process (no re-encoding: reading the files is all there is to do)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def imap(self, fn, jobs, chunksize=1):
        return map(fn, jobs)


def pack(
    root: Path,
    out: Path,
    max_side: int | None = None,
    shard_size_mb: float = 256,
    quality: int = 90,
    workers: int | None = None,
) -> dict:
    from src.datasets import _check_folder

    _check_folder(root)
    splits = [name for name in SPLITS if (root / name).is_dir()]
    if "train" not in splits or len(splits) < 2:
        raise ConfigError(f"{root}: expected train/ and val/ or test/ class folders (ImageFolder layout)")
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"{out} is not empty; pack into a new folder (or remove this one)")
    out.mkdir(parents=True, exist_ok=True)
    entries = {
        name: pack_split(
            root / name, out, name, max_side, int(shard_size_mb * 2**20), quality, workers or os.cpu_count() or 1
        )
        for name in splits
    }
    classes = entries["train"].pop("classes")
    for name, entry in entries.items():
        if entry.pop("classes", classes) != classes:
            raise ConfigError(f"{root}/{name} has other class folders than train/; every split needs the same")
    meta = {
        "version": VERSION,
        "source": str(root.resolve()),
        "classes": classes,
        "max_side": max_side,
        "splits": entries,
    }
    (out / "meta.json.tmp").write_text(json.dumps(meta, indent=1))
    os.replace(out / "meta.json.tmp", out / "meta.json")
    return meta


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m src.shards", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pack", help="pack an ImageFolder (train/ and val/ or test/) into shards")
    p.add_argument("root", type=Path, help="ImageFolder root with train/ and val/ or test/")
    p.add_argument("out", type=Path, help="new folder for the shards (data.root of data=shards)")
    p.add_argument("--max-side", type=int, help="re-encode images whose shorter side is larger to this many pixels")
    p.add_argument("--shard-size-mb", type=float, default=256, help="bytes per shard file, in MiB (default 256)")
    p.add_argument("--quality", type=int, default=90, help="JPEG quality of re-encoded images (default 90)")
    p.add_argument("--workers", type=int, help="processes re-encoding images (default: every core)")
    args = parser.parse_args(argv)
    try:
        if args.max_side is not None and args.max_side < 1 or args.shard_size_mb <= 0:
            raise ConfigError("--max-side and --shard-size-mb must be positive")
        meta = pack(args.root, args.out, args.max_side, args.shard_size_mb, args.quality, args.workers)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    counts = ", ".join(f"{name} {s['count']} images in {len(s['shards'])} shards" for name, s in meta["splits"].items())
    print(f"packed {args.root} into {args.out}: {counts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
