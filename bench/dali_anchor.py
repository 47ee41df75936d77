#!/usr/bin/env python
"""DALI's standard ResNet-50 training pipeline beside ddplab's loaders: the anchor of the disk path.

    python bench/dali_anchor.py --gpus N --shards data/il256 --mode loader|loop --out X.json

The pipeline is the one NVIDIA's ResNet-50 examples train with: `readers.file` (sharded by rank, shuffled),
`decoders.image_random_crop` on device "mixed" (it decodes only the crop's region; the GPU's hardware JPEG
decoder where there is one), resize to the training size, `crop_mirror_normalize` with a random flip.
It reads the images of a ddplab shard pack (`python -m src.data.shards pack`), written out once as a folder.

- `loader`: the pipeline alone on every rank at once (images/s summed over ranks);
- `loop`: bench.py's ceiling step (the same model, loss, fused SGD, bf16, channels_last, CUDA graphs) fed by
  DALI; with N ranks the gradients are averaged by one all-reduce of a flat buffer after the backward, as
  ddplab's ddp does (`strategy.gradient_sync=auto`). Then the same step on one batch left on the GPU: the
  ceiling, measured in the same process.

Needs `nvidia-dali-cuda130` (requirements.txt installs it on Linux x86-64). Results: bench/results/dali-*.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from src.config.arguments import fraction, positive  # noqa: E402  (src is importable once ROOT is on the path)
from src.data.datasets import IMAGENET_STATS  # noqa: E402
from src.reporting.efficiency import host  # noqa: E402

MEAN, STD = ([255 * v for v in stats] for stats in IMAGENET_STATS)  # DALI normalizes 0..255 pixels


def pack_identity(shards: Path) -> str:
    """What tells two packs apart: a hash of meta.json and the training index (a pack is renamed into place
    whole, so these change whenever its images do)."""
    digest = hashlib.sha256((shards / "meta.json").read_bytes())
    digest.update((shards / "train-index.npz").read_bytes())
    return digest.hexdigest()[:16]


def unpack(shards: Path, folder: Path) -> Path:
    """The pack's training images as an ImageFolder (one sub-folder per label), written once: DALI's file
    reader takes a folder. `.complete` marks a finished one with its pack's identity; a folder of another pack,
    or one holding files this script did not write, is refused in one line, never written into."""
    from src.data.shards import read_meta

    info = read_meta(shards)
    identity = pack_identity(shards)
    done, started = folder / ".complete", folder / ".unpacking"
    if done.exists():
        if json.loads(done.read_text())["pack"] != identity:
            raise SystemExit(
                f"dali_anchor.py: {folder} holds another pack's images; remove it or pass another --folder"
            )
        return folder
    if folder.exists() and any(folder.iterdir()) and not started.exists():
        raise SystemExit(f"dali_anchor.py: {folder} holds files this script did not write; pass another --folder")
    folder.mkdir(parents=True, exist_ok=True)
    started.write_text(identity)
    index = np.load(shards / "train-index.npz")
    for label in range(len(info["classes"])):
        (folder / f"{label:04d}").mkdir(exist_ok=True)
    handles = [open(shards / name, "rb") for name in info["splits"]["train"]["shards"]]
    try:
        for i, (shard, offset, length, label) in enumerate(
            zip(index["shard"], index["offset"], index["length"], index["label"])
        ):
            handles[shard].seek(int(offset))
            (folder / f"{int(label):04d}" / f"{i:07d}.jpg").write_bytes(handles[shard].read(int(length)))
    finally:
        for handle in handles:
            handle.close()
    done.write_text(json.dumps({"pack": identity, "images": len(index["label"])}))
    started.unlink()
    return folder


def build_iterator(folder: Path, args, rank: int, world: int, local_rank: int):
    from nvidia.dali import fn, pipeline_def, types
    from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

    decoder_options = {} if args.hw_decoder_load is None else {"hw_decoder_load": args.hw_decoder_load}

    @pipeline_def(batch_size=args.batch, num_threads=args.threads, device_id=local_rank, prefetch_queue_depth=2)
    def pipeline():
        jpegs, labels = fn.readers.file(
            file_root=str(folder), shard_id=rank, num_shards=world, random_shuffle=True, name="Reader"
        )
        images = fn.decoders.image_random_crop(
            jpegs,
            device="mixed",
            output_type=types.RGB,
            random_aspect_ratio=[0.75, 4 / 3],
            random_area=[0.08, 1.0],
            num_attempts=100,
            **decoder_options,
        )
        images = fn.resize(images, device="gpu", resize_x=args.image_size, resize_y=args.image_size)
        images = fn.crop_mirror_normalize(
            images,
            dtype=types.FLOAT,
            output_layout="HWC",  # NHWC: seen as NCHW it is channels_last without a copy
            mean=MEAN,
            std=STD,
            mirror=fn.random.coin_flip(probability=0.5),
        )
        return images, labels.gpu()

    pipe = pipeline(seed=1234 + rank)
    pipe.build()
    return DALIGenericIterator(
        [pipe], ["x", "y"], reader_name="Reader", last_batch_policy=LastBatchPolicy.DROP, auto_reset=True
    )


def batches(iterator):
    """(x as channels_last NCHW, y) forever, epoch after epoch."""
    while True:
        for out in iterator:
            yield out[0]["x"].permute(0, 3, 1, 2), out[0]["y"].view(-1).long()


def make_step(args, device: torch.device, world: int):
    """bench.py's ceiling step, fed a batch each time; with world > 1 the gradients are summed over the ranks by
    ddp's one flat all-reduce after the backward (FlatGradientSync), of a loss scaled to the ranks' mean."""
    from bench import ceiling_step
    from src.strategies.ddp import FlatGradientSync

    spec = {"model": args.model, "model_yaml": "torchvision", "model_options": {"name": args.model}}
    spec.update(channels_last=True, amp=True, compile=True, compile_mode="reduce-overhead")
    step, _ = ceiling_step(spec, device, FlatGradientSync if world > 1 else None, ranks=world)
    return step


def refused(shards: Path) -> str | None:
    """Why this machine cannot run the anchor, in one line (before any process group starts)."""
    from src.config.errors import ConfigError
    from src.data.loader_plan import DALI_INSTALL, dali_installed
    from src.data.shards import read_meta

    if not dali_installed():
        return f"needs NVIDIA DALI, which is not installed here: {DALI_INSTALL}"
    try:
        read_meta(shards)
    except ConfigError as exc:
        return str(exc).replace("data.root: ", "--shards: ", 1)
    return None if torch.cuda.is_available() else "needs a CUDA GPU (DALI decodes on it)"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shards", required=True, help="a ddplab pack (python -m src.data.shards pack)")
    p.add_argument("--folder", help="where its training images are written out once (default <shards>-folder)")
    p.add_argument("--mode", choices=["loader", "loop"], required=True)
    p.add_argument("--model", default="resnet50", help="a torchvision classifier (default resnet50)")
    p.add_argument("--batch", type=positive, default=256, help="images per GPU per step")
    p.add_argument("--image-size", type=positive, default=224)
    p.add_argument("--threads", type=positive, help="DALI CPU threads per GPU (default: the host's CPUs / GPUs - 1)")
    p.add_argument("--hw-decoder-load", type=fraction, help="share of the decoding on the hardware JPEG decoder")
    p.add_argument("--warmup", type=positive, default=30, help="untimed steps first (compilation, autotuning)")
    p.add_argument("--steps", type=positive, default=200, help="timed steps")
    p.add_argument("--out", required=True, help="JSON file (rank 0 writes it)")
    p.add_argument("--gpus", type=positive, default=1, help="ranks on this host, started by torchrun (default 1)")
    args = p.parse_args()
    refusal = refused(Path(args.shards))
    if refusal:
        sys.exit(f"dali_anchor.py: {refusal}")
    if "LOCAL_RANK" not in os.environ:  # not started by a launcher: check here, then start the ranks
        if args.gpus > torch.cuda.device_count():
            sys.exit(f"dali_anchor.py: --gpus {args.gpus}: this host has {torch.cuda.device_count()} GPUs")
        run = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.gpus), __file__]
        os.execv(sys.executable, [*run, *sys.argv[1:]])

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    args.threads = args.threads or max(1, (os.cpu_count() or 2) // local_world - 1)
    shards = Path(args.shards)
    folder = Path(args.folder or f"{shards}-folder")
    if rank == 0:
        unpack(shards, folder)
    dist.barrier()
    iterator = build_iterator(folder, args, rank, world, local_rank)
    source = batches(iterator)
    step = make_step(args, device, world) if args.mode == "loop" else None

    last = []

    def fed():  # one step on DALI's next batch (loader mode: the batch alone)
        x, y = next(source)
        last[:] = [x, y]
        if step is not None:
            step(x, y)
        return len(y)

    def resident():  # the ceiling: the same step on one batch already on the GPU
        step(*last)
        return len(last[1])

    def timed(one, steps: int) -> tuple[int, float]:
        for _ in range(args.warmup):
            one()
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        images = sum(one() for _ in range(steps))
        torch.cuda.synchronize()
        return images, time.perf_counter() - t0

    images, seconds = timed(fed, args.steps)
    ceiling = None
    if step is not None:
        last[:] = [t.clone() for t in last]
        ceiling = timed(resident, args.steps)
    each = [None] * world
    dist.all_gather_object(each, {"rank": rank, "images": images, "seconds": seconds, "ceiling": ceiling})
    if rank == 0:
        import nvidia.dali

        report = {
            "mode": args.mode,
            "gpus": world,
            "images_per_sec": sum(e["images"] for e in each) / max(e["seconds"] for e in each),
            "per_rank": each,
            "ceiling_images_per_sec": None
            if ceiling is None
            else sum(e["ceiling"][0] for e in each) / max(e["ceiling"][1] for e in each),
            "args": {k: v for k, v in vars(args).items()},
            "train_images": json.loads((folder / ".complete").read_text())["images"],
            **host(device),
            "dali_version": nvidia.dali.__version__,
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))
        print(f"dali {args.mode} x{world}: {report['images_per_sec']:.0f} images/s -> {args.out}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
