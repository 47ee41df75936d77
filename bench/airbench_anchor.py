#!/usr/bin/env python
"""airbench96 on the CIFAR-10 JPEGs: the time-to-accuracy anchor of `experiment=cifar10_*` (issue 34, item 4).

    python bench/airbench_anchor.py --data data/cifar10-jpeg --seeds 2,4,42 --out airbench96.json
    python bench/airbench_anchor.py --data data/cifar10-jpeg --epochs 40,60,80 --out longer.json  # its plateau

airbench (Keller Jordan's CIFAR-10 speedruns, `pip install airbench==0.1.8`) reads CIFAR-10 as two tensor files,
`cifar10/train.pt` and `cifar10/test.pt` under its working directory. This script writes them once from the same
JPEG ImageFolder ddplab trains on (decoded by PIL, labels in ImageFolder order), runs airbench's warm-up, then
`train96` once per seed and training length (`--epochs`; airbench96's own is 40), and reports the test-time-augmented
accuracy and time that airbench itself prints (CUDA events around the whitening layer's initialisation, the training
steps and the final evaluation), with the wall time of each run beside them.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SPLITS = {"train": ("train",), "test": ("test", "val")}


def fingerprint(folder: Path) -> str:
    """A hash of the folder's files (path, size, modification time): another folder, or this one changed, gets
    tensors of its own instead of the last one's."""
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        stat = path.stat()
        digest.update(f"{path.relative_to(folder)}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


def export_tensors(folder: Path, out: Path) -> Path:
    """`out/<the folder's fingerprint>/cifar10/{train,test}.pt` from an ImageFolder of 32×32 images (train/, test/
    or val/), written once per folder content: uint8 images N×32×32×3, int64 labels, class names, as airbench's
    CifarLoader reads them. Returns that cifar10/ folder."""
    import torch
    from PIL import Image

    target = out / fingerprint(folder) / "cifar10"
    if all((target / f"{split}.pt").exists() for split in SPLITS):
        return target
    target.mkdir(parents=True, exist_ok=True)
    for split, names in SPLITS.items():
        root = next((folder / n for n in names if (folder / n).is_dir()), None)
        if root is None:
            raise SystemExit(f"airbench_anchor.py: {folder} has no {' or '.join(names)}/ folder")
        classes = sorted(d.name for d in root.iterdir() if d.is_dir())
        images, labels = [], []
        for label, name in enumerate(classes):
            for path in sorted((root / name).iterdir()):
                with Image.open(path) as img:
                    pixels = np.asarray(img.convert("RGB"))
                if pixels.shape != (32, 32, 3):
                    raise SystemExit(
                        f"airbench_anchor.py: {path} is {pixels.shape[1]}×{pixels.shape[0]} px; airbench "
                        "trains on 32×32 CIFAR images"
                    )
                images.append(pixels)
                labels.append(label)
        data = {"images": torch.from_numpy(np.stack(images)), "labels": torch.tensor(labels), "classes": classes}
        partial = target / f".{split}.pt.partial"
        torch.save(data, partial)
        partial.rename(target / f"{split}.pt")  # a killed export leaves no file airbench would read
    return target


def final_row(printed: str) -> tuple[float, float]:
    """(TTA test accuracy, seconds) from the last row airbench prints (epoch `eval`: tta_val_acc and
    total_time_seconds). Its time counts the whitening layer's initialisation, the training steps and the final
    evaluation, not the per-epoch evaluations nor loading the tensors."""
    for line in reversed(printed.splitlines()):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 7 and cells[1] == "eval":
            return float(cells[5]), float(cells[6])
    raise SystemExit(f"airbench_anchor.py: airbench printed no final row; it printed:\n{printed[-2000:]}")


def refused(folder: Path) -> str | None:
    import importlib.util

    import torch

    if importlib.util.find_spec("airbench") is None:
        return "needs airbench, which ddplab does not install: pip install airbench==0.1.8"
    if not folder.is_dir():
        return f"--data: {folder} is not a folder (the CIFAR-10 JPEGs: unzip cifar10-jpeg.zip)"
    return None if torch.cuda.is_available() else "needs a CUDA GPU (airbench trains on cuda:0)"


def seeds(text: str) -> list[int]:
    """An argparse type: comma-separated whole numbers (a ValueError becomes argparse's one-line usage error)."""
    return [int(s) for s in text.split(",")]


def epochs(text: str) -> list[float]:
    """An argparse type: comma-separated positive epoch counts (airbench takes fractions)."""
    counts = [float(s) for s in text.split(",")]
    if not all(0 < c < 1000 for c in counts):
        raise ValueError(text)
    return counts


def by_epochs(runs: list[dict]) -> list[dict]:
    """Per training length: the mean and sample std of the test top-1 over its seeds, and the mean time."""
    summaries = []
    for length in dict.fromkeys(r["epochs"] for r in runs):
        mine = [r for r in runs if r["epochs"] == length]
        top1 = [r["test_top1"] for r in mine]
        summaries.append(
            {
                "epochs": length,
                "test_top1_mean": statistics.mean(top1),
                "test_top1_std": statistics.stdev(top1) if len(top1) > 1 else 0.0,
                "seconds_mean": statistics.mean(r["seconds"] for r in mine),
            }
        )
    return summaries


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="the CIFAR-10 JPEG ImageFolder (train/, test/)")
    p.add_argument("--seeds", type=seeds, default="2,4,42", help="comma-separated seeds, one airbench96 run each")
    p.add_argument("--epochs", type=epochs, default="40", help="comma-separated training lengths (default: 40)")
    p.add_argument("--work", default="outputs/bench/airbench", help="where cifar10/{train,test}.pt are written")
    p.add_argument("--out", required=True, help="JSON file")
    args = p.parse_args()
    data, out = Path(args.data).resolve(), Path(args.out).resolve()  # before the chdir below
    refusal = refused(data)
    if refusal:
        sys.exit(f"airbench_anchor.py: {refusal}")
    import airbench
    import torch
    from airbench import lib_airbench96

    from src.reporting.efficiency import host

    work = Path(args.work).resolve()
    os.chdir(export_tensors(data, work).parent)  # airbench opens cifar10/ relative to the working directory
    with contextlib.redirect_stdout(io.StringIO()):
        airbench.warmup96()  # one step: compilation and cuDNN autotuning, untimed
    runs: list[dict] = []
    for length in args.epochs:
        for k, seed in enumerate(args.seeds):
            torch.manual_seed(seed)
            printed = io.StringIO()
            t0 = time.perf_counter()
            with contextlib.redirect_stdout(printed):
                lib_airbench96.train96(epochs=length, run=k + 1)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
            top1, seconds = final_row(printed.getvalue())
            runs.append(
                {"epochs": length, "seed": seed, "test_top1": 100 * top1, "seconds": seconds, "wall_seconds": wall}
            )
            print(f"airbench96 {length:g} epochs, seed {seed}: {100 * top1:.2f} % in {seconds:.2f} s", flush=True)
            report = {
                "runs": runs,
                "by_epochs": by_epochs(runs),
                "data": str(data),
                **host(torch.device("cuda", 0)),
                "airbench_version": getattr(airbench, "__version__", "0.1.8"),
            }
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(report, indent=2))  # after every run: a run cut short keeps the ones before
    return 0


if __name__ == "__main__":
    sys.exit(main())
