#!/usr/bin/env python
"""fsdp's whole step as one CUDA graph, beside one GPU: the route that takes the host out of a small model's
sharded step (issue 34, item 3; bench/results/fsdp-small-work_2xh200_2026-11-28.md).

    python bench/fsdp_step_graph.py --gpus 2 --out X.json

Each rank keeps its rows of every parameter, as fsdp's in-graph route does (`strategy.collectives=graph`,
src/strategies/graph_shards.py): reading a parameter all-gathers it (bf16 on CUDA) and its backward reduce-scatters
the gradient (fp32), ops inside the compiled graph, not hooks around it. The forward, backward and fused SGD step
(bench.py's ceiling step) are then captured as one CUDA graph and replayed: the host launches one graph per step. In
the same call, on the same machine: one GPU with bench.py's ceiling step (CUDA graphs through torch.compile, the
README's one-GPU figure) and one GPU with the whole step captured the same way; last, the sharding under inductor's
CUDA graphs (compile mode reduce-overhead, as ddplab's trainer runs it), a row or one line saying why it failed.
Data: one random batch left on the GPU: the ceiling of the route's step, without the loop.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from src.config.arguments import positive, positive_number  # noqa: E402  (src is importable once ROOT is on the path)
from src.reporting.efficiency import host  # noqa: E402
from src.strategies.graph_shards import BUCKETED, shard_rows  # noqa: E402

SPEC = {"model": "resnet18", "channels_last": True, "amp": True, "compile": True}  # bench.py's ResNet-18 ceiling


def sharded(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """`model` with fsdp's in-graph sharding (src/strategies/graph_shards.py, `strategy.collectives=graph`): each
    rank keeps its rows of every parameter, gathered in `dtype`; the gradients are reduced in fp32 and averaged."""
    shard_rows(model, dtype, torch.float32)
    return model


def whole_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Each parameter of a sharded model, whole, by its name (collective: reading one gathers it)."""
    return {
        f"{prefix}.{name}" if prefix else name: getattr(module, name).detach().clone()
        for prefix, module in model.named_modules()
        for name in module._parameters
    }


def whole_step_graph(step, x: torch.Tensor, y: torch.Tensor, warmup: int):
    """`step(x, y)` captured as one CUDA graph after `warmup` eager steps on a side stream (`.replay()` runs it)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step(x, y)
    torch.cuda.current_stream().wait_stream(side)
    if dist.is_initialized():
        dist.barrier()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(x, y)
    return graph


def timed(run, steps: int, warmup: int) -> dict:
    """GPU seconds (CUDA events) and host seconds of `steps` calls of `run` after `warmup` untimed ones."""
    for _ in range(warmup):
        run()
    torch.cuda.synchronize()
    if dist.is_initialized():
        dist.barrier()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    begin.record()
    for _ in range(steps):
        run()
    host_sec = time.perf_counter() - t0
    end.record()
    end.synchronize()
    return {"gpu_sec": begin.elapsed_time(end) / 1000, "host_sec": host_sec, "steps": steps}


def rank_main(args) -> None:
    """One process of a measurement: --role one (one GPU, both ways), sharded (every rank, the whole-step graph)
    or sharded-trees (every rank, inductor's CUDA graphs)."""
    from bench import ceiling_step

    local = int(os.environ.get("LOCAL_RANK", 0))
    cuda = not args.check
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    world = int(os.environ.get("WORLD_SIZE", 1))
    if cuda:
        torch.cuda.set_device(device)
    if world > 1:
        dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    rank = dist.get_rank() if world > 1 else 0
    if args.bucket:  # as the trainer compiles its in-graph route
        for key, value in BUCKETED.items():
            setattr(torch._inductor.config, key, value)
    spec = dict(SPEC, model=args.model, compile_mode=None, batch=args.batch)
    if args.check:  # a few eager steps on the CPU; the test compares the whole weights with one process's
        spec = dict(spec, channels_last=False, amp=False, compile=False)
        spec["model_options"] = {"batch_norm": False} if args.model == "tiny_cnn" else {}  # split-independent
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch * world, 3, 32, 32, generator=g)[rank * args.batch : (rank + 1) * args.batch]
    y = torch.randint(0, 10, (args.batch * world,), generator=g)[rank * args.batch : (rank + 1) * args.batch]
    fmt = torch.channels_last if spec["channels_last"] else torch.contiguous_format
    x, y = x.to(device).contiguous(memory_format=fmt), y.to(device)
    out = {"role": args.role, "world": world, "batch_per_gpu": args.batch, "model": args.model}
    if args.role == "sharded":
        dtype = torch.bfloat16 if cuda else torch.float32
        step, model = ceiling_step(spec, device, wrap=lambda m: sharded(m, dtype))  # averaged: the loss of one rank
        if args.check:
            for _ in range(args.steps):
                step(x, y)
            whole = whole_parameters(model)  # every rank gathers
            if rank == 0:
                torch.save(whole, args.result)
            dist.destroy_process_group()
            return
        graph = whole_step_graph(step, x, y, args.warmup)
        out["sharded_graph"] = timed(graph.replay, args.steps, 5)
    elif args.role == "sharded-trees":  # the same sharding under inductor's CUDA graphs, as ddplab's trainer runs
        graph, dtype = None, torch.bfloat16
        try:
            step, _ = ceiling_step(
                dict(spec, compile_mode="reduce-overhead"),
                device,
                wrap=lambda m: sharded(m, dtype),
            )
            out["sharded_trees"] = timed(lambda: step(x, y), args.steps, args.warmup)
        except Exception as error:  # a row saying why, not the end of the measurement
            out["sharded_trees_error"] = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    else:
        step, _ = ceiling_step(dict(spec, compile_mode="reduce-overhead"), device)
        out["one_gpu_ceiling_step"] = timed(lambda: step(x, y), args.steps, args.warmup)
        step, _ = ceiling_step(spec, device)
        graph = whole_step_graph(step, x, y, args.warmup)
        out["one_gpu_graph"] = timed(graph.replay, args.steps, 5)
    if rank == 0:
        Path(args.result).write_text(json.dumps(dict(out, **host(device))))
    torch.cuda.synchronize()
    # before the process group: a graph holding captured NCCL work hangs its destruction (torch#115388)
    if graph is not None:
        graph.reset()
    else:
        from torch._inductor import cudagraph_trees

        cudagraph_trees.reset_cudagraph_trees()
    if world > 1:
        dist.destroy_process_group()


