#!/usr/bin/env python
"""Speed benchmark: the compute ceiling of one GPU vs the full training loop (bench/README.md).

The parent process plans the configurations, runs each one in a fresh
`python bench/bench.py --one '<json>'` subprocess (no CUDA state or compile cache shared in memory),
reads the JSON the child prints as its last stdout line, computes the ratios, prints a table and
writes everything to --out.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import fnmatch
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from src.config.arguments import positive, positive_number  # noqa: E402  (argparse types)

# name suffix, trainer.amp, trainer.channels_last, torch.compile mode (False: no compile)
CEILINGS = [
    ("fp32", False, False, False),
    ("bf16", True, False, False),
    ("bf16-cl", True, True, False),
    ("bf16-cl-compile", True, True, "default"),
    ("bf16-cl-cudagraphs", True, True, "reduce-overhead"),
]
# compile mode of the loops: CUDA graphs for single and ddp; not DataParallel's threads; fsdp as its reports of larger
# models ran (under CUDA graphs: --override trainer.compile_mode=reduce-overhead, `make bench-fsdp-small`)
LOOP_COMPILE_MODE = {"single": "reduce-overhead", "ddp": "reduce-overhead", "dp": "default", "fsdp": "default"}
# every multi-GPU strategy at 2, 4 and 8 GPUs, up to --gpus
LOOP_STRATEGIES = [("single", 1)] + [(s, g) for g in (2, 4, 8) for s in ("dp", "ddp", "fsdp")]
# what a run reports where it applies: the GPU's data wait and memory on CUDA, FLOP rates where counted
OPTIONAL_FIGURES = ("gpu_data_wait_fraction", "peak_mem_gb", "peak_mem_reserved_gb", "tflops_per_gpu", "mfu")
WIDTH = 36  # the run column: resnet50-ceiling-bf16-cl-cudagraphs
SMOKE = {
    "model": "tiny_cnn",
    "batch": 64,
    "samples": 1024,
    "epochs": 2,
    "workers": "0",
    "ceilings": CEILINGS[:1],
    "strategies": [("single", 1), ("ddp", 2)],
    "windows": (2, 3, 5),
    "min_timed_steps": 0,
}
GPU = {
    "model": "resnet18",
    "batch": 512,
    "samples": 50000,
    "epochs": 3,
    "workers": "8",
    "ceilings": CEILINGS,
    "strategies": LOOP_STRATEGIES,
    "windows": (15, 7, 25),
    "min_timed_steps": 100,  # a loop run trains more epochs than --epochs where its timed ones would be fewer steps
}  # windows: warm-up, windows, steps


# --- the parent: plan, run, compare ---------------------------------------------------------------


def model_of(args, mode) -> tuple[str, list[str], str, dict]:
    """(name, loop overrides, model YAML, its options) of --model: conf/model/<name>.yaml where there is one,
    else the torchvision classifier of that name; by default the mode's model."""
    name = args.model or mode["model"]
    if (ROOT / "conf/model" / f"{name}.yaml").exists():
        return name, [f"model={name}"], name, {}
    return name, ["model=torchvision", f"model.name={name}"], "torchvision", {"name": name}


# --decode value: (run-name tag, data overrides)
DECODES = {
    "auto": ("auto", []),  # the default: what data.decode=auto picks for this host
    "gpu": ("gpudecode", ["data.decode=gpu"]),
    "cpu": ("classic", ["data.decode=cpu", "data.crop=workers"]),
    "cpudecode": ("cpudecode", ["data.decode=cpu", "data.crop=device"]),
    "cpuauto": ("cpuauto", ["data.decode=cpu"]),  # data.crop=auto: where the GPU's wait puts the crops
    "split": ("split", ["data.decode=split"]),
    "dali": ("dali", ["data.decode=dali"]),  # needs NVIDIA DALI (pip install nvidia-dali-cuda130)
}


