#!/usr/bin/env python
"""Where does DDP lose time? Train steps on a fixed on-device batch, one process per GPU.

    torchrun --nproc-per-node 1 bench/ddp_probe.py            # the one-GPU references
    torchrun --nproc-per-node 2 bench/ddp_probe.py            # DDP variants on two GPUs
    torchrun --nproc-per-node 2 bench/ddp_probe.py --cpu --batch 8 --warmup 2 --windows 1 --steps 2 --modes ...
                                                              # do these modes run at all? (gloo, no timing value)

Each mode builds ResNet-18 (CIFAR stem), bf16 autocast, channels_last, fused SGD, 512 images per GPU,
warms up (compilation, cuDNN tuning), then times windows of steps with CUDA events; the slowest
rank's window counts. Also times a plain NCCL all-reduce of ResNet-18's gradient size.
Prints one JSON line per mode from rank 0.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch._inductor.config
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from src.config.arguments import positive  # noqa: E402
from src.models import cifar_resnet18  # noqa: E402
from src.run.loss import build_loss_terms  # noqa: E402
from src.strategies import COMM_DTYPES, FlatGradientSync  # noqa: E402

MODES = {  # name: (compile mode or False, scope, comm hook, bucket MB, dynamo optimize_ddp[, DDP options])
    "eager": (False, None, None, 25, True),
    "compile-module-cudagraphs": ("reduce-overhead", "module", None, 25, True),
    "cudagraphs-nobcast": ("reduce-overhead", "module", None, 25, True, {"broadcast_buffers": False}),
    "cudagraphs-nobcast-1bucket": ("reduce-overhead", "module", None, 100, True, {"broadcast_buffers": False}),
    "cudagraphs-wrapper-split": ("reduce-overhead", "wrapper", None, 25, True, {"broadcast_buffers": False}),
    "cudagraphs-wrapper-split-b10": ("reduce-overhead", "wrapper", None, 10, True, {"broadcast_buffers": False}),
    "cudagraphs-wrapper-split-b5": ("reduce-overhead", "wrapper", None, 5, True, {"broadcast_buffers": False}),
    # ResNet-18's layer4 holds 33.6 MB of the 44.7 MB of gradients and its backward comes first: a 35-40 MB
    # first bucket cuts the backward graph once, after layer4, leaving ~10 MB to all-reduce at the end
    "cudagraphs-wrapper-split-b35": ("reduce-overhead", "wrapper", None, 35, True, {"broadcast_buffers": False}),
    "cudagraphs-wrapper-split-b40": ("reduce-overhead", "wrapper", None, 40, True, {"broadcast_buffers": False}),
    # compiled autograd traces DDP's (python) reducer into the backward graph, where Inductor may reorder the
    # all-reduces to overlap the backward (measured slower: resnet18_h200_2026-11-26.md, tried and rejected)
    "cudagraphs-compiled-autograd": (
        "reduce-overhead",
        "wrapper",
        None,
        25,
        "python_reducer",
        {"broadcast_buffers": False},
    ),
    "compiled-autograd": (True, "wrapper", None, 25, "python_reducer", {"broadcast_buffers": False}),
    "cudagraphs-after-backward": ("reduce-overhead", "after_backward", None, 0, True),
    "cudagraphs-after-backward-bf16": ("reduce-overhead", "after_backward", "bf16", 0, True),
    "cudagraphs-after-backward-cat": ("reduce-overhead", "after_backward_cat", None, 0, True),
    "compile-module": (True, "module", None, 25, True),
    "compile-wrapper": (True, "wrapper", None, 25, True),
    "compile-wrapper-nosplit": (True, "wrapper", None, 25, False),
    "compile-module-bf16hook": (True, "module", "bf16", 25, True),
    "compile-module-bucket100": (True, "module", None, 100, True),
    "eager-bf16hook": (False, None, "bf16", 25, True),
}


def build(mode: str, device: torch.device, world: int):
    """(model to call, optimizer, gradient sync to call after the backward or None)"""
    compile_, scope, hook, bucket, optimize_ddp, *ddp_options = MODES[mode]
    torch._dynamo.reset()
    torch._dynamo.config.optimize_ddp = optimize_ddp
    torch._dynamo.config.compiled_autograd = optimize_ddp == "python_reducer"
    torch._inductor.config.reorder_for_compute_comm_overlap = optimize_ddp == "python_reducer"
    torch.manual_seed(0)
    model = cifar_resnet18(10).to(device).to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(
        model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4, fused=device.type == "cuda"
    )
    compiled = (lambda m: torch.compile(m, mode=None if compile_ is True else compile_)) if compile_ else None
    if world == 1:
        return (compiled(model) if compile_ else model), opt, None
    if scope == "after_backward":  # ddplab's strategy.gradient_sync=after_backward: no DDP wrapper
        return compiled(model), opt, FlatGradientSync(model.parameters(), COMM_DTYPES.get(hook))
    if scope == "after_backward_cat":  # the simpler packing, for comparison: a fresh torch.cat every step
        return compiled(model), opt, cat_gradient_sync(list(model.parameters()))
    inner = compiled(model) if compile_ and scope == "module" else model
    ddp = DDP(
        inner,
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=bucket,
        gradient_as_bucket_view=True,
        **(ddp_options[0] if ddp_options else {}),
    )
    if hook:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(None, getattr(default_hooks, f"{hook}_compress_hook"))
    return (compiled(ddp) if compile_ and scope == "wrapper" else ddp), opt, None


def cat_gradient_sync(params):
    """after_backward packed by torch.cat into a new buffer each step (the persistent buffer's baseline)."""

    def sync():
        grads = [p.grad for p in params]
        flat = torch.cat([g.as_strided((g.numel(),), (1,)) for g in grads])  # dense gradients only
        dist.all_reduce(flat)
        offset = 0
        for p, g in zip(params, grads):
            p.grad = flat.as_strided(g.shape, g.stride(), offset)
            offset += g.numel()

    return sync


def make_step(model, opt, sync, objective, x, y):
    """One train step as the trainer runs it; `mark` is called after the forward, the backward, the gradient
    sync and the optimizer (segment_times records its clocks there)."""
    scale = (1 if sync else dist.get_world_size()) / (len(y) * dist.get_world_size())  # as the trainer scales

    def step(mark=lambda: None):
        torch.compiler.cudagraph_mark_step_begin()  # CUDA graphs: the previous step's outputs are dead
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            loss, _ = objective(model(x), y, scale)
        mark()
        loss.backward()
        mark()
        if sync:
            sync()
        mark()
        opt.step()
        opt.zero_grad(set_to_none=True)
        mark()

    return step


def trace_tail(step, steps: int = 3, last: int = 45) -> list[str]:
    """The device's last `last` kernels, copies and memsets of `steps` profiled steps: the end of the last
    backward, the gradient sync and the optimizer, with start times (us, from the first listed), durations
    and streams."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name))["traceEvents"]
    device = sorted(
        (e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"]
    )[-last:]
    t0 = device[0]["ts"]
    return [f"{e['ts'] - t0:9.1f} {e['dur']:8.1f} s{e['args'].get('stream', '?')} {e['name'][:70]}" for e in device]


def time_steps(step, x, warmup: int, windows: int, steps: int) -> float:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(windows):
        if x.is_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        began = time.perf_counter()
        for _ in range(steps):
            step()
        if x.is_cuda:
            end.record()
            end.synchronize()
        seconds = start.elapsed_time(end) / 1000 if x.is_cuda else time.perf_counter() - began
        t = torch.tensor([seconds], device=x.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(t.item())
    return statistics.median(times)


def segment_times(step, steps: int) -> dict:
    """Median per-step milliseconds of each part of the step, on the device (CUDA events) and on the host
    (time the Python calls take to return): if host time reaches device time, the host is the bottleneck."""
    names = ("forward", "backward", "sync", "optimizer")
    device, host = {n: [] for n in names}, {n: [] for n in names}
    for _ in range(steps):
        events, clock = [], []

        def mark(events=events, clock=clock):
            events.append(torch.cuda.Event(enable_timing=True))
            events[-1].record()
            clock.append(time.perf_counter())

        mark()
        step(mark)
        for i, n in enumerate(names):
            device[n].append((events, i))
            host[n].append((clock[i + 1] - clock[i]) * 1000)
    torch.cuda.synchronize()
    out = {}
    for n in names:
        out[f"device_{n}_ms"] = round(statistics.median(e[i].elapsed_time(e[i + 1]) for e, i in device[n]), 3)
        out[f"host_{n}_ms"] = round(statistics.median(host[n]), 3)
    return out


def allreduce_bandwidth(device: torch.device, numel: int, dtype: torch.dtype, iters: int = 30) -> dict:
    buf = torch.ones(numel, dtype=dtype, device=device)
    for _ in range(5):
        dist.all_reduce(buf)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        dist.all_reduce(buf)
    end.record()
    end.synchronize()
    sec = start.elapsed_time(end) / 1000 / iters
    n = dist.get_world_size()
    size = numel * buf.element_size()
    return {"bytes": size, "ms": round(sec * 1000, 3), "bus_GBps": round(size / sec * 2 * (n - 1) / n / 1e9, 1)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--batch", type=positive, default=512)
    parser.add_argument("--warmup", type=positive, default=20)
    parser.add_argument("--windows", type=positive, default=7)
    parser.add_argument("--steps", type=positive, default=25)
    parser.add_argument("--tag", default="", help="a label for this process group's lines")
    parser.add_argument("--segments", action="store_true", help="also time each part of the step, device and host")
    parser.add_argument("--trace", action="store_true", help="also print each rank's device timeline of a step's end")
    parser.add_argument(
        "--cpu", action="store_true", help="gloo on CPU: check that the modes run (timings mean nothing)"
    )
    args = parser.parse_args()
    local = int(os.environ.get("LOCAL_RANK", 0))
    if args.cpu:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    else:
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.backends.cudnn.benchmark = True
    g = torch.Generator(device=device).manual_seed(rank)
    x = torch.randn(args.batch, 3, 32, 32, device=device, generator=g).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (args.batch,), device=device, generator=g)
    info = {
        "tag": args.tag,
        "gpus": world,
        "gpu": torch.cuda.get_device_name(device) if not args.cpu else "cpu",
        "torch": torch.__version__,
    }
    if world > 1 and not args.cpu:
        params = sum(p.numel() for p in cifar_resnet18(10).parameters())
        for dtype in (torch.float32, torch.bfloat16):
            r = allreduce_bandwidth(device, params, dtype)
            if rank == 0:
                print(json.dumps({**info, "mode": f"allreduce-{str(dtype)[6:]}", **r}), flush=True)
    for mode in filter(None, args.modes.split(",")):  # --modes "": the all-reduce timings alone
        if world == 1 and (
            MODES[mode][1] in ("wrapper", "after_backward", "after_backward_cat") or MODES[mode][2] or MODES[mode][5:]
        ):
            continue  # DDP-only variants
        model, opt, sync = build(mode, device, world)
        compile_ = MODES[mode][0]
        objective = build_loss_terms(bool(compile_), "default" if compile_ is True else (compile_ or "default"))
        step = make_step(model, opt, sync, objective, x, y)
        sec = time_steps(step, x, args.warmup, args.windows, args.steps)
        parts = segment_times(step, args.steps) if args.segments and x.is_cuda else {}
        line = {
            **info,
            "mode": mode,
            "images_per_sec": round(args.batch * world * args.steps / sec),
            "step_ms": round(sec / args.steps * 1000, 2),
            "rank": rank,
            **parts,
        }
        tail = trace_tail(step) if args.trace and x.is_cuda else []
        for r in range(world) if parts or tail else [0]:  # every rank's lines: is one rank slower?
            if rank == r:
                print(json.dumps(line), *tail, sep="\n", flush=True)
            dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
