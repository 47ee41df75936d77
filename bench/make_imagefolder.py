#!/usr/bin/env python
"""An ImageNet-like ImageFolder made from the CIFAR-10 JPEGs, to benchmark loading (bench/README.md).

    python bench/make_imagefolder.py --zip ../shared/datasets/cifar10-jpeg.zip --out data/imagenet-like \\
        --train 50000 --test 10000

Each image is a CIFAR-10 image with its real label, upscaled to an ImageNet-like size (long side 440-520 px,
aspect 0.66-0.8, a quarter of them portrait) with pixel noise added, so that as a quality-95 JPEG (4:2:0, the
common ImageNet mode) it weighs about 100 KiB, like an average ImageNet file: decoding costs what ImageNet's
does. Image k of a split is CIFAR image k modulo the split's size, so --train may exceed 50,000. Every core
works at once (multiprocessing); `<out>/.complete.json` marks a finished folder, and a second call with the
same arguments returns at once.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import time
import zipfile
from multiprocessing import Pool
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from src.config.arguments import jpeg_quality, positive  # noqa: E402  (argparse types)

SPLITS = ("train", "test")
_zip: zipfile.ZipFile | None = None  # one open archive per worker process


def _open(path: str) -> None:
    global _zip
    _zip = zipfile.ZipFile(path)


def make_one(job: tuple) -> int:
    """Write one image; returns its size in bytes."""
    from PIL import Image

    member, out, split_index, k, seed, quality = job
    rng = np.random.default_rng([seed, split_index, k])
    long_side = int(rng.integers(440, 521))
    short_side = round(long_side * rng.uniform(0.66, 0.8))
    w, h = (long_side, short_side) if rng.random() < 0.75 else (short_side, long_side)
    with Image.open(io.BytesIO(_zip.read(member))) as img:
        pixels = np.asarray(img.convert("RGB").resize((w, h), Image.Resampling.BICUBIC), dtype=np.int16)
    # luma-like noise shared by the channels plus a weaker per-channel one: texture JPEG cannot smooth away
    noisy = pixels + rng.integers(-22, 23, (h, w, 1), dtype=np.int16) + rng.integers(-12, 13, (h, w, 3), dtype=np.int16)
    buffer = io.BytesIO()
    Image.fromarray(noisy.clip(0, 255).astype(np.uint8)).save(buffer, "JPEG", quality=quality)
    Path(out).write_bytes(buffer.getvalue())
    return buffer.tell()


def members(archive: str) -> dict[str, list[tuple[str, str]]]:
    """(member name, class) of the JPEGs of each split (<anything>/<split>/<class>/<file>.jpg), classes in turn."""
    found: dict[str, list[tuple[str, str]]] = {s: [] for s in SPLITS}
    with zipfile.ZipFile(archive) as z:
        for name in z.namelist():
            parts = name.split("/")
            if name.lower().endswith((".jpg", ".jpeg")) and len(parts) >= 3 and parts[-3] in found:
                found[parts[-3]].append((name, parts[-2]))
    for split, items in found.items():
        if not items:
            raise SystemExit(f"error: {archive} has no <split>/<class>/*.jpg images for split {split}")
        by_class: dict[str, list] = {}
        for item in sorted(items):
            by_class.setdefault(item[1], []).append(item)
        # class by class in turn, so that the first N images (N below the split's size) hold every class
        found[split] = [item for group in zip(*by_class.values()) for item in group]
    return found


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--zip", required=True, help="the CIFAR-10 JPEG archive (cifar10-jpeg.zip: train/ and test/)")
    p.add_argument("--out", required=True, type=Path, help="the ImageFolder to write (train/, test/)")
    p.add_argument("--train", type=positive, default=50000, help="training images (default 50000)")
    p.add_argument("--test", type=positive, default=10000, help="test images (default 10000)")
    p.add_argument("--quality", type=jpeg_quality, default=95, help="JPEG quality (default 95: ~100 KiB per image)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sizes and the noise (default 0)")
    p.add_argument("--workers", type=positive, default=os.cpu_count(), help="processes (default: every core)")
    args = p.parse_args(argv)
    settings = {
        "zip": Path(args.zip).name,
        "train": args.train,
        "test": args.test,
        "quality": args.quality,
        "seed": args.seed,
        "version": 1,
    }
    marker = args.out / ".complete.json"
    if marker.exists() and json.loads(marker.read_text()).get("settings") == settings:
        print(f"{args.out} is complete already ({marker})")
        return 0
    marker.unlink(missing_ok=True)
    sources = members(args.zip)
    jobs = []
    for index, split in enumerate(SPLITS):
        source = sources[split]
        for k in range(getattr(args, split)):
            member, cls = source[k % len(source)]
            (args.out / split / cls).mkdir(parents=True, exist_ok=True)
            jobs.append((member, str(args.out / split / cls / f"{k:06d}.jpg"), index, k, args.seed, args.quality))
    start = time.perf_counter()
    with Pool(args.workers, initializer=_open, initargs=(args.zip,)) as pool:
        sizes = list(pool.imap_unordered(make_one, jobs, chunksize=64))
    seconds = time.perf_counter() - start
    summary = {
        "settings": settings,
        "images": len(sizes),
        "mean_kib": round(sum(sizes) / len(sizes) / 1024, 1),
        "total_gib": round(sum(sizes) / 2**30, 2),
        "seconds": round(seconds, 1),
        "workers": args.workers,
    }
    marker.write_text(json.dumps(summary, indent=1))
    print(
        f"wrote {args.out}: {summary['images']} images, {summary['mean_kib']} KiB each on average, "
        f"{summary['total_gib']} GiB, in {seconds:.0f} s with {args.workers} processes"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