def loaders_of(args) -> list[tuple[str, list[str]]]:
    """(tag, data overrides) of each loader the loops and loader runs compare. Default: the in-memory data on
    the GPU (`gpu`) and the DataLoader with each --workers count (`classic<N>`). With --decode: images read
    from disk (the --data-root folder, and --shards), decoded on the GPU (`gpudecode`, reading with the first
    --workers count), by the workers that also crop (`classic<N>`) or by workers that only decode and cut
    the crops' regions, the training process resizing them on the GPU (`cpudecode<N>`), either as data.crop=auto
    chooses (`cpuauto<N>`), or shared between N CPU workers and 3 that decode on the GPU (`split<N>`,
    data.gpu_share of each batch on the GPU), or by DALI in the training process with N threads (`dali<N>`); shard
    tags start with `shards-`."""
    workers = args.workers.split(",")  # counts, or auto: what data.num_workers=auto gives this host
    if not args.decode:
        return [("gpu", ["data.loader=resident", "data.num_workers=0"])] + [
            (f"classic{w}", ["data.loader=workers", f"data.num_workers={w}"]) for w in workers
        ]
    common = ["data.augment=random_resized_crop", *([f"data.image_size={args.image_size}"] if args.image_size else [])]
    sources = [("", ["data=imagefolder", f"data.root={Path(args.data_root).resolve()}"])] if args.data_root else []
    if args.shards:
        sources.append(("shards-", ["data=shards", f"data.root={Path(args.shards).resolve()}"]))
    out = []
    for prefix, data in sources:
        for decode in args.decode.split(","):
            counts = workers[:1] if decode == "gpu" else workers
            tag, where = DECODES[decode]
            for w in counts:  # the gpu path reads with one count: its tag names none
                name = f"{prefix}{tag}" if decode == "gpu" else f"{prefix}{tag}{w}"
                out.append((name, [*data, *common, *where, f"data.num_workers={w}"]))
    return out


def plan(args) -> list[dict]:
    """Every configuration, in run order: ceilings first, then the loaders alone (--decode), then the loops."""
    mode = SMOKE if args.smoke else GPU
    device = "cpu" if args.smoke else "cuda"
    warmup, windows, steps = mode["windows"]
    model, model_overrides, model_yaml, model_options = model_of(args, mode)
    prefix = f"{args.model}-" if args.model else ""  # names say the model when it is not the default
    configs = [
        {
            "name": f"{prefix}ceiling-{tag}",
            "kind": "ceiling",
            "model": model,
            "model_yaml": model_yaml,
            "model_options": model_options,
            "image_size": args.image_size or 32,
            "device": device,
            "batch": args.batch,
            "amp": amp,
            "channels_last": cl,
            "compile": bool(comp),
            "compile_mode": comp,
            "precision": "bf16" if amp else "fp32",
            "gpus": 1,
            "warmup": warmup,
            "windows": windows,
            "steps": steps,
        }
        for tag, amp, cl, comp in mode["ceilings"]
    ]
    amp = not args.smoke
    precision = "bf16" if amp else "fp32"
    if args.decode:
        data = []
    elif args.data_root:
        data = ["data=imagefolder", f"data.root={Path(args.data_root).resolve()}", "data.augment=crop_flip"]
    else:
        side = args.image_size or 32  # on-device random images of the ceiling's size
        data = ["data=synthetic", f"data.num_samples={args.samples}", f"data.shape=[3,{side},{side}]"]
        data += ["data.num_test=" + str(min(args.samples, 4 * args.batch)), "data.augment=crop_flip"]
    loaders = loaders_of(args)
    if args.decode:  # the loader alone, as one GPU's rank runs it: read, decode, augment, no model
        configs += [
            {
                "name": f"loader-{tag}",
                "kind": "loader",
                "model": model,
                "gpus": 1,
                "loader": tag,
                "precision": precision,
                "device": device,
                "batch": args.batch,
                "warmup": 10,
                "steps": args.loader_steps,
                "channels_last": amp,
                "overrides": [*loader_data, f"trainer.device={device}", *(args.override or [])],
            }
            for tag, loader_data in loaders
        ]
        if args.gpus > 1:  # one loader per GPU, all at once: what the host's CPUs deliver to every GPU together
            configs += [
                {**c, "name": c["name"].replace("loader-", f"loader{args.gpus}-", 1), "gpus": args.gpus}
                for c in configs
                if c["kind"] == "loader"
            ]
    compiles = [False] if args.smoke else {"on": [True], "off": [False], "both": [True, False]}[args.compile]
    for compile_ in compiles:
        for strategy, gpus in mode["strategies"]:
            if gpus > args.gpus:
                continue
            for tag, loader_data in loaders:
                name = f"{prefix}{strategy}{gpus}-{tag}" + ("" if compile_ or args.smoke else "-eager")
                overrides = [
                    *model_overrides,
                    *data,
                    *loader_data,
                    f"strategy={strategy}",
                    f"trainer.devices={gpus}",
                    f"trainer.device={device}",
                    f"data.batch_size={args.batch * gpus}",
                    f"trainer.max_epochs={args.epochs}",
                    f"trainer.amp={str(amp).lower()}",
                    "trainer.amp_dtype=bf16",
                    f"trainer.channels_last={str(amp).lower()}",
                    f"trainer.compile={str(compile_).lower()}",
                    "trainer.progress_bar=false",
                    f"trainer.compile_mode={LOOP_COMPILE_MODE[strategy]}",
                ]
                if args.steps:
                    overrides.append(f"trainer.limit_train_batches={args.steps}")
                overrides += args.override or []
                configs.append(
                    {
                        "name": name,
                        "kind": "loop",
                        "model": model,
                        "strategy": strategy,
                        "gpus": gpus,
                        "loader": tag,
                        "compile": compile_,
                        "precision": precision,
                        "compile_mode": LOOP_COMPILE_MODE[strategy] if compile_ else None,
                        "min_timed_steps": 0 if args.steps else mode["min_timed_steps"],
                        "overrides": overrides,
                    }
                )
    return configs


