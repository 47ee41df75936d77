"""Which strategy lets a model fit, and how fast: train it once per variant and tabulate memory and speed.

    python bench/strategies_table.py [--epochs 3] [--out outputs/bench/strategies.md] [overrides...]
        ResNet-18 on the CIFAR-10 JPEGs (experiment=cifar10_jpeg) with single, dp, ddp x2 and fsdp x2
    python bench/strategies_table.py --variant 'ddp:strategy=ddp trainer.devices=4' \\
        --variant 'fsdp:strategy=fsdp trainer.devices=4' \\
        --variant 'fsdp+ac:strategy=fsdp trainer.devices=4 trainer.activation_checkpointing=true' [overrides...]
        your own variants (NAME:OVERRIDES), e.g. a model and batch where ddp runs out of memory ("why fsdp")
    python bench/strategies_table.py --scaling resnet50|vit_b16|resnet18 [--gpus 4] [--dry-run]
        single, ddp and fsdp on 2 and 4 GPUs, compiled, bf16, synthetic data on the device (the runs of
        bench/results/fsdp_h100_2026-11-27.md); --dry-run prints the commands

Each variant runs `python train.py <overrides> <the variant's overrides>` in its own process, for --epochs or, where
those after the first (warm-up) would time fewer than --min-timed-steps (100) steps, for as many more as that takes.
A variant that runs out of memory is a row that says so (train.py's one line, e.g. the memory it had reached), not a
failure.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import start_session  # bench/bench.py, next to this script

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # src, imported where needed

from src.config.arguments import non_negative, positive  # noqa: E402  (argparse types)

DEFAULT_VARIANTS = {
    "single": "strategy=single",
    "dp": "strategy=dp",
    "ddp": "strategy=ddp trainer.devices=2",
    "fsdp": "strategy=fsdp trainer.devices=2",
}
# --scaling MODEL: (model and data overrides, images per GPU). single and ddp use CUDA graphs; fsdp cannot
SCALING = {
    "resnet50": ("model=torchvision model.name=resnet50 data.shape=[3,224,224] trainer.channels_last=true", 256),
    "vit_b16": ("model=timm model.name=vit_base_patch16_224 data.shape=[3,224,224]", 256),
    "resnet18": (
        "model=resnet18 data.shape=[3,32,32] data.augment=crop_flip trainer.channels_last=true data.num_samples=50000",
        512,
    ),
}
SCALING_COMMON = (
    "data=synthetic data.num_samples=20480 data.num_test=256 data.eval_batch_size=256 trainer.limit_eval_batches=1 "
    "trainer.amp=true trainer.compile=true logger=none"
)
COLUMNS = "| variant | ranks | global batch | fits | images/s | peak GiB | TFLOP/s/GPU | MFU | test top-1 | wall s |"


def epochs_for(overrides: list[str], epochs: int, min_timed_steps: int) -> int:
    """`epochs`, or more where the timed epochs (all but the first, the warm-up) would hold fewer than
    `min_timed_steps` steps, as in bench.py's GPU mode."""
    if not min_timed_steps:
        return epochs
    from hydra import compose, initialize_config_dir
    from omegaconf import open_dict

    from src.data.datasets import load_data

    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=[f"paths.root_dir={ROOT}", *overrides])
    if cfg.data.name == "synthetic":
        with open_dict(cfg):
            cfg.data.shape = [1, 1, 1]  # the count of images is what matters here, not the images
    steps = cfg.trainer.limit_train_batches or len(load_data(cfg.data).train) // cfg.data.batch_size
    return max(epochs, 1 + -(-min_timed_steps // max(1, steps)))


def variant(text: str) -> tuple[str, list[str]]:
    name, sep, overrides = text.partition(":")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"--variant takes NAME:OVERRIDES, e.g. 'fsdp:strategy=fsdp', got {text!r}")
    return name.strip(), shlex.split(overrides)


def run(name: str, overrides: list[str], run_dir: Path) -> dict:
    start = time.time()
    proc = start_session(  # stopping this process stops the variant's train.py too, ranks and all
        [sys.executable, str(ROOT / "train.py"), *overrides, f"hydra.run.dir={run_dir}"],
        cwd=ROOT,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    stdout, stderr = proc.communicate()
    metrics_file = run_dir / "metrics.json"
    metrics = json.loads(metrics_file.read_text()) if metrics_file.is_file() else {}
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    print(f"{name}: exit {proc.returncode} in {time.time() - start:.0f} s", errors[-1] if errors else "", flush=True)
    if proc.returncode and not errors:
        print(stdout[-1500:], stderr[-1500:], flush=True)
    return {
        "variant": name,
        "overrides": overrides,
        "returncode": proc.returncode,
        "status": metrics.get("status", "failed" if proc.returncode else "?"),
        "error": errors[-1][len("error: ") :] if errors else None,
        "metrics": metrics,
        "wall_sec": time.time() - start,
    }


def scaling(model: str, gpus: int) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """(common overrides, variants) of --scaling MODEL on up to `gpus` GPUs."""
    overrides, per_gpu = SCALING[model]
    graphs = "trainer.compile_mode=reduce-overhead"
    variants = [("single", f"strategy=single trainer.devices=1 data.batch_size={per_gpu} {graphs}")]
    for n in (2, 4, 8):
        if n <= gpus:
            variants.append((f"ddp{n}", f"strategy=ddp trainer.devices={n} data.batch_size={per_gpu * n} {graphs}"))
            variants.append((f"fsdp{n}", f"strategy=fsdp trainer.devices={n} data.batch_size={per_gpu * n}"))
    return shlex.split(f"{SCALING_COMMON} {overrides}"), [(name, shlex.split(o)) for name, o in variants]


def row(r: dict) -> str:
    m, wall = r["metrics"], f"{r['wall_sec']:.0f}"
    h, f = m.get("hparams", {}), m.get("final", {})
    gpus, batch = h.get("world_size", ""), h.get("global_batch", "")
    if r["status"] != "completed":
        fits = "**out of memory**" if r["status"] == "out_of_memory" else f"failed ({r['status']})"
        return f"| {r['variant']} | {gpus} | {batch} | {fits} | | | | | | {wall} |"

    def cell(key, fmt, scale=1.0):
        return format(f[key] * scale, fmt) if f.get(key) is not None else ""

    return (
        f"| {r['variant']} | {gpus} | {batch} | yes | {cell('images_per_sec', ',.0f')} | "
        f"{cell('peak_mem_gb', '.1f') or cell('peak_host_mem_gb', '.1f') + ' (host)'} | "
        f"{cell('tflops_per_gpu', '.1f')} | {cell('mfu', '.1f', 100)}{'%' if f.get('mfu') is not None else ''} | "
        f"{cell('test_top1', '.2f')} | {wall} |"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--epochs", type=positive, default=3, help="trainer.max_epochs (default 3; speed leaves out epoch 1)"
    )
    p.add_argument(
        "--min-timed-steps",
        type=non_negative,
        default=100,
        help="more epochs than --epochs where those after the first would time fewer steps (default 100; 0: off)",
    )
    p.add_argument("--variant", action="append", type=variant, help="NAME:OVERRIDES (repeatable)")
    p.add_argument("--scaling", choices=sorted(SCALING), help="single, ddp and fsdp on 2..--gpus GPUs (no --variant)")
    p.add_argument("--gpus", type=positive, default=4, help="with --scaling: the most GPUs a variant uses (default 4)")
    p.add_argument("--dry-run", action="store_true", help="print each variant's command; run nothing")
    # git-ignored by default: a table worth keeping is copied into bench/results/ with its report
    p.add_argument("--out", default=str(ROOT / "outputs/bench/strategies.md"))
    args, extra = p.parse_known_args()
    if args.scaling and args.variant:
        p.error("--scaling chooses the variants itself; drop --variant (or --scaling)")
    if args.scaling:
        base, variants = scaling(args.scaling, args.gpus)
    else:
        variants = args.variant or [(n, shlex.split(o)) for n, o in DEFAULT_VARIANTS.items()]
        base = [] if args.variant else ["experiment=cifar10_jpeg", "seed=2"]
    base.append("trainer.progress_bar=false")

    def with_epochs(own: list[str]) -> list[str]:  # the command line's and a variant's own max_epochs come later
        epochs = epochs_for([*base, *extra, *own], args.epochs, args.min_timed_steps)
        return [f"trainer.max_epochs={epochs}", *extra, *own]

    variants = [(name, with_epochs(own)) for name, own in variants]
    if args.dry_run:
        for name, overrides in variants:
            print(f"{name}: {shlex.join(['python', 'train.py', *base, *overrides])}")
        return
    tmp = Path(tempfile.mkdtemp(prefix="strategies-"))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results = []
    for k, (name, overrides) in enumerate(variants):  # the table so far after each run: a stopped call keeps it
        results.append(run(name, [*base, *overrides], tmp / f"{k}"))
        header = f"# Strategies (so far: {len(results)} of {len(variants)} variants)"
        if len(results) == len(variants):
            import torch  # only now: this process needs no GPU of its own while the runs train

            from src.reporting.efficiency import cpus_named, host

            h = host(torch.device("cuda", 0) if torch.cuda.is_available() else None)
            machine = f"{h['gpu_count']} x {h['device_name']}, {cpus_named(h)}, torch {h['torch_version']}"
            header = f"# Strategies on {machine}"
        write(out, header, results)
    print(out.read_text(), end="")
    print(f"written: {out} and {out.with_suffix('.json')}")


def write(out: Path, header: str, results: list[dict]) -> None:
    lines = [
        header,
        "",
        f"`{shlex.join(['python', 'bench/strategies_table.py', *sys.argv[1:]])}`",
        "",
        COLUMNS,
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|",
        *(row(r) for r in results),
        "",
        "images/s, TFLOP/s and MFU leave out epoch 1 (warm-up); peak memory is the max over ranks and epochs;",
        "test top-1 uses the best-validation weights.",
    ]
    lines += [f"- {r['variant']}: {r['error']}" for r in results if r["error"]]
    out.write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
