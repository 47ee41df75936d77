#!/usr/bin/env python
"""Profile one steady-state epoch of the real training loop (what `python train.py ...` runs).

    python bench/profile_loop.py experiment=cifar10_94 [overrides...] [--trace /tmp/trace.json]
    torchrun --nproc-per-node 2 bench/profile_loop.py strategy=ddp [overrides...]   # rank 0's view of ddp

Builds the run as train() does, trains --warmup-epochs epochs (default 1) unprofiled (compilation, cuDNN tuning),
then the next epoch under torch.profiler, and prints: the epoch's wall time, the GPU's busy time (sum of kernel
times), how many CUDA graphs were recorded during it (0 once they only replay), and the operators with the most GPU
and CPU time.
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
from torch.autograd import DeviceType

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
    parser.add_argument("--warmup-epochs", type=int, default=1, help="epochs trained before the profiled one")
    args = parser.parse_intermixed_args()  # overrides before, between or after the options
    if args.warmup_epochs < 1:
        parser.error(
            f"--warmup-epochs must be at least 1 (compilation and tuning are not profiled), got {args.warmup_epochs}"
        )
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=[f"paths.root_dir={ROOT}", *args.overrides])
    with tempfile.TemporaryDirectory(prefix="ddplab-profile-") as out:  # its checkpoints and logs: nobody's
        with open_dict(cfg):
            cfg.paths.output_dir = out
            cfg.trainer.max_epochs = max(cfg.trainer.max_epochs, args.warmup_epochs + 1)
        run = prepare_run(cfg)
        try:
            profile(run, args)
        finally:
            run.close()
            destroy_process_group()


def profile(run, args) -> None:
    run.build()
    stop = StopRequest(elastic=True)
    for epoch in range(args.warmup_epochs):
        last_warmup = run.train_epoch(epoch, stop)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        profiled = run.train_epoch(args.warmup_epochs, stop)
        wall = time.perf_counter() - start
    stop.restore()
    if not run.primary:
        return
    events = prof.key_averages()
    kernels = device_seconds(events)
    recorded = graphs_recorded(events)
    n = args.warmup_epochs
    print(
        f"epoch {n}: {last_warmup['images_per_sec']:.0f} img/s | epoch {n + 1} (profiled):"
        f" {profiled['images_per_sec']:.0f} img/s, {wall:.3f} s wall, GPU kernels {kernels:.3f} s ="
        f" {100 * kernels / wall:.1f}% busy, {run.steps_per_epoch} steps, data wait"
        f" {100 * profiled['data_wait_fraction']:.1f}%, CUDA graphs recorded {recorded}"
    )
    print(events.table(sort_by="self_device_time_total", row_limit=args.rows, max_name_column_width=70))
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=70))
    if args.trace:
        prof.export_chrome_trace(args.trace)


def device_seconds(events) -> float:
    """The device's own time: its kernels, copies and memsets, as the profiler's table totals it. A CPU operator's
    device time and a GPU-side user annotation (such as a compiled graph's call) repeat the kernels they cover."""
    on_device = [e for e in events if e.device_type != DeviceType.CPU and not e.is_user_annotation]
    return sum(e.self_device_time_total for e in on_device) / 1e6


def graphs_recorded(events) -> int:
    """How many CUDA graphs the profiled events recorded: a graph that keeps being recorded again never pays off.
    Inductor times each recording with dynamo_timed, one "... (dynamo_timed)" event; other events named after the
    recording repeat it (their sum was 3x the recordings)."""
    named = {e.key: e.count for e in events if e.key.startswith("CUDAGraphNode.record")}
    return named.get("CUDAGraphNode.record (dynamo_timed)", max(named.values(), default=0))


if __name__ == "__main__":
    main()