def start_session(cmd: list[str], **popen) -> subprocess.Popen:
    """Popen(cmd) in a process session of its own (killed whole, its ranks too), which a SIGTERM, SIGINT or
    SIGHUP to this process also kills before this process exits 128 + the signal, with one line on stderr."""
    proc = subprocess.Popen(cmd, start_new_session=True, **popen)

    def stop(signum, frame):  # its own session is out of the signal's reach: the ranks would train on, orphaned
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        print(f"{Path(sys.argv[0]).name}: stopped by {signal.Signals(signum).name}; killed its child", file=sys.stderr)
        raise SystemExit(128 + signum)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, stop)
    return proc


def run_child(config: dict, timeout: float) -> dict:
    """One configuration in a fresh interpreter (its own session, so a timeout ends its ranks too)."""
    start = time.perf_counter()
    proc = start_session(
        [sys.executable, str(Path(__file__).resolve()), "--one", json.dumps(config)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        err += f"\ntimed out after {timeout:.0f} s (raise --timeout)"
    record = {**config, "ok": False, "wall_sec": round(time.perf_counter() - start, 1)}
    lines = out.strip().splitlines()
    try:
        result = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        result = None
    if proc.returncode == 0 and isinstance(result, dict) and result.get("images_per_sec", 0) > 0:
        record.update(result, ok=True)
    else:
        record["error"] = "\n".join((out + err).strip().splitlines()[-25:])
    return record


def ratios(runs: dict) -> list[dict]:
    """vs_ceiling: loop (or loader alone) img/s / (GPUs x best ceiling of the same model and precision);
    vs_single: N-GPU / single1."""
    ok = {n: r for n, r in runs.items() if r["ok"]}
    out = []
    for name, r in ok.items():
        if r["kind"] not in ("loop", "loader"):
            continue
        same = [
            c
            for c in ok.values()
            if c["kind"] == "ceiling"
            and c["precision"] == r["precision"]
            and c.get("model") == r.get("model", c.get("model"))
        ]  # (older files: loops name no model)
        if same:
            best = max(same, key=lambda c: c["images_per_sec"])
            out.append(
                {
                    "kind": "vs_ceiling",
                    "run": name,
                    "reference": best["name"],
                    "gpus": r["gpus"],
                    "value": r["images_per_sec"] / (best["images_per_sec"] * r["gpus"]),
                }
            )
        if r["kind"] == "loader":
            continue
        single = [
            s
            for s in ok.values()
            if s["kind"] == "loop"
            and s["strategy"] == "single"
            and (s["loader"], s["compile"], s["precision"], s.get("model"))
            == (r["loader"], r["compile"], r["precision"], r.get("model"))
        ]
        if r["gpus"] > 1 and single:
            out.append(
                {
                    "kind": "vs_single",
                    "run": name,
                    "reference": single[0]["name"],
                    "gpus": r["gpus"],
                    "value": r["images_per_sec"] / single[0]["images_per_sec"],
                }
            )
    return out


def table(report: dict) -> str:
    from src.reporting.efficiency import cpus_named

    runs, by = report["runs"], {(x["kind"], x["run"]): x for x in report["ratios"]}
    gpus = f"{report['gpu_name']} x{report['gpu_count']}" if report["gpu_count"] else "no GPU (cpu)"
    cpus = f" | {cpus_named(report)}" if report.get("cpus") else ""  # older files name none
    lines = [
        f"ddplab bench | {gpus}{cpus} | torch {report['torch_version']} | "
        f"{report['data']} | {report['batch_per_gpu']} img/GPU/step",
        f"{'run':<{WIDTH}}{'img/s':>10}{'vs ceiling':>12}{'vs 1 GPU':>10}{'data wait (GPU)':>16}{'epoch 1 s':>11}"
        f"{'wall s':>8}{'peak GB':>9}{'MFU':>6}{'pass start s':>14}",
    ]
    for name, r in runs.items():
        if not r["ok"]:
            lines.append(f"{name:<{WIDTH}}  FAILED: {r['error'].strip().splitlines()[-1][:90] if r['error'] else '?'}")
            continue
        ceil, single = by.get(("vs_ceiling", name)), by.get(("vs_single", name))
        wait = f"{100 * r['data_wait_fraction']:.0f}%" if "data_wait_fraction" in r else ""
        wait += f" ({100 * r['gpu_data_wait_fraction']:.0f}%)" if "gpu_data_wait_fraction" in r else ""
        first = f"{r['epoch_sec'][0]:.1f}" if r.get("epoch_sec") else ""
        ceil, single = (f"{x['value']:.2f}" if x else "" for x in (ceil, single))
        mem = f"{r['peak_mem_gb']:.1f}" if r.get("peak_mem_gb") is not None else ""
        mfu = f"{100 * r['mfu']:.0f}%" if r.get("mfu") is not None else ""
        start = f"{r['pass_start_sec']:.3f}" if r.get("pass_start_sec") is not None else ""
        lines.append(
            f"{name:<{WIDTH}}{r['images_per_sec']:>10.0f}{ceil:>12}{single:>10}{wait:>16}{first:>11}"
            f"{r['wall_sec']:>8.0f}{mem:>9}{mfu:>6}{start:>14}"
        )
    refs = sorted(
        {
            (x["reference"], runs[x["reference"]]["images_per_sec"])
            for x in report["ratios"]
            if x["kind"] == "vs_ceiling"
        }
    )
    lines.append(
        "vs ceiling = loop img/s / (GPUs x best ceiling of its precision: "
        + (", ".join(f"{n} {v:.0f} img/s" for n, v in refs) or "none ran; --merge with one")
        + ")"
    )
    lines.append(
        "vs 1 GPU = N-GPU loop img/s / single1 loop img/s with the same loader, compile and precision "
        "(scaling efficiency = vs 1 GPU / N)"
    )
    if any(r["kind"] == "loader" for r in runs.values()):
        lines.append(
            "loader-* = one GPU's loader alone (read, decode, augment; no model); its vs ceiling > 1: "
            "it can feed that GPU; loaderN-* = N of them at once, one per GPU (the host's CPUs shared; vs ceiling "
            "per GPU); pass start = the wait for the first batch of a pass (each epoch, each evaluation)"
        )
    return "\n".join(lines)


def summarize(args, runs: dict, extra: dict | None = None) -> dict:
    from src.reporting.results import git_state

    first = next((r for r in runs.values() if r["ok"]), {})
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": [sys.executable, *sys.argv],
        "gpu_name": first.get("device_name", "?"),
        "gpu_count": first.get("gpu_count", 0),
        "torch_version": first.get("torch_version", "?"),
        **{k: first.get(k) for k in ("cpu_model", "cpus", "cpus_usable", "hostname")},
        **git_state(ROOT),  # the code measured: its commit, and whether tracked files differed from it
        "smoke": args.smoke,
        "data": data_label(args),
        "batch_per_gpu": args.batch,
        **(extra or {}),
        "runs": runs,
        "ratios": ratios(runs),
    }


def data_label(args) -> str:
    if args.decode:  # images read from disk
        parts = [f"imagefolder {args.data_root}"] if args.data_root else []
        parts += [f"shards {args.shards}"] if args.shards else []
        return " + ".join(parts) + f" ({args.image_size or 'native'} px, decode {args.decode})"
    side = args.image_size or 32
    return f"imagefolder {args.data_root}" if args.data_root else f"synthetic {args.samples}x3x{side}x{side}"


def merge(paths: list[str]) -> tuple[dict, dict]:
    """Runs of several --out files (later files win); their header must name the same GPU."""
    runs, header, sources = {}, None, []
    for path in paths:
        report = json.loads(Path(path).read_text())
        sources.append({"file": str(path), "command": report["command"], "date": report["date"]})
        if header and (report["gpu_name"], report["gpu_count"]) != (header["gpu_name"], header["gpu_count"]):
            print(
                f"warning: {path} ran on {report['gpu_name']} x{report['gpu_count']}, "
                f"not {header['gpu_name']} x{header['gpu_count']}",
                file=sys.stderr,
            )
        header = header or report
        runs.update(report["runs"])
    return runs, {"merged_from": sources, **{k: header[k] for k in ("data", "batch_per_gpu", "smoke")}}


# --- the children: one configuration each ---------------------------------------------------------


def ceiling_step(spec: dict, device, gradient_sync=None, ranks: int = 1, wrap=None):
    """(`step(x, y)`, the model it trains): the ceiling's train step (forward, the loop's objective: cross-entropy
    and top-1 hits, compiled with the model; backward; fused SGD step) of spec's model, precision and compile mode.
    `gradient_sync(params)` makes what sums the gradients over `ranks` ranks between the backward and the
    optimizer step (dali_anchor.py: ddp's FlatGradientSync); the loss is then scaled to their mean, as the trainer's.
    `wrap(model)` shards it first (fsdp_step_graph.py: gradients averaged over the ranks, so `ranks` stays 1): the
    optimizer then steps each rank's shards."""
    import torch
    from omegaconf import OmegaConf

    from src.models import build_model
    from src.run.loss import build_loss_terms
    from src.run.optim import build_optimizer

    cuda = device.type == "cuda"
    torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)  # every rank of dali_anchor.py starts from the same weights
    fmt = torch.channels_last if spec["channels_last"] else torch.contiguous_format
    model_cfg = OmegaConf.load(ROOT / "conf/model" / f"{spec.get('model_yaml', spec['model'])}.yaml")
    model_cfg.update(spec.get("model_options", {}))
    model = build_model(model_cfg, 10, 3).to(device, memory_format=fmt)
    model = wrap(model) if wrap is not None else model
    optimizer = build_optimizer(OmegaConf.load(ROOT / "conf/optim/sgd.yaml"), model, fused=cuda)
    forward = torch.compile(model, mode=spec["compile_mode"]) if spec["compile"] else model
    objective = build_loss_terms(spec["compile"], spec["compile_mode"] or "default")
    sync = gradient_sync(model.parameters()) if gradient_sync is not None else None

    def step(x, y):
        if spec["compile"]:
            torch.compiler.cudagraph_mark_step_begin()  # reduce-overhead: the last step's outputs are dead
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=spec["amp"]):
            loss, _ = objective(forward(x), y, 1 / (len(y) * ranks))
        loss.backward()
        if sync is not None:
            sync()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, model


