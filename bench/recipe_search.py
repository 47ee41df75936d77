#!/usr/bin/env python
"""Run several training recipes at once (several per GPU) and compare their accuracy.

    python bench/recipe_search.py --out /tmp/search --per-gpu 4 \
        'r18-e30: trainer.max_epochs=30' 'r9-e24: model=resnet9 trainer.max_epochs=24'
    python bench/recipe_search.py --out /tmp/search --per-gpu 4 --seeds 2,4,42 \
        --base 'experiment=cifar10_airbench trainer.test_every_epoch=false' 'base:' 'lr1: optim.lr=1.0'

Each recipe is `name: overrides` on top of `--base` and runs as `python train.py ...` with CUDA_VISIBLE_DEVICES
set round-robin. With `--seeds`, a recipe is one process sweeping its seeds (`-m seed=...`), so on a GPU its later
seeds reuse the first one's compiled graphs. Runs that share a GPU slow each other down, so only the accuracies are
comparable here; time a chosen recipe alone. Prints and writes (<out>/summary.json) each recipe's final and best
test top-1 per run, their mean and std over the seeds, and each run's curve.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from src.config.arguments import non_negative, positive, positive_number  # noqa: E402  (argparse types)
from src.config.commands import hydra_value  # noqa: E402


def recipe(text: str) -> tuple[str, list[str]]:
    """'name: override ...' -> (name, overrides); the name is a folder under --out, so a plain word."""
    name, colon, overrides = text.partition(":")
    name = name.strip()
    if not colon or not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", name):
        raise ValueError(text)
    return name, shlex.split(overrides)


def shell_words(text: str) -> str:
    shlex.split(text)  # unbalanced quotes: argparse's one-line error now, not a traceback once runs start
    return text


def seeds(text: str) -> list[int]:
    return [non_negative(s) for s in text.split(",")]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="recipe_search.py")
    parser.add_argument(
        "recipes", nargs="+", type=recipe, help="'name: override override ...' (name: letters, digits, _ . -)"
    )
    parser.add_argument("--out", required=True)
    parser.add_argument("--gpus", type=positive, default=None, help="default: all visible")
    parser.add_argument("--per-gpu", type=positive, default=4, help="concurrent runs per GPU")
    parser.add_argument(
        "--base", type=shell_words, default="experiment=cifar10_94", help="overrides every recipe starts from"
    )
    parser.add_argument("--seeds", type=seeds, default=None, help="e.g. 2,4,42: each recipe sweeps them in one process")
    parser.add_argument(
        "--time-limit",
        type=positive_number,
        default=None,
        help="seconds; then stop the runs still going (their logs stay) and write the summary",
    )
    args = parser.parse_args(argv)
    names = [name for name, _ in args.recipes]
    if len(set(names)) < len(names):
        parser.error(f"recipe names must differ, got {', '.join(names)}")
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):  # a finished search is never rewritten
        parser.error(f"--out {out} exists and is not an empty folder: give a new one")
    out.mkdir(parents=True, exist_ok=True)
    try:  # the search's record, made first: of two searches started into one --out at once, one goes on
        with open(out / "search.json", "x") as record:
            json.dump({"argv": sys.argv[1:] if argv is None else list(argv)}, record)
    except FileExistsError:
        parser.error(f"another recipe_search writes to --out {out}: give a new one")
    return args


def command(args: argparse.Namespace, name: str, overrides: list[str]) -> list[str]:
    out = hydra_value(Path(args.out).resolve() / name)
    train = [sys.executable, str(ROOT / "train.py")]
    rest = [*shlex.split(args.base), *overrides, "trainer.progress_bar=false"]
    if args.seeds is None:
        return [*train, *rest, f"hydra.run.dir={out}"]
    seed_list = ",".join(map(str, args.seeds))
    return [*train, "-m", *rest, f"seed={seed_list}", f"hydra.sweep.dir={out}", "hydra.sweep.subdir=seed${seed}"]


def run_all(args: argparse.Namespace) -> dict[str, str]:
    """Run the recipes, per_gpu at a time on each GPU; return how each ended: "ran", "stopped" (by --time-limit)
    or "not started"."""
    import torch

    gpus = args.gpus or max(torch.cuda.device_count(), 1)
    out = Path(args.out)
    queue = list(args.recipes)
    running, ended = [], {name: "not started" for name, _ in args.recipes}
    deadline = time.time() + args.time_limit if args.time_limit else float("inf")
    slots = [g for g in range(gpus) for _ in range(args.per_gpu)]
    while queue or running:
        while queue and slots:
            gpu = slots.pop(0)
            name, overrides = queue.pop(0)
            log = open(out / f"{name}.log", "x")
            env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(gpu)}
            proc = subprocess.Popen(
                command(args, name, overrides), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env
            )
            running.append((name, gpu, proc))
            ended[name] = "ran"
        time.sleep(2)
        if time.time() > deadline:  # stop once: a second SIGTERM could cut a run's checkpoint save short
            queue.clear()
            for name, _, proc in running:
                proc.terminate()
                ended[name] = "stopped"
            deadline = float("inf")
        for name, gpu, proc in list(running):
            if proc.poll() is not None:
                running.remove((name, gpu, proc))
                slots.append(gpu)
    return ended


def read_run(run_dir: Path, seed: int | None) -> dict:
    """One run's figures from the metrics.json train.py wrote (ok: false where it did not finish)."""
    try:
        m = json.loads((run_dir / "metrics.json").read_text())
    except (OSError, ValueError):
        return {"seed": seed, "ok": False}
    curve = [(e["epoch"], round(e["train_sec_total"], 2), e.get("test_top1")) for e in m["epochs"]]
    final = (m.get("final") or {}).get("test_top1")
    return {
        "seed": seed,
        "ok": m.get("status") == "completed" and final is not None,
        "final_top1": final,
        "best_top1": max((c[2] or 0) for c in curve) if curve else None,
        "epochs": len(curve),
        "curve": curve,
    }


