#!/usr/bin/env python
"""Run several training recipes at once (several per GPU) and compare their accuracy curves.

    python bench/recipe_search.py --out /tmp/search --per-gpu 4 \
        'r18-e30: trainer.max_epochs=30' 'r9-e24: model=resnet9 trainer.max_epochs=24'

Each recipe is `name: overrides` on top of `experiment=cifar10_94` and runs as
`python train.py ...` with CUDA_VISIBLE_DEVICES set round-robin. Runs that share a GPU slow each
other down, so only the accuracies are comparable here; time a chosen recipe alone.
Prints and writes (<out>/summary.json) each recipe's final and best test top-1 and its curve.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from src.config.arguments import positive, positive_number  # noqa: E402  (argparse types)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("recipes", nargs="+", help="'name: override override ...'")
    parser.add_argument("--out", required=True)
    parser.add_argument("--gpus", type=positive, default=None, help="default: all visible")
    parser.add_argument("--per-gpu", type=positive, default=4, help="concurrent runs per GPU")
    parser.add_argument("--base", default="experiment=cifar10_94")
    parser.add_argument(
        "--time-limit",
        type=positive_number,
        default=None,
        help="seconds; then stop the runs still going (their logs stay) and write the summary",
    )
    args = parser.parse_args()
    import torch

    gpus = args.gpus or max(torch.cuda.device_count(), 1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    queue = [(r.split(":", 1)[0].strip(), r.split(":", 1)[1].split()) for r in args.recipes]
    running, done = [], {}
    deadline = time.time() + args.time_limit if args.time_limit else float("inf")
    slots = [g for g in range(gpus) for _ in range(args.per_gpu)]
    while queue or running:
        while queue and slots:
            gpu = slots.pop(0)
            name, overrides = queue.pop(0)
            cmd = [
                sys.executable,
                str(ROOT / "train.py"),
                args.base,
                *overrides,
                "trainer.progress_bar=false",
                f"hydra.run.dir={out / name}",
            ]
            log = open(out / f"{name}.log", "w")
            env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(gpu)}
            running.append((name, gpu, subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)))
        time.sleep(2)
        if time.time() > deadline:  # stop once: a second SIGTERM could cut a run's checkpoint save short
            queue.clear()
            for _, _, proc in running:
                proc.terminate()
            deadline = float("inf")
        for item in list(running):
            name, gpu, proc = item
            if proc.poll() is not None:
                running.remove(item)
                slots.append(gpu)
                done[name] = proc.returncode
    summary = []
    for r in args.recipes:
        name = r.split(":", 1)[0].strip()
        metrics = out / name / "metrics.json"
        if not metrics.exists():
            summary.append({"name": name, "overrides": r.split(":", 1)[1].strip(), "ok": False})
            continue
        m = json.loads(metrics.read_text())
        curve = [(e["epoch"], round(e["train_sec_total"], 2), e.get("test_top1")) for e in m["epochs"]]
        summary.append(
            {
                "name": name,
                "overrides": r.split(":", 1)[1].strip(),
                "ok": m.get("status") == "completed",
                "final_top1": m.get("final", {}).get("test_top1"),
                "best_top1": max((c[2] or 0) for c in curve),
                "epochs": len(curve),
                "curve": curve,
            }
        )
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    for s in summary:
        if "curve" in s:
            final = "stopped" if not s["ok"] else f"{s['final_top1']:6.2f}"
            print(
                f"{s['name']:<28} final {final:>7}  best {s['best_top1']:6.2f}  "
                f"epochs {s['epochs']:3d}  | {s['overrides']}"
            )
        else:
            print(
                f"{s['name']:<28} no metrics.json: stopped by --time-limit or failed "
                f"(see {out / s['name']}.log) | {s['overrides']}"
            )


if __name__ == "__main__":
    main()