def child_ceiling(spec: dict) -> dict:
    """Train steps (ceiling_step) on one fixed random batch already on the device."""
    import torch

    from src.reporting.efficiency import host

    device = torch.device(spec["device"])
    cuda = device.type == "cuda"
    step, _ = ceiling_step(spec, device)
    fmt = torch.channels_last if spec["channels_last"] else torch.contiguous_format
    size = spec.get("image_size", 32)
    x = torch.randn(spec["batch"], 3, size, size, device=device).contiguous(memory_format=fmt)
    y = torch.randint(0, 10, (spec["batch"],), device=device)
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    t0 = time.perf_counter()
    for _ in range(spec["warmup"]):  # compilation and cuDNN autotuning happen here
        step(x, y)
    sync()
    warmup_sec, seconds = time.perf_counter() - t0, []
    for _ in range(spec["windows"]):
        if cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            for _ in range(spec["steps"]):
                step(x, y)
            end.record()
            end.synchronize()
            seconds.append(begin.elapsed_time(end) / 1000)
        else:
            t0 = time.perf_counter()
            for _ in range(spec["steps"]):
                step(x, y)
            seconds.append(time.perf_counter() - t0)
    return {
        "images_per_sec": spec["batch"] * spec["steps"] / statistics.median(seconds),
        "window_sec": seconds,
        "warmup_sec": warmup_sec,
        **host(device),
    }