def launch(args, role: str, ranks: int, result: str) -> bool:
    """torchrun with `ranks` ranks of this script; True once its result is written. A rank that does not exit
    within a minute of the result is stopped (seen: NCCL ranks hanging at exit after a captured graph)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), __file__]
    cmd += ["--role", role, "--result", result, "--model", args.model, "--batch", str(args.batch)]
    cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup), "--bucket" if args.bucket else "--no-bucket"]
    proc = subprocess.Popen(cmd + (["--check"] if args.check else []), start_new_session=True)
    deadline, limit = None, time.monotonic() + args.timeout
    while proc.poll() is None:
        if deadline is None and Path(result).exists():
            deadline = time.monotonic() + 60
        if time.monotonic() > min(deadline or limit, limit):
            os.killpg(proc.pid, 9)
            why = "a minute after their result" if deadline else f"within --timeout {args.timeout:g} s"
            print(f"fsdp_step_graph.py: the {role} ranks did not exit {why}; stopped")
            break
        time.sleep(0.5)
    return Path(result).exists()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", type=positive, default=2, help="ranks of the sharded run (default 2)")
    p.add_argument("--model", default="resnet18", help="a conf/model YAML (default resnet18, the CIFAR stem)")
    p.add_argument("--batch", type=positive, default=512, help="images per GPU per step (default 512)")
    p.add_argument("--warmup", type=positive, default=30, help="untimed steps first (compilation, autotuning)")
    p.add_argument("--steps", type=positive, default=500, help="timed steps")
    p.add_argument("--bucket", action=argparse.BooleanOptionalAction, default=True, help="merged collectives")
    p.add_argument("--check", action="store_true", help="CPU: eager sharded steps for the tests (--gpus gloo ranks)")
    p.add_argument("--out", help="JSON file")
    p.add_argument("--timeout", type=positive_number, default=600, help="seconds per run (default 600)")
    p.add_argument("--role", choices=["one", "sharded", "sharded-trees"], help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.role:
        rank_main(args)
        return 0
    if args.check and not args.out:
        p.error("--check writes the whole weights to --out: give one")
    if not args.check and torch.cuda.device_count() < args.gpus:
        sys.exit(f"fsdp_step_graph.py: --gpus {args.gpus}: this host has {torch.cuda.device_count()} GPUs")
    if args.check:
        return 0 if launch(args, "sharded", args.gpus, args.out) else 1
    with tempfile.TemporaryDirectory() as tmp:
        one, sharded = Path(tmp, "one.json"), Path(tmp, "sharded.json")
        if not (launch(args, "one", 1, str(one)) and launch(args, "sharded", args.gpus, str(sharded))):
            sys.exit("fsdp_step_graph.py: a run wrote no result; its output is above")
        runs = {"one": json.loads(one.read_text()), "sharded": json.loads(sharded.read_text())}
        trees = Path(tmp, "trees.json")
        runs["sharded_trees"] = (
            json.loads(trees.read_text()) if launch(args, "sharded-trees", args.gpus, str(trees)) else {}
        )
    rows = [("one GPU, ceiling step", runs["one"]["one_gpu_ceiling_step"], 1)]
    rows += [("one GPU, whole-step graph", runs["one"]["one_gpu_graph"], 1)]
    rows += [(f"fsdp x{args.gpus}, whole-step graph", runs["sharded"]["sharded_graph"], args.gpus)]
    if "sharded_trees" in runs["sharded_trees"]:
        rows += [(f"fsdp x{args.gpus}, inductor's graphs", runs["sharded_trees"]["sharded_trees"], args.gpus)]
    else:
        why = runs["sharded_trees"].get("sharded_trees_error", "no result (its output is above)")
        print(f"fsdp x{args.gpus} under inductor's CUDA graphs (trainer.compile_mode=reduce-overhead): {why}")
    base = args.batch * rows[0][1]["steps"] / rows[0][1]["gpu_sec"]
    table = []
    for name, t, ranks in rows:
        rate = args.batch * ranks * t["steps"] / t["gpu_sec"]
        host_ms = 1000 * t["host_sec"] / t["steps"]
        table.append({"run": name, "images_per_sec": rate, "vs_one_gpu": rate / base, "host_ms_per_step": host_ms})
        print(f"{name:32s} {rate:10,.0f} images/s  {rate / base:5.2f}x one GPU  host {host_ms:5.2f} ms/step")
    if args.out:
        report = {"command": sys.argv, "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "table": table, "runs": runs}
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
