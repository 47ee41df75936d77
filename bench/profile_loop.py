#!/usr/bin/env python
"""Profile one steady-state epoch of the real training loop (what `python train.py ...` runs).

    python bench/profile_loop.py experiment=cifar10_94 [overrides...] [--trace /tmp/trace.json]
    torchrun --nproc-per-node 2 bench/profile_loop.py strategy=ddp [overrides...]   # rank 0's view of ddp

Builds the run as train() does, trains epoch 1 untimed (compilation, cuDNN tuning), then trains
epoch 2 under torch.profiler and prints: the epoch's wall time, the GPU's busy time (sum of kernel
times), and the operators with the most GPU and CPU time.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from omegaconf import open_dict

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import src  # noqa: E402,F401  (registers the resolvers)
from src.distributed import destroy_process_group  # noqa: E402
from src.run.trainer import prepare_run  # noqa: E402
from src.state.signals import StopRequest  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--trace", default=None, help="write a Chrome/Perfetto trace here")
    parser.add_argument("--rows", type=int, default=18)
    args = parser.parse_args()
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=[f"paths.root_dir={ROOT}", *args.overrides])
    with open_dict(cfg):
        cfg.paths.output_dir = tempfile.mkdtemp(prefix="ddplab-profile-")
        cfg.trainer.max_epochs = max(cfg.trainer.max_epochs, 2)
    run = prepare_run(cfg)
    run.build()
    stop = StopRequest(elastic=True)
    first = run.train_epoch(0, stop)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        second = run.train_epoch(1, stop)
        wall = time.perf_counter() - start
    stop.restore()
    if run.primary:
        events = prof.key_averages()
        kernels = sum(e.self_device_time_total for e in events) / 1e6
        print(
            f"epoch 1: {first['images_per_sec']:.0f} img/s | epoch 2 (profiled): {second['images_per_sec']:.0f} img/s,"
            f" {wall:.3f} s wall, GPU kernels {kernels:.3f} s = {100 * kernels / wall:.1f}% busy,"
            f" {run.steps_per_epoch} steps, data wait {100 * second['data_wait_fraction']:.1f}%"
        )
        print(events.table(sort_by="self_device_time_total", row_limit=args.rows, max_name_column_width=70))
        print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=70))
        if args.trace:
            prof.export_chrome_trace(args.trace)
    destroy_process_group()


if __name__ == "__main__":
    main()