def compose(overrides: list[str], output_dir: str):
    """The real config, composed as tests/conftest.py does, writing into output_dir."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import open_dict

    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = hydra_compose("train", overrides=[f"paths.root_dir={ROOT}", *overrides])
    with open_dict(cfg):
        cfg.paths.output_dir = output_dir
    return cfg


def child_loop(spec: dict) -> dict:
    """`src.run.launch.main(cfg)` (it spawns the ranks of ddp/fsdp) and its metrics."""
    from src.data.datasets import load_data
    from src.reporting.efficiency import HOST_FIELDS
    from src.run.launch import main

    with tempfile.TemporaryDirectory(prefix="ddplab-bench-") as out:
        cfg = compose(spec["overrides"], out)
        train_size = len(load_data(cfg.data).train)  # also decodes + caches an ImageFolder once
        if spec.get("prepare"):
            return {"images_per_sec": 1.0, "train_images": train_size}
        if cfg.trainer.limit_train_batches is None:  # full batches only: one batch shape, no recompiles
            cfg.trainer.limit_train_batches = train_size // cfg.data.batch_size
        steps = cfg.trainer.limit_train_batches
        timed = -(-spec.get("min_timed_steps", 0) // steps)  # epochs after the first (warm-up) one
        cfg.trainer.max_epochs = max(cfg.trainer.max_epochs, 1 + timed)
        final = main(cfg)
        metrics = json.loads((Path(out) / "metrics.json").read_text())
    epochs = metrics["epochs"]
    return {
        "images_per_sec": final["images_per_sec"],
        "sec_per_epoch": final["sec_per_epoch"],
        "data_wait_fraction": final["data_wait_fraction"],
        **{k: final[k] for k in OPTIONAL_FIGURES if k in final},
        "steps_per_epoch": steps,
        "timed_steps": steps * (len(epochs) - 1),
        "epoch_sec": [e["epoch_sec"] for e in epochs],
        "epoch_images_per_sec": [e["images_per_sec"] for e in epochs],
        **{k: metrics[k] for k in HOST_FIELDS},  # the machine, as the run recorded it
        "hparams": metrics["hparams"],
    }


def child_loader(spec: dict) -> dict:
    """The loader alone, as one rank of a run builds it: `warmup` batches, then `steps` timed ones (read,
    decode, augment, normalize; on CUDA until the last batch is ready on the device); then the wait for the
    first batch of the next pass (each epoch and each evaluation starts one). With gpus N > 1, N such loaders run at
    once, one per GPU in a process of its own, timed from a common start: images/s is their sum."""
    if spec["gpus"] == 1:
        return time_loader(spec, 0)
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    start, results = ctx.Barrier(spec["gpus"]), ctx.Queue()
    procs = [ctx.Process(target=_one_of_loaders, args=(spec, i, start, results)) for i in range(spec["gpus"])]
    for proc in procs:
        proc.start()
    each = _answers(procs, results, start)
    for proc in procs:
        proc.join()
    failed = [r for r in each if "error" in r]
    if failed:
        raise SystemExit(failed[0]["error"])
    each.sort(key=lambda r: r["rank"])
    return {
        **each[0],
        "images_per_sec": sum(r["images_per_sec"] for r in each),
        "images": sum(r["images"] for r in each),
        "seconds": max(r["seconds"] for r in each),
        "pass_start_sec": max(r["pass_start_sec"] for r in each),
        "per_gpu_images_per_sec": [r["images_per_sec"] for r in each],
    }


def _answers(procs: list, results, start) -> list[dict]:
    """Each loader process's answer. One killed outright (e.g. by the out-of-memory killer) never answers: say so
    at once, stopping the others, instead of waiting for the run's --timeout."""
    import queue

    each: list[dict] = []
    while len(each) < len(procs):
        try:
            each.append(results.get(timeout=1.0))
        except queue.Empty:
            answered = {r["rank"] for r in each}
            dead = [(i, p.exitcode) for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in answered]
            if dead:
                start.abort()
                for proc in procs:
                    proc.kill()
                rank, code = dead[0]
                raise SystemExit(
                    f"loader {rank} of {len(procs)}: its process died (exit code {code}) before answering"
                ) from None
    return each


