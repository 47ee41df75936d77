"""Which strategy lets a model fit, and how fast: train it once per variant and tabulate memory and speed.

    python bench/strategies_table.py [--epochs 3] [--out outputs/bench/strategies.md] [overrides...]
        ResNet-18 on the CIFAR-10 JPEGs (experiment=cifar10_jpeg) with single, dp, ddp x2 and fsdp x2
    python bench/strategies_table.py --variant 'ddp:strategy=ddp trainer.devices=4' \\
        --variant 'fsdp:strategy=fsdp trainer.devices=4' \\
        --variant 'fsdp+ac:strategy=fsdp trainer.devices=4 trainer.activation_checkpointing=true' [overrides...]
        your own variants (NAME:OVERRIDES), e.g. a model and batch where ddp runs out of memory ("why fsdp")

Each variant runs `python train.py <overrides> <the variant's overrides>` in its own process. A variant that runs
out of memory is a row that says so (train.py's one line, e.g. the memory it had reached), not a failure.
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

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_VARIANTS = {
    "single": "strategy=single",
    "dp": "strategy=dp",
    "ddp": "strategy=ddp trainer.devices=2",
    "fsdp": "strategy=fsdp trainer.devices=2",
}
COLUMNS = "| variant | ranks | global batch | fits | images/s | peak GiB | TFLOP/s/GPU | MFU | test top-1 | wall s |"


def variant(text: str) -> tuple[str, list[str]]:
    name, sep, overrides = text.partition(":")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"--variant takes NAME:OVERRIDES, e.g. 'fsdp:strategy=fsdp', got {text!r}")
    return name.strip(), shlex.split(overrides)


def run(name: str, overrides: list[str], run_dir: Path) -> dict:
    start = time.time()
    proc = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *overrides, f"hydra.run.dir={run_dir}"],
        cwd=ROOT,
        text=True,
        capture_output=True,
    )
    metrics_file = run_dir / "metrics.json"
    metrics = json.loads(metrics_file.read_text()) if metrics_file.is_file() else {}
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    print(f"{name}: exit {proc.returncode} in {time.time() - start:.0f} s", errors[-1] if errors else "", flush=True)
    if proc.returncode and not errors:
        print(proc.stdout[-1500:], proc.stderr[-1500:], flush=True)
    return {
        "variant": name,
        "overrides": overrides,
        "returncode": proc.returncode,
        "status": metrics.get("status", "failed" if proc.returncode else "?"),
        "error": errors[-1][len("error: ") :] if errors else None,
        "metrics": metrics,
        "wall_sec": time.time() - start,
    }


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
    p.add_argument("--epochs", type=int, default=3, help="trainer.max_epochs (default 3; speed leaves out epoch 1)")
    p.add_argument("--variant", action="append", type=variant, help="NAME:OVERRIDES (repeatable)")
    # git-ignored by default: a table worth keeping is copied into bench/results/ with its report
    p.add_argument("--out", default=str(ROOT / "outputs/bench/strategies.md"))
    args, extra = p.parse_known_args()
    variants = args.variant or [(n, shlex.split(o)) for n, o in DEFAULT_VARIANTS.items()]
    base = [] if args.variant else ["experiment=cifar10_jpeg", "seed=2"]
    base += [f"trainer.max_epochs={args.epochs}", "trainer.progress_bar=false", *extra]
    tmp = Path(tempfile.mkdtemp(prefix="strategies-"))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results = []
    for k, (name, overrides) in enumerate(variants):  # the table so far after each run: a stopped call keeps it
        results.append(run(name, [*base, *overrides], tmp / f"{k}"))
        header = f"# Strategies (so far: {len(results)} of {len(variants)} variants)"
        if len(results) == len(variants):
            import torch  # only now: this process needs no GPU of its own while the runs train

            gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
            header = f"# Strategies on {torch.cuda.device_count()} x {gpu}, torch {torch.__version__}"
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
