"""Packed shards: an ImageFolder's encoded images in a few large files, read with few large reads.

    python -m src.data.shards pack <imagefolder root> <out dir> [--max-side N] [--shard-size-mb 256]
    python train.py data=shards data.root=<out dir> ...

A folder of a million small files costs an open, a stat and a read per image, per epoch; shards are read
with pread of contiguous byte ranges (neighbouring samples of a batch in one read: evaluation's contiguous
shards read a batch at once). Each rank reads only the samples of its own micro-batches. Layout of <out dir>:
`<split>-00000.shard ...` (the images' bytes back to back), `<split>-index.npz` (shard, offset, length,
label per sample, in ImageFolder order), `<split>-names.txt` (each sample's path in the folder, for error
messages) and `meta.json` (classes, each split's sample count and shard files with their sizes, options).
A pack is written beside <out dir> and renamed to it when complete; loading checks that its parts agree.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import shlex
import shutil
import signal
import sys
from multiprocessing import Pool
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from omegaconf import DictConfig

from src.config.arguments import jpeg_quality, positive, positive_number
from src.config.errors import ConfigError
from src.data.decode import EncodedImages, as_tensor, decode_cpu, unreadable
from src.state.signals import Interrupted, StopRequest, interrupt_outside_training

if TYPE_CHECKING:
    from src.data.datasets import DataBundle

VERSION = 1
SPLITS = ("train", "val", "test")
MERGE_GAP = 256 * 1024  # read through gaps up to this many bytes: one read instead of two


class ShardImages(EncodedImages):
    """One split of a pack; files are opened once per process (DataLoader workers are forked)."""

    def __init__(self, root: Path, split: str, shards: list[str], index: dict[str, np.ndarray]):
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
                    f"{exc.filename}: cannot open this shard ({exc.strerror}); {_again(self.root)}"
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


def _again(root: Path, source=None) -> str:
    """What to do about a damaged pack (pack writes only into a new or empty folder)."""
    src = shlex.quote(source) if isinstance(source, str) else "<imagefolder root>"
    return f"pack the folder again into a new folder: python -m src.data.shards pack {src} <new folder>"


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def read_meta(root: Path) -> dict:
    """meta.json, checked to hold what loading reads (a pack's counts, classes and shard files)."""
    meta = root / "meta.json"
    if not meta.is_file():
        raise ConfigError(
            f"data.root: {root} holds no packed shards (no meta.json); write them with "
            f"python -m src.data.shards pack <imagefolder root> {shlex.quote(str(root))}"
        )
    try:
        info = json.loads(meta.read_text())
    except (OSError, ValueError) as exc:  # unreadable, not UTF-8, not JSON (a truncated write)
        raise ConfigError(f"{meta}: not readable JSON ({type(exc).__name__}); {_again(root)}") from None
    source = info.get("source") if isinstance(info, dict) else None

    def need(ok: bool, what: str) -> None:
        if not ok:
            raise ConfigError(f"{meta}: {what}; {_again(root, source)}")

    need(isinstance(info, dict), "not a JSON object")
    need(info.get("version") == VERSION, f"shard format version {info.get('version')!r}, this code reads {VERSION}")
    classes, splits = info.get("classes"), info.get("splits")
    need(isinstance(classes, list) and classes and all(isinstance(c, str) for c in classes), "no list of classes")
    need(
        isinstance(splits, dict) and "train" in splits and len(splits) > 1 and set(splits) <= set(SPLITS),
        "its splits are not train and val or test",
    )
    for name, split in splits.items():
        need(isinstance(split, dict), f"split {name!r} is not a JSON object")
        shards, sizes = split.get("shards"), split.get("bytes")  # bytes: absent from packs written before it was
        need(
            _is_count(split.get("count"))
            and isinstance(shards, list)
            and all(isinstance(s, str) and re.fullmatch(rf"{name}-\d{{5}}\.shard", s) for s in shards)
            and (sizes is None or isinstance(sizes, list) and len(sizes) == len(shards) and all(map(_is_count, sizes))),
            f"split {name!r} lacks its count, its shard files or their sizes",
        )
    return info


def read_index(root: Path, name: str, split: dict, num_classes: int, source=None) -> dict[str, np.ndarray]:
    """One split's index, checked against meta.json and the shard files: as many rows as meta.json counts,
    labels in [0, num_classes), each sample within its shard file, each shard file present at its recorded size."""
    path = root / f"{name}-index.npz"
    try:
        with np.load(path) as npz:  # allow_pickle=False: an object array is refused, never unpickled
            index = {key: npz[key] for key in ("shard", "offset", "length", "label")}
    except Exception as exc:  # missing, truncated, not an .npz, a key missing, pickled objects
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else "truncated or not written by pack"
        raise ConfigError(f"{path}: cannot read this index ({why}); {_again(root, source)}") from None

    def need(ok: bool, what: str, file: Path = path) -> None:
        if not ok:
            raise ConfigError(f"{file}: {what}; {_again(root, source)}")

    need(all(a.ndim == 1 and a.dtype.kind in "iu" for a in index.values()), "its columns are not integer vectors")
    rows = sorted({len(a) for a in index.values()})
    need(rows == [split["count"]], f"{'/'.join(map(str, rows))} rows, but meta.json counts {split['count']} samples")
    sizes = []
    for k, shard in enumerate(split["shards"]):
        try:
            sizes.append(os.stat(root / shard).st_size)
        except OSError as exc:
            raise ConfigError(
                f"{root / shard}: cannot read this shard ({exc.strerror}); {_again(root, source)}"
            ) from None
        recorded = (split.get("bytes") or sizes)[k]
        need(sizes[k] == recorded, f"{sizes[k]} bytes, but meta.json says {recorded}", root / shard)
    shard, offset, length, label = (index[key].astype(np.int64) for key in ("shard", "offset", "length", "label"))
    need(((label >= 0) & (label < num_classes)).all(), f"labels outside [0, {num_classes}) (meta.json's classes)")
    need(((shard >= 0) & (shard < len(sizes))).all(), f"shard numbers outside [0, {len(sizes)})")
    ends = np.asarray(sizes, dtype=np.int64)[shard] if len(shard) else shard
    need(((offset >= 0) & (length >= 0) & (offset + length <= ends)).all(), "samples beyond the end of their shard")
    need((root / f"{name}-names.txt").is_file(), f"{name}-names.txt is missing")
    return index


def load_shards(cfg: DictConfig) -> DataBundle:
    """data=shards: a pack written by `python -m src.data.shards pack`, read like an on-disk ImageFolder, once its
    meta.json, indexes and shard files agree (read_meta, read_index)."""
    from src.data.datasets import disk_bundle

    root = Path(str(cfg.root))
    info = read_meta(root)
    files = {
        name: ShardImages(
            root, name, split["shards"], read_index(root, name, split, len(info["classes"]), info.get("source"))
        )
        for name, split in info["splits"].items()
    }
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


def _worker_start() -> None:
    """A packing worker leaves Ctrl-C (sent to the whole process group) to its parent, which ends it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def pack_split(
    folder: Path, out: Path, name: str, max_side: int | None, shard_bytes: int, quality: int, workers: int
) -> dict:
    """Write one split's shards, index and names; returns its meta.json entry."""
    from src.data.image_folder import image_folder

    ds = image_folder(folder)
    jobs = [(path, max_side, quality) for path, _ in ds.samples]
    shard, offset, length, shards = [], [], [], []
    current, written = None, 0
    # a stop is acted on between images: raised inside Pool's own code, it can leave Pool.terminate waiting forever
    stop = StopRequest(elastic=False)
    try:
        with Pool(workers, _worker_start) if max_side and workers > 1 else _Serial() as pool:
            for data in pool.imap(_payload, jobs, chunksize=64):
                if stop.signum is not None:
                    break
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
    finally:
        stop.restore()
        if current is not None:
            current.close()
    if stop.signum is not None:
        raise Interrupted(stop.signum)
    np.savez(
        out / f"{name}-index.npz",
        shard=np.array(shard, dtype=np.int32),
        offset=np.array(offset, dtype=np.int64),
        length=np.array(length, dtype=np.int64),
        label=np.array(ds.targets, dtype=np.int64),
    )
    (out / f"{name}-names.txt").write_text("".join(os.path.relpath(p, folder.parent) + "\n" for p, _ in ds.samples))
    sizes = [(out / shard).stat().st_size for shard in shards]
    return {"count": len(ds.samples), "shards": shards, "bytes": sizes, "classes": ds.classes}


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
    from src.data.image_folder import check_folder

    check_folder(root)
    splits = [name for name in SPLITS if (root / name).is_dir()]
    if "train" not in splits or len(splits) < 2:
        raise ConfigError(f"{root}: expected train/ and val/ or test/ class folders (ImageFolder layout)")
    if out.resolve() == root.resolve() or root.resolve() in out.resolve().parents:
        raise ConfigError(f"{out} is inside the image folder {root}; pack into a folder outside it")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out} is not empty; pack into a new folder (or remove this one)")
    # written beside out and renamed at the end: a failed or stopped pack leaves no half-made out
    target = out.resolve()
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.parent / f".{target.name}.partial-{os.getpid()}"
    _remove_stale(partial)
    partial.mkdir()
    shard_bytes, workers = int(shard_size_mb * 2**20), workers or os.cpu_count() or 1
    try:
        entries = {
            name: pack_split(root / name, partial, name, max_side, shard_bytes, quality, workers) for name in splits
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
        (partial / "meta.json").write_text(json.dumps(meta, indent=1))
        os.replace(partial, target)  # onto an empty folder too
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return meta


def _remove_stale(partial: Path) -> None:
    """Leftovers of packs into the same folder that were killed outright (SIGKILL): their process is gone."""
    prefix = partial.name.rsplit("-", 1)[0] + "-"
    for stale in partial.parent.iterdir():
        pid = stale.name[len(prefix) :] if stale.name.startswith(prefix) else ""
        try:
            if pid.isdigit():
                os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(stale, ignore_errors=True)
        except OSError:  # another user's live process
            pass


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m src.data.shards", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pack", help="pack an ImageFolder (train/ and val/ or test/) into shards")
    p.add_argument("root", type=Path, help="ImageFolder root with train/ and val/ or test/")
    p.add_argument("out", type=Path, help="new folder for the shards (data.root of data=shards)")
    p.add_argument(
        "--max-side", type=positive, help="re-encode images whose shorter side is larger to this many pixels"
    )
    p.add_argument(
        "--shard-size-mb", type=positive_number, default=256, help="bytes per shard file, in MiB (default 256)"
    )
    p.add_argument(
        "--quality", type=jpeg_quality, default=90, help="JPEG quality of re-encoded images, 1-100 (default 90)"
    )
    p.add_argument("--workers", type=positive, help="processes re-encoding images (default: every core)")
    args = parser.parse_args(argv)
    try:
        with interrupt_outside_training((signal.SIGINT, signal.SIGTERM)):
            meta = pack(args.root, args.out, args.max_side, args.shard_size_mb, args.quality, args.workers)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except Interrupted as exc:
        print(f"stopped by {signal.Signals(exc.signum).name}: nothing was written to {args.out}", file=sys.stderr)
        return 128 + exc.signum
    counts = ", ".join(f"{name} {s['count']} images in {len(s['shards'])} shards" for name, s in meta["splits"].items())
    print(f"packed {args.root} into {args.out}: {counts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