def _one_of_loaders(spec: dict, rank: int, start, results) -> None:
    try:
        results.put({**time_loader(spec, rank, start), "rank": rank})
    except BaseException as exc:  # the parent waits for every rank's answer; the others must not wait for this one
        start.abort()
        results.put({"rank": rank, "error": f"loader {rank} of {spec['gpus']}: {exc!r}"})


def time_loader(spec: dict, rank: int, start=None) -> dict:
    """One loader on device `rank` (of spec["gpus"] loaders sharing the host); `start`: a barrier passed by all of
    them after their warm-up, so that their timed batches overlap."""
    import torch

    from src.data.datasets import load_data
    from src.data.epoch import plan_epoch
    from src.data.loaders import build_loader
    from src.reporting.efficiency import host

    with tempfile.TemporaryDirectory(prefix="ddplab-bench-") as out:
        cfg = compose(spec["overrides"], out)
    device = torch.device(spec["device"], rank) if spec["device"] == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    data = load_data(cfg.data)
    loader = build_loader(data, cfg.data, device, spec["channels_last"], seed=0, local_processes=spec["gpus"])
    steps = plan_epoch(len(data.train), spec["batch"], 1, 0, 1, seed=0, epoch=0, drop_last=True)
    steps = steps[: spec["warmup"] + spec["steps"]]
    if len(steps) <= spec["warmup"]:
        raise SystemExit(f"{len(data.train)} training images give {len(steps)} batches; lower --loader-steps")
    timed = 0
    try:
        for k, batch in enumerate(loader.train_batches(steps, 0)):
            if k == spec["warmup"]:
                sync()
                if start is not None:
                    start.wait()
                t0 = time.perf_counter()
            timed += len(batch.y) if k >= spec["warmup"] else 0
        sync()
        seconds = time.perf_counter() - t0
        t0 = time.perf_counter()  # a new pass over the same workers: how long the device waits at its start
        for _ in loader.train_batches(steps[:1], 1):
            sync()
        pass_start = time.perf_counter() - t0
    finally:
        loader.close()
    return {
        "images_per_sec": timed / seconds,
        "pass_start_sec": pass_start,
        "seconds": seconds,
        "images": timed,
        "workers": loader.plan.workers,
        "loader_name": loader.plan.name,
        **host(device),
    }