def summarize(args: argparse.Namespace, ended: dict[str, str]) -> list[dict]:
    out = Path(args.out)
    summary = []
    for name, overrides in args.recipes:
        if args.seeds is None:
            runs = [read_run(out / name, None)]
        else:
            runs = [read_run(out / name / f"seed{s}", s) for s in args.seeds]
        finals = [r["final_top1"] for r in runs if r["ok"]]
        summary.append(
            {
                "name": name,
                "overrides": shlex.join(overrides),
                "ended": ended[name],
                "ok": all(r["ok"] for r in runs),
                "final_top1_mean": statistics.fmean(finals) if finals else None,
                "final_top1_std": statistics.stdev(finals) if len(finals) > 1 else None,
                "runs": runs,
            }
        )
    return summary


def last_line(log: Path) -> str:
    lines = [t for t in log.read_text(errors="replace").splitlines() if t.strip()] if log.exists() else []
    return lines[-1].strip() if lines else "no output"


def line(s: dict, log: Path) -> str:
    if s["ended"] == "not started":
        return f"{s['name']:<28} not started: --time-limit came first | {s['overrides']}"
    if not s["ok"]:
        done = " ".join(f"{r['final_top1']:.2f}" for r in s["runs"] if r["ok"])
        how = "stopped by --time-limit" if s["ended"] == "stopped" else "failed"
        finished = f" (finished: {done})" if done else ""
        return f"{s['name']:<28} {how}{finished}: {last_line(log)} [{log}] | {s['overrides']}"
    finals = " ".join(f"{r['final_top1']:6.2f}" for r in s["runs"])
    spread = f" ± {s['final_top1_std']:.2f}" if s["final_top1_std"] is not None else ""
    return f"{s['name']:<28} final {s['final_top1_mean']:6.2f}{spread}  runs {finals} | {s['overrides']}"


def main(argv=None) -> None:
    args = parse_args(argv)
    summary = summarize(args, run_all(args))
    (Path(args.out) / "summary.json").write_text(json.dumps(summary, indent=1))
    for s in summary:
        print(line(s, Path(args.out) / f"{s['name']}.log"))


if __name__ == "__main__":
    main()
