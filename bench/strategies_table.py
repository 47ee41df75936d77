"""Train ResNet-18 on the CIFAR-10 JPEGs with each strategy and tabulate throughput, epoch time and accuracy.

    python bench/strategies_table.py [--epochs 3] [--out outputs/bench/strategies.md] [extra overrides...]
Each strategy runs `python train.py experiment=cifar10_jpeg strategy=<s> ...` in its own process.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
STRATEGIES = {"single": [], "dp": [], "ddp": ["trainer.devices=2"], "fsdp": ["trainer.devices=2"]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=3)
    # git-ignored by default: a table worth keeping is copied into bench/results/ with its report
    p.add_argument("--out", default=str(ROOT / "outputs/bench/strategies.md"))
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    args, extra = p.parse_known_args()
    rows, base = [], Path(tempfile.mkdtemp(prefix="strategies-"))
    for name in args.strategies.split(","):
        overrides = [
            "experiment=cifar10_jpeg",
            f"strategy={name}",
            "seed=2",
            f"trainer.max_epochs={args.epochs}",
            "trainer.progress_bar=false",
            f"hydra.run.dir={base / name}",
            *STRATEGIES[name],
            *extra,
        ]
        start = time.time()
        proc = subprocess.run(
            [sys.executable, str(ROOT / "train.py"), *overrides], cwd=ROOT, text=True, capture_output=True
        )
        print(proc.stdout[-1500:], proc.stderr[-1500:] if proc.returncode else "", flush=True)
        if proc.returncode:
            rows.append((name, overrides, None, time.time() - start))
            continue
        rows.append((name, overrides, json.loads((base / name / "metrics.json").read_text()), time.time() - start))
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    lines = [
        f"# Strategies on {torch.cuda.device_count()} x {gpu}, torch {torch.__version__}",
        "",
        f"`python bench/strategies_table.py --epochs {args.epochs} {' '.join(extra)}`",
        "",
        "| strategy | GPUs | global batch | images/s | s/epoch | data wait | test top-1 | test loss | wall s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, _, m, wall in rows:
        if m is None:
            lines.append(f"| {name} | failed | | | | | | | {wall:.0f} |")
            continue
        f, h = m["final"], m["hparams"]
        lines.append(
            f"| {name} | {h['world_size']} | {h['global_batch']} | {f['images_per_sec']:.0f} | "
            f"{f['sec_per_epoch']:.2f} | {100 * f['data_wait_fraction']:.0f}% | {f['test_top1']:.2f} | "
            f"{f['test_loss']:.4f} | {wall:.0f} |"
        )
    lines += ["", "images/s and s/epoch exclude epoch 1 (warm-up); test metrics use the best-validation weights."]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