# --- command line ---------------------------------------------------------------------------------


def refused_data(args) -> str | None:
    """Why no configuration could read --data-root or --shards, in one line before any starts (src's own checks:
    the ImageFolder layout, the pack's meta.json)."""
    if not (args.data_root or args.shards):  # synthetic data: nothing to read, nothing to import
        return None
    from src.config.errors import ConfigError
    from src.data.image_folder import check_imagefolder
    from src.data.shards import read_meta

    for option, path, check in (
        ("--data-root", args.data_root, check_imagefolder),
        ("--shards", args.shards, read_meta),
    ):
        try:
            if path:
                check(Path(path))
        except ConfigError as exc:
            line = str(exc).replace("data.root", option)  # src says it of train.py's option
            return line if line.startswith(option) else f"{option}: {line}"
    return None


def worker_counts(text: str) -> str:
    """An argparse type: comma-separated data.num_workers values, each a whole number >= 0 or auto."""
    if not all(w == "auto" or (w.isdigit() and w.isascii()) for w in text.split(",")):
        raise ValueError(text)
    return text


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny CPU mode for CI (tiny_cnn, fp32, no compile)")
    p.add_argument("--only", help="comma-separated name patterns (fnmatch), e.g. 'ceiling-*,single1-*'")
    p.add_argument("--list", action="store_true", help="print the selected configuration names and exit")
    p.add_argument("--out", help="JSON file (default bench/results/bench-<date>.json; --smoke: outputs/bench/)")
    p.add_argument("--data-root", help="ImageFolder root (train/, test/); default synthetic CIFAR-sized data")
    p.add_argument("--compile", choices=["on", "off", "both"], default="on", help="trainer.compile of the loops")
    p.add_argument(
        "--workers",
        type=worker_counts,
        help="data.num_workers of the loaders, comma-separated counts and/or auto (default 8; smoke 0)",
    )
    p.add_argument("--gpus", type=positive, default=2, help="largest GPU count to run (default 2)")
    p.add_argument("--batch", type=positive, help="images per GPU per step (default 512; smoke 64)")
    p.add_argument(
        "--epochs",
        type=positive,
        help="epochs per loop run, the first excluded from its speed (default 3; smoke 2); a GPU run trains "
        "more where its timed epochs would be under 100 steps",
    )
    p.add_argument("--samples", type=positive, help="synthetic data.num_samples (default 50000; smoke 1024)")
    p.add_argument("--steps", type=positive, help="trainer.limit_train_batches (default: every full batch)")
    p.add_argument(
        "--override",
        action="append",
        metavar="KEY=VALUE",
        help="a config override for every loop run (repeatable), e.g. strategy.gradient_sync=reducer",
    )
    p.add_argument(
        "--model",
        help="model of the ceilings and loops: conf/model/<NAME>.yaml or a torchvision "
        "classifier, e.g. resnet50 (names then start with it; default resnet18, smoke tiny_cnn)",
    )
    p.add_argument(
        "--image-size", type=positive, help="the ceiling's input size (default 32) and, with --decode, data.image_size"
    )
    p.add_argument(
        "--decode",
        help="compare images read from disk instead: auto (the default's choice for this host), gpu, cpu (the "
        "workers crop too), cpudecode (the workers only decode and cut the crops' regions, the GPU resizes them) "
        "split (CPU workers and GPU-decoding workers share each batch: --override data.gpu_share=...) and/or "
        "dali (DALI in the training process, --workers threads), "
        "e.g. gpu,cpu (with --data-root and/or --shards; adds loader-* runs: the loader alone)",
    )
    p.add_argument("--shards", help="a pack of the same images (python -m src.data.shards pack): data=shards runs too")
    p.add_argument("--loader-steps", type=positive, default=50, help="timed batches of a loader-* run (default 50)")
    p.add_argument("--timeout", type=positive_number, default=600, help="seconds per configuration (default 600)")
    p.add_argument("--merge", nargs="+", metavar="JSON", help="combine earlier --out files; runs nothing")
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        spec = json.loads(args.one)
        child = {"ceiling": child_ceiling, "loader": child_loader, "loop": child_loop}[spec["kind"]]
        result = child(spec)
        print(json.dumps(result), flush=True)
        return 0
    mode = SMOKE if args.smoke else GPU
    for key in ("batch", "epochs", "samples", "workers"):
        if getattr(args, key) is None:
            setattr(args, key, mode[key])
    refusal = None if args.merge or args.list else refused_data(args)
    if refusal:
        p.error(refusal)
    if args.decode and (not (args.data_root or args.shards) or set(args.decode.split(",")) - set(DECODES)):
        p.error(
            "--decode takes auto, gpu, cpu, cpudecode, split and/or dali (e.g. gpu,cpu) and needs --data-root and/or "
            "--shards"
        )
    folder = "outputs/bench" if args.smoke else "bench/results"  # a smoke run is no result to keep: git-ignored
    out = Path(args.out or ROOT / folder / f"bench-{datetime.datetime.now():%Y-%m-%d-%H%M%S}.json")

    def write(report: dict) -> None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2))

    if args.merge:
        runs, extra = merge(args.merge)
        report = {**summarize(args, runs), **extra}
        write(report)
    else:
        patterns = args.only.split(",") if args.only else ["*"]
        configs = [c for c in plan(args) if any(fnmatch.fnmatch(c["name"], pat) for pat in patterns)]
        if args.list or not configs:
            print("\n".join(c["name"] for c in configs) or f"no configuration matches --only {args.only}")
            return 0 if configs else 2
        if not args.smoke:  # every run would fail on its own, minutes later
            import torch

            needed, here = max(c["gpus"] for c in configs), torch.cuda.device_count()
            if needed > here:
                p.error(
                    f"the selected runs need {needed} CUDA GPU(s), this machine has {here}: lower --gpus or --only, "
                    "or run --smoke (the CPU mode)"
                )
        loops = [c for c in configs if c["kind"] == "loop"]
        if args.data_root and loops:  # decode the JPEGs once, before any timed run
            prep = run_child({**loops[0], "name": "prepare-data", "prepare": True}, args.timeout)
            print(f"data ready ({prep['wall_sec']:.0f} s)" if prep["ok"] else prep["error"], flush=True)
        runs = {}
        for i, config in enumerate(configs, 1):
            r = runs[config["name"]] = run_child(config, args.timeout)
            print(
                f"[{i}/{len(configs)}] {config['name']:<{WIDTH}} "
                + (f"{r['images_per_sec']:>9.0f} img/s" if r["ok"] else "FAILED")
                + f"  ({r['wall_sec']:.0f} s)",
                flush=True,
            )
            report = summarize(args, runs)
            write(report)  # after every run: a killed call keeps its results
    print(table(report))
    print(f"written: {out}")
    return 0 if all(r["ok"] for r in report["runs"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
